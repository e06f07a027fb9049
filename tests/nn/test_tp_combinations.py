"""Issue 12 "everything else composes": the tensor-parallel features that were each tested alone, combined.

Each cell runs in one small world against plain single-process PyTorch on the global batch (fp32, ~1e-5):
1. pp x tp x rdp with sharded AdamW state (fp16/bf16 + clip_master_grads: sharded equals unsharded bitwise), its
   checkpoint merged (Adam moments equal plain AdamW's), resumed as it is and re-cut for pp = 1;
2. GPT-J and GPT-NeoX at pp = 2 x tp = 2 in both batch modes, their parts merged into stock HF dicts by the CLI;
3. a pp x tp checkpoint merged and re-cut for other degrees by the CLI and resumed there (fp32; bf16 masters too);
4. activation checkpointing + delayed initialization + 4 microbatches + prescaled_batch (+ sharded state) in one job.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm
from smp_compat.testing import run_ranks

PP2_TP2 = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 2,
           "pipeline": "interleaved", "auto_partition": False, "default_partition": 0}  # fmt: skip
STEPS = 4


def _adamw(params: Any) -> torch.optim.Optimizer:
    # eps above float noise: the attention key bias's true gradient is 0 (see test_tp_pipeline.py)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.01)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)  # momentum: the optimizer state matters on resume


def _tiny_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return tm.lm_loss(model(ids), ids)


def _place_tiny(smp: Any, model: Any) -> None:
    smp.set_partition(model.get_module().transformer.seq_layers[1], 1)
    smp.set_partition(model.get_module().proj, 1)


def _run(smp: Any, model: Any, opt: Any, loss_fn: Callable, steps: range, clip: float | None = None) -> dict:
    """Train ``steps`` of the shared global batches; losses (and clip norms) per step."""

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model, ids)
        model.backward(loss)
        return loss

    data, losses, norms = tm.batches(max(steps, default=0) + 1), {}, []
    for step in steps:
        opt.zero_grad()
        losses[step] = train_step(tm.my_samples(smp, data[step])).reduce_mean().item()
        if clip is not None:
            norms.append(float(opt.clip_master_grads(clip)))
        opt.step()
    return {"losses": losses, "norms": norms, "coords": (smp.pp_rank(), smp.tp_rank(), smp.rdp_rank()),
            "local": {n: p.detach().clone() for n, p in model.local_named_parameters()}}  # fmt: skip


def _mean_losses(results: list[dict], steps: range) -> torch.Tensor:
    return torch.tensor([[r["losses"][s] for s in steps] for r in results]).mean(dim=0)


def _assert_close_dict(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


# 1. pp = 2 x tp = 2 x rdp = 2 with shard_optimizer_state ------------------------------------------------------


def _pp_tp_rdp(precision: str, shard: bool, directory: str | None = None, pp: int = 2,
               resume: str | None = None) -> dict:  # fmt: skip
    """Trains steps 0-3 (saving tag "s" after them into ``directory``), or resumes ``resume`` and trains 4-5."""
    import smp_compat as smp

    torch.set_num_threads(1)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    smp.init({**PP2_TP2, "pipeline_parallel_degree": pp, "shard_optimizer_state": shard,
              **({precision: True} if half else {})})  # fmt: skip
    torch.manual_seed(0)
    with smp.model_creation(dtype=half):
        net = tm.TinySmpLM(smp.nn)
    model = smp.DistributedModel(net)
    if pp > 1:
        _place_tiny(smp, model)
    opt = smp.DistributedOptimizer(_adamw(model.parameters()))
    if resume is not None:
        smp.resume_from_checkpoint(resume)
    steps = range(STEPS, STEPS + 2) if resume else range(STEPS)
    out = _run(smp, model, opt, _tiny_loss, steps, clip=0.3 if half else None)
    out["state"] = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    out["held"] = sum(p.numel() for p in model.local_parameters())
    out["full"] = {k: v.clone() for k, v in model.state_dict().items()} if not half else {}
    if directory is not None:  # optimizer parts _{pp}_{tp}_{rdp}, each an rdp share of its (stage, tp shard)
        smp.save_checkpoint(directory, "s", model=model, optimizer=opt)  # (a full opt.state_dict() is refused)
    return out


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The fp32 sharded pp = 2 x tp = 2 x rdp = 2 job (steps 0-3, then its checkpoint), shared by two tests."""
    root = tmp_path_factory.mktemp("sharded")
    return root, run_ranks(_pp_tp_rdp, 8, "fp32", True, str(root), timeout=300)


