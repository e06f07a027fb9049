"""Hugging Face state outside tensors at pp = 2: attentions collected by hooks, and KV caches.

transformers 5 collects ``output_attentions`` through forward hooks and a context variable; the layers
served on rank 1 used to add nothing, so half the attentions were silently missing. A KV cache filled by
earlier decoding is changed in place by each rank's layers, and those changes do not come back: refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers  # the test extra installs it: these tests must run, not skip

import smp_compat as smp
from smp_compat.testing import RankFailure, run_ranks

pytestmark = pytest.mark.hf  # run again under the oldest supported transformers

LAYERS, STEPS, LR = 4, 2, 0.1


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
                                     attn_implementation="eager", bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _ids() -> torch.Tensor:
    return torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(3))


def _loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """The LM loss plus a term of every layer's attentions (their gradients must reach every rank)."""
    return out.loss + sum(a[..., 0].mean() for a in out.attentions)


def _init(pp_layers: bool) -> Any:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    model = smp.DistributedModel(_gpt2())
    for block in model.module.transformer.h[LAYERS // 2:]:
        smp.set_partition(block, 1)
    return model


def _train_ranks() -> dict[str, Any]:
    model = _init(True)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        out = model(input_ids=ids, labels=ids, output_attentions=True)
        loss = _loss(out, ids)
        model.backward(loss)
        return loss, len(out.attentions)

    losses, counts = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss, count = train_step(model, _ids())
        optimizer.step()
        losses.append(loss.reduce_mean().item())
        counts.append(count[0])  # a non-tensor output: one value per microbatch
    return {"losses": losses, "counts": counts,
            "params": {n: p.detach().clone() for n, p in model.local_named_parameters()}}  # fmt: skip


def test_attentions_of_every_rank_are_returned_and_train_like_plain_pytorch() -> None:
    results = run_ranks(_train_ranks, 2, timeout=90)
    plain = _gpt2()
    optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        ids = _ids()
        halves = [_loss(plain(input_ids=h, labels=h, output_attentions=True), h) for h in ids.chunk(2)]
        (sum(halves) / 2).backward()
        optimizer.step()
        losses.append((sum(halves) / 2).item())
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["counts"] == [LAYERS] * STEPS  # was LAYERS // 2: rank 1's layers added nothing
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        merged.update(r["params"])
    for name, value in plain.named_parameters():
        torch.testing.assert_close(merged[name], value.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _decode_ranks() -> None:
    model = _init(True)
    model.eval()

    @smp.step
    def decode(model: Any, ids: torch.Tensor, past: Any) -> Any:
        return model(input_ids=ids, past_key_values=past, use_cache=True)

    with torch.no_grad():
        cache = decode(model, _ids(), None).past_key_values[0]  # an empty cache to start: fine
        decode(model, _ids()[:, -1:], cache)  # rank 1's layers are missing from it


def test_decoding_with_a_filled_kv_cache_is_refused() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_decode_ranks, 2, timeout=60)
    assert "SMPUnsupportedError: past_key_values holding cached keys and values" in str(info.value)
