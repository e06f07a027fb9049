"""smp.save_checkpoint / smp.resume_from_checkpoint: layout, exact resume, retention, checks (§2.7, §4.9)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import smp_compat as smp
from models import causal_mask, lm_loss, make_batches, make_model
from smp_compat.checkpoints.folders import read_newest
from smp_compat.errors import CheckpointError
from smp_compat.testing import run_ranks

__all__: list[str] = []

# The first optimizer of a process imports torch._dynamo (seconds); do it once here so that forked
# ranks inherit it instead of each paying for it.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

N_STEPS, K_STEPS, GLOBAL_BATCH = 4, 2, 8



def _names(directory: Path) -> list[str]:
    """The files saved, without the keyed digest beside each (checkpoints.signing)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".hmac"))


# ---------------------------------------------------------------------------- pipeline runs (forked ranks)


def _config(dp: int) -> dict[str, Any]:
    """One microbatch: with several, the pipeline accumulates gradient contributions in arrival order, so
    two identical runs already differ in the last bits (tolerance-level, see test_pp_fidelity)."""
    cfg: dict[str, Any] = {"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": False,
                           "default_partition": 0}  # fmt: skip
    if dp > 1:
        cfg["ddp"] = True
    return cfg


def _build(dp: int) -> tuple[Any, Any, Any]:
    model = smp.DistributedModel(make_model())
    for i, block in enumerate(model.module.blocks):
        smp.set_partition(block, 0 if i < 2 else 1)
    smp.set_partition(model.module.ln_f, 1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    mask = causal_mask(8)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


def _train(model: Any, opt: Any, train_step: Any, first: int, last: int) -> list[float]:
    per_rank = GLOBAL_BATCH // smp.dp_size()
    lo = smp.dp_rank() * per_rank
    losses = []
    for x, y in make_batches(N_STEPS, GLOBAL_BATCH)[first:last]:
        opt.zero_grad()
        out = train_step(model, x[lo : lo + per_rank], y[lo : lo + per_rank])
        opt.step()
        losses.append(out.reduce_mean())
    return losses


def _snapshot(model: Any, opt: Any) -> dict[str, Any]:
    named = dict(model.local_named_parameters())
    local = opt.local_state_dict()
    opt_state = {local["_smp_param_names"][i]: {k: v.clone() for k, v in s.items()} for i, s in local["state"].items()}
    return {"params": {n: p.detach().clone() for n, p in named.items()}, "opt": opt_state}


def _straight_with_checkpoints(directory: str, dp: int) -> dict[str, Any]:
    """N steps in one run; after K of them a partial checkpoint, at the end a full one."""
    smp.init(_config(dp))
    model, opt, train_step = _build(dp)
    losses = _train(model, opt, train_step, 0, K_STEPS)
    smp.save_checkpoint(directory, f"step{K_STEPS}", model=model, optimizer=opt,
                        user_content={"step": K_STEPS, "note": "half way"})  # fmt: skip
    losses += _train(model, opt, train_step, K_STEPS, N_STEPS)
    smp.save_checkpoint(directory, "final", partial=False, model=model)
    return {"losses": losses, **_snapshot(model, opt), "rank": smp.rank()}


def _resumed(directory: str, dp: int, before_wrapping: bool) -> dict[str, Any]:
    """Fresh processes: resume (before or after wrapping), then the remaining N - K steps."""
    smp.init(_config(dp))
    content = smp.resume_from_checkpoint(directory) if before_wrapping else None
    model, opt, train_step = _build(dp)
    if not before_wrapping:
        content = smp.resume_from_checkpoint(directory)
    losses = _train(model, opt, train_step, content["step"], N_STEPS)
    return {"losses": losses, **_snapshot(model, opt), "content": content, "rank": smp.rank()}


def _assert_bitwise(straight: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> None:
    for a, b in zip(straight, resumed):
        assert b["content"] == {"step": K_STEPS, "note": "half way"}
        for x, y in zip(a["losses"][K_STEPS:], b["losses"]):
            assert torch.equal(x, y)
        assert set(a["params"]) == set(b["params"])
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert set(a["opt"]) == set(b["opt"]) == set(a["params"])
        for name, s in a["opt"].items():
            for key, value in s.items():
                assert torch.equal(value, b["opt"][name][key]), (name, key)


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("pp2")
    return directory, run_ranks(_straight_with_checkpoints, 2, str(directory), 1, timeout=60)


def test_pp2_adam_resume_is_bitwise_exact_resumed_before_wrapping(pp2_run: tuple[Path, list]) -> None:
    directory, straight = pp2_run
    _assert_bitwise(straight, run_ranks(_resumed, 2, str(directory), 1, True, timeout=60))


def test_pp2_dp2_resume_is_bitwise_exact_resumed_after_wrapping(tmp_path: Path) -> None:
    straight = run_ranks(_straight_with_checkpoints, 4, str(tmp_path), 2, timeout=60)
    _assert_bitwise(straight, run_ranks(_resumed, 4, str(tmp_path), 2, False, timeout=60))


def test_partial_checkpoint_layout(pp2_run: tuple[Path, list]) -> None:
    directory, _ = pp2_run
    assert _names(directory) == ["final", "newest", "step2_partial", "user_content_final"]
    assert read_newest(directory) == ["step2_partial"]
    folder = directory / "step2_partial"
    assert _names(folder) == ["model_0_0.pt", "model_1_0.pt", "optimizer_states_0_0.pt", "optimizer_states_1_0.pt",
                              "smp_config.pt", "user_content.pt"]  # fmt: skip
    config = torch.load(folder / "smp_config.pt", weights_only=True)
    assert config["pipeline_parallel_degree"] == 2 and config["config"]["microbatches"] == 1
    assert config["partition"]["assignment"]["blocks.2.ln1"] == 1
    part = torch.load(folder / "model_1_0.pt", weights_only=True)
    assert part["_smp_is_partial"] is True and "blocks.3.mlp.0.weight" in part and "embed.weight" not in part


def test_full_checkpoint_is_the_plain_state_dict(pp2_run: tuple[Path, list]) -> None:
    directory, straight = pp2_run
    full = torch.load(directory / "final", weights_only=True)
    plain = make_model(seed=4)
    plain.load_state_dict(full)  # strict: plain PyTorch names, nothing extra
    for r in straight:
        for name, value in r["params"].items():
            assert torch.equal(full[name], value)
    assert torch.load(directory / "user_content_final", weights_only=True) is None


def test_resuming_with_another_pipeline_degree_is_rejected(pp2_run: tuple[Path, list]) -> None:
    directory, _ = pp2_run
    smp.init({})
    with pytest.raises(CheckpointError, match=r"pipeline_parallel_degree: saved 2, now 1.*checkpoint merge"):
        smp.resume_from_checkpoint(directory)


def _resume_each(resumes: list[tuple[str, bool]]) -> list[str]:
    """One rank: resume each (checkpoint, load_optimizer) in turn; the error message of each, or "no error"."""
    smp.init(_config(1))
    _build(1)
    messages = []
    for root, load_optimizer in resumes:
        try:
            smp.resume_from_checkpoint(root, load_optimizer=load_optimizer)
            messages.append("no error")
        except CheckpointError as exc:
            messages.append(str(exc))
    return messages


def _damaged_copy(source: Path, target: Path, damage: dict[str, str]) -> str:
    """A copy of a checkpoint with files of its ``step2_partial`` removed (""), truncated ("half"), or
    replaced by another of its files."""
    shutil.copytree(source, target)
    folder = target / "step2_partial"
    for name, how in damage.items():
        if not how:
            (folder / name).unlink()
        elif how == "half":
            data = (folder / name).read_bytes()
            (folder / name).write_bytes(data[: len(data) // 2])
        else:
            shutil.copyfile(folder / how, folder / name)
    return str(target)


_DAMAGE = {  # name: (what is done to the checkpoint, load_optimizer, the error every rank must raise)
    "one_missing": ({"optimizer_states_1_0.pt": ""}, True, r"rank 1: .*optimizer_states_1_0\.pt' is missing"),
    "all_missing": ({"optimizer_states_0_0.pt": "", "optimizer_states_1_0.pt": ""}, True,
                    r"rank 0: .*optimizer_states_0_0\.pt' is missing.*rank 1: .*optimizer_states_1_0\.pt' is missing"),
    "model_only": ({"optimizer_states_0_0.pt": "", "optimizer_states_1_0.pt": ""}, False, r"^no error$"),
    "swapped": ({"optimizer_states_1_0.pt": "optimizer_states_0_0.pt"}, True,
                r"optimizer_states_1_0\.pt' does not belong to this rank: .* of pp_rank 0, .* is pp_rank 1"),
    "truncated": ({"optimizer_states_1_0.pt": "half"}, True, r"optimizer_states_1_0\.pt' is truncated or unreadable"),
    "model_truncated": ({"model_0_0.pt": "half"}, True, r"rank 0: .*model_0_0\.pt' is truncated or unreadable"),
}  # fmt: skip


def test_damaged_parts_fail_on_every_rank_naming_the_file(pp2_run: tuple[Path, list], tmp_path: Path) -> None:
    """A part missing on one rank used to hang the others in a collective; all missing, or another rank's part,
    loaded silently (no optimizer state); a truncated file gave torch's errors, which do not name it."""
    directory, _ = pp2_run
    resumes = [(_damaged_copy(directory, tmp_path / name, damage), load) for name, (damage, load, _) in _DAMAGE.items()]
    first, second = run_ranks(_resume_each, 2, resumes, timeout=30)
    assert first == second  # the same error on every rank: none went on into a load alone
    for message, (_, _, pattern) in zip(first, _DAMAGE.values(), strict=True):
        assert re.search(pattern, message), message


def _mismatched_tags(directory: str) -> str:
    smp.init({"ddp": True})
    try:
        smp.save_checkpoint(directory, f"tag{smp.rank()}", model=None)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_tags_must_agree_across_ranks(tmp_path: Path) -> None:
    messages = run_ranks(_mismatched_tags, 2, str(tmp_path), timeout=30)
    for message in messages:
        assert "rank 0: 'tag0', rank 1: 'tag1'" in message
    assert not tmp_path.exists() or _names(tmp_path) == []


# ---------------------------------------------------------------------------- a world of one (in process)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Opaque:
    """An arbitrary class instance: safe loading must refuse it."""

    def __init__(self, value: int) -> None:
        self.value = value


def _one(seed: int = 0) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = smp.DistributedModel(Net())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    @smp.step
    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    return model, opt, step


def _train_one(model: Any, opt: Any, step: Any, n: int) -> None:
    for i in range(n):
        opt.zero_grad()
        step(model, torch.full((4, 4), float(i + 1)))
        opt.step()


def test_retention_keeps_the_newest_k(tmp_path: Path) -> None:
    smp.init({})
    model, opt, step = _one()
    for i in range(4):
        _train_one(model, opt, step, 1)
        smp.save_checkpoint(tmp_path, f"s{i}", model=model, optimizer=opt, num_kept_partial_checkpoints=2)
    assert _names(tmp_path) == ["newest", "s2_partial", "s3_partial"]
    assert read_newest(tmp_path) == ["s2_partial", "s3_partial"]
    smp.save_checkpoint(tmp_path, "s2", model=model, optimizer=opt)  # the same tag again: replaced, moved last
    assert read_newest(tmp_path) == ["s3_partial", "s2_partial"]
    assert _names(tmp_path) == ["newest", "s2_partial", "s3_partial"]
    with pytest.raises(CheckpointError, match="positive int"):
        smp.save_checkpoint(tmp_path, "s5", model=model, num_kept_partial_checkpoints=0)
    with pytest.raises(CheckpointError, match="path separators"):
        smp.save_checkpoint(tmp_path, "a/b", model=model)


def test_resume_before_the_model_exists_is_queued(tmp_path: Path) -> None:
    smp.init({})
    model, opt, step = _one()
    _train_one(model, opt, step, 2)
    smp.save_checkpoint(tmp_path, "two", model=model, optimizer=opt, user_content={"step": 2})
    _train_one(model, opt, step, 1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    smp.reset()
    smp.init({})
    assert smp.resume_from_checkpoint(tmp_path) == {"step": 2}  # nothing exists yet: queued
    model, opt, step = _one(seed=5)
    _train_one(model, opt, step, 1)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name])


def test_full_checkpoints_need_a_tag_and_load_back(tmp_path: Path) -> None:
    smp.init({})
    model, opt, step = _one()
    _train_one(model, opt, step, 1)
    with pytest.warns(UserWarning, match="model only"):
        smp.save_checkpoint(tmp_path, "full", partial=False, model=model, optimizer=opt, user_content=[1, 2])
    smp.save_checkpoint(tmp_path, "marked", partial=False, model=model, translate_if_full=False)
    assert _names(tmp_path) == ["full", "marked", "user_content_full", "user_content_marked"]
    assert torch.load(tmp_path / "marked", weights_only=True)["_smp_is_partial"] is False
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _train_one(model, opt, step, 1)
    with pytest.raises(CheckpointError, match="needs the tag"):
        smp.resume_from_checkpoint(tmp_path, partial=False)
    assert smp.resume_from_checkpoint(tmp_path, "full", partial=False) == [1, 2]
    assert torch.equal(model.module.lin.weight, saved["lin.weight"])
    smp.resume_from_checkpoint(tmp_path, "marked", partial=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        smp.resume_from_checkpoint(tmp_path, "nope", partial=False)


def test_missing_checkpoints_are_explained(tmp_path: Path) -> None:
    smp.init({})
    with pytest.raises(CheckpointError, match="no `newest` file"):
        smp.resume_from_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        smp.resume_from_checkpoint(tmp_path, tag="absent")


def test_a_checkpoint_saved_without_an_optimizer_resumes_with_the_default_load_optimizer(tmp_path: Path) -> None:
    smp.init({})
    model, opt, _ = _one()
    smp.save_checkpoint(tmp_path, "m", model=model, user_content=1)  # no optimizer: none of its parts is missing
    assert torch.load(tmp_path / "m_partial" / "smp_config.pt", weights_only=True)["saved_optimizer"] is False
    assert smp.resume_from_checkpoint(tmp_path) == 1


def test_user_content_loads_safely_unless_trusted(tmp_path: Path) -> None:
    smp.init({})
    model, opt, _ = _one()
    smp.save_checkpoint(tmp_path, "obj", model=model, optimizer=opt, user_content={"thing": Opaque(3)})
    assert smp.resume_from_checkpoint(tmp_path)["thing"].value == 3  # this job's own: its keyed digest verifies
    (tmp_path / "obj_partial" / "user_content.pt.hmac").unlink()  # as a file smp_compat did not write
    with pytest.raises(CheckpointError, match="weights_only=False"):
        smp.resume_from_checkpoint(tmp_path)
    content = smp.resume_from_checkpoint(tmp_path, weights_only=False)
    assert isinstance(content["thing"], Opaque) and content["thing"].value == 3


def test_changed_config_warns_and_changed_degree_fails(tmp_path: Path) -> None:
    smp.init({})
    model, opt, _ = _one()
    smp.save_checkpoint(tmp_path, "c", model=model, optimizer=opt)
    config_path = tmp_path / "c_partial" / "smp_config.pt"
    record = torch.load(config_path, weights_only=True)
    record["config"]["memory_weight"] = 0.5
    torch.save(record, config_path)
    with pytest.warns(UserWarning, match="memory_weight"):
        smp.resume_from_checkpoint(tmp_path)
    record["tensor_parallel_degree"] = 2
    torch.save(record, config_path)
    with pytest.raises(CheckpointError, match="tensor_parallel_degree: saved 2, now 1"):
        smp.resume_from_checkpoint(tmp_path)


def test_a_replaced_folder_is_recovered_after_a_kill_between_renames(tmp_path: Path) -> None:
    smp.init({})
    model, opt, step = _one()
    smp.save_checkpoint(tmp_path, "t", model=model, optimizer=opt, user_content=1)
    os.replace(tmp_path / "t_partial", tmp_path / ".t_partial.old-0123abcd")  # as if killed mid-publish
    assert smp.resume_from_checkpoint(tmp_path) == 1  # read from the intact old folder
    _train_one(model, opt, step, 1)
    smp.save_checkpoint(tmp_path, "u", model=model, optimizer=opt, user_content=2)  # recovers it first
    assert _names(tmp_path) == ["newest", "t_partial", "u_partial"]
    assert smp.resume_from_checkpoint(tmp_path, "t") == 1


def test_a_kill_while_replacing_newest_leaves_nothing_behind_after_the_next_save(tmp_path: Path) -> None:
    smp.init({})
    model, opt, _ = _one()
    smp.save_checkpoint(tmp_path, "t", model=model, optimizer=opt, user_content=1)
    (tmp_path / ".newest.k2j9x_1a.tmp").write_bytes(b"t_par")  # atomic_write's temporary file, killed mid-write
    assert smp.resume_from_checkpoint(tmp_path) == 1  # `newest` itself was never touched
    smp.save_checkpoint(tmp_path, "u", model=model, optimizer=opt, user_content=2)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    assert smp.resume_from_checkpoint(tmp_path) == 2


# ---------------------------------------------------------------------------- smp.load with v3 names


def test_load_reads_v3_names(tmp_path: Path) -> None:
    smp.init({})
    smp.save({"rdp": 0}, tmp_path / "opt", v3=True)
    assert smp.load(tmp_path / "opt") == {"rdp": 0}  # detected
    assert smp.load(tmp_path / "opt", v3=True) == {"rdp": 0}
    torch.save({"rdp": 1}, tmp_path / "opt_0_0_1.pt")  # a part of a job with two replicas
    with pytest.raises(CheckpointError, match=r"found parts \[\(0, 0, 0\), \(0, 0, 1\)\].*v3 names"):
        smp.load(tmp_path / "opt")
