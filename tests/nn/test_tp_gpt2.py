"""Hugging Face GPT-2 under tensor parallelism: swapped for DistributedTransformer, trains like stock HF."""

from __future__ import annotations

import pytest
import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm  # noqa: E402
from smp_compat.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.hf  # run again under the oldest supported transformers

LAYERS = 2


def _config(**overrides: object) -> object:
    base = dict(vocab_size=tm.VOCAB, n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=LAYERS, n_head=tm.HEADS,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=True)  # fmt: skip
    return transformers.GPT2Config(**{**base, **overrides})


def _mask(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[ids[:, 0] % 3 == 0, -2:] = 0  # right padding on some samples (chosen by content: the same on any split)
    return mask


def _hf_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=_mask(ids), labels=ids).loss


def _train(tp: int, prescaled: bool) -> dict:
    import smp_compat as smp
    from smp_compat.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2

    smp.init({"tensor_parallel_degree": tp, "ddp": True, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = transformers.GPT2LMHeadModel(_config())
    model = smp.DistributedModel(hf)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    inner = model.get_module()
    paths_ok = all(hasattr(layer, "attention") and hasattr(layer, "output") for layer in inner.transformer.seq_layers)

    losses = tm.train(smp, model, opt, _hf_loss)
    return {
        "losses": losses, "hf": translate_state_dict_to_hf_gpt2(model.state_dict()), "paths_ok": paths_ok,
        "kind": type(inner.transformer).__mro__[1].__name__, "tied": inner.lm_head.weight is inner.transformer.wte.weight,
        "local": sum(p.numel() for p in model.parameters()),
        "layers": len(inner.transformer.seq_layers),
    }  # fmt: skip


def _reference() -> tuple[list[float], dict]:
    return tm.reference(lambda: transformers.GPT2LMHeadModel(_config()), loss_fn=_hf_loss)


@pytest.mark.parametrize(("world", "prescaled"), [(2, False), (2, True), (4, False)])
def test_gpt2_tp2_matches_stock_hf_and_round_trips(world: int, prescaled: bool) -> None:
    results = run_ranks(_train, world, 2, prescaled, timeout=240)
    ref_losses, ref_params = _reference()
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(dim=0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    stock = transformers.GPT2LMHeadModel(_config())
    total = sum(p.numel() for p in stock.parameters())
    for r in results:
        assert r["paths_ok"] and r["kind"] == "DistributedTransformer" and r["tied"] and r["layers"] == LAYERS
        stock.load_state_dict(r["hf"], strict=True)  # the gathered, translated dict is a stock HF checkpoint
        for name, value in ref_params.items():
            torch.testing.assert_close(r["hf"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        per_layer_sharded = 4 * tm.HIDDEN * tm.HIDDEN + 3 * tm.HIDDEN + 2 * 4 * tm.HIDDEN * tm.HIDDEN + 4 * tm.HIDDEN
        assert r["local"] == total - LAYERS * per_layer_sharded // 2


def _tp1_swap() -> dict:
    import smp_compat as smp

    smp.init({})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = transformers.GPT2LMHeadModel(_config(scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=True))
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(_config(scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=True))
    model = smp.DistributedModel(hf)
    ids = tm.batches(1)[0]
    with torch.no_grad():
        ours, theirs = model(input_ids=ids, attention_mask=_mask(ids)).logits, plain(input_ids=ids, attention_mask=_mask(ids)).logits
    return {"has_seq_layers": hasattr(model.get_module().transformer, "seq_layers"), "diff": (ours - theirs).abs().max().item()}


def test_gpt2_swapped_at_tp1_too() -> None:
    r = run_ranks(_tp1_swap, 1, timeout=60)[0]
    assert r["has_seq_layers"] and r["diff"] < 1e-5


def test_translate_round_trip_and_mask_buffers() -> None:
    from smp_compat.nn.huggingface import gpt2

    torch.manual_seed(0)
    sd = transformers.GPT2LMHeadModel(_config()).state_dict()
    ours = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(sd)
    assert "transformer.seq_layers.1.attention.query_weight" in ours and not any(".h." in k for k in ours)
    back = gpt2.translate_state_dict_to_hf_gpt2(ours)
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    with_buffers = gpt2.translate_state_dict_to_hf_gpt2(ours, max_seq_len=tm.SEQ)
    assert with_buffers["transformer.h.0.attn.bias"].shape == (1, 1, tm.SEQ, tm.SEQ)
    # the name AWS's 2021-22 GPT-2 script imports, called with the sequence length; HF's mask buffers are dropped
    old_name = gpt2.translate_hf_state_dict_to_smdistributed(with_buffers, tm.SEQ)
    assert old_name.keys() == ours.keys() and all(torch.equal(old_name[k], v) for k, v in ours.items())


def _full_checkpoint(path: str) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = transformers.GPT2LMHeadModel(_config())
    model = smp.DistributedModel(hf)
    ids = tm.my_samples(smp, tm.batches(1)[0])
    model(input_ids=ids)  # partitions (pp = 1)
    before = {k: v.clone() for k, v in model.local_state_dict().items() if isinstance(v, torch.Tensor)}
    smp.save_checkpoint(path, "full", partial=False, model=model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    smp.resume_from_checkpoint(path, tag="full", partial=False)  # an HF-format file: translated back, then cut to shards
    after = model.local_state_dict()
    return {"restored": all(torch.equal(after[k], v) for k, v in before.items())}


def test_full_checkpoint_is_stock_hf_and_resumes(tmp_path) -> None:
    results = run_ranks(_full_checkpoint, 2, str(tmp_path), timeout=180)
    assert all(r["restored"] for r in results)
    saved = torch.load(tmp_path / "full", weights_only=True)
    torch.manual_seed(0)
    stock = transformers.GPT2LMHeadModel(_config())
    stock.load_state_dict(saved, strict=True)  # save_checkpoint(partial=False) wrote Hugging Face's format
    for name, value in transformers.GPT2LMHeadModel(_config()).state_dict().items():
        assert saved[name].shape == value.shape
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(_config()).state_dict()
    for name, value in reference.items():
        torch.testing.assert_close(saved[name], value)  # the untrained model: same seed, same weights


def _tp1_flags() -> float:
    import smp_compat as smp

    smp.init({})
    flags = dict(attention_in_fp32=False, query_key_layer_scaling=True, fused_softmax=True, fused_bias_gelu=True,
                 flash_attention=True, fp32_residual_addition=True)  # what AWS's GPT-2 script passes  # fmt: skip
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True, **flags):
        hf = transformers.GPT2LMHeadModel(_config())
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(_config())
    model = smp.DistributedModel(hf)
    assert model.get_module().transformer.seq_layers[0].attention.math.flash
    ids = tm.batches(1)[0]
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=_mask(ids)).logits
        theirs = plain(input_ids=ids, attention_mask=_mask(ids)).logits
    return (ours - theirs).abs().max().item()


def test_gpt2_with_aws_script_kernel_flags_keeps_the_numerics() -> None:
    assert run_ranks(_tp1_flags, 1, timeout=60)[0] < 1e-5


def _block_hooks() -> dict:
    import smp_compat as smp
    from smp_compat.nn.huggingface import gpt2
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    smp.tp_register_with_module(GPT2Block, smp.nn.DistributedTransformerLayer, *gpt2.get_hf_gpt2_transformer_layer_hooks())
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(_config())
    weights = gpt2._translate(hf.state_dict(), "h.", "h.", gpt2._hf_block_to_smp)  # HF blocks -> layer names
    for block in hf.transformer.h:
        smp.set_tensor_parallelism(block)
    model = smp.DistributedModel(hf)
    model.load_state_dict(weights)  # dist modules re-initialize (as in SMP): load the HF weights after wrapping
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    kinds = [type(b).__name__ for b in model.get_module().transformer.h]

    losses = tm.train(smp, model, opt, _hf_loss)
    return {"losses": losses, "kinds": kinds}


def test_gpt2_blocks_registered_with_the_library_hooks() -> None:
    results = run_ranks(_block_hooks, 2, timeout=180)
    ref_losses, _ = _reference()
    assert results[0]["kinds"] == ["DistributedTransformerLayer"] * LAYERS
    torch.testing.assert_close(torch.tensor([r["losses"] for r in results]).mean(0), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
