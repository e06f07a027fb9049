"""The small pieces of SMP v2's checkpoint API: folder pruning, the DCP wrappers before and after tsm.init,
SMP's global coordinator ranks, S3 refusals, init_optim_state, the async queue, signed local files."""

from __future__ import annotations

import pickle
import types
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import smp_compat.v2.checkpoint.utils as tsm_checkpoint
import torch.distributed.checkpoint as dcp
from smp_compat.errors import CheckpointError, SMPUnsupportedError
from smp_compat.testing import run_ranks
from smp_compat.v2 import dcp_compat, signed_files
from smp_compat.v2.distributed.checkpoint.async_utils import AsyncCallsQueue, AsyncRequest
from smp_compat.v2.distributed.checkpoint.state_dict_saver import async_save
from smp_compat.v2.distributed.checkpoint.state_dict_utils import init_optim_state


def _folders(root: Path, *names: str) -> None:
    for name in names:
        (root / name / "tp2-0").mkdir(parents=True)


def test_limit_num_subdirs_keeps_the_newest_by_last_int(tmp_path: Path) -> None:
    _folders(tmp_path, "llama-8steps", "llama-10steps", "llama-9steps", "notes")
    latest = tmp_path / "llama-10steps" / "tp2-0"  # the scripts pass the folder just written
    assert tsm_checkpoint.limit_num_subdirs(str(latest), 2, log=False) == []  # only the log rank deletes
    deleted = tsm_checkpoint.limit_num_subdirs(str(latest), 2, sort_fn=tsm_checkpoint.SORT_BY_LAST_INT,
                                               regex=r"^.*\d+steps$", log=True)  # fmt: skip
    assert [Path(p).name for p in deleted] == ["llama-8steps"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-10steps", "llama-9steps", "notes"]
    assert tsm_checkpoint.limit_num_subdirs(str(tmp_path), 1) == [str(tmp_path / "llama-9steps")]
    assert tsm_checkpoint.SORT_BY_LAST_INT("/a/run3/llama-120steps") == 120


def test_torch_attributes_are_wrapped_and_pass_through_before_init(monkeypatch) -> None:
    import torch.distributed.checkpoint.optimizer as dcp_optimizer

    assert getattr(dcp.save_state_dict, "__smp_compat_v2_wrapper__", False)
    assert getattr(dcp_optimizer.load_sharded_optimizer_state_dict, "__smp_compat_v2_wrapper__", False)
    seen = []
    monkeypatch.setitem(dcp_compat.STOCK, "load_sharded_optimizer_state_dict", lambda *a, **k: seen.append(k))
    dcp_compat.install()  # idempotent: the wrappers already in place stay
    monkeypatch.setattr(dcp_compat, "v2_initialized", lambda: False)
    wrapper = dcp_compat._sharded_optimizer_loader()
    wrapper({}, "optimizer", None, process_group="pg")
    assert seen == [{"process_group": "pg"}]  # unchanged: stock raises its own TypeError for it


def test_torchs_deprecation_warning_names_the_scripts_line_not_the_wrapper(tmp_path: Path) -> None:
    """AWS's scripts call the deprecated ``save_state_dict``: the warning is theirs to see, at their line."""
    with pytest.warns(FutureWarning, match="save_state_dict` is deprecated") as caught:
        dcp.save_state_dict({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    assert [w.filename for w in caught if w.category is FutureWarning] == [__file__]
    loaded = {"w": torch.zeros(2)}
    with pytest.warns(FutureWarning, match="load_state_dict` is deprecated"):
        dcp.load_state_dict(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(loaded["w"], torch.ones(2))

def _coordinator_body() -> list[int]:
    import torch.distributed as dist

    group = dist.new_group([1, 2])
    if dist.get_rank() not in (1, 2):
        return []
    translated = [dcp_compat.group_rank(group, 1), dcp_compat.group_rank(group, 2)]
    try:
        dcp_compat.group_rank(group, 0)
    except CheckpointError:
        translated.append(-1)
    return translated


def test_global_coordinator_rank_becomes_the_group_rank() -> None:
    results = run_ranks(_coordinator_body, 3, timeout=120)
    assert results[1] == results[2] == [0, 1, -1]


def _writer_groups_after_replica_zero_saved() -> float:
    """Replica 0 (ranks 0, 1) makes the async_sharded writer group; then every rank makes its async_local one
    with a rank of the other replica ({0, 2}, {1, 3}), as a job saving both types does; one sum over it."""
    import torch.distributed as dist

    from smp_compat.v2.distributed.checkpoint.state_dict_saver import _writer_group

    rank, shard = dist.get_rank(), dist.new_group([0, 1])
    replication = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    if rank < 2:
        _writer_group(shard)
    total = torch.ones(())
    dist.all_reduce(total, group=_writer_group(replication))
    return float(total)


def test_async_writer_groups_form_whichever_ranks_saved_before() -> None:
    """Torch names a member-only group by the number of groups the process made: without our naming the
    second groups waited under different names forever (this test timed out)."""
    assert run_ranks(_writer_groups_after_replica_zero_saved, 4, timeout=60) == [2.0] * 4


def test_async_save_refuses_s3() -> None:
    with pytest.raises(SMPUnsupportedError, match="S3"):
        async_save({}, checkpoint_id="s3://bucket/ckpt")


def test_init_optim_state_creates_state_without_moving_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}],
                            lr=0.1, weight_decay=0.3)  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    init_optim_state(opt)
    assert len(opt.state) == 4 and all(torch.equal(s["exp_avg"], torch.zeros_like(s["exp_avg"]))
                                       for s in opt.state.values())  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5] and all(p.grad is None for p in model.parameters())


