"""Hugging Face GPT-J under tensor parallelism (rotary, parallel residual, shared LayerNorm) trains like stock HF."""

from __future__ import annotations

import pytest
import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm  # noqa: E402
from smp_compat.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.hf  # run again under the oldest supported transformers

LAYERS, HEADS = 2, 2  # head size 8, rotary on its first 4 features: interleaved pairs differ from rotate_half


def _model() -> torch.nn.Module:
    config = transformers.GPTJConfig(
        vocab_size=tm.VOCAB, n_positions=4 * tm.SEQ, n_embd=tm.HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPTJForCausalLM(config)


def _train(prescaled: bool) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = _model()
    model = smp.DistributedModel(hf)
    opt = smp.DistributedOptimizer(tm.adamw(model.parameters()))
    inner = model.get_module()

    losses = tm.train(smp, model, opt, tm.hf_padded_loss)
    mine = tm.my_samples(smp, tm.batches(1)[0])
    with torch.no_grad():
        logits = model(**tm.padded_inputs(mine)).logits
    return {
        "losses": losses, "hf": smp.nn.huggingface.gptj.translate_state_dict_to_hf_gptj(model.state_dict()),
        "ids": mine, "logits": logits, "local": sum(p.numel() for p in model.parameters()),
        "kind": type(inner.transformer).__name__,
        "paths": all(hasattr(c, "attention") and hasattr(c, "output") for c in inner.transformer.seq_layers),
    }  # fmt: skip


@pytest.mark.parametrize("prescaled", [False, True])
def test_gptj_tp2_matches_stock_hf(prescaled: bool) -> None:
    results = run_ranks(_train, 2, prescaled, timeout=240)
    ref_losses, ref_params = tm.reference(_model, loss_fn=tm.hf_padded_loss, make_opt=tm.adamw)
    torch.testing.assert_close(torch.tensor([r["losses"] for r in results]).mean(0), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    stock = _model()
    total = sum(p.numel() for p in stock.parameters())
    h = tm.HIDDEN
    sharded = 4 * h * h + 2 * 4 * h * h + 4 * h  # q, k, v, out_proj; fc_in (+ bias), fc_out
    for r in results:
        assert r["kind"] == "DistributedGPTJModel" and r["paths"]
        assert r["local"] == total - LAYERS * sharded // 2  # each rank holds half of every sharded tensor
        stock.load_state_dict(r["hf"], strict=True)  # the gathered, translated dict is a stock HF checkpoint
        for name, value in ref_params.items():
            torch.testing.assert_close(r["hf"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        with torch.no_grad():
            theirs = stock(**tm.padded_inputs(r["ids"])).logits
        torch.testing.assert_close(r["logits"], theirs, rtol=1e-5, atol=1e-5)


def _tp1() -> dict:
    import smp_compat as smp

    smp.init({})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = _model()
    torch.manual_seed(0)
    plain = _model()
    model = smp.DistributedModel(hf)
    inner = model.get_module().transformer
    ids = tm.batches(1)[0]
    out, ref = model(**tm.padded_inputs(ids), labels=ids), plain(**tm.padded_inputs(ids), labels=ids)
    refused = ""
    try:
        model(input_ids=ids, output_attentions=True)
    except smp.SMPUnsupportedError as exc:
        refused = str(exc)
    return {
        "logits": (out.logits - ref.logits).abs().max().item(), "loss": abs(out.loss.item() - ref.loss.item()),
        "layers": [type(c).__name__ for c in inner.seq_layers], "attention": type(inner.seq_layers[0].attention).__name__,
        "untied": model.get_module().lm_head.weight is not inner.wte.weight, "refused": refused,
    }  # fmt: skip


def test_gptj_swapped_at_tp1_matches_stock_hf() -> None:
    r = run_ranks(_tp1, 1, timeout=120)[0]
    assert r["logits"] < 1e-5 and r["loss"] < 1e-6
    assert r["layers"] == ["RotaryTransformerLayer"] * LAYERS and r["attention"] == "RotaryAttentionLayer"
    assert r["untied"] and "output_attentions" in r["refused"]


def test_gptj_translate_round_trip_and_names() -> None:
    from smp_compat.nn.huggingface import gptj

    torch.manual_seed(0)
    sd = _model().state_dict()
    ours = gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj(sd)
    assert "transformer.seq_layers.1.attention.query_weight" in ours and not any(".h." in k for k in ours)
    back = gptj.translate_state_dict_to_hf_gptj(ours)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], v) for k, v in sd.items())
    assert gptj.translate_hf_state_dict_to_smdistributed_gptj is gptj.translate_hf_gptj_state_dict_to_smdistributed
    assert gptj.translate_hf_state_dict_to_smdistributed_gptj is gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj
    with_buffers = gptj.translate_state_dict_to_hf_gptj(ours, max_seq_len=tm.SEQ)
    assert with_buffers["transformer.h.0.attn.bias"].shape == (1, 1, tm.SEQ, tm.SEQ)
    assert gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj(with_buffers).keys() == ours.keys()
