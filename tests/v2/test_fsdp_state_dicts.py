"""FSDP1's state-dict APIs on the façade, as checkpoints.py calls them (issue 34, items 4 and 10).

One world-4 job: train 3 steps at hybrid shard 2 x 2 replicas; the scripts' sharded save (SHARDED_STATE_DICT,
``FSDP.optim_state_dict``, DCP over ``model.process_group`` from replica 0); a new job at hybrid shard 1 loads
it as ``_load_sharded`` does (``load_sharded_optimizer_state_dict``, ``FSDP.optim_state_dict_to_load``,
``optimizer.load_state_dict``): parameters and Adam state equal bit for bit, and one more step equals the
first job's. Then LOCAL_STATE_DICT and FULL_STATE_DICT round trips into fresh models (the full one with
the optimizer state as plain tensors), bit for bit.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import fsdp_job
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf


def _optimizer_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {}
    for pid, entries in opt.state_dict()["state"].items():
        for k, v in entries.items():
            flat[f"{pid}.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).clone()
    return flat


def _save_sharded(model: Any, opt: Any, path: str) -> dict[str, Any]:
    import torch.sagemaker as tsm
    from torch.distributed import checkpoint
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt), "total_steps": 3}
    if tsm.state.ranker.get_rep_rank(dist.get_rank()) == 0:
        checkpoint.save_state_dict(state_dict=sd, storage_writer=checkpoint.FileSystemWriter(path),
                                   process_group=model.process_group, coordinator_rank=0)  # fmt: skip
    dist.barrier()
    return sd


def _load_sharded(model: Any, opt: Any, path: str) -> int:
    from torch.distributed import checkpoint
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import ShardedOptimStateDictConfig

    cfg = ShardedOptimStateDictConfig(offload_to_cpu=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, optim_state_dict_config=cfg):
        sd = {"model": model.state_dict(), "total_steps": 0}
        checkpoint.load_state_dict(state_dict=sd, storage_reader=checkpoint.FileSystemReader(path),
                                   process_group=model.process_group, coordinator_rank=0)  # fmt: skip
        model.load_state_dict(sd["model"])
        osd = load_sharded_optimizer_state_dict(model_state_dict=sd["model"], optimizer_key="optimizer",
                                                storage_reader=checkpoint.FileSystemReader(path))  # fmt: skip
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model=model, optim=opt, optim_state_dict=osd["optimizer"]))
    return sd["total_steps"]


def _round_trip(kind: Any, source: Any, seed: int, **cfg: Any) -> dict[str, torch.Tensor]:
    """``source``'s state dict of ``kind`` loaded into a fresh model (other seed); that model's full params."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(source, kind, **cfg):
        sd = {k: v.clone() for k, v in source.state_dict().items()}
    target = fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama(seed=seed))
    with FSDP.state_dict_type(target, kind):
        target.load_state_dict(sd)
    return fsdp_job.full_params(target)


def _full_optimizer_round_trip(model: Any, opt: Any) -> tuple[set[type], float]:
    """FULL_STATE_DICT optimizer state (plain tensors on every rank) loaded into a fresh model's optimizer."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, optim_state_dict_config=FullOptimStateDictConfig()):
        osd, msd = FSDP.optim_state_dict(model, opt), model.state_dict()
    target = fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama(seed=13))
    target_opt = fsdp_job.adamw(target)
    with FSDP.state_dict_type(target, StateDictType.FULL_STATE_DICT):
        target.load_state_dict(msd)
        target_opt.load_state_dict(FSDP.optim_state_dict_to_load(target, target_opt, osd))
    kinds = {type(v) for entries in osd["state"].values() for v in entries.values()}
    return kinds, fsdp_job.max_diff(_optimizer_state(opt), _optimizer_state(target_opt))


def _job(path: str) -> dict[str, Any]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    warnings.simplefilter("ignore", FutureWarning)  # DCP's deprecated *_state_dict calls, as the scripts make them
    fsdp_job.init_v2(2)
    model = fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama())
    opt = fsdp_job.adamw(model)
    fsdp_job.train_steps(model, opt, dist.get_rank(), range(3))
    saved = _save_sharded(model, opt, path)
    before, before_opt = fsdp_job.full_params(model), _optimizer_state(opt)
    out: dict[str, Any] = {"sharded_types": {type(v) for v in saved["model"].values()}}
    out["first_job_step4"] = fsdp_job.train_steps(model, opt, dist.get_rank(), range(3, 4))
    after = fsdp_job.full_params(model)

    fsdp_job.init_v2(1)  # a new job at another hybrid shard degree
    resumed = fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama(seed=7))
    opt2 = fsdp_job.adamw(resumed)
    out["total_steps"] = _load_sharded(resumed, opt2, path)
    loaded, loaded_opt = fsdp_job.full_params(resumed), _optimizer_state(opt2)
    out["second_job_step4"] = fsdp_job.train_steps(resumed, opt2, dist.get_rank(), range(3, 4))
    out["local"] = _round_trip(StateDictType.LOCAL_STATE_DICT, resumed, seed=9)
    full_cfg = FullStateDictConfig(rank0_only=False)
    out["full"] = _round_trip(StateDictType.FULL_STATE_DICT, resumed, seed=11, state_dict_config=full_cfg)
    with FSDP.state_dict_type(resumed, StateDictType.LOCAL_STATE_DICT):
        out["local_types"] = {type(v) for v in resumed.state_dict().values()}
    out["full_optimizer"] = _full_optimizer_round_trip(resumed, opt2)
    if dist.get_rank() == 0:
        current = fsdp_job.full_params(resumed)
        out.update(before=before, loaded=loaded, before_opt=before_opt, loaded_opt=loaded_opt, after=after,
                   current=current)  # fmt: skip
    else:
        fsdp_job.full_params(resumed)
    return out


def test_sharded_save_resumes_at_another_degree_and_local_full_round_trip(tmp_path: Path) -> None:
    results = run_ranks(_job, 4, str(tmp_path / "ckpt"), timeout=300)
    r0 = results[0]
    assert all(r["sharded_types"] == {DTensor} for r in results)
    assert all(r["local_types"] == {torch.Tensor} for r in results)
    assert r0["total_steps"] == 3
    assert fsdp_job.max_diff(r0["before"], r0["loaded"]) == 0.0
    assert fsdp_job.max_diff(r0["before_opt"], r0["loaded_opt"]) == 0.0
    # another shard degree sums the gradients in another order: float noise, not a checkpoint difference
    torch.testing.assert_close(r0["second_job_step4"], r0["first_job_step4"], rtol=0, atol=1e-6)
    assert fsdp_job.max_diff(r0["after"], r0["current"]) < 1e-6
    for kind in ("local", "full"):
        assert fsdp_job.max_diff(results[0][kind], r0["current"]) == 0.0, kind
    assert all(r["full_optimizer"] == ({torch.Tensor}, 0.0) for r in results)
