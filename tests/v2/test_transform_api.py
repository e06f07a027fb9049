"""tsm.transform's single-process surface: tp = 1, the TransformerLayer class the scripts' FSDP wrap policy and
activation checkpointing look for, refusals, and the import-only SMP names."""

from __future__ import annotations

import functools

import pytest
import torch

import transformers  # noqa: F401 - the test extra installs it

import tp_helpers as th
from smp_compat.errors import SMPConfigError, SMPNotInitializedError, SMPUnsupportedError
from smp_compat.testing import run_ranks
from smp_compat.v2.tensor_parallel.transformer import TransformerLayer
from smp_compat.v2.transform.api import tensor_parallelize, transform
from smp_compat.v2.transform.family import find_family
from smp_compat.v2.transform.sharding import check_divisible

pytestmark = pytest.mark.hf


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_neox"])
def test_tp1_marks_the_decoder_layers_and_changes_nothing_else(family: str) -> None:
    model = th.build(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not any(isinstance(m, TransformerLayer) for m in model.modules())
    assert tensor_parallelize(model, None) is model
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert layers == list(find_family(model).layers(model))
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    untouched = th.build(family)
    assert not isinstance(find_family(untouched).layers(untouched)[0], TransformerLayer)  # transformed layers only


def test_dtype_and_device_are_honoured_and_meta_stays_meta() -> None:
    model = tensor_parallelize(th.build("llama"), None, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.device("meta"):
        meta = th.build("llama")
    tensor_parallelize(meta, None, device="cpu")
    assert all(p.is_meta for p in meta.parameters())
    with pytest.raises(SMPConfigError, match="floating-point"):
        tensor_parallelize(th.build("llama"), None, dtype=torch.int32)


def test_scripts_wrap_policy_and_activation_checkpointing_find_the_layers() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper)  # fmt: skip
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    model = tensor_parallelize(th.build("llama"), None)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    wrapped = [n for n, m in model.named_modules() if policy(module=m, recurse=False, nonwrapped_numel=0)]
    assert wrapped == ["model.layers.0", "model.layers.1"]

    ids = th.batches(1)[0]
    expected = th.build("llama")(input_ids=ids, labels=ids).loss
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)  # as the scripts
    check = lambda m: isinstance(m, TransformerLayer)  # noqa: E731 - the scripts' check_fn
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=check)
    assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == th.LAYERS
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def _stock_fsdp1_wraps_the_layers() -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    model = tensor_parallelize(th.build("gpt_neox"), None)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    fsdp = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)
    return [n for n, m in fsdp.named_modules() if isinstance(m, FSDP)]


def test_fsdp_auto_wrap_with_transformer_layer_wraps_each_decoder_layer() -> None:
    (names,) = run_ranks(_stock_fsdp1_wraps_the_layers, 1, timeout=60)
    assert [n.replace("_fsdp_wrapped_module.", "") for n in names] == ["", "gpt_neox.layers.0", "gpt_neox.layers.1"]


def _transform_at_tp1() -> dict:
    import torch.sagemaker as tsm
    from torch.sagemaker import transform as imported

    tsm.init({})
    model = th.build("mistral")
    return {"same": tsm.transform(model) is model, "function": imported is transform,
            "marked": sum(isinstance(m, TransformerLayer) for m in model.modules())}  # fmt: skip


def test_torch_sagemaker_transform_at_tp1_after_init() -> None:
    with pytest.raises(SMPNotInitializedError, match="init"):
        transform(th.build("llama"))
    assert run_ranks(_transform_at_tp1, 1, timeout=60) == [{"same": True, "function": True, "marked": th.LAYERS}]


def test_transformer_layer_is_not_built_directly() -> None:
    with pytest.raises(SMPUnsupportedError, match="torch.sagemaker.transform"):
        TransformerLayer()


def test_unsupported_models_name_the_supported_ones() -> None:
    with pytest.raises(SMPUnsupportedError, match="GPT-NeoX, Llama .*, Mistral and Mixtral.*got Linear"):
        tensor_parallelize(torch.nn.Linear(2, 2), None)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32))
    with pytest.raises(SMPUnsupportedError, match="got a Hugging Face 'gpt2' model"):
        tensor_parallelize(gpt2, None)


def test_tp_must_split_heads_kv_heads_and_mlp_evenly() -> None:
    family = find_family(th.build("llama"))
    assert check_divisible(family, th.config("llama"), 2).kv_heads == 2
    with pytest.raises(SMPConfigError, match=r"num_key_value_heads \(2\) is not divisible by tensor_parallel_degree"):
        check_divisible(family, th.config("llama"), 4)
    with pytest.raises(SMPConfigError, match=r"num_attention_heads \(4\) is not divisible .*\(3\)"):
        check_divisible(family, th.config("llama"), 3)


def test_moe_config_and_cp_comm_type_are_checked_before_anything_runs() -> None:
    from smp_compat.v2.moe.moe_config import MoEConfig

    config = MoEConfig(moe_load_balancing="aux_loss", use_cpu_initialization=True)
    assert (config.random_seed, config.moe_aux_loss_coeff, config.smp_moe) == (12345, 0.001, True)
    with pytest.raises(SMPConfigError, match="moe_load_balancing"):
        MoEConfig(moe_load_balancing="random")
    with pytest.raises(SMPNotInitializedError, match="init"):  # MoE itself: tests/v2/test_moe_ep.py
        transform(th.build("llama"), config=config)
    with pytest.raises(SMPConfigError, match="cp_comm_type"):
        transform(th.build("llama"), cp_comm_type="ring")


@pytest.mark.parametrize(("key", "feature"), [("expert_parallel_degree", "expert parallelism")])
def test_ep_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, key: str, feature: str) -> None:
    """Expert parallelism without config=MoEConfig(...) (Mixtral's way in) is refused by transform's own guard."""
    import types

    from smp_compat.v2.transform import api

    degrees = {"context_parallel_degree": 1, "expert_parallel_degree": 1, key: 2}
    monkeypatch.setattr(api, "state", types.SimpleNamespace(initialized=True, tensor_parallel_degree=1, **degrees))
    refusal = f"{feature} \\({key}=2\\) works through transform\\(model, config=MoEConfig"
    with pytest.raises(SMPUnsupportedError, match=refusal):
        transform(th.build("llama"))
