"""Under sharded data parallelism a full Hugging Face state dict loads into a swapped model, as without sharding.

AWS's GPT-2 fine-tuning notebook saves ``from_pretrained``'s state dict as ``fullmodel.pt`` and loads it with
``smp.resume_from_checkpoint(path, tag="fullmodel.pt", partial=False)``; ``--load_full`` loads what
``--save_final_full_model`` (``save_checkpoint(partial=False)``, Hugging Face's format) wrote. SMP translated
such dicts for its supported models; under sdp they failed with ``Unexpected key(s) ... transformer.h.0...``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm  # noqa: E402
from smp_compat.testing import run_ranks  # noqa: E402


def _gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tm.VOCAB, n_positions=4 * tm.SEQ, n_embd=tm.HIDDEN, n_layer=2, n_head=tm.HEADS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # fmt: skip


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**tm.padded_inputs(tm.batches(1)[0])).logits.float()


def _pretrained(directory: Path, seed: int) -> torch.nn.Module:
    """A stock Hugging Face model saved with save_pretrained (a local stand-in for a hub checkpoint)."""
    torch.manual_seed(seed)
    model = _gpt2().eval()
    model.save_pretrained(directory / f"pretrained{seed}")
    return model


def _fine_tune(directory: str) -> dict[str, Any]:
    import smp_compat as smp

    root = Path(directory)
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "delayed_parameter_initialization": True})
    with smp.model_creation(tensor_parallelism=True):
        hf = _gpt2()
    model = smp.DistributedModel(hf)
    model.eval()
    out: dict[str, Any] = {"swapped": hasattr(model.get_module().transformer, "seq_layers")}
    if smp.rank() == 0:  # the notebook: rank 0 saves from_pretrained's state dict, every rank resumes it
        pretrained = transformers.GPT2LMHeadModel.from_pretrained(root / "pretrained1")
        torch.save(pretrained.state_dict(), root / "fullmodel.pt")
    smp.barrier()
    smp.resume_from_checkpoint(directory, tag="fullmodel.pt", partial=False)
    out["resumed"] = _logits(model)
    stock = transformers.GPT2LMHeadModel.from_pretrained(root / "pretrained2")
    model.load_state_dict(stock.state_dict())  # a stock model's own dict
    out["loaded"] = _logits(model)
    model.train()
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2))
    tm.train(smp, model, opt, tm.hf_padded_loss)
    model.eval()
    out["trained"] = _logits(model)
    smp.save_checkpoint(directory, "final.pt", partial=False, model=model)  # --save_final_full_model: HF's format
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    smp.resume_from_checkpoint(directory, tag="final.pt", partial=False)  # --load_full
    out["reloaded"] = _logits(model)
    return out


def test_full_hugging_face_dicts_load_into_a_swapped_sdp2_model(tmp_path: Path) -> None:
    first, second = _pretrained(tmp_path, 1), _pretrained(tmp_path, 2)
    results = run_ranks(_fine_tune, 2, str(tmp_path), timeout=180)
    exported = _gpt2().eval()
    exported.load_state_dict(torch.load(tmp_path / "final.pt", weights_only=True), strict=True)
    for r in results:
        assert r["swapped"]
        torch.testing.assert_close(r["resumed"], _logits(first), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["loaded"], _logits(second), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(r["trained"], r["loaded"])
        torch.testing.assert_close(r["reloaded"], r["trained"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_logits(exported), r["trained"], rtol=1e-5, atol=1e-5)
