"""``smp-compat checkpoint merge|split`` across tensor-parallel degrees: a tp = 2 GPT-2 checkpoint merged into
the job's full state dict (and stock HF), re-cut for tp = 1 and back to tp = 2, each resume continuing the
training exactly as the uninterrupted run does (fp32, SGD with momentum so the optimizer state matters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm
from smp_compat.checkpoints import convert
from smp_compat.cli import main
from smp_compat.testing import run_ranks

__all__: list[str] = []

STEPS = 6
PROBE = tm.batches(1, 2)[0]  # the logits compared between the job and stock HF


def _config() -> Any:
    return transformers.GPT2Config(vocab_size=tm.VOCAB, n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=2,
                                   n_head=tm.HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip


def _job(tp: int, steps: range, resume: tuple[str, str] | None, save: tuple[str, str, int] | None) -> dict:
    """Train the given global steps at ``tp`` (resuming first, saving a partial checkpoint after step save[2])."""
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": tp, "ddp": True})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = transformers.GPT2LMHeadModel(_config())
    model = smp.DistributedModel(hf)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    resumed = smp.resume_from_checkpoint(resume[0], tag=resume[1]) if resume is not None else None

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    out: dict[str, Any] = {"losses": {}, "user_content": resumed}
    data = tm.batches(STEPS)
    for step in steps:
        opt.zero_grad()
        out["losses"][step] = train_step(tm.my_samples(smp, data[step])).reduce_mean().item()
        opt.step()
        if save is not None and step == save[2]:
            smp.save_checkpoint(save[0], save[1], model=model, optimizer=opt, user_content={"step": step})
            bundle = {"model": model.local_state_dict(), "optimizer": opt.local_state_dict(), "step": step}
            smp.save(bundle, f"{save[0]}/bundle.pt", partial=True)  # AWS's scripts' smp.save parts
            out["full"] = {k: v.clone() for k, v in model.state_dict().items()}  # (it aliases replicated params)
            with torch.no_grad():
                out["logits"] = model(input_ids=PROBE).logits
    out["local"] = sum(p.numel() for p in model.parameters())
    return out


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """tp = 2 on 2 ranks, steps 0-3 uninterrupted, a partial checkpoint after step 1."""
    root = tmp_path_factory.mktemp("tp2")
    return root, run_ranks(_job, 2, 2, range(4), None, (str(root), "s1", 1), timeout=240)


def _mean_losses(results: list[dict], steps: range) -> torch.Tensor:
    return torch.tensor([[r["losses"][s] for s in steps] for r in results]).mean(dim=0)


def test_merge_joins_tp_shards_into_the_full_state_dict_and_stock_hf(tp2_run: tuple[Path, list[dict]],
                                                                     tmp_path: Path) -> None:  # fmt: skip
    root, results = tp2_run
    assert sorted(p.name for p in (root / "s1_partial").glob("model_*")) == ["model_0_0.pt", "model_0_1.pt"]
    out, hf_out, opt_out = tmp_path / "model.pt", tmp_path / "hf.pt", tmp_path / "optim.pt"
    assert main(["checkpoint", "merge", str(root), "-o", str(out), "--optimizer-output", str(opt_out)]) == 0
    merged, full = torch.load(out, weights_only=True), results[0]["full"]
    assert list(merged) == list(full)  # the same names, in the job's order
    for name, value in full.items():
        assert torch.equal(merged[name], value), name
    optim = torch.load(opt_out, weights_only=True)
    attn = optim["_smp_param_names"].index("transformer.seq_layers.0.attention.query_weight")
    assert optim["state"][attn]["momentum_buffer"].shape == (tm.HIDDEN, tm.HIDDEN)  # joined like its parameter
    bundle_out, bundle_opt = tmp_path / "b.pt", tmp_path / "bo.pt"
    assert main(["checkpoint", "merge", str(root / "bundle.pt"), "-o", str(bundle_out),
                 "--optimizer-output", str(bundle_opt)]) == 0  # fmt: skip
    assert all(torch.equal(torch.load(bundle_out, weights_only=True)[k], v) for k, v in full.items())
    from_bundle = torch.load(bundle_opt, weights_only=True)
    assert all(torch.equal(from_bundle["state"][i]["momentum_buffer"], s["momentum_buffer"])
               for i, s in optim["state"].items())  # fmt: skip
    assert main(["checkpoint", "merge", str(root), "-o", str(hf_out), "--translate", "hf-gpt2"]) == 0
    stock = transformers.GPT2LMHeadModel(_config())
    stock.load_state_dict(torch.load(hf_out, weights_only=True), strict=True)
    with torch.no_grad():
        logits = stock(input_ids=PROBE).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)


def _assert_losses(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_split_to_tp1_and_back_to_tp2_continue_the_training(tp2_run: tuple[Path, list[dict]], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    root, tp2 = tp2_run
    model, optim = tmp_path / "model.pt", tmp_path / "optim.pt"
    assert main(["checkpoint", "merge", str(root), "-o", str(model), "--optimizer-output", str(optim)]) == 0
    assert main(["checkpoint", "split", str(model), "--tp", "2", "-o", str(tmp_path / "x")]) == 2
    assert "--like" in capsys.readouterr().err  # a plain dict does not say which entries are shards
    tp1_dir = tmp_path / "tp1"
    assert main(["checkpoint", "split", str(model), "--tp", "1", "--like", str(root), "--optimizer", str(optim),
                 "-o", str(tp1_dir), "--tag", "from_tp2"]) == 0  # fmt: skip
    assert "model and optimizer" in capsys.readouterr().out
    # tp = 1 on one rank: resumes the tp = 2 checkpoint, matches its continuation, then saves at tp = 1
    tp1 = run_ranks(_job, 1, 1, range(2, STEPS), (str(tp1_dir), "from_tp2"), (str(tp1_dir), "s3", 3), timeout=180)
    _assert_losses(_mean_losses(tp1, range(2, 4)), _mean_losses(tp2, range(2, 4)))
    # the tp = 1 checkpoint re-cut for tp = 2 straight from its folder (its own shard record, optimizer included)
    tp2_dir = tmp_path / "tp2"
    assert main(["checkpoint", "split", str(tp1_dir), "--source-tag", "s3", "--tp", "2", "-o", str(tp2_dir),
                 "--tag", "from_tp1"]) == 0  # fmt: skip
    again = run_ranks(_job, 2, 2, range(4, STEPS), (str(tp2_dir), "from_tp1"), None, timeout=180)
    assert again[0]["user_content"] == {"step": 3}  # the re-cut folder keeps the source's (it wrote None)
    _assert_losses(_mean_losses(again, range(4, STEPS)), _mean_losses(tp1, range(4, STEPS)))
    assert again[0]["local"] == tp2[0]["local"] < tp1[0]["local"]  # each tp rank holds only its shards


def test_split_refuses_what_it_cannot_cut(tp2_run: tuple[Path, list[dict]], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    root, _ = tp2_run
    assert main(["checkpoint", "split", str(root), "--tp", "3", "-o", str(tmp_path / "x")]) == 2
    assert "not divisible by 3" in capsys.readouterr().err  # 4 heads, hidden 16: tp = 3 cannot cut them
    sd, table = convert.merge_model_with_shards(convert.detect_layout(root))
    assert table["transformer.seq_layers.0.attention.query_weight"] == {"dim": 0, "blocks": 1, "shape": [16, 16]}
    assert "transformer.wte.weight" not in table  # tied to the replicated lm_head: not distributed
    assert main(["checkpoint", "info", str(root)]) == 0
    assert f"tensor-parallel parts: 2 (shard record: {len(table)} tensor-parallel entries)" in capsys.readouterr().out


def _bf16_job(tp: int, directory: str, resume_tag: str | None) -> dict:
    """bf16 smp.nn model: trains one step and saves (tag "s"), or resumes ``resume_tag``; returns its fp32 masters."""
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": tp, "ddp": True, "bf16": True})
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.bfloat16):
        net = tm.TinySmpLM(smp.nn)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    if resume_tag is not None:
        smp.resume_from_checkpoint(directory, tag=resume_tag)
    with torch.no_grad():
        model(tm.my_samples(smp, tm.batches(1)[0]))  # partitions: the resume is applied
    if resume_tag is None:
        opt.zero_grad()
        train_step(tm.my_samples(smp, tm.batches(1)[0]))
        opt.step()
        smp.save_checkpoint(directory, "s", model=model, optimizer=opt)
    return {"masters": opt.local_fp16_state_dict()["fp32_master_params"], "adam": opt.state_dict()["state"]}


def test_bf16_masters_and_adam_state_follow_the_recut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from smp_compat.checkpoints.fp16_reshard import merge_fp16_states

    saved = run_ranks(_bf16_job, 2, 2, str(tmp_path / "tp2"), None, timeout=180)
    table = convert.merge_model_with_shards(convert.detect_layout(tmp_path / "tp2"))[1]
    whole = merge_fp16_states(tmp_path / "tp2" / "s_partial", table)["fp32_master_params"]
    proj = whole["proj.weight"]
    assert proj.shape == (tm.HIDDEN, tm.HIDDEN) and proj.dtype == torch.float32
    assert torch.equal(proj[:, : tm.HIDDEN // 2], saved[0]["masters"]["proj.weight"])  # row-parallel: dim 1
    adam = convert.merge_optimizer(convert.detect_layout(tmp_path / "tp2"))
    assert main(["checkpoint", "split", str(tmp_path / "tp2"), "--tp", "1", "-o", str(tmp_path / "tp1"),
                 "--tag", "r"]) == 0  # fmt: skip
    assert "model and optimizer, fp32 masters" in capsys.readouterr().out
    resumed = run_ranks(_bf16_job, 1, 1, str(tmp_path / "tp1"), "r", timeout=180)[0]
    for name, value in whole.items():
        assert torch.equal(resumed["masters"][name], value), name  # exact: not re-made from the bf16 weights
    assert len(resumed["adam"]) == len(adam["state"]) == len(whole)
    for i, state in adam["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed["adam"][i][key], value), (adam["_smp_param_names"][i], key)
