"""Swapped Hugging Face models built under ``smp.model_creation(dtype=...)`` train in that dtype (fp16 / bf16).

The distributed layers are built at ``smp.DistributedModel``, after the dtype context closed; they used to be
fp32 next to the model's 16-bit embeddings, and the first forward failed (``mat1 and mat2 must have the same
dtype``). Each run is compared with the 16-bit oracle (tests/oracle16.py): a one-process run of stock Hugging
Face under SMP's 16-bit semantics (the model in 16 bits, fp32 master weights stepped by the optimizer, fp16's
loss scale).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers  # the test extra installs it: these tests must run, not skip
from oracle16 import build_16bit, train_16bit

import tp_models as tm
from smp_compat.precision.fp16 import LossScaler
from smp_compat.testing import run_ranks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SCALE = 256.0  # fp16's static loss scale
LR = 0.05


def _gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tm.VOCAB, n_positions=4 * tm.SEQ, n_embd=tm.HIDDEN, n_layer=2, n_head=tm.HEADS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # fmt: skip


def _gptj() -> torch.nn.Module:
    return transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=tm.VOCAB, n_positions=4 * tm.SEQ, n_embd=tm.HIDDEN, n_layer=2, n_head=2, rotary_dim=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # fmt: skip


MODELS = {"gpt2": _gpt2, "gptj": _gptj}


def _weights(kind: str) -> dict[str, torch.Tensor]:
    """fp32 weights both runs load (a pre-trained checkpoint): delayed initialization replays other inits."""
    torch.manual_seed(0)
    return MODELS[kind]().state_dict()


def _train(kind: str, key: str, tp: int, delayed: bool, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": tp, "ddp": True, key: True, "delayed_parameter_initialization": delayed})
    with smp.model_creation(tensor_parallelism=True, dtype=DTYPES[key]):
        hf = MODELS[kind]()
    model = smp.DistributedModel(hf)
    model.load_state_dict(weights)  # Hugging Face's names, translated into the swapped model
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), static_loss_scale=SCALE)
    mine = tm.train(smp, model, opt, tm.hf_padded_loss)
    losses = torch.tensor(smp.allgather(mine, smp.DP_GROUP)).mean(0).tolist()
    dtypes = {str(p.dtype) for p in model.local_parameters()}
    full = model.state_dict()
    translate = {"gpt2": smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2,
                 "gptj": smp.nn.huggingface.gptj.translate_state_dict_to_hf_gptj}[kind]  # fmt: skip
    swapped = hasattr(model.get_module().base_model, "seq_layers")
    return {"losses": losses, "dtypes": dtypes, "params": translate(full), "swapped": swapped}


def _oracle(kind: str, key: str, weights: dict[str, torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The 16-bit oracle (tests/oracle16.py): stock HF built in 16 bits, SGD on fp32 masters, fp16's static scale."""
    dtype = DTYPES[key]
    model = build_16bit(MODELS[kind], dtype)
    model.load_state_dict(weights)
    scaler = LossScaler.create(SCALE, False, None) if key == "fp16" else None
    oracle = train_16bit(model, tm.batches(), tm.hf_padded_loss, lambda ps: torch.optim.SGD(ps, lr=LR), dtype, scaler)
    return oracle.losses, {k: v.float() for k, v in model.state_dict().items()}  # tied names included


@pytest.mark.parametrize(
    ("kind", "key", "tp", "delayed"),
    [("gpt2", "bf16", 1, False), ("gpt2", "fp16", 2, True), ("gptj", "bf16", 2, True), ("gptj", "fp16", 1, False)],
    ids=["gpt2-bf16-dp2", "gpt2-fp16-tp2-delayed", "gptj-bf16-tp2-delayed", "gptj-fp16-dp2"],
)  # fmt: skip
def test_swapped_layers_take_the_model_creation_dtype(kind: str, key: str, tp: int, delayed: bool) -> None:
    weights = _weights(kind)
    results = run_ranks(_train, 2, kind, key, tp, delayed, weights, timeout=180)
    ref_losses, ref_params = _oracle(kind, key, weights)
    for r in results:
        assert r["swapped"] and r["dtypes"] == {str(DTYPES[key])}
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-3, atol=1e-3)
        for name, value in ref_params.items():  # one 16-bit ulp apart at most (the weights move by up to 2e-2)
            torch.testing.assert_close(r["params"][name].float(), value, rtol=1e-2, atol=1e-3,
                                       msg=lambda m: f"{name}: {m}")  # fmt: skip


def _registered_blocks() -> dict[str, Any]:
    """``tp_register`` swaps (the generic path, built from the recorded constructor arguments) too."""
    import smp_compat as smp
    from smp_compat.nn.huggingface import gpt2
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "bf16": True})
    smp.tp_register_with_module(GPT2Block, smp.nn.DistributedTransformerLayer, *gpt2.get_hf_gpt2_transformer_layer_hooks())
    with smp.model_creation(dtype=torch.bfloat16):
        hf = _gpt2()
    for block in hf.transformer.h:
        smp.set_tensor_parallelism(block)
    model = smp.DistributedModel(hf)
    logits = model(**tm.padded_inputs(tm.batches(1)[0])).logits
    kinds = {type(b).__name__ for b in model.get_module().transformer.h}
    return {"dtypes": {str(p.dtype) for p in model.parameters()}, "kinds": kinds, "finite": bool(logits.isfinite().all())}


def test_registered_block_swaps_take_the_model_creation_dtype_too() -> None:
    for r in run_ranks(_registered_blocks, 2, timeout=120):
        assert r["kinds"] == {"DistributedTransformerLayer"} and r["dtypes"] == {"torch.bfloat16"} and r["finite"]
