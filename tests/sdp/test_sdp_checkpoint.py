"""Sharded-DP checkpoints: DCP inside <tag>_partial/, bitwise resume, resume at another sdp, full save, merge."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import torch
from sdp_helpers import init_sdp, reference, train

from smp_compat.testing import run_ranks

SPLIT = 2  # save after this many steps, then 2 more


def _save_then_continue(sdp: int, directory: str) -> tuple[dict, dict, dict]:
    smp, model, opt = init_sdp(sdp)
    train(smp, model, opt, steps=SPLIT)
    smp.save_checkpoint(directory, "step2", partial=True, model=model, optimizer=opt, user_content={"step": SPLIT})
    saved = model.state_dict()
    smp.save_checkpoint(directory, "full.pt", partial=False, model=model)
    losses, _ = train(smp, model, opt, steps=2, start=SPLIT)
    return saved, model.state_dict(), {"losses": losses, "local": model.local_state_dict()}


def _resume_and_continue(sdp: int, directory: str) -> tuple[dict, dict, dict]:
    smp, model, opt = init_sdp(sdp)
    content = smp.resume_from_checkpoint(directory, tag=None, partial=True)
    resumed = model.state_dict()
    losses, _ = train(smp, model, opt, steps=2, start=SPLIT)
    return resumed, model.state_dict(), {"losses": losses, "content": content}


def test_partial_checkpoint_layout_and_bitwise_resume_at_the_same_sdp(tmp_path: Path) -> None:
    first = run_ranks(_save_then_continue, 2, 2, str(tmp_path), timeout=180)
    folder = tmp_path / "step2_partial"
    names = sorted(p.name for p in folder.iterdir())
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "user_content.pt", "smp_config.pt"} <= set(names)
    assert (tmp_path / "newest").read_text().split() == ["step2_partial"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging renamed away
    second = run_ranks(_resume_and_continue, 2, 2, str(tmp_path), timeout=180)
    for (saved, final, info), (resumed, final2, info2) in zip(first, second):
        assert info2["content"] == {"step": SPLIT}
        for name in saved:
            assert torch.equal(saved[name], resumed[name]), name
            assert torch.equal(final[name], final2[name]), name  # bitwise: same sdp, same reduction order
        assert info["losses"] == info2["losses"]


def test_saved_at_sdp4_resumes_at_sdp2_like_the_uninterrupted_run(tmp_path: Path) -> None:
    run_ranks(_save_then_continue, 4, 4, str(tmp_path), timeout=240)
    ref = reference(steps=SPLIT + 2)
    for resumed, final, info in run_ranks(_resume_and_continue, 2, 2, str(tmp_path), timeout=180):
        torch.testing.assert_close(torch.tensor(info["losses"]), torch.tensor(ref[0][SPLIT:]), rtol=1e-5, atol=1e-6)
        for name, value in ref[1].items():
            torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _resume_full(sdp: int, directory: str) -> dict:
    smp, model, _ = init_sdp(sdp)
    smp.resume_from_checkpoint(directory, tag="full.pt", partial=False)
    return model.state_dict()


def test_full_checkpoint_is_one_plain_state_dict_and_loads_back(tmp_path: Path) -> None:
    saved = run_ranks(_save_then_continue, 2, 2, str(tmp_path), timeout=180)[0][0]
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    plain = {k: v for k, v in full.items() if not k.startswith("_smp")}
    assert plain.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(plain[name], value) and plain[name].shape == value.shape
    model = __import__("models").make_model()
    model.load_state_dict(plain)  # a plain PyTorch module takes it as is
    for loaded in run_ranks(_resume_full, 4, 4, str(tmp_path), timeout=180):  # any sdp loads it
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name


def test_merge_cli_turns_the_sharded_checkpoint_into_one_state_dict(tmp_path: Path) -> None:
    saved = run_ranks(_save_then_continue, 2, 2, str(tmp_path), timeout=180)[0][0]
    out, optim = tmp_path / "merged.pt", tmp_path / "optim.pt"
    subprocess.run(
        [sys.executable, "-m", "smp_compat.cli", "checkpoint", "merge", str(tmp_path), "-o", str(out),
         "--optimizer-output", str(optim)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    merged = torch.load(out, weights_only=True)
    assert merged.keys() == saved.keys()
    info = subprocess.run([sys.executable, "-m", "smp_compat.cli", "checkpoint", "info", str(tmp_path)],
                          check=True, capture_output=True, text=True).stdout  # fmt: skip
    assert "sharded data parallelism (torch DCP)" in info and "'sharded_data_parallel_degree': 2" in info
    for name, value in saved.items():
        assert torch.equal(merged[name], value), name
    state = torch.load(optim, weights_only=True)["state"]
    assert state["blocks.0.mlp.0.weight"]["exp_avg"].shape == saved["blocks.0.mlp.0.weight"].shape


def _local_shapes(sdp: int) -> dict:
    smp, model, opt = init_sdp(sdp)
    local = model.local_state_dict()
    return {k: tuple(v.to_local().shape) for k, v in local.items() if hasattr(v, "to_local")}


def test_local_state_dict_holds_this_ranks_shards() -> None:
    shapes = run_ranks(_local_shapes, 2, 2, timeout=120)[0]
    assert shapes["blocks.0.mlp.0.weight"] == (32, 16)  # (64, 16) split over 2 ranks on dim 0


def _resume_weights_only(sdp: int, directory: str) -> tuple[dict, int]:
    smp, model, opt = init_sdp(sdp)
    smp.resume_from_checkpoint(directory, load_sharded_optimizer_state=False)
    return model.state_dict(), len(opt.state)


def test_load_sharded_optimizer_state_false_restores_weights_but_not_moments(tmp_path: Path) -> None:
    saved = run_ranks(_save_then_continue, 2, 2, str(tmp_path), timeout=180)[0][0]
    for weights, states in run_ranks(_resume_weights_only, 2, 2, str(tmp_path), timeout=180):
        assert states == 0
        assert all(torch.equal(weights[k], v) for k, v in saved.items())


def _state_dict_round_trips(sdp: int) -> dict:
    smp, model, opt = init_sdp(sdp)
    train(smp, model, opt, steps=1)
    model_full, opt_full = model.state_dict(), opt.state_dict()
    # like torch's, the sharded dicts share storage with the live tensors: copy them, as saving would
    model_local, opt_local = copy.deepcopy(model.local_state_dict()), copy.deepcopy(opt.local_state_dict())
    train(smp, model, opt, steps=1, start=1)  # move away from the saved state
    model.load_state_dict(model_local)
    opt.load_state_dict(opt_full)
    after_full_opt = opt.state_dict()
    opt.load_state_dict(opt_local)
    same_model = all(torch.equal(model.state_dict()[k], v) for k, v in model_full.items())
    name = "blocks.0.mlp.0.weight"
    exp_avg = opt.state_dict()["state"][name]["exp_avg"]
    return {"model": same_model, "full_opt": torch.equal(after_full_opt["state"][name]["exp_avg"],
                                                         opt_full["state"][name]["exp_avg"]),
            "local_opt": torch.equal(exp_avg, opt_full["state"][name]["exp_avg"]),
            "full_shape": tuple(opt_full["state"][name]["exp_avg"].shape)}  # fmt: skip


def test_model_and_optimizer_state_dicts_round_trip_full_and_sharded() -> None:
    for r in run_ranks(_state_dict_round_trips, 2, 2, timeout=180):
        assert r == {"model": True, "full_opt": True, "local_opt": True, "full_shape": (64, 16)}


def _with_unused_parameter(directory: str, resume: bool) -> dict:
    """A block holds a parameter the forward never uses (Flan-T5's unused ``relative_attention_bias`` under AWS's
    flash attention): AdamW never gets a gradient for it, so it has no optimizer state to save."""
    import smp_compat as smp

    from models import make_model

    torch.set_num_threads(1)
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2})
    net = make_model()
    net.blocks[0].unused = torch.nn.Linear(4, 4)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if resume:
        smp.resume_from_checkpoint(directory, tag="stateless", partial=True)
        opt.load_state_dict(opt.state_dict())  # the full and the sharded optimizer state dicts load such state too
        opt.load_state_dict(opt.local_state_dict())
    else:
        train(smp, model, opt, steps=SPLIT)
        smp.save_checkpoint(directory, "stateless", partial=True, model=model, optimizer=opt)
    losses, _ = train(smp, model, opt, steps=2, start=SPLIT)
    unused = net.blocks[0].unused.weight
    return {"losses": losses, "params": model.state_dict(), "unused_state": dict(opt.state.get(unused, {})),
            "states": len(opt.state)}  # fmt: skip


def test_sharded_resume_of_a_parameter_without_optimizer_state(tmp_path: Path) -> None:
    """Plain PyTorch resumes such an optimizer, the parameter stays state-less; once failed with
    ``Missing key in checkpoint state_dict: optim.state.<name>.step``."""
    first = run_ranks(_with_unused_parameter, 2, str(tmp_path), False, timeout=180)
    second = run_ranks(_with_unused_parameter, 2, str(tmp_path), True, timeout=180)
    for uninterrupted, resumed in zip(first, second):
        assert resumed["unused_state"] == {} and uninterrupted["unused_state"] == {}
        assert resumed["states"] == uninterrupted["states"]
        assert resumed["losses"] == uninterrupted["losses"]
        for name, value in uninterrupted["params"].items():
            assert torch.equal(resumed["params"][name], value), name
