"""``torch.sagemaker.moe.moe_layer.MoELayer``: a Mixtral sparse-MoE block with expert parallelism.

``transform(model, config=MoEConfig(...))`` puts one in place of each decoder layer's Hugging Face block,
keeping its parameter names (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``;
transformers 4.x's ``block_sparse_moe`` keeps its name and returns ``(hidden_states, router_logits)`` as 4.x's does).
With ``expert_parallel_degree`` E, each rank of an expert-parallel group holds ``num_local_experts / E``
experts (``LocalExperts``) and tokens travel to them over the group (dispatch.py). The router's auxiliary
and z losses join the backward pass without changing the forward output (Megatron's way): the script's
``outputs["loss"]`` stays the language-model loss, its gradient includes ``moe_aux_loss_coeff`` x the
load-balancing loss and ``moe_z_loss_coeff`` x the z loss of every MoE layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smp_compat.v2.moe import routing
from smp_compat.v2.moe.dispatch import AllToAll, exchange_counts
from smp_compat.v2.moe.moe_config import MoEConfig

__all__ = ["MoELayer", "LocalExperts"]


class LocalExperts(nn.Module):
    """This rank's experts as Hugging Face 5.x stacks them: ``gate_up_proj`` [n, 2I, H], ``down_proj`` [n, H, I]."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: nn.Module, first: int,
                 init_std: float = 0.02, total: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.init_std = init_std  # Hugging Face's initializer_range, for delayed parameter initialization
        self.total = gate_up_proj.shape[0] if total is None else total  # experts over the whole ep group
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.act_fn = act_fn
        self.first = first  # global index of expert 0 here
        self.grad_scale = 1.0  # the FSDP façade sets 1/ep: these gradients already hold every ep peer's tokens

    def reset_parameters(self) -> None:
        """Hugging Face's Mixtral initialization of expert weights: normal(0, initializer_range).

        Every rank draws all ``total`` experts, one at a time in a fixed order, and keeps its own: delayed
        initialization then gives the same weights (and leaves the random stream in the same state) at any
        expert_parallel_degree, with one expert's weights as the only extra memory."""
        with torch.no_grad():
            for param in (self.gate_up_proj, self.down_proj):
                scratch = torch.empty_like(param[0])
                for e in range(self.total):
                    scratch.normal_(0.0, self.init_std)
                    if self.first <= e < self.first + param.shape[0]:
                        param[e - self.first].copy_(scratch)

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """``rows[j]``: tokens for local expert j -> that expert's outputs (Mixtral's SwiGLU MLP)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.grad_scale != 1.0:
            gate_up, down = _ScaleGrad.apply(gate_up, self.grad_scale), _ScaleGrad.apply(down, self.grad_scale)
        out = []
        for j, x in enumerate(rows):
            gate, up = F.linear(x, gate_up[j]).chunk(2, dim=-1)
            out.append(F.linear(self.act_fn(gate) * up, down[j]))
        return out


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _JoinBackward(torch.autograd.Function):
    """Returns ``out`` unchanged; backward gives ``extra`` (a scalar loss) gradient 1, as if added to the loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ctx.extra_shape = extra.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.extra_shape, dtype=torch.float32, device=grad.device)


class MoELayer(nn.Module):
    """Router + experts over the expert-parallel group; the block Mixtral's decoder layer calls as ``mlp``."""

    def __init__(self, gate: nn.Module, experts: LocalExperts, top_k: int, num_experts: int, config: MoEConfig,
                 group: dist.ProcessGroup | None, ep_size: int, jitter_noise: float = 0.0,
                 returns_router_logits: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.gate = gate  # Hugging Face's router: weight [num_experts, hidden]
        self.experts = experts
        self.top_k, self.num_experts, self.moe_config = top_k, num_experts, config
        self.ep_group, self.ep_size, self.jitter_noise = group, ep_size, jitter_noise
        self.last_router_loss: torch.Tensor | None = None  # detached, for logging
        self.returns_router_logits = returns_router_logits  # transformers 4.x's decoder layer unpacks a pair

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise
            )
        x = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(x, self.gate.weight)
        weights, indices = routing.route(logits, self.top_k, self.moe_config.moe_load_balancing, self.training)
        pairs = self._run_experts(x, indices)  # [T * k, H], pair t*k + slot
        out = (pairs.view(x.shape[0], self.top_k, -1) * weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1)
        out = self._join_router_losses(out, logits, indices).reshape(shape)
        return (out, logits) if self.returns_router_logits else out

    def _run_experts(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        flat = indices.flatten()
        order = torch.argsort(flat, stable=True)
        rows = x[order // self.top_k]
        counts = torch.bincount(flat, minlength=self.num_experts).view(self.ep_size, -1)
        if self.ep_size == 1:
            done = torch.cat(self.experts(list(rows.split(counts[0].tolist()))), dim=0)
        else:
            done = self._exchange_and_run(rows, counts)
        pairs = torch.empty_like(done)
        pairs[order] = done
        return pairs

    def _exchange_and_run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each peer the rows for its experts, run this rank's experts on what arrives, send results back."""
        recv_counts = exchange_counts(counts, self.ep_group)  # [source rank, local expert]
        send, recv = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        arrived = AllToAll.apply(rows, send, recv, self.ep_group)
        chunks = list(arrived.split(recv_counts.flatten().tolist()))  # (source, expert) in row-major order
        local = recv_counts.shape[1]
        per_expert = [torch.cat(chunks[j::local], dim=0) for j in range(local)]
        outputs = self.experts(per_expert)
        back: list[torch.Tensor] = [None] * len(chunks)  # type: ignore[list-item]
        for j, out in enumerate(outputs):
            for src, piece in enumerate(out.split(recv_counts[:, j].tolist())):
                back[src * local + j] = piece
        return AllToAll.apply(torch.cat(back, dim=0), recv, send, self.ep_group)

    def _join_router_losses(self, out: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        cfg = self.moe_config
        extra = logits.new_zeros((), dtype=torch.float32)
        if cfg.moe_load_balancing == "aux_loss" and cfg.moe_aux_loss_coeff:
            extra = extra + routing.aux_loss(logits, indices, cfg.moe_aux_loss_coeff)
        if cfg.moe_z_loss_coeff:
            extra = extra + routing.z_loss(logits, cfg.moe_z_loss_coeff)
        self.last_router_loss = extra.detach()
        if self.training and torch.is_grad_enabled() and extra.requires_grad:
            return _JoinBackward.apply(out, extra)
        return out
