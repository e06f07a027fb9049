"""Pipeline x tensor parallelism (pp = 2 x tp = 2 on 4 ranks) trains exactly like plain PyTorch on the global batch.

The tp peers of each stage run their own pipelines in lockstep (runtime/lockstep.py): without it the
interleaved schedule with several microbatches in flight pairs different microbatches' collectives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm
from smp_compat.testing import run_ranks

STEPS = 3
_NON_PERSISTENT: set[str] = set()


def _gpt2_config() -> Any:
    return transformers.GPT2Config(vocab_size=tm.VOCAB, n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=2,
                                   n_head=tm.HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip


def _gpt2_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _smp_nn_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return tm.lm_loss(model(ids), ids)


def _adamw(params: Any) -> torch.optim.Optimizer:
    # eps well above float noise: the attention key bias's true gradient is 0, and Adam's default eps would
    # turn the ~1e-9 noise of a different summation order into full-size steps
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.01)


def _build(smp: Any, kind: str) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    if kind == "gpt2":
        with smp.model_creation(tensor_parallelism=True):
            return transformers.GPT2LMHeadModel(_gpt2_config()), _gpt2_loss
    return tm.TinySmpLM(smp.nn), _smp_nn_loss


def _place(smp: Any, model: Any, kind: str) -> None:
    """Second transformer layer (and what follows it, for the smp.nn model) on stage 1."""
    inner = model.get_module()
    if kind == "gpt2":
        smp.set_partition(inner.transformer.seq_layers[1], 1)
        smp.set_partition(inner.transformer.ln_f, 1)
    else:
        smp.set_partition(inner.transformer.seq_layers[1], 1)
        smp.set_partition(inner.proj, 1)


def _train(kind: str, prescaled: bool, mb: int, pipeline: str, extra: dict | None = None) -> dict:
    import smp_compat as smp

    torch.set_num_threads(1)
    extra = extra or {}
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "microbatches": mb,
              "pipeline": pipeline, "prescaled_batch": prescaled, "auto_partition": False, "default_partition": 0,
              **extra})  # fmt: skip
    module, loss_fn = _build(smp, kind)
    model = smp.DistributedModel(module)
    if not extra.get("auto_partition"):
        _place(smp, model, kind)
    opt = smp.DistributedOptimizer(_adamw(model.parameters()))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model, ids)
        model.backward(loss)
        return loss

    losses = []
    for ids in tm.batches(STEPS):
        opt.zero_grad()
        losses.append(train_step(tm.my_samples(smp, ids)).reduce_mean().item())
        opt.step()
    local = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    plan = model.pipeline_engine.plan
    return {"losses": losses, "full": {k: v.clone() for k, v in model.state_dict().items()}, "local": local,
            "coords": (smp.pp_rank(), smp.tp_rank()), "stages": {plan.rank_of(n) for n, _ in model.module.named_modules()} - {None}}  # fmt: skip


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    import smp_compat as smp

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config()) if kind == "gpt2" else tm.TinySmpLM(smp.nn)
    if kind == "gpt2":  # the names the swapped model's full state dict uses
        from smp_compat.nn.huggingface.gpt2 import translate_hf_state_dict_to_smdistributed_gpt2 as to_smp
    opt = _adamw(model.parameters())
    loss_fn = _gpt2_loss if kind == "gpt2" else _smp_nn_loss
    losses = []
    for ids in tm.batches(STEPS):
        loss = loss_fn(model, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, to_smp(state) if kind == "gpt2" else state


def _check(results: list[dict], kind: str, auto: bool = False) -> None:
    ref_losses, ref_state = _reference(kind)
    assert sorted(set(r["coords"] for r in results)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(dim=0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for r in results:
        if r["coords"][0] == 1 and auto:
            assert r["full"] == {} and r["stages"] == {0, 1}
            continue
        if r["coords"][0] == 1:  # gather_to_rank0 (the default): the full dict is on pp_rank 0 only
            assert r["full"] == {}
            stage1 = ("transformer.seq_layers.1.", "transformer.ln_f.", "proj.")
            assert r["local"] and all(n.startswith(stage1) for n in r["local"]), sorted(r["local"])
            continue
        assert r["full"].keys() == ref_state.keys() - _NON_PERSISTENT
        for name, value in r["full"].items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        if kind == "gpt2":  # gathered over tp, then pp: a checkpoint stock Hugging Face loads (strict)
            from smp_compat.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2

            transformers.GPT2LMHeadModel(_gpt2_config()).load_state_dict(translate_state_dict_to_hf_gpt2(r["full"]))


@pytest.mark.hf
@pytest.mark.parametrize("prescaled", [False, True])
def test_gpt2_pp2_tp2_matches_stock_hf(prescaled: bool) -> None:
    _check(run_ranks(_train, 4, "gpt2", prescaled, 2, "interleaved", timeout=240), "gpt2")


@pytest.mark.parametrize("prescaled", [False, True])
def test_smp_nn_pp2_tp2_matches_single_process(prescaled: bool) -> None:
    _check(run_ranks(_train, 4, "smp_nn", prescaled, 2, "simple", timeout=240), "smp_nn")


def test_interleaved_many_microbatches_in_flight() -> None:
    """Four microbatches in flight: arrival order differs between tp peers; only lockstep keeps collectives paired."""
    results = run_ranks(_train, 4, "smp_nn", False, 4, "interleaved", {"active_microbatches": 4}, timeout=240)
    _check(results, "smp_nn")


def test_gpt2_auto_partition_pp2_tp2() -> None:
    """The tp peers of global rank 0 trace the first step with it (their collectives must pair up)."""
    results = run_ranks(_train, 4, "gpt2", False, 2, "interleaved", {"auto_partition": True}, timeout=240)
    _check(results, "gpt2", auto=True)


def test_pp2_tp2_rdp2_on_eight_ranks() -> None:
    """Shards reduced over rdp per stage, the rest over dp per stage (8 ranks: kept to one small case)."""
    results = run_ranks(_train, 8, "smp_nn", False, 2, "interleaved", timeout=300)
    _check(results, "smp_nn")


def _small_pipeline(smp: Any) -> Any:
    """The smp.nn model at pp = 2 x tp = 2 with 4 microbatches, placed as ``_place`` does."""
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 4,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    torch.manual_seed(0)
    model = smp.DistributedModel(tm.TinySmpLM(smp.nn))
    _place(smp, model, "smp_nn")
    return model


def _fail_on_one_tp_rank() -> None:
    import smp_compat as smp

    model = _small_pipeline(smp)
    steps = [0]

    def explode(module: torch.nn.Module, args: Any, output: Any) -> None:
        if steps[0] == 1 and smp.tp_rank() == 1:
            raise ValueError("boom on tp rank 1")

    model.get_module().transformer.seq_layers[1].register_forward_hook(explode)

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = _smp_nn_loss(model, ids)
        model.backward(loss)
        return loss

    for steps[0], ids in enumerate(tm.batches(STEPS)):
        train_step(tm.my_samples(smp, ids))


def test_failure_on_one_tp_peer_stops_every_rank_quickly() -> None:
    """An error on a follower only (its peers never see it) ends the job with that error, not a lockstep hang."""
    import time

    from smp_compat.testing import RankFailure

    start = time.monotonic()
    with pytest.raises(RankFailure, match="boom on tp rank 1"):
        run_ranks(_fail_on_one_tp_rank, 4, timeout=120)
    assert time.monotonic() - start < 60


def _catch_a_failed_step() -> list[str]:
    import smp_compat as smp

    model = _small_pipeline(smp)

    @smp.step
    def train_step(ids: torch.Tensor, fail: bool) -> torch.Tensor:
        loss = _smp_nn_loss(model, ids)
        if fail:
            raise KeyError("the step body failed on purpose")
        model.backward(loss)
        return loss

    raised = []
    for step, ids in enumerate(tm.batches(STEPS)):
        try:
            train_step(tm.my_samples(smp, ids), step == 1)
        except Exception as exc:  # noqa: BLE001 - the script goes on, as an OOM-skipping loop would
            raised.append(f"{type(exc).__name__}: {exc}")
    return raised


def test_a_caught_step_failure_with_tp_in_the_pipeline_refuses_later_steps() -> None:
    """Decisions already shared with tp followers cannot be recalled: every rank raises the step's error, then
    refuses later steps with a clear error instead of running them on a confused schedule."""
    for raised in run_ranks(_catch_a_failed_step, 4, timeout=120, env={"SMP_PIPELINE_TIMEOUT_S": "30"}):
        assert len(raised) == 2 and raised[0].startswith("KeyError"), raised
        assert raised[1].startswith("StepUsageError: the pipeline cannot run another step"), raised
