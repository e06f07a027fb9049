"""Building the model: DelayedParamIniter, sync_module_states, and what the FSDP façade refuses (issue 34, 4, 6, 10).

DelayedParamIniter materializes a meta model per module with Hugging Face's own ``_init_weights``: the
tensors HF fixes (norm weights, rotary frequencies) equal a model built on the CPU, the random ones have the
configured spread, and two runs with one seed agree (so replicas and shards do). Through the façade at
hybrid shard 2 x 2 replicas: a meta model wrapped with the initer's functions is complete and identical on
every rank, and ``sync_module_states=True`` on CPU modules makes every rank hold rank 0's weights.
"""

from __future__ import annotations

import functools
from typing import Any

import fsdp_job
import pytest
import torch
import torch.distributed as dist
from torch import nn

from smp_compat.errors import SMPUnsupportedError
from smp_compat.testing import run_ranks
from smp_compat.v2.delayed_param import DelayedParamIniter, UninitializedStateError

pytestmark = pytest.mark.hf


def _materialized(seed: int) -> nn.Module:
    """A Llama built with its parameters on meta, materialized module by module (breadth first, as FSDP1 calls it)."""
    model = fsdp_job.tiny_llama(meta=True)
    initer = DelayedParamIniter(model)
    torch.manual_seed(seed)
    init, post = initer.get_param_init_fn(), initer.get_post_param_init_fn()
    for m in list(model.modules()):
        init(m)
    post(model)
    return model


def test_delayed_init_uses_hf_init_and_is_deterministic() -> None:
    built = fsdp_job.tiny_llama(seed=0).state_dict()
    model = _materialized(seed=3)
    again = _materialized(seed=3).state_dict()
    sd = model.state_dict()
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert fsdp_job.max_diff(sd, again) == 0.0
    std = model.config.initializer_range
    for name, value in sd.items():
        if "norm" in name:
            assert torch.equal(value, built[name]), name  # HF fixes them: ones
        else:
            assert abs(value.std().item() - std) < 0.25 * std, name  # normal(0, initializer_range)
    cpu_buffers = dict(fsdp_job.tiny_llama().named_buffers())  # rotary frequencies (per model or per layer)
    assert cpu_buffers and all(torch.equal(b, cpu_buffers[n]) for n, b in model.named_buffers())
    assert DelayedParamIniter(model).count_num_params() == sum(p.numel() for p in built.values())


def test_buffers_built_on_meta_are_recomputed_as_their_constructor_computes_them() -> None:
    """``torch.device("meta")`` puts buffers on meta too; transformers 4.x's init leaves its rotary ones untouched."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(fsdp_job.tiny_llama(meta=True).config)
    init = DelayedParamIniter(model).get_param_init_fn()
    for m in list(model.modules()):
        init(m)
    cpu_buffers = dict(fsdp_job.tiny_llama().named_buffers())
    assert cpu_buffers.keys() == dict(model.named_buffers()).keys()
    assert all(torch.equal(b, cpu_buffers[n]) for n, b in model.named_buffers())


def test_validate_names_what_is_still_on_meta() -> None:
    model = fsdp_job.tiny_llama(meta=True)
    with pytest.raises(UninitializedStateError, match=r"still on the meta device.*model\.embed_tokens\.weight"):
        with DelayedParamIniter(model).validate_params_and_buffers_inited():
            pass


def _init_job() -> dict[str, Any]:
    fsdp_job.init_v2(2)
    rank = dist.get_rank()
    synced = fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama(seed=rank), sync_module_states=True)
    meta = fsdp_job.tiny_llama(meta=True)
    initer = DelayedParamIniter(meta)
    torch.manual_seed(5)
    with initer.validate_params_and_buffers_inited():
        delayed = fsdp_job.wrap_as_scripts(meta, param_init_fn=initer.get_param_init_fn(),
                                           post_param_init_fn=initer.get_post_param_init_fn())  # fmt: skip
    local = {n: p.to_local().clone() for n, p in delayed.named_parameters()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {"synced": fsdp_job.full_params(synced), "delayed": fsdp_job.full_params(delayed), "locals": gathered}


def test_facade_materializes_delayed_models_and_syncs_module_states() -> None:
    results = run_ranks(_init_job, 4, timeout=240)
    r0 = results[0]
    assert fsdp_job.max_diff(r0["synced"], fsdp_job.tiny_llama(seed=0).state_dict()) == 0.0
    delayed = r0["delayed"]
    assert not any(v.isnan().any() for v in delayed.values())
    built = fsdp_job.tiny_llama().state_dict()
    assert all(torch.equal(delayed[k], built[k]) for k in delayed if "norm" in k)
    # replicas (ranks 0/2 and 1/3 at 2 shards x 2 replicas) hold the same shard
    locals_ = r0["locals"]
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(locals_[a][n], locals_[b][n]) for n in locals_[a]), (a, b)


def _refusals() -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    fsdp_job.init_v2(1)
    errors = []
    for kwargs in ({"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy)},
                   {"process_group": dist.group.WORLD}):  # fmt: skip
        try:
            FSDP(fsdp_job.tiny_llama(), **kwargs)
        except SMPUnsupportedError as e:
            errors.append(str(e))
    try:
        FSDP.summon_full_params(fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama()))
    except SMPUnsupportedError as e:
        errors.append(str(e))
    return errors


def _lambda_policy_units() -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    from smp_compat.v2.fsdp import facade_state

    fsdp_job.init_v2(1)
    layer = fsdp_job.decoder_layer()
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, layer))
    model = FSDP(fsdp_job.tiny_llama(), auto_wrap_policy=policy, device_id=torch.device("cpu"))
    return [type(u).__name__ for u in facade_state(model).units]


def _stock_before_init() -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from smp_compat.v2.fsdp import install

    install()  # as after `import torch.sagemaker`, before tsm.init()
    model = FSDP(nn.Linear(4, 4), device_id=torch.device("cpu"), use_orig_params=True)
    return type(model).__name__


def test_refusals_name_the_feature_and_stock_fsdp_before_init() -> None:
    errors = run_ranks(_refusals, 1, timeout=120)[0]
    assert len(errors) == 3
    assert "size_based_auto_wrap_policy" in errors[0] and "transformer_auto_wrap_policy" in errors[0]
    assert "process_group" in errors[1] and "hybrid_shard_degree" in errors[1]
    assert "summon_full_params" in errors[2] and "FULL_STATE_DICT" in errors[2]
    assert run_ranks(_stock_before_init, 2, timeout=120) == ["FullyShardedDataParallel"] * 2
    assert run_ranks(_lambda_policy_units, 1, timeout=120)[0] == ["FSDPLlamaDecoderLayer"] * 2


def _accumulate() -> float:
    """Two microbatches, the first under FSDP1's ``model.no_sync()``; the norm from ``model.clip_grad_norm_``."""
    fsdp_job.init_v2(2)
    model = fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama())
    with model.no_sync():
        fsdp_job._loss(model, fsdp_job.batch(0, dist.get_rank())).backward()
    fsdp_job._loss(model, fsdp_job.batch(1, dist.get_rank())).backward()
    return model.clip_grad_norm_(1.0).item()


def test_no_sync_accumulates_and_clip_method_gives_the_global_norm() -> None:
    model = fsdp_job.tiny_llama()
    loss = sum(fsdp_job._loss(model, fsdp_job.batch(step, r)) for step in range(2) for r in range(2)) / 2
    loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    for norm in run_ranks(_accumulate, 2, timeout=120):
        assert norm == pytest.approx(expected, rel=1e-5)
