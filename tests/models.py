"""Small deterministic models and data shared by the fidelity tests (no dropout, fixed seeds)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block; the attention mask arrives as a keyword argument."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, bias=False)  # key bias has a zero true grad
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=attention_mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Embedding tied to the output head, a ModuleList loop, and a residual from the embedding to the head."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x0 = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        x = x0
        for block in self.blocks:
            x = block(x, attention_mask=attention_mask)
        return self.head(self.ln_f(x) + 0.5 * x0)


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, error: Exception) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        ctx.error = error
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:  # type: ignore[no-untyped-def, override]
        raise ctx.error


def fail_in_backward(x: torch.Tensor, error: Exception) -> torch.Tensor:
    """The identity in forward; raises ``error`` when the backward reaches it (the failure tests' fault)."""
    return _FailInBackward.apply(x, error)


def causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_model(seed: int = 0, **kwargs: int) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs)


def make_batches(steps: int, batch: int, seq: int = 8, vocab: int = 32, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def reference_training(steps: int, batch: int, lr: float = 1e-2) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process PyTorch on the global batch: the oracle every parallel run must match."""
    losses, model, _ = plain_training(steps, batch, lambda m: torch.optim.Adam(m.parameters(), lr=lr))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def plain_training(
    steps: int, batch: int, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
) -> tuple[list[float], TinyTransformer, torch.optim.Optimizer]:
    """``reference_training`` with any optimizer (built from the model), whose state the test compares too."""
    model = make_model()
    opt = make_optimizer(model)
    mask = causal_mask(8)
    losses = []
    for x, y in make_batches(steps, batch):
        opt.zero_grad()
        loss = lm_loss(model(x, attention_mask=mask), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model, opt


def place_blocks_by_stage(smp, model) -> None:  # type: ignore[no-untyped-def]
    """The manual split the pipeline tests share: blocks spread in order over the stages, ln_f on the last one,
    the tied embedding and head on rank 0 (so a microbatch goes rank 0 -> later ranks -> rank 0)."""
    blocks = model.module.blocks
    per = len(blocks) // smp.pp_size()
    for i, block in enumerate(blocks):
        smp.set_partition(block, min(i // per, smp.pp_size() - 1))
    smp.set_partition(model.module.ln_f, smp.pp_size() - 1)


def lm_train_step(smp):  # type: ignore[no-untyped-def]
    """The @smp.step every transformer test trains with: causal mask as a keyword, loss in the step body."""
    mask = causal_mask(8)

    @smp.step
    def train_step(model, x, y):  # type: ignore[no-untyped-def]
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(loss)
        return loss

    return train_step


def train_smp(smp, model, opt, train_step, steps: int, global_batch: int) -> list[float]:  # type: ignore[no-untyped-def]
    """SMP-style loop on this data-parallel rank's shard of the reference batches; global mean losses."""
    per_rank = global_batch // smp.dp_size()
    lo = smp.dp_rank() * per_rank
    losses = []
    for x, y in make_batches(steps, global_batch):
        opt.zero_grad()
        out = train_step(model, x[lo : lo + per_rank], y[lo : lo + per_rank])
        opt.step()
        losses.append(sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size())
    return losses