def test_queue_finalizes_in_order_and_names_a_failed_checkpoint() -> None:
    queue = AsyncCallsQueue()
    ok, bad = Future(), Future()
    ok.set_result(None)
    bad.set_exception(OSError("disk full"))
    queue.schedule_async_call(AsyncRequest(ok, "/ckpt/a-1steps"))
    queue.schedule_async_call(AsyncRequest(bad, "/ckpt/a-2steps"))
    with pytest.raises(CheckpointError, match="a-2steps.*disk full"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert queue.get_num_unfinalized_calls() == 0


def test_the_jobs_own_torch_save_loads_with_plain_torch_load(tmp_path: Path, monkeypatch) -> None:
    signed_files.install()
    state = {"model": {"w": torch.ones(2)}, "model_config": types.SimpleNamespace(hidden=32)}
    monkeypatch.setattr(dcp_compat, "v2_initialized", lambda: False)
    torch.save(state, tmp_path / "before.pt")  # before tsm.init: stock, unsigned
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "before.pt")
    monkeypatch.setattr(dcp_compat, "v2_initialized", lambda: True)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "before.pt")  # no digest: refused as before
    torch.save(state, tmp_path / "0.pt")
    assert (tmp_path / "0.pt.hmac").exists()
    loaded = torch.load(tmp_path / "0.pt")
    assert loaded["model_config"].hidden == 32 and torch.equal(loaded["model"]["w"], torch.ones(2))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "0.pt", weights_only=True)  # an explicit choice is obeyed
    (tmp_path / "0.pt").write_bytes((tmp_path / "0.pt").read_bytes() + b"\0")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "0.pt")  # changed since it was signed


@pytest.mark.hf
def test_a_local_file_with_a_hugging_face_config_loads_in_a_fresh_container(tmp_path: Path, monkeypatch) -> None:
    """Issue 33 for v2's local type: saved under one key, loaded where the key is new (an empty home) with plain
    torch.load: the config is data-only, so it loads; an object of other code still needs the job's own key."""
    from transformers import LlamaConfig

    from opaque import Opaque
    from smp_compat.checkpoints.signing import KEY_ENV

    signed_files.install()
    monkeypatch.setattr(dcp_compat, "v2_initialized", lambda: True)
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "old-home" / "checkpoint.key"))
    torch.save({"model": {"w": torch.ones(2)}, "model_config": LlamaConfig(hidden_size=32)}, tmp_path / "0.pt")
    torch.save({"model_config": Opaque("x")}, tmp_path / "1.pt")
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "new-home" / "checkpoint.key"))
    loaded = torch.load(tmp_path / "0.pt")
    assert loaded["model_config"].hidden_size == 32 and torch.equal(loaded["model"]["w"], torch.ones(2))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "1.pt")
