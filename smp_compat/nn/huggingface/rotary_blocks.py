"""Distributed blocks for the rotary GPT family (Hugging Face GPT-J and GPT-NeoX).

Two things set these models apart from the pre-LN GPT-2 layer that ``DistributedTransformerLayer`` computes:
rotary position embeddings on q/k (no position table), and the *parallel residual*
``h + attn(ln(h)) + mlp(ln'(h))`` (GPT-J: one LayerNorm shared by both branches; GPT-NeoX: one each, and
optionally the sequential form). The attention and MLP branches here are ``DistributedAttentionLayer`` /
``DistributedTransformerOutputLayer`` subclasses: same parameters, initialization and sharding (whole heads per
rank, column- then row-parallel); only what ``forward`` composes differs. A layer is ``seq_layers[i]`` with
children ``attention`` and ``output`` (the paths scripts checkpoint and partition), and takes and returns
``(hidden, additive_mask, position_ids)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp_compat.errors import SMPUnsupportedError
from smp_compat.nn import comm
from smp_compat.nn.attention import DistributedAttentionLayer
from smp_compat.nn.module import DistributedModule
from smp_compat.nn.transformer import DistributedTransformerOutputLayer

__all__ = ["RotaryEmbedding", "RotaryAttentionLayer", "MLPBranch", "RotaryTransformerLayer", "enter", "additive_mask",
           "layer_options"]  # fmt: skip

Inputs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]


class RotaryEmbedding:
    """Rotary position embedding of the first ``dim`` features of each head.

    ``interleaved`` (GPT-J) rotates feature pairs ``(2i, 2i+1)``; otherwise (GPT-NeoX, "rotate_half") pairs
    ``(i, i + dim/2)``. The angles are computed in fp32 exactly as Hugging Face does, then cast to q's dtype.
    """

    def __init__(self, dim: int, base: float, interleaved: bool) -> None:
        if dim <= 0 or dim % 2:
            raise ValueError(f"rotary dimension {dim} must be a positive even number")
        self.dim, self.base, self.interleaved = dim, base, interleaved

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # GPT-J's create_sinusoidal_positions
            inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64) / self.dim))
        else:  # GPT-NeoX's default rope
            inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))
        return positions.float()[..., None] * inv_freq.to(positions.device)  # [N, S, dim/2]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: ``[N, heads, S, d]``; positions: ``[N, S]``."""
        angles = self._angles(positions)
        if self.interleaved:
            angles = torch.repeat_interleave(angles, 2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        sin, cos = angles.sin()[:, None].to(q.dtype), angles.cos()[:, None].to(q.dtype)
        return self._apply(q, sin, cos), self._apply(k, sin, cos)

    def _apply(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        if self.interleaved:
            turned = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
        else:
            half = self.dim // 2
            turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + turned * sin, rest), dim=-1)


