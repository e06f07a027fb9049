"""Registry exercises without a training loop of their own: init and state, ranks and groups, communication,
errors, save / load / checkpoints with every state-dict member, the launcher keys (tests/cli/test_support_e2e.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from exercises_common import PP2_DP2, assert_matches, full_params, make_net, make_optimizer, reference, train


def init_reset_shutdown(smp: Any, tmp: str) -> None:
    """smp.init from a JSON file, is_initialized, reset, shutdown."""
    path = Path(tmp) / "smp_config.json"
    if dist.get_rank() == 0:
        path.write_text(json.dumps({"microbatches": 3, "ddp": True}))
    dist.barrier()
    smp.init(str(path))
    assert smp.is_initialized() and smp.num_microbatches() == 3 and smp.state.cfg.ddp
    smp.reset()
    assert not smp.is_initialized()
    smp.init({"ddp": True})
    smp.shutdown()
    assert not smp.is_initialized()


def ranks_groups_and_communication(smp: Any, tmp: str) -> None:
    """Every rank, size and group function at pp = 2 x dp = 2 ("cluster"), then every communication call."""
    smp.init(PP2_DP2)
    r = dist.get_rank()
    assert (smp.rank(), smp.size(), smp.local_rank(), smp.local_size()) == (r, 4, r, 4)
    assert (smp.pp_rank(), smp.pp_size(), smp.dp_rank(), smp.dp_size()) == (r % 2, 2, r // 2, 2)
    assert (smp.tp_rank(), smp.tp_size(), smp.rdp_rank(), smp.rdp_size()) == (0, 1, r // 2, 2)
    assert (smp.mp_rank(), smp.mp_size()) == (r % 2, 2)
    pp_group, dp_group = [r - r % 2, r - r % 2 + 1], [r % 2, r % 2 + 2]
    assert smp.get_pp_group() == pp_group and smp.get_mp_group() == pp_group and smp.get_tp_group() == [r]
    assert smp.get_dp_group() == dp_group and smp.get_rdp_group() == dp_group
    groups = [(smp.get_world_process_group, 4), (smp.get_pp_process_group, 2), (smp.get_mp_process_group, 2),
              (smp.get_dp_process_group, 2), (smp.get_rdp_process_group, 2), (smp.get_tp_process_group, 1)]  # fmt: skip
    for get_group, size in groups:
        t = torch.ones(())
        dist.all_reduce(t, group=get_group())
        assert t.item() == size, get_group.__name__
    assert smp.allgather(r, smp.CommGroup.WORLD) == [0, 1, 2, 3] and smp.allgather(r, smp.PP_GROUP) == pp_group
    assert smp.allgather(r, smp.DP_GROUP) == dp_group and smp.allgather(r, smp.RDP_GROUP) == dp_group
    assert smp.allgather(r, smp.MP_GROUP) == pp_group and smp.allgather(r, smp.TP_GROUP) == [r]
    assert smp.allgather(r, smp.WORLD) == [0, 1, 2, 3]
    gathered = smp.gather(r, smp.DP_GROUP, rank=1)
    assert gathered == (dp_group if smp.dp_rank() == 1 else None)
    if smp.rank() == 0:
        smp.broadcast({"from": 0}, smp.WORLD)
    else:
        assert smp.recv_from(0, smp.RankType.WORLD_RANK) == {"from": 0}
    if smp.pp_rank() == 0:
        smp.send(("hello", r), 1, smp.RankType.PP_RANK)
    else:
        assert smp.recv_from(0, smp.RankType.PP_RANK) == ("hello", r - 1)
    for barrier in (smp.barrier, smp.dp_barrier, smp.mp_barrier, smp.pp_barrier, smp.tp_barrier, smp.rdp_barrier):
        barrier()


def errors_are_raised_where_smp_raised_them(smp: Any, tmp: str) -> None:
    """Each exception class, from the situation that raises it; all are SMPError."""
    expect: list[tuple[type[BaseException], Any]] = [
        (smp.SMPConfigError, lambda: smp.init({"microbatches": 0})),
        (smp.SMPUnsupportedError, lambda: (smp.init({"ddp": True}), smp.DistributedModel(torch.nn.Linear(2, 2)).join())),
    ]
    for error, action in expect:
        try:
            action()
        except error as exc:
            assert isinstance(exc, smp.SMPError)
        else:
            raise AssertionError(f"{error.__name__} not raised")
        smp.reset()
    smp.init({"pipeline_parallel_degree": 4, "microbatches": 2})  # no data parallelism, so no ddp needed
    _raises(smp, smp.DDPNotEnabledError, smp.get_dp_process_group)
    smp.reset()
    smp.init(PP2_DP2)
    model = smp.DistributedModel(make_net())
    _raises(smp, smp.MultipleDistributedModelError, lambda: smp.DistributedModel(make_net()))
    _raises(smp, smp.FwdExecutionNotInStepFnError, lambda: model(torch.zeros(2, 4)))
    smp.reset()
    smp.init({"microbatches": 2, "ddp": True})  # pp = 1: every rank splits its own batch
    model = smp.DistributedModel(make_net())

    @smp.step
    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    _raises(smp, smp.TensorSplitError, lambda: step(model, torch.zeros(3, 4)))  # 3 rows, 2 microbatches


def _raises(smp: Any, error: type[BaseException], action: Any) -> None:
    try:
        action()
    except error as exc:
        assert isinstance(exc, smp.SMPError), type(exc)
    else:
        raise AssertionError(f"{error.__name__} not raised")


def save_load_and_resume(smp: Any, tmp: str) -> None:
    """Train 2 steps, save every way, then resume every way and train 1 more: each equals 3 steps straight."""
    folder = Path(tmp)
    expected = reference(optimizer="adam")
    smp.init(PP2_DP2)
    model = smp.DistributedModel(make_net())
    opt = smp.DistributedOptimizer(make_optimizer("adam", model.parameters()))
    train(smp, model, opt, range(2))
    full_model, full_opt = model.state_dict(), opt.state_dict()
    local = {"model": model.local_state_dict(), "opt": opt.local_state_dict()}
    assert local["model"]["_smp_is_partial"] and local["opt"]["_smp_is_partial"]
    assert {k for k in local["model"] if not k.startswith("_smp")} == {n for n, _ in model.local_named_parameters()} | {
        n for n, _ in model.local_named_buffers()}  # fmt: skip
    if smp.dp_rank() == 0:
        smp.save({**local, "opt_local": opt.local_optimizer_state_dict()}, str(folder / "parts.pt"), partial=True)
    smp.save({"model": full_model, "opt": full_opt}, str(folder / "full.pt"), partial=False)
    smp.save_checkpoint(str(folder / "ckpt"), tag="step2", partial=True, model=model, optimizer=opt,
                        user_content={"step": 2})  # fmt: skip
    smp.barrier()
    smp.reset()
    for way in ("full", "partial", "local optimizer", "resume"):
        smp.init(PP2_DP2)
        user = smp.resume_from_checkpoint(str(folder / "ckpt")) if way == "resume" else None
        model = smp.DistributedModel(make_net(seed=5))
        opt = smp.DistributedOptimizer(make_optimizer("adam", model.parameters()))
        if way == "full":
            saved = smp.load(str(folder / "full.pt"), partial=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        elif way != "resume":
            saved = smp.load(str(folder / "parts.pt"), partial=True)
            model.load_state_dict(saved["model"])
            if way == "partial":
                opt.load_state_dict(saved["opt"])
            else:
                opt.load_local_optimizer_state_dict(saved["opt_local"])
        else:
            assert user == {"step": 2}, user
        train(smp, model, opt, range(2, 3))
        assert_matches(full_params(smp, model), expected)
        smp.reset()


def launcher_keys(smp: Any, tmp: str) -> None:
    """ddp_port and ddp_dist_backend: smp.init makes the process group itself under an mpirun-style launch.

    Runs last in its world: it replaces the test harness's process group with smp_compat's own.
    """
    port = int(Path(tmp, "port").read_text())
    dist.barrier()
    dist.destroy_process_group()
    rank, world = os.environ.pop("RANK"), os.environ.pop("WORLD_SIZE")
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        os.environ.pop(var, None)
    os.environ.update(OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_SIZE=world, OMPI_COMM_WORLD_LOCAL_RANK=rank,
                      OMPI_COMM_WORLD_LOCAL_SIZE=world, MASTER_ADDR="127.0.0.1")  # fmt: skip
    smp.init({"ddp": True, "ddp_port": port, "ddp_dist_backend": "gloo"})
    assert smp.state.launch.launcher == "mpi" and smp.state.launch.master_port == port
    assert smp.state.backend == "gloo" and dist.get_backend() == "gloo"
    assert smp.allgather(smp.rank(), smp.WORLD) == list(range(int(world)))


API = [init_reset_shutdown, ranks_groups_and_communication, errors_are_raised_where_smp_raised_them,
       save_load_and_resume]  # fmt: skip
LAST = launcher_keys
