"""``smp.nn``'s transformer family: output (MLP) layer, transformer layer, stack and LM head.

Column-parallel first projection, row-parallel second, whole heads per rank; LayerNorms and the
row-parallel biases are replicated and applied to each rank's own samples outside the sharded region.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp_compat.errors import SMPUnsupportedError
from smp_compat.nn import comm
from smp_compat.nn.attention import DistributedAttentionLayer, full_linear
from smp_compat.nn.linear import DistributedEmbedding
from smp_compat.nn.module import DistributedModule, check_flags, divide, shard

__all__ = ["DistributedTransformerOutputLayer", "DistributedTransformerLayer", "DistributedTransformer",
           "DistributedTransformerLMHead", "activation_fn"]  # fmt: skip

_ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation_fn(name: str) -> Any:
    if name not in _ACTIVATIONS:
        raise SMPUnsupportedError(
            f"activation {name!r} in smp.nn transformer layers (use one of {sorted(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[name]


def _residual(a: torch.Tensor, b: torch.Tensor, in_fp32: bool) -> torch.Tensor:
    return (a.float() + b.float()).to(a.dtype) if in_fp32 else a + b


class DistributedTransformerOutputLayer(DistributedModule):
    """The MLP half of a layer: ``dense1`` (H -> I, column-parallel), activation, ``dense2`` (row-parallel)."""

    def __init__(
        self,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        fp32_residual_addition: bool = False,
        **flags: Any,
    ) -> None:
        super().__init__()
        check_flags("DistributedTransformerOutputLayer", flags)
        if not (pre_layernorm or post_layernorm):
            raise ValueError("DistributedTransformerOutputLayer needs pre_layernorm or post_layernorm (or both) True")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        divide(intermediate_size, "intermediate_size")
        self.act = activation_fn(activation)
        self.pre_layernorm, self.post_layernorm = pre_layernorm, post_layernorm
        self.fp32_residual_addition = fp32_residual_addition
        self._init = (use_normal_initialization, initializer_range)
        d1 = full_linear(hidden_size, intermediate_size, use_normal_initialization, initializer_range)
        d2 = full_linear(intermediate_size, hidden_size, use_normal_initialization, initializer_range)
        self.dense1_weight, self.dense1_bias = shard(d1.weight.data, 0), shard(d1.bias.data, 0)
        self.dense2_weight, self.dense2_bias = shard(d2.weight.data, 1), nn.Parameter(d2.bias.data.clone())
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.dropout = nn.Dropout(hidden_dropout_prob)

    def reset_parameters(self) -> None:
        """Delayed initialization: whole tensors from the global RNG as in the constructor, then this rank's slices."""
        normal, std = self._init
        d1 = full_linear(self.hidden_size, self.intermediate_size, normal, std)
        d2 = full_linear(self.intermediate_size, self.hidden_size, normal, std)
        with torch.no_grad():
            self.dense1_weight.copy_(shard(d1.weight.data, 0))
            self.dense1_bias.copy_(shard(d1.bias.data, 0))
            self.dense2_weight.copy_(shard(d2.weight.data, 1))
            self.dense2_bias.copy_(d2.bias.data)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = self.layernorm(inp) if self.pre_layernorm else inp
        h = self.act(F.linear(comm.enter_region(x), self.dense1_weight, self.dense1_bias))
        out = self.dropout(comm.exit_region(F.linear(h, self.dense2_weight)) + self.dense2_bias)
        out = _residual(out, inp, self.fp32_residual_addition)
        return self.layernorm(out) if self.post_layernorm and not self.pre_layernorm else out


class DistributedTransformerLayer(DistributedModule):
    """``attention`` (+ ``cross_attention``) then ``output``; ``forward((h, mask))`` -> ``(h, mask)``,
    with cross-attention ``forward((h, cross_states, mask, cross_mask))`` -> the same 4-tuple."""

    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        use_alibi: bool = False,
        alibi_bias_max: int = 8,
        **flags: Any,
    ) -> None:
        super().__init__()
        common = dict(num_attention_heads=num_attention_heads, attention_head_size=attention_head_size,
                      hidden_size=hidden_size, attention_dropout_prob=attention_dropout_prob,
                      hidden_dropout_prob=hidden_dropout_prob, layernorm_epsilon=layernorm_epsilon,
                      initializer_range=initializer_range, use_normal_initialization=use_normal_initialization,
                      pre_layernorm=pre_layernorm, post_layernorm=post_layernorm, use_alibi=use_alibi)  # fmt: skip
        attn_flags = {k: v for k, v in flags.items() if k != "fp32_residual_addition"}
        self.attention = DistributedAttentionLayer(causal_mask_size=causal_mask_size, **common, **attn_flags)
        self.add_cross_attention = add_cross_attention
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(cross_attention=True, **common, **attn_flags)
        out_flags = {k: v for k, v in flags.items() if k == "fp32_residual_addition" or k.startswith("fused")}
        self.output = DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, hidden_dropout_prob, activation, layernorm_epsilon, initializer_range,
            use_normal_initialization, pre_layernorm, post_layernorm, **out_flags)  # fmt: skip

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.add_cross_attention:
            hidden, cross, mask, cross_mask = inputs
            hidden = self.attention((hidden, mask))
            hidden = self.cross_attention((hidden, cross, cross_mask))
            return self.output(hidden), cross, mask, cross_mask
        hidden, mask = inputs
        return self.output(self.attention((hidden, mask))), mask


