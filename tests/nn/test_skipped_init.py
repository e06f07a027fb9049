"""A model whose script made ``PreTrainedModel.init_weights`` a no-op for SMP's swap starts from Hugging Face's
initialization, not torch's construction defaults (AWS's GPT-2 scripts at tp > 1 without delayed init: an
N(0, 1) embedding tied to the head gave a first loss of ~44 at vocabulary 512 instead of ~ln 512 = 6.2);
what ``from_pretrained`` loaded, and a model whose ``init_weights`` is left alone, keep their weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import transformers

from smp_compat.testing import run_ranks

__all__: list[str] = []

VOCAB, HIDDEN = 512, 64


def _config() -> transformers.GPT2Config:
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=2, n_head=4,
                                   bos_token_id=0, eos_token_id=0)  # fmt: skip


def _swapped(no_op: bool, pretrained: str | None = None) -> dict[str, Any]:
    """In a forked rank: build (or load) GPT-2 under ``model_creation(tensor_parallelism=True)`` and swap it."""
    import smp_compat as smp
    from smp_compat.nn.swap import swap_modules

    smp.init({})
    if no_op:
        transformers.PreTrainedModel.init_weights = lambda self: None  # AWS's scripts (a forked rank: local)
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = (transformers.GPT2LMHeadModel.from_pretrained(pretrained) if pretrained
              else transformers.GPT2LMHeadModel(_config()))  # fmt: skip
    built = {k: v.clone() for k, v in hf.transformer.state_dict().items() if k in ("wte.weight", "wpe.weight")}
    model = swap_modules(hf)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    return {"built": built, "wte": model.transformer.wte.weight.detach().clone(), "loss": loss,
            "wpe": model.transformer.wpe.weight.detach().clone(), "swapped": hasattr(model.transformer, "seq_layers")}


def test_a_model_built_under_a_no_op_init_weights_gets_hugging_faces_initialization_at_the_swap() -> None:
    r = run_ranks(_swapped, 1, True, timeout=120)[0]
    assert r["swapped"]
    assert r["built"]["wte.weight"].std() > 0.9  # the no-op left torch's N(0, 1)
    std = _config().initializer_range
    for name in ("wte", "wpe"):
        assert abs(r[name].std().item() - std) < 0.2 * std, (name, r[name].std().item())
    assert r["loss"] < 1.1 * math.log(VOCAB), r["loss"]


def test_weights_from_pretrained_are_kept_under_a_no_op_init_weights(tmp_path: Path) -> None:
    torch.manual_seed(3)
    saved = transformers.GPT2LMHeadModel(_config())
    with torch.no_grad():
        saved.transformer.wte.weight.mul_(5.0)  # nothing an initialization would give
        saved.transformer.wpe.weight.add_(1.0)
    saved.save_pretrained(tmp_path)
    r = run_ranks(_swapped, 1, True, str(tmp_path), timeout=120)[0]
    assert torch.equal(r["wte"], saved.transformer.wte.weight) and torch.equal(r["wpe"], saved.transformer.wpe.weight)


def test_a_model_whose_init_weights_is_left_alone_keeps_its_weights_through_the_swap() -> None:
    r = run_ranks(_swapped, 1, False, timeout=120)[0]
    assert torch.equal(r["wte"], r["built"]["wte.weight"]) and torch.equal(r["wpe"], r["built"]["wpe.weight"])