def enter(x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> Inputs:
    """The layer input, its mask and its positions following the batch into the sharded region."""
    n, s = x.shape[:2]
    mask_all = comm.gather_mask(mask, n, s, s, x.dtype)
    # every rank sends [n, s] positions, whether it got per-sample ones or HF's default [1, s]
    positions_all = comm.gather_batch_nograd(positions.reshape(-1, s).expand(n, s).contiguous())
    return comm.enter_region(x), mask_all, positions_all


class RotaryAttentionLayer(DistributedAttentionLayer):
    """Causal self-attention with rotary q/k; optionally without its own LayerNorm, without the residual (a
    parallel-residual branch) and without the output projection's bias (GPT-J). ``entered``: the input was
    already taken into the sharded region (GPT-J's layer does it once for both branches of its shared
    LayerNorm), so ``forward`` gets ``enter(...)``'s triple."""

    def __init__(self, rotary: RotaryEmbedding, layernorm: bool = True, residual: bool = True,
                 dense_bias: bool = True, entered: bool = False, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(pre_layernorm=True, post_layernorm=False, **kwargs)
        if entered and (layernorm or residual):
            raise ValueError("an attention branch fed inside the sharded region has no LayerNorm nor residual")
        self.rotary, self.residual, self.entered = rotary, residual, entered
        if not layernorm:
            self.layernorm = None
        if not dense_bias:
            self.dense_bias = None

    def forward(self, inputs: Inputs) -> torch.Tensor:  # type: ignore[override]
        hidden, mask, positions = inputs
        if self.entered:
            x_all, mask_all, positions_all = inputs
        else:
            x_all, mask_all, positions_all = enter(
                hidden if self.layernorm is None else self.layernorm(hidden), mask, positions)  # fmt: skip
        q = self._heads(x_all, self.query_weight, self.query_bias)
        k = self._heads(x_all, self.key_weight, self.key_bias)
        v = self._heads(x_all, self.value_weight, self.value_bias)
        q, k = self.rotary(q, k, positions_all)
        context = self.math(q, k, v, mask_all, True, self.training)
        context = context.transpose(1, 2).reshape(*x_all.shape[:2], -1)
        out = comm.exit_region(F.linear(context, self.dense_weight))
        out = self.dropout2(out if self.dense_bias is None else out + self.dense_bias)
        return out + hidden if self.residual else out


class MLPBranch(DistributedTransformerOutputLayer):
    """The MLP (``dense1`` column-parallel, ``dense2`` row-parallel); optionally without its own LayerNorm and
    without the residual, as a parallel-residual branch; ``entered`` as for ``RotaryAttentionLayer``."""

    def __init__(self, layernorm: bool = True, residual: bool = True, entered: bool = False, **kwargs: Any) -> None:
        super().__init__(pre_layernorm=True, post_layernorm=False, **kwargs)
        if entered and (layernorm or residual):
            raise ValueError("an MLP branch fed inside the sharded region has no LayerNorm nor residual")
        self.residual, self.entered = residual, entered
        if not layernorm:
            self.layernorm = None

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = inp if self.layernorm is None else self.layernorm(inp)
        h = self.act(F.linear(x if self.entered else comm.enter_region(x), self.dense1_weight, self.dense1_bias))
        out = self.dropout(comm.exit_region(F.linear(h, self.dense2_weight)) + self.dense2_bias)
        if not self.residual:
            return out
        return (out.float() + inp.float()).to(out.dtype) if self.fp32_residual_addition else out + inp


class RotaryTransformerLayer(DistributedModule):
    """``seq_layers[i]``: ``attention`` and ``output``, summed in parallel with the input (``parallel``) or
    applied one after the other; ``shared_layernorm`` gives the layer one LayerNorm feeding both branches, whose
    output enters the sharded region once for both (one all-gather per layer instead of two)."""

    def __init__(self, attention: dict[str, Any], output: dict[str, Any], rotary: RotaryEmbedding, parallel: bool,
                 shared_layernorm: bool, dense_bias: bool) -> None:  # fmt: skip
        super().__init__()
        if shared_layernorm and not parallel:
            raise ValueError("a shared LayerNorm needs the parallel residual")
        self.parallel = parallel
        self.layernorm = None
        if shared_layernorm:
            self.layernorm = nn.LayerNorm(attention["hidden_size"], eps=attention["layernorm_epsilon"])
        own = not shared_layernorm
        self.attention = RotaryAttentionLayer(rotary, own, not parallel, dense_bias, shared_layernorm, **attention)
        self.output = MLPBranch(own, not parallel, shared_layernorm, **output)

    def forward(self, inputs: Inputs) -> Inputs:
        hidden, mask, positions = inputs
        if not self.parallel:
            return self.output(self.attention(inputs)), mask, positions
        if self.layernorm is None:
            a, m = self.attention(inputs), self.output(hidden)
        else:
            entered = enter(self.layernorm(hidden), mask, positions)
            a, m = self.attention(entered), self.output(entered[0])
        if self.output.fp32_residual_addition:
            return (hidden.float() + a.float() + m.float()).to(hidden.dtype), mask, positions
        return a + m + hidden, mask, positions


def build_layers(num_layers: int, layer: dict[str, Any], rotary: RotaryEmbedding, parallel: bool,
                 shared_layernorm: bool, dense_bias: bool) -> nn.Sequential:  # fmt: skip
    """``num_layers`` layers from one flat dict of ``DistributedTransformerLayer``-style arguments and flags."""
    common = ("hidden_size", "hidden_dropout_prob", "layernorm_epsilon", "initializer_range",
              "use_normal_initialization")  # fmt: skip
    out_only = ("intermediate_size", "activation", "fp32_residual_addition")
    output = {k: v for k, v in layer.items() if k in common or k in out_only or k.startswith("fused")}
    attention = {k: v for k, v in layer.items() if k not in out_only}
    return nn.Sequential(*(
        RotaryTransformerLayer({**attention, "layer_idx": i}, output, rotary, parallel, shared_layernorm, dense_bias)
        for i in range(num_layers)))  # fmt: skip


def additive_mask(attention_mask: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor | None:
    """HF's 0/1 padding mask ``[N, S]`` -> the additive ``[N, 1, 1, S]`` mask the distributed layers take."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise SMPUnsupportedError("a 4-D attention_mask in the tensor-parallel GPT-J/GPT-NeoX (pass the 2-D one)")
    keep = attention_mask.to(h.dtype)
    return ((1.0 - keep) * torch.finfo(h.dtype).min)[:, None, None, :]


def layer_options(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The model's layer arguments with the script's ``tensor_parallelism(...)`` options on top. Asking for
    ``flash_attention`` without ``attention_in_fp32`` runs scores through SDPA in the input dtype, as Hugging
    Face's own flash path for these models does (the models' fp32 scores would otherwise keep it off)."""
    merged = {**defaults, **overrides}
    if overrides.get("flash_attention") and "attention_in_fp32" not in overrides:
        merged["attention_in_fp32"] = False
    return merged
