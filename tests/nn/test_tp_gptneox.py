"""Hugging Face GPT-NeoX under tensor parallelism (fused per-head q|k|v, partial rotary, parallel or sequential
residual, tied head) trains like stock HF."""

from __future__ import annotations

import pytest
import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm  # noqa: E402
from smp_compat.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.hf  # run again under the oldest supported transformers

LAYERS, HEADS, INTER = 2, 2, 24  # head size 8, rotary on its first 4 features: rotate_half differs from interleaved


def _model(parallel: bool = True, bias: bool = True, rotary_pct: float = 0.5) -> torch.nn.Module:
    config = transformers.GPTNeoXConfig(
        vocab_size=tm.VOCAB, max_position_embeddings=4 * tm.SEQ, hidden_size=tm.HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=INTER, rotary_pct=rotary_pct, use_parallel_residual=parallel,
        attention_bias=bias, tie_word_embeddings=True, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPTNeoXForCausalLM(config)


def _inputs(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``padded_inputs`` with positions below the sequence length: transformers 4's GPT-NeoX looks them up in a
    rotary table as long as the sequence."""
    inputs = tm.padded_inputs(ids)
    forward = torch.arange(ids.shape[1])
    inputs["position_ids"] = torch.where(ids[:, :1] % 3 == 1, forward.flip(0), forward)  # per sample, by content
    return inputs


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(**_inputs(ids), labels=ids).loss


def _train(prescaled: bool, parallel: bool) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = _model(parallel, rotary_pct=1.0)
    model = smp.DistributedModel(hf)
    opt = smp.DistributedOptimizer(tm.adamw(model.parameters()))
    inner = model.get_module()

    losses = tm.train(smp, model, opt, _loss)
    mine = tm.my_samples(smp, tm.batches(1)[0])
    with torch.no_grad():
        logits = model(**_inputs(mine)).logits
    return {
        "losses": losses, "hf": smp.nn.huggingface.gptneox.translate_state_dict_to_hf_gptneox(model.state_dict()),
        "ids": mine, "logits": logits, "local": sum(p.numel() for p in model.parameters()),
        "kind": type(inner.gpt_neox).__name__, "tied": inner.get_output_embeddings().weight is inner.gpt_neox.embed_in.weight,
        "paths": all(hasattr(c, "attention") and hasattr(c, "output") for c in inner.gpt_neox.seq_layers),
    }  # fmt: skip


@pytest.mark.parametrize(("prescaled", "parallel"), [(False, True), (True, False)])
def test_gptneox_tp2_matches_stock_hf(prescaled: bool, parallel: bool) -> None:
    results = run_ranks(_train, 2, prescaled, parallel, timeout=240)
    # rotary on every feature: the key bias of unrotated features has a zero true gradient, whose float noise AdamW
    # would amplify (GPT-J's tests cover partial rotary under tp; test_gptneox_swapped_at_tp1 covers it here)
    ref_losses, ref_params = tm.reference(lambda: _model(parallel, rotary_pct=1.0), loss_fn=_loss, make_opt=tm.adamw)
    torch.testing.assert_close(torch.tensor([r["losses"] for r in results]).mean(0), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    stock = _model(parallel, rotary_pct=1.0)
    total = sum(p.numel() for p in stock.parameters())
    h = tm.HIDDEN
    sharded = 4 * h * h + 3 * h + 2 * h * INTER + INTER  # q, k, v (+ biases), dense; h_to_4h (+ bias), 4h_to_h
    for r in results:
        assert r["kind"] == "DistributedGPTNeoXModel" and r["paths"] and r["tied"]
        assert r["local"] == total - LAYERS * sharded // 2  # each rank holds half of every sharded tensor
        stock.load_state_dict(r["hf"], strict=True)  # the gathered, translated dict is a stock HF checkpoint
        for name, value in ref_params.items():
            torch.testing.assert_close(r["hf"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        with torch.no_grad():
            theirs = stock(**_inputs(r["ids"])).logits
        torch.testing.assert_close(r["logits"], theirs, rtol=1e-5, atol=1e-5)


def _tp1() -> dict:
    import smp_compat as smp

    smp.init({})
    flags = dict(query_key_layer_scaling=True, fused_softmax=True, fused_bias_gelu=True, flash_attention=True,
                 fp32_residual_addition=True)  # what AWS's scripts pass: same numerics  # fmt: skip
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True, **flags):
        hf = _model(bias=False)
    torch.manual_seed(0)
    plain = _model(bias=False)
    model = smp.DistributedModel(hf)
    inner = model.get_module().gpt_neox
    ids = tm.batches(1)[0]
    out, ref = model(**_inputs(ids), labels=ids), plain(**_inputs(ids), labels=ids)
    refused = ""
    try:  # generation's first call: an empty cache the stack would never fill
        model(input_ids=ids, past_key_values=transformers.DynamicCache(), use_cache=True)
    except smp.SMPUnsupportedError as exc:
        refused = str(exc)
    layer = inner.seq_layers[0]
    return {
        "logits": (out.logits - ref.logits).abs().max().item(), "loss": abs(out.loss.item() - ref.loss.item()),
        "layers": [type(c).__name__ for c in inner.seq_layers], "biases": (layer.attention.key_bias,
        layer.attention.dense_bias), "refused": refused, "flash": layer.attention.math.flash and not
        layer.attention.math.in_fp32,
    }  # fmt: skip


def test_gptneox_swapped_at_tp1_matches_stock_hf() -> None:
    r = run_ranks(_tp1, 1, timeout=120)[0]
    assert r["logits"] < 1e-5 and r["loss"] < 1e-6
    assert r["layers"] == ["RotaryTransformerLayer"] * LAYERS and r["biases"] == (None, None) and r["flash"]
    assert "past_key_values" in r["refused"]


def test_gptneox_translate_round_trip_and_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    from smp_compat.nn.huggingface import gptneox

    torch.manual_seed(0)
    stock = _model()
    sd = stock.state_dict()
    ours = gptneox.translate_hf_state_dict_to_smdistributed_gptneox(sd, num_attention_heads=HEADS)
    assert "gpt_neox.seq_layers.1.attention.key_bias" in ours and not any(".layers." in k for k in ours)
    # head 0's q rows are the fused weight's first head_size rows; its k rows follow
    fused, size = sd["gpt_neox.layers.0.attention.query_key_value.weight"], tm.HIDDEN // HEADS
    assert torch.equal(ours["gpt_neox.seq_layers.0.attention.query_weight"][:size], fused[:size])
    assert torch.equal(ours["gpt_neox.seq_layers.0.attention.key_weight"][:size], fused[size : 2 * size])
    back = gptneox.translate_state_dict_to_hf_gptneox(ours, num_attention_heads=HEADS)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], v) for k, v in sd.items())
    with_buffers = gptneox.translate_state_dict_to_hf_gptneox(ours, max_seq_len=tm.SEQ, num_attention_heads=HEADS)
    assert with_buffers["gpt_neox.layers.0.attention.bias"].shape == (1, 1, tm.SEQ, tm.SEQ)
    again = gptneox.translate_hf_state_dict_to_smdistributed_gptneox(with_buffers, num_attention_heads=HEADS)
    assert again.keys() == ours.keys()
    monkeypatch.setattr(gptneox, "_heads_seen", set())  # nothing swapped in this process: the count must be given
    with pytest.raises(TypeError, match="num_attention_heads"):
        gptneox.translate_state_dict_to_hf_gptneox(ours)


def test_gptneox_full_checkpoint_translation_takes_heads_from_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """save_checkpoint(translate_if_full=True) and resuming from an HF file call the translators with the state
    dict alone: the swapped model supplies the head count, even with two head counts seen in the process."""
    from smp_compat.nn.huggingface import from_hf_translator, gptneox, to_hf_format

    monkeypatch.setattr(gptneox, "_heads_seen", {HEADS, 2 * HEADS})
    torch.manual_seed(0)
    model, stock = _model(), _model()
    model.gpt_neox = gptneox._build(model.gpt_neox, {})  # the swap at tp = 1, without smp.init
    ours = model.state_dict()
    stock.load_state_dict(to_hf_format(model, ours), strict=True)
    translate = from_hf_translator(model, stock.state_dict())
    assert translate is not None
    back = translate(stock.state_dict())
    assert back.keys() == ours.keys() and all(torch.equal(back[k], v) for k, v in ours.items())