class DistributedTransformer(DistributedModule):
    """``num_layers`` ``DistributedTransformerLayer``s in ``seq_layers``; with both pre- and post-LayerNorm,
    a LayerNorm at the stack's input and output too. ``forward`` takes and returns the layers' tuple."""

    def __init__(
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        **flags: Any,
    ) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.seq_layers = nn.Sequential(*(
            DistributedTransformerLayer(
                num_attention_heads, attention_head_size, hidden_size, intermediate_size, attention_dropout_prob,
                hidden_dropout_prob, activation, layernorm_epsilon, initializer_range, use_normal_initialization,
                causal_mask_size, add_cross_attention, pre_layernorm, post_layernorm, layer_idx=i, **flags)
            for i in range(num_layers)))  # fmt: skip
        self.stack_layernorms = pre_layernorm and post_layernorm
        if self.stack_layernorms:
            self.input_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
            self.output_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.stack_layernorms:
            inputs = (self.input_layernorm(inputs[0]), *inputs[1:])
        out = self.seq_layers(tuple(inputs))
        if self.stack_layernorms:
            out = (self.output_layernorm(out[0]), *out[1:])
        return out


class DistributedTransformerLMHead(DistributedModule):
    """Embeddings (word, position, optional token type) -> ``transformer`` -> bias-free LM head tied to the word
    embeddings. ``forward((input_ids, attention_mask, token_type_ids, position_ids, labels))`` returns the logits
    ``[N,S,vocab]``; ``attention_mask`` is 0/1 with 1 marking a masked position (as SMP documents)."""

    def __init__(
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        vocab_size: int = 30522,
        num_positions: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        num_token_types: int = 0,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        add_lm_head: bool = True,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        **flags: Any,
    ) -> None:
        super().__init__()
        if add_cross_attention:
            raise SMPUnsupportedError("DistributedTransformerLMHead(add_cross_attention=True)")
        self.word_embedding = DistributedEmbedding(vocab_size, hidden_size, initializer_range=initializer_range)
        self.position_embedding = DistributedEmbedding(num_positions, hidden_size, initializer_range=initializer_range)
        self.token_type_embedding = None
        if num_token_types:
            self.token_type_embedding = DistributedEmbedding(num_token_types, hidden_size,
                                                             initializer_range=initializer_range)  # fmt: skip
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers, num_attention_heads, attention_head_size, hidden_size, intermediate_size, attention_dropout_prob,
            hidden_dropout_prob, activation, layernorm_epsilon, initializer_range, use_normal_initialization,
            causal_mask_size, False, pre_layernorm, post_layernorm, **flags)  # fmt: skip
        self.add_lm_head, self.hidden_size = add_lm_head, hidden_size

    def forward(self, inputs: tuple[Any, ...]) -> torch.Tensor:
        input_ids, attention_mask, token_type_ids, position_ids, labels = inputs
        if labels is not None:
            raise SMPUnsupportedError("DistributedTransformerLMHead computing a loss from labels; pass labels=None "
                                      "and compute the loss from the returned logits")  # fmt: skip
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        h = self.word_embedding(input_ids) + self.position_embedding(position_ids)
        if self.token_type_embedding is not None and token_type_ids is not None:
            h = h + self.token_type_embedding(token_type_ids)
        h = self.dropout(h)
        mask = None
        if attention_mask is not None:
            mask = (attention_mask.to(h.dtype) * torch.finfo(h.dtype).min)[:, None, None, :]
        h = self.transformer((h, mask))[0]
        if not self.add_lm_head:
            return h
        emb = self.word_embedding
        start = comm.tp_index() * emb.local_embedding_dim
        h_all = comm.enter_region(h)[..., start : start + emb.local_embedding_dim]
        return comm.exit_region(F.linear(h_all, emb.weight))
