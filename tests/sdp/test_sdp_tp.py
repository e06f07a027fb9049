"""Tensor parallelism x sharded data parallelism (tp = 2 x sdp = 2 on 4 ranks) trains like plain PyTorch.

FSDP2 shards every parameter of each tp rank's model over its rdp group; the tp group's part of SMP's
gradient rule, clipping and the tp gathers of state dicts are checked against one process on the global
batch: losses every step, every parameter after several AdamW steps with SMP's default clipping (1.0).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm
from smp_compat.testing import run_ranks

TP, SDP, WORLD = 2, 2, 4
LR, EPS, CLIP = 1e-2, 1e-3, 1.0
# eps 1e-3, not 1e-8: the key bias's true gradient is 0, and Adam would turn its float noise (~1e-9, different
# in every summation order) into steps of ~lr; with eps 1e-3 it stays noise while real gradients still move.


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=tm.VOCAB, n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=2,
                                     n_head=tm.HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _build(kind: str, smp: Any = None) -> torch.nn.Module:
    """The model, built from the same seed; under smp as SMP scripts do (model_creation for HF)."""
    import smp_compat

    torch.manual_seed(0)
    if kind == "smp_nn":
        return tm.TinySmpLM((smp or smp_compat).nn)
    if smp is None:
        return _gpt2()
    with smp.model_creation(tensor_parallelism=True, distribute_embedding=True):  # as AWS's scripts under sdp x tp
        return _gpt2()


def _loss(kind: str, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss if kind == "gpt2" else tm.lm_loss(model(ids), ids)


def _reference(kind: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    model = _build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, norms = [], []
    for ids in tm.batches(steps):
        opt.zero_grad()
        loss = _loss(kind, model, ids)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _init(kind: str, prescaled: bool) -> tuple[Any, Any, Any]:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({"tensor_parallel_degree": TP, "sharded_data_parallel_degree": SDP, "ddp": True,
              "prescaled_batch": prescaled})  # fmt: skip
    model = smp.DistributedModel(_build(kind, smp))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS))
    return smp, model, opt


def _train(smp: Any, kind: str, model: Any, opt: Any, steps: int, start: int = 0,
           plain: bool = False) -> tuple[list[float], list[float]]:
    """SMP's loop on this rank's samples (``plain``: loss.backward() without @smp.step, as SMP allowed at pp = 1);
    the global mean loss and the gradient norm of every step."""

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = _loss(kind, model, ids)
        model.backward(loss)
        return loss

    losses, norms = [], []
    for ids in tm.batches(start + steps)[start:]:
        opt.zero_grad()
        if plain:
            out = _loss(kind, model, tm.my_samples(smp, ids))
            out.backward()
            loss = out.item()
        else:
            loss = train_step(tm.my_samples(smp, ids)).reduce_mean().item()
        opt.step()
        losses.append(sum(smp.allgather(loss, smp.WORLD)) / smp.size())
        norms.append(opt._global_grad_norm)
    return losses, norms


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sizes(model: Any, opt: Any, full: dict[str, torch.Tensor]) -> dict[str, int]:
    """Elements this rank holds for the tp-shard parameters (weights, AdamW moments), and their whole size."""
    sizes = {"params": 0, "optimizer": 0, "whole": 0}
    for name, p in model.module.named_parameters():
        if model.is_distributed_parameter(p):
            sizes["params"] += _local(p).numel()
            sizes["whole"] += full[name].numel()  # gathered over rdp and tp by model.state_dict()
            sizes["optimizer"] += sum(_local(v).numel() for v in opt.state[p].values() if v.dim() > 0)
    return sizes


def _fidelity(kind: str, prescaled: bool, plain: bool, directory: str) -> dict[str, Any]:
    smp, model, opt = _init(kind, prescaled)
    losses, norms = _train(smp, kind, model, opt, tm.STEPS, plain=plain)
    full = model.state_dict()
    sizes = _sizes(model, opt, full)
    reloaded = True
    if kind == "gpt2":
        from smp_compat.nn.huggingface import gpt2

        smp.save_checkpoint(directory, "full.pt", partial=False, model=model)  # HF's own layout (translate_if_full)
        _train(smp, kind, model, opt, 1, start=tm.STEPS)  # move away, then resume the HF-format file (AWS's flow)
        smp.resume_from_checkpoint(directory, tag="full.pt", partial=False,
                                   translate_function=gpt2.translate_hf_state_dict_to_smdistributed_gpt2)  # fmt: skip
        reloaded = all(torch.equal(v, full[k]) for k, v in model.state_dict().items())
        full = gpt2.translate_state_dict_to_hf_gpt2(full)
    return {"losses": losses, "params": full, "sizes": sizes, "norms": norms, "reloaded": reloaded,
            "n_dist": len(model.distributed_modules())}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "prescaled", "plain"),
    [("smp_nn", False, False), ("smp_nn", True, False), ("smp_nn", False, True), ("gpt2", False, False),
     ("gpt2", True, False)],
    ids=["smp_nn-own-samples", "smp_nn-prescaled", "smp_nn-plain-backward", "gpt2-own-samples", "gpt2-prescaled"],
)  # fmt: skip
def test_tp2_sdp2_matches_plain_pytorch(kind: str, prescaled: bool, plain: bool, tmp_path: Path) -> None:
    results = run_ranks(_fidelity, WORLD, kind, prescaled, plain, str(tmp_path), timeout=240)
    ref_losses, ref_params, ref_norms = _reference(kind, tm.STEPS)
    assert max(ref_norms) > CLIP  # SMP's default clipping acts in the reference run
    full_elements = sum(v.numel() for v in ref_params.values())
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert r["params"].keys() == ref_params.keys()
        for name, value in ref_params.items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        # each rank holds 1/(tp*sdp) of every tp-sharded weight and of its AdamW moments
        sizes = r["sizes"]
        assert r["n_dist"] > 0 and sizes["whole"] > full_elements / 2  # most of the model is tp-sharded
        assert sizes["params"] * TP * SDP == sizes["whole"]
        assert sizes["optimizer"] == 2 * sizes["params"]
        assert r["reloaded"]  # gpt2: resume_from_checkpoint(partial=False, translate_function=...) restored it
    if kind == "gpt2":  # save_checkpoint(partial=False): whole tensors, in a form stock HF GPT-2 loads (strict)
        stock = _gpt2()
        stock.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=True), strict=True)
        for name, value in stock.state_dict().items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


SPLIT = 2  # save after this many steps, then 2 more


def _save_then_continue(directory: str) -> dict[str, Any]:
    smp, model, opt = _init("smp_nn", False)
    _train(smp, "smp_nn", model, opt, SPLIT)
    smp.save_checkpoint(directory, "step2", partial=True, model=model, optimizer=opt, user_content={"step": SPLIT})
    # whole tensors (rdp and tp gathered); like torch's, the optimizer dict shares its scalars (step) with the state
    saved, saved_optimizer = model.state_dict(), copy.deepcopy(opt.state_dict())
    moments = {n: _local(opt.state[p]["exp_avg"]).clone() for n, p in model.module.named_parameters()}
    losses, norms = _train(smp, "smp_nn", model, opt, 2, start=SPLIT)
    final = model.state_dict()
    model.load_state_dict(saved)  # full dicts: each rank takes its tp slice, then its rdp shard of it
    opt.load_state_dict(saved_optimizer)
    reloaded = model.state_dict()
    moments_reloaded = {n: _local(opt.state[p]["exp_avg"]).clone() for n, p in model.module.named_parameters()}
    return {"saved": saved, "final": final, "losses": losses, "norms": norms, "moments": moments,
            "local": {k: tuple(_local(v).shape) for k, v in model.local_state_dict().items()},
            "reloaded": reloaded, "saved_optimizer": saved_optimizer, "moments_reloaded": moments_reloaded}  # fmt: skip


def _resume_and_continue(directory: str) -> dict[str, Any]:
    smp, model, opt = _init("smp_nn", False)
    content = smp.resume_from_checkpoint(directory, tag=None, partial=True)
    resumed = model.state_dict()
    moments = {n: _local(opt.state[p]["exp_avg"]).clone() for n, p in model.module.named_parameters()}
    losses, norms = _train(smp, "smp_nn", model, opt, 2, start=SPLIT)
    return {"resumed": resumed, "final": model.state_dict(), "losses": losses, "norms": norms, "moments": moments,
            "content": content}  # fmt: skip


def test_partial_checkpoint_resumes_bitwise_and_merges_to_the_full_model(tmp_path: Path) -> None:
    first = run_ranks(_save_then_continue, WORLD, str(tmp_path), timeout=240)
    folder = tmp_path / "step2_partial"
    ranks = {f"__{r}_0.distcp" for r in range(WORLD)}
    expected = {".metadata", "tp_layout.pt", "user_content.pt", "smp_config.pt"} | ranks
    assert expected <= {p.name for p in folder.iterdir()}
    second = run_ranks(_resume_and_continue, WORLD, str(tmp_path), timeout=240)
    ref_losses, ref_params, _ = _reference("smp_nn", SPLIT + 2)
    for a, b in zip(first, second):
        assert b["content"] == {"step": SPLIT}
        for name, value in a["saved"].items():
            assert torch.equal(b["resumed"][name], value), name  # every tp rank got its own slices back
            assert torch.equal(b["final"][name], a["final"][name]), name  # bitwise: same degrees, same order
        for name, value in a["moments"].items():
            assert torch.equal(b["moments"][name], value), name
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert all(torch.equal(a["reloaded"][k], v) for k, v in a["saved"].items())
        assert not all(torch.equal(a["final"][k], v) for k, v in a["saved"].items())  # the load changed something
        assert all(torch.equal(a["moments_reloaded"][k], v) for k, v in a["moments"].items())
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(ref_losses[SPLIT:]), rtol=1e-5, atol=1e-6)
        for name, value in ref_params.items():  # model.state_dict() is the whole model, as one process has it
            torch.testing.assert_close(b["final"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # local_state_dict: this rank's 1/(tp*sdp) of a column-parallel weight
    whole = first[0]["saved"]["transformer.seq_layers.0.attention.query_weight"].shape
    assert first[0]["local"]["transformer.seq_layers.0.attention.query_weight"] == (whole[0] // (TP * SDP), whole[1])
    state = _check_merge(tmp_path, first[0]["saved"], set(first[0]["moments"]))
    for name, entry in first[0]["saved_optimizer"]["state"].items():  # the CLI's merge = optimizer.state_dict()
        assert all(torch.equal(state[name][k], v) for k, v in entry.items()), name
    for rank, r in enumerate(first):  # placement DPT: tp fastest, so rank = rdp_rank * TP + tp_rank
        tp_rank, rdp_rank = rank % TP, rank // TP
        column = state["transformer.seq_layers.0.attention.query_weight"]["exp_avg"]  # tp slices on dim 0
        assert torch.equal(column.chunk(TP)[tp_rank].chunk(SDP)[rdp_rank],
                           r["moments"]["transformer.seq_layers.0.attention.query_weight"])  # fmt: skip
        replicated = state["ln.weight"]["exp_avg"]
        assert torch.equal(replicated.chunk(SDP)[rdp_rank], r["moments"]["ln.weight"])


def _check_merge(directory: Path, saved: dict[str, torch.Tensor], param_names: set[str]) -> dict[str, Any]:
    """``smp-compat checkpoint merge`` joins the rdp shards (DCP) and the tp slices into whole tensors."""
    out, optim = directory / "merged.pt", directory / "optim.pt"
    command = ["checkpoint", "merge", str(directory / "step2_partial"), "-o", str(out),
               "--optimizer-output", str(optim)]  # fmt: skip
    subprocess.run([sys.executable, "-m", "smp_compat.cli", *command], check=True, capture_output=True, text=True)
    merged = torch.load(out, weights_only=True)
    assert merged.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(merged[name], value), name
    state = torch.load(optim, weights_only=True)["state"]
    assert set(state) == param_names  # plain names: the tp-tagged slices were joined
    for name, entry in state.items():
        assert entry["exp_avg"].shape == saved[name].shape, name
    return state


def test_sdp_with_tp_is_accepted_and_shards_over_rdp() -> None:
    from smp_compat.config import resolve_config
    from smp_compat.errors import SMPConfigError

    cfg = resolve_config({"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True}, environ={})
    cfg.check_world_size(4)  # tp 2 x sdp 2
    cfg.check_world_size(8)  # tp 2 x two replicas of sdp 2 (HSDP over rdp 4)
    wide = resolve_config({"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 2, "ddp": True}, environ={})
    with pytest.raises(SMPConfigError, match=r"must divide the reduced-data-parallel degree \(2 = world size 4"):
        wide.check_world_size(4)


def _delayed(tp: int, sdp: int) -> dict[str, Any]:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({"tensor_parallel_degree": tp, "sharded_data_parallel_degree": sdp, "ddp": True,
              "delayed_parameter_initialization": True})  # fmt: skip
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = _gpt2()
    on_meta = all(p.is_meta for p in hf.parameters())
    torch.manual_seed(5)  # materialization draws from the global RNG: at wrapping under sdp, else at the 1st forward
    model = smp.DistributedModel(hf)
    torch.manual_seed(5)
    model(input_ids=tm.batches(1)[0][:2])
    return {"on_meta": on_meta, "local": sum(_local(p).numel() for p in model.parameters()),
            "full": model.state_dict()}  # fmt: skip


def test_delayed_initialization_materializes_the_same_weights_in_shards() -> None:
    whole = run_ranks(_delayed, 1, 1, 1, timeout=120)[0]
    total = sum(p.numel() for p in _gpt2().parameters())
    for r in run_ranks(_delayed, WORLD, TP, SDP, timeout=240):
        assert r["on_meta"] and whole["on_meta"]
        assert r["local"] < total / SDP  # 1/sdp of everything, and 1/(tp*sdp) of the tp-sharded weights
        for name, value in whole["full"].items():  # the same RNG draws: whole tensors, then slices, then shards
            assert torch.equal(r["full"][name], value), name
