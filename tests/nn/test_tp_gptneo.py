"""Hugging Face GPT-Neo under tensor parallelism (global and sliding-window local layers) trains like stock HF."""

from __future__ import annotations

import pytest
import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm  # noqa: E402
from smp_compat.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.hf  # run again under the oldest supported transformers


def _model() -> torch.nn.Module:
    config = transformers.GPTNeoConfig(
        vocab_size=tm.VOCAB, max_position_embeddings=tm.SEQ, hidden_size=tm.HIDDEN, num_layers=2, num_heads=tm.HEADS,
        attention_types=[[["global", "local"], 1]], window_size=3, resid_dropout=0.0, embed_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPTNeoForCausalLM(config)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[ids[:, 0] % 3 == 0, -2:] = 0
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _train(prescaled: bool) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = _model()
    model = smp.DistributedModel(hf)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    windows = [layer.attention.math.window_size for layer in model.get_module().transformer.seq_layers]

    losses = tm.train(smp, model, opt, _loss)
    hf_sd = smp.nn.huggingface.gptneo.translate_state_dict_to_hf_gptneo(model.state_dict())
    return {"losses": losses, "hf": hf_sd, "windows": windows}


@pytest.mark.parametrize("prescaled", [False, True])
def test_gptneo_tp2_matches_stock_hf(prescaled: bool) -> None:
    results = run_ranks(_train, 2, prescaled, timeout=240)
    ref_losses, ref_params = tm.reference(_model, loss_fn=_loss)
    torch.testing.assert_close(torch.tensor([r["losses"] for r in results]).mean(0), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    stock = _model()
    for r in results:
        assert r["windows"] == [None, 3]
        stock.load_state_dict(r["hf"], strict=True)
        for name, value in ref_params.items():
            torch.testing.assert_close(r["hf"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