def test_pp2_tp2_rdp2_sharded_adamw_matches_plain_pytorch(sharded_run: tuple[Path, list[dict]], tmp_path: Path) -> None:
    import smp_compat as smp
    from smp_compat.cli import main

    root, results = sharded_run
    ref_opt: list[torch.optim.Optimizer] = []
    ref_losses, ref_params = tm.reference(lambda: tm.TinySmpLM(smp.nn), steps=STEPS,
                                          make_opt=lambda ps: ref_opt.append(_adamw(ps)) or ref_opt[0])  # fmt: skip
    assert sorted(r["coords"] for r in results) == [(p, t, d) for p in (0, 1) for t in (0, 1) for d in (0, 1)]
    torch.testing.assert_close(_mean_losses(results, range(STEPS)), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    full = [r["full"] for r in results if r["full"]]
    assert len(full) == 4  # pp_rank 0 of every (tp, rdp) pair (gather_to_rank0)
    for f in full:
        _assert_close_dict(f, ref_params)
    by_shard: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        by_shard.setdefault(r["coords"][:2], []).append(r)
    for (pp, tp), (a, b) in by_shard.items():  # rdp replicas identical; Adam's moments split between them
        assert a["local"].keys() == b["local"].keys() and a["local"]
        assert all(torch.equal(a["local"][n], b["local"][n]) for n in a["local"]), (pp, tp)
        assert a["state"] + b["state"] == 2 * a["held"] and 0 < a["state"] < 2 * a["held"], (a["state"], a["held"])
    # the Adam moments of the whole model: the CLI joins the rdp shares, tp shards and stages of the parts
    assert main(["checkpoint", "merge", str(root), "-o", str(tmp_path / "m.pt"),
                 "--optimizer-output", str(tmp_path / "o.pt")]) == 0  # fmt: skip
    names = list(ref_params)  # TinySmpLM has no buffers: its parameters in creation order
    expected = {names[i]: s for i, s in ref_opt[0].state_dict()["state"].items()}
    merged = torch.load(tmp_path / "o.pt", weights_only=True)
    assert merged["_smp_param_names"] == names  # torch's index order too: it loads into the plain AdamW as it is
    by_name = {merged["_smp_param_names"][i]: s for i, s in merged["state"].items()}
    assert by_name.keys() == expected.keys()
    for name, moments in expected.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(by_name[name][key], moments[key], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name} {key}: {m}")  # fmt: skip


def test_sharded_pp2_tp2_rdp2_checkpoint_resumes_at_its_degrees_and_recut_for_pp1(
    sharded_run: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    """The sharded job's checkpoint resumed as it is (8 ranks), and re-cut by the CLI for pp = 1 x tp = 2 x rdp = 2
    (4 ranks, still sharded): both continue exactly like plain AdamW over all six steps."""
    import smp_compat as smp
    from smp_compat.cli import main

    root = sharded_run[0]
    ref_losses, ref_params = tm.reference(lambda: tm.TinySmpLM(smp.nn), steps=STEPS + 2, make_opt=_adamw)
    assert main(["checkpoint", "split", str(root), "--pp", "1", "--tp", "2",
                 "-o", str(tmp_path / "pp1"), "--tag", "r"]) == 0  # fmt: skip
    for world, pp, directory in ((8, 2, root), (4, 1, tmp_path / "pp1")):
        resumed = run_ranks(_pp_tp_rdp, world, "fp32", True, None, pp, str(directory), timeout=300)
        later = range(STEPS, STEPS + 2)
        torch.testing.assert_close(_mean_losses(resumed, later), torch.tensor(ref_losses[STEPS:]), rtol=1e-5, atol=1e-6)
        for f in (r["full"] for r in resumed if r["full"]):
            _assert_close_dict(f, ref_params)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pp2_tp2_rdp2_sharded_half_with_clipping_equals_unsharded_bitwise(precision: str) -> None:
    sharded = run_ranks(_pp_tp_rdp, 8, precision, True, timeout=300)
    plain = run_ranks(_pp_tp_rdp, 8, precision, False, timeout=300)
    assert min(plain[0]["norms"]) > 0.3  # clipping changes every step: a share-only norm would clip differently
    for s, p in zip(sharded, plain):
        assert s["coords"] == p["coords"] and 0 < s["state"] < p["state"]  # the sharded run really split the state
        assert s["losses"] == p["losses"] and s["norms"] == p["norms"] == plain[0]["norms"]
        for name, value in s["local"].items():
            assert torch.equal(value, p["local"][name]), f"{s['coords']} {name}: sharded differs from unsharded"


def _grad_scaler(inject_at: int) -> dict:
    """autocast + smp.amp.GradScaler at pp = 2 x tp = 2 x rdp = 2, sharded; an inf in one rank's shard only."""
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({**PP2_TP2, "shard_optimizer_state": True})
    torch.manual_seed(0)
    net = tm.TinySmpLM(smp.nn)
    model = smp.DistributedModel(net)
    _place_tiny(smp, model)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler()
    step = [0]
    if (smp.pp_rank(), smp.tp_rank(), smp.rdp_rank()) == (1, 1, 0):  # the other replica owns it (share) or not
        net.proj.weight.register_hook(lambda g: g * float("inf") if step[0] == inject_at else g)

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = tm.lm_loss(model(ids).float(), ids)
        model.backward(scaler.scale(loss))
        return loss

    scales, unchanged = [], []
    for step[0], ids in enumerate(tm.batches(3)):
        opt.zero_grad()
        train_step(tm.my_samples(smp, ids))
        before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        unchanged.append(all(torch.equal(before[n], p) for n, p in model.local_named_parameters()))
    local = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"scales": scales, "unchanged": unchanged, "local": local, "coords": (smp.pp_rank(), smp.tp_rank())}


def test_grad_scaler_overflow_in_one_shard_skips_the_step_on_all_eight_ranks() -> None:
    results = run_ranks(_grad_scaler, 8, 1, timeout=300)
    for r in results:
        assert r["unchanged"] == [False, True, False] and r["scales"] == results[0]["scales"]
        assert r["scales"][1] == r["scales"][0] / 2
    for coords in {r["coords"] for r in results}:  # the rdp replicas stay identical
        a, b = (r["local"] for r in results if r["coords"] == coords)
        assert all(torch.equal(a[n], b[n]) for n in a)


# 2. GPT-J and GPT-NeoX at pp = 2 x tp = 2 ---------------------------------------------------------------------


def _gptj() -> torch.nn.Module:
    config = transformers.GPTJConfig(
        vocab_size=tm.VOCAB, n_positions=4 * tm.SEQ, n_embd=tm.HIDDEN, n_layer=2, n_head=2, rotary_dim=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPTJForCausalLM(config)


def _gptneox() -> torch.nn.Module:
    config = transformers.GPTNeoXConfig(
        vocab_size=tm.VOCAB, max_position_embeddings=4 * tm.SEQ, hidden_size=tm.HIDDEN, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=24, rotary_pct=1.0, use_parallel_residual=True,
        tie_word_embeddings=True, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
        eos_token_id=0)  # fmt: skip
    return transformers.GPTNeoXForCausalLM(config)


def _hf_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Right padding on some samples and per-sample position ids, chosen by content (the same on any split),
    below the sequence length (transformers 4's GPT-NeoX looks them up in a rotary table that long)."""
    mask = torch.ones_like(ids)
    mask[ids[:, 0] % 3 == 0, -2:] = 0
    forward = torch.arange(ids.shape[1])
    positions = torch.where(ids[:, :1] % 3 == 1, forward.flip(0), forward)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=ids).loss


def _hf_pp_tp(kind: str, prescaled: bool, directory: str) -> dict:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({**PP2_TP2, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = _gptj() if kind == "gptj" else _gptneox()
    model = smp.DistributedModel(hf)
    inner = model.get_module()
    if kind == "gptj":  # the untied head, with the final LayerNorm, on stage 1
        for module in (inner.transformer.seq_layers[1], inner.transformer.ln_f, inner.lm_head):
            smp.set_partition(module, 1)
    else:  # the head tied to embed_in stays with it on stage 0: stage 0 -> 1 -> 0
        smp.set_partition(inner.gpt_neox.seq_layers[1], 1)
        smp.set_partition(inner.gpt_neox.final_layer_norm, 1)
    opt = smp.DistributedOptimizer(_adamw(model.parameters()))
    out = _run(smp, model, opt, _hf_loss, range(3))
    translate = getattr(smp.nn.huggingface, kind).__dict__[f"translate_state_dict_to_hf_{kind}"]
    full = model.state_dict()
    out["hf"] = translate(full) if full else {}
    out["tied"] = kind == "gptneox" and inner.get_output_embeddings().weight is inner.gpt_neox.embed_in.weight
    smp.save_checkpoint(directory, "s", model=model, optimizer=opt)  # merged below into a stock HF dict
    return out


@pytest.mark.parametrize("prescaled", [pytest.param(False, marks=pytest.mark.hf), True])  # one run at the floor
@pytest.mark.parametrize("kind", ["gptj", "gptneox"])
def test_hf_rotary_models_at_pp2_tp2_match_stock_hf(kind: str, prescaled: bool, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from smp_compat.cli import main

    build = _gptj if kind == "gptj" else _gptneox
    results = run_ranks(_hf_pp_tp, 4, kind, prescaled, str(tmp_path), timeout=240)
    ref_losses, ref_params = tm.reference(build, steps=3, loss_fn=_hf_loss, make_opt=_adamw)
    torch.testing.assert_close(_mean_losses(results, range(3)), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    stage1 = {r["coords"][1]: set(r["local"]) for r in results if r["coords"][0] == 1}
    assert stage1[0] == stage1[1] and all(".seq_layers.1." in n or "ln_f" in n or "final_layer_norm" in n
                                          or n.startswith("lm_head") for n in stage1[0])  # fmt: skip
    full = [r for r in results if r["hf"]]
    assert len(full) == 2  # pp_rank 0 of each tp rank
    for r in full:
        assert r["tied"] == (kind == "gptneox")
        build().load_state_dict(r["hf"], strict=True)
        _assert_close_dict({k: r["hf"][k] for k in ref_params}, ref_params)
    heads = ["--num-attention-heads", "2"] if kind == "gptneox" else []  # offline: no swapped model to ask
    if heads:
        no_heads = ["checkpoint", "merge", str(tmp_path), "-o", str(tmp_path / "x.pt"), "--translate", "hf-gptneox"]
        assert main(no_heads) == 2
        assert "--num-attention-heads" in capsys.readouterr().err
    assert main(["checkpoint", "merge", str(tmp_path), "-o", str(tmp_path / "hf.pt"), "--translate", f"hf-{kind}",
                 *heads]) == 0  # the job's pp x tp parts, joined and under stock names  # fmt: skip
    merged = torch.load(tmp_path / "hf.pt", weights_only=True)
    build().load_state_dict(merged, strict=True)
    assert all(torch.equal(merged[k], v) for k, v in full[0]["hf"].items())


# 3. pp x tp checkpoint -> merge -> split for other degrees -> resume ------------------------------------------


def _ckpt_job(pp: int, tp: int, steps: range, resume: tuple[str, str] | None, save: str | None) -> dict:
    """TinySmpLM at pp x tp (stage 1: seq_layers[1] and proj), SGD with momentum; saves after step 1."""
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({**PP2_TP2, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp})
    torch.manual_seed(0)
    model = smp.DistributedModel(tm.TinySmpLM(smp.nn))
    if pp > 1:
        _place_tiny(smp, model)
    opt = smp.DistributedOptimizer(_sgd(model.parameters()))
    if resume is not None:
        smp.resume_from_checkpoint(resume[0], tag=resume[1])
    out = _run(smp, model, opt, _tiny_loss, steps[:2] if save else steps)
    if save:
        smp.save_checkpoint(save, "s1", model=model, optimizer=opt)
        out["saved"] = {k: v.clone() for k, v in model.state_dict().items()}
        later = _run(smp, model, opt, _tiny_loss, steps[2:])
        out["losses"].update(later["losses"])
    out["full"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def test_pp2_tp2_checkpoint_merged_and_recut_resumes_at_other_degrees(tmp_path: Path) -> None:
    from smp_compat.cli import main

    root = tmp_path / "job"
    straight = run_ranks(_ckpt_job, 4, 2, 2, range(STEPS), None, str(root), timeout=240)
    model_file, optim_file = tmp_path / "model.pt", tmp_path / "optim.pt"
    assert main(["checkpoint", "merge", str(root), "-o", str(model_file), "--optimizer-output", str(optim_file)]) == 0
    merged = torch.load(model_file, weights_only=True)
    saved = next(r["saved"] for r in straight if r["saved"])
    assert merged.keys() == saved.keys()  # the job's full model.state_dict() (pipeline parts: stage by stage)
    assert all(torch.equal(merged[k], v) for k, v in saved.items())
    tables = [torch.load(root / "s1_partial" / f"model_{pp}_{tp}.pt", weights_only=True)["_smp_load_info"]["tp_shards"]
              for pp in (0, 1) for tp in (0, 1)]  # fmt: skip
    assert all(t == tables[0] for t in tables)  # every part records every stage's shards, with whole shapes
    assert {k: v["shape"] for k, v in tables[0].items()} == {k: list(saved[k].shape) for k in tables[0]}
    tp_only, pp_only = tmp_path / "pp1_tp2", tmp_path / "pp2_tp1"
    assert main(["checkpoint", "split", str(model_file), "--pp", "1", "--tp", "2", "--like", str(root),
                 "--optimizer", str(optim_file), "-o", str(tp_only), "--tag", "r"]) == 0  # fmt: skip
    assert main(["checkpoint", "split", str(root), "--pp", "2", "--tp", "1", "--plan", str(root),
                 "-o", str(pp_only), "--tag", "r"]) == 0  # fmt: skip
    later = range(2, STEPS)
    final = next(r["full"] for r in straight if r["full"])
    for pp, tp, directory in ((1, 2, tp_only), (2, 1, pp_only)):
        resumed = run_ranks(_ckpt_job, 2, pp, tp, later, (str(directory), "r"), None, timeout=180)
        torch.testing.assert_close(_mean_losses(resumed, later), _mean_losses(straight, later), rtol=1e-5, atol=1e-6)
        _assert_close_dict(next(r["full"] for r in resumed if r["full"]), final)


# 4. activation checkpointing + delayed initialization + 4 microbatches + prescaled_batch, at pp = 2 x tp = 2 (x rdp)


def _everything(initial: dict[str, torch.Tensor], rdp: int, directory: str) -> dict:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({**PP2_TP2, "microbatches": 4, "prescaled_batch": True, "delayed_parameter_initialization": True,
              "shard_optimizer_state": rdp > 1})  # fmt: skip
    with smp.model_creation():
        net = tm.TinySmpLM(smp.nn)
    all_meta = all(p.is_meta for p in net.parameters())
    model = smp.DistributedModel(net)
    _place_tiny(smp, model)
    layers = model.get_module().transformer.seq_layers
    smp.set_activation_checkpointing(layers[0])  # a whole layer on stage 0
    smp.set_activation_checkpointing(layers[1].output)  # a layer's part on stage 1
    model.load_state_dict(initial)  # delayed init, then a full checkpoint: waits for partitioning, then cut
    opt = smp.DistributedOptimizer(_adamw(model.parameters()))
    out = _run(smp, model, opt, _tiny_loss, range(STEPS))
    out["all_meta"] = all_meta
    out["held"] = sum(p.numel() for p in net.parameters() if not p.is_meta)
    out["full"] = {k: v.clone() for k, v in model.state_dict().items()}
    smp.save_checkpoint(directory, "s", model=model, optimizer=opt)
    return out


@pytest.mark.parametrize("rdp", [1, 2])
def test_activation_checkpointing_delayed_init_microbatches_prescaled_at_pp2_tp2(rdp: int, tmp_path: Path) -> None:
    """rdp = 2 adds sharded AdamW state on top (8 ranks): every feature of this file in one job."""
    import smp_compat as smp
    from smp_compat.cli import main

    torch.manual_seed(0)
    initial = tm.TinySmpLM(smp.nn).state_dict()
    total = sum(v.numel() for v in initial.values())
    results = run_ranks(_everything, 4 * rdp, initial, rdp, str(tmp_path), timeout=300)
    ref_losses, ref_params = tm.reference(lambda: tm.TinySmpLM(smp.nn), steps=STEPS, make_opt=_adamw)
    torch.testing.assert_close(_mean_losses(results, range(STEPS)), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    full = [r["full"] for r in results if r["full"]]
    assert len(full) == 2 * rdp
    for f in full:
        _assert_close_dict(f, ref_params)
    for r in results:  # each rank materialized only its stage's parameters, and of those only its shards
        assert r["all_meta"] and r["held"] == sum(v.numel() for v in r["local"].values()) < total / 2
    assert sum(r["held"] for r in results) < 2 * rdp * total  # a tp pair holds less than two copies
    assert main(["checkpoint", "merge", str(tmp_path), "-o", str(tmp_path / "m.pt")]) == 0
    merged = torch.load(tmp_path / "m.pt", weights_only=True)
    assert merged.keys() == full[0].keys() and all(torch.equal(merged[k], v) for k, v in full[0].items())


def _bf16_ckpt(pp: int, tp: int, directory: str, resume: bool) -> dict:
    """bf16 TinySmpLM at pp x tp: two steps then save_checkpoint (tag "s"), or resume tag "r"; its fp32 masters."""
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({**PP2_TP2, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "bf16": True})
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.bfloat16):
        net = tm.TinySmpLM(smp.nn)
    model = smp.DistributedModel(net)
    if pp > 1:
        _place_tiny(smp, model)
    opt = smp.DistributedOptimizer(_adamw(model.parameters()))
    if resume:
        smp.resume_from_checkpoint(directory, tag="r")
        with torch.no_grad():
            model(tm.my_samples(smp, tm.batches(1)[0]))  # partitions: the resume is applied
    else:
        _run(smp, model, opt, _tiny_loss, range(2))
        smp.save_checkpoint(directory, "s", model=model, optimizer=opt)
    return {"masters": opt.local_fp16_state_dict()["fp32_master_params"], "adam": opt.state_dict()["state"],
            "names": [n for n, _ in model.local_named_parameters()]}  # fmt: skip


def test_bf16_pp2_tp2_checkpoint_recut_for_one_rank_keeps_masters_and_adam_state(tmp_path: Path) -> None:
    from smp_compat.checkpoints import convert
    from smp_compat.checkpoints.fp16_reshard import merge_fp16_states
    from smp_compat.cli import main

    run_ranks(_bf16_ckpt, 4, 2, 2, str(tmp_path / "job"), False, timeout=240)
    layout = convert.detect_layout(tmp_path / "job")
    table = convert.merge_model_with_shards(layout)[1]
    whole = merge_fp16_states(tmp_path / "job" / "s_partial", table)["fp32_master_params"]
    adam = convert.merge_optimizer(layout)
    assert main(["checkpoint", "split", str(tmp_path / "job"), "--pp", "1", "--tp", "1",
                 "-o", str(tmp_path / "one"), "--tag", "r"]) == 0  # fmt: skip
    resumed = run_ranks(_bf16_ckpt, 1, 1, 1, str(tmp_path / "one"), True, timeout=180)[0]
    assert sorted(resumed["masters"]) == sorted(whole) == sorted(resumed["names"])  # both stages' masters, whole
    for name, value in whole.items():
        assert name not in table or list(value.shape) == table[name]["shape"], name
        assert torch.equal(resumed["masters"][name], value), name  # exact: not re-made from the bf16 weights
    by_name = {adam["_smp_param_names"][i]: s for i, s in adam["state"].items()}
    assert len(resumed["adam"]) == len(by_name) == len(whole)
    for i, name in enumerate(resumed["names"]):
        for key, value in by_name[name].items():
            assert torch.equal(resumed["adam"][i][key], value), (name, key)
