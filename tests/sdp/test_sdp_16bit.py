"""A model built in 16 bits under sharded data parallelism trains as SMP's 16-bit recipe (issue 26, point 1).

SMP kept fp32 master partitions and fp32 optimizer state; FSDP2 keeps its shards in the dtype it is
given, so a ``smp.model_creation(dtype=torch.bfloat16)`` model used to get bf16 shards and bf16 Adam
moments (small updates rounded away) and, in fp16, NaN weights from the first applied step on. Each run
is compared with the 16-bit oracle (tests/oracle16.py): losses every step, the fp32 masters and the
16-bit weights after the last, at a 16-bit tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle16 import TOLERANCE, build_16bit, train_16bit
from sdp_helpers import GLOBAL_BATCH, train

import tp_models as tm
from models import causal_mask, lm_loss, make_batches, make_model
from smp_compat import nn as smp_nn
from smp_compat.precision.fp16 import LossScaler
from smp_compat.sdp.checkpoint import merge_sharded
from smp_compat.testing import run_ranks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# eps 1e-3 (as test_sdp_tp.py): Adam turns a near-zero gradient's rounding noise (16-bit here, summed in another
# order on each rank) into a step of ~lr either way; with eps 1e-3 that noise stays noise, real gradients still move
EPS = 1e-3
LR, STEPS = 2e-3, 5
FP16_SCALING = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**12, "scale_window": 2}}


def _from_fp32_start(net: torch.nn.Module) -> torch.nn.Module:
    """The 16-bit model, its initial weights the fp32 model's rounded: the same start on every torch.

    Below 2.12, torch's CPU random kernels draw bf16 / fp16 tensors in another order than fp32 ones, so a
    model built in 16 bits starts elsewhere there (from where this run's loss rises over its 5 steps).
    """
    net.load_state_dict(build_16bit(make_model, torch.float32).state_dict())  # fp32 also in model_creation; rounds
    return net


def _adamw(lr: float) -> Any:
    return lambda params: torch.optim.AdamW(params, lr=lr, eps=EPS)


def _oracle(key: str, lr: float, steps: int) -> Any:
    mask = causal_mask(8)

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y, m = batch
        return lm_loss(model(x, attention_mask=m).float(), y)

    scaler = LossScaler.create(1.0, True, dict(FP16_SCALING["dynamic_loss_args"])) if key == "fp16" else None
    batches = [(x, y, mask) for x, y in make_batches(steps, GLOBAL_BATCH)]
    model = _from_fp32_start(build_16bit(make_model, DTYPES[key]))
    return train_16bit(model, batches, loss_fn, _adamw(lr), DTYPES[key], scaler, clip=1.0)  # sdp_gradient_clipping 1.0


def _sdp_run(sdp: int, key: str, lr: float, steps: int) -> dict[str, Any]:
    import smp_compat as smp
    from smp_compat.sdp.state_dicts import full_model_state_dict

    torch.set_num_threads(1)
    smp.init({"ddp": True, "sharded_data_parallel_degree": sdp, key: True})
    with smp.model_creation(dtype=DTYPES[key]):
        net = _from_fp32_start(make_model())
    model = smp.DistributedModel(net)
    scaling = FP16_SCALING if key == "fp16" else {}
    opt = smp.DistributedOptimizer(_adamw(lr)(model.parameters()), **scaling)
    losses, norms = train(smp, model, opt, steps=steps)
    p = next(iter(model.parameters()))
    return {
        "losses": losses, "norms": norms, "masters": full_model_state_dict(model), "weights": model.state_dict(),
        "shard_dtype": p.dtype, "moment_dtypes": {v.dtype for v in opt.state[p].values() if v.dim() > 0},
        "nan": any(bool(q.to_local().isnan().any()) for q in model.parameters()),
    }  # fmt: skip


def _check_against_oracle(result: dict[str, Any], oracle: Any, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    assert result["shard_dtype"] == torch.float32 and result["moment_dtypes"] == {torch.float32}
    assert not result["nan"]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(oracle.losses), rtol=rtol, atol=atol)
    # the norm before clipping: Adam would hide a wrongly scaled gradient, the norm does not
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(oracle.norms), rtol=rtol, atol=atol)
    for name, master in oracle.masters.items():
        torch.testing.assert_close(result["masters"][name], master, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        weight = result["weights"][name]
        assert weight.dtype == dtype  # model.state_dict(): the 16-bit model, as SMP's full save
        torch.testing.assert_close(weight, oracle.weights[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(("sdp", "key"), [(2, "bf16"), (2, "fp16"), (4, "bf16")])
def test_16bit_model_under_sdp_trains_as_the_16bit_oracle(sdp: int, key: str) -> None:
    results = run_ranks(_sdp_run, sdp, sdp, key, LR, STEPS, timeout=180)
    oracle = _oracle(key, LR, STEPS)
    assert all(n > 0 for n in oracle.norms)  # every step applied (a skipped one would test only the scaler)
    for result in results:
        _check_against_oracle(result, oracle, DTYPES[key])
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        assert result["losses"][-1] < result["losses"][0]


def test_bf16_sdp_moves_layernorm_gains_as_fp32_masters_do() -> None:
    """At lr 1e-4 each Adam step (~1e-4) is below half a bf16 ulp at 1.0 (2**-9): a bf16 master never moves."""
    lr, steps = 1e-4, 3
    oracle = _oracle("bf16", lr, steps)
    gains = [n for n in oracle.masters if n.endswith(("ln1.weight", "ln2.weight", "ln_f.weight"))]
    moved = torch.cat([(oracle.masters[n] - 1.0).abs().flatten() for n in gains])
    assert 0 < moved.max() < 2.0**-9 and bool((moved > 0).all())
    for result in run_ranks(_sdp_run, 2, 2, "bf16", lr, steps, timeout=120):
        for name in gains:  # fp32 masters: every gain moved as in the oracle, far below a bf16 ulp
            torch.testing.assert_close(result["masters"][name].float(), oracle.masters[name], rtol=0, atol=lr / 10)


def _sgd(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum for tp x sdp: its row-parallel sums round in 16 bits in another order, noise Adam would
    turn into steps of ~lr (tp_models.reference); the momentum buffer is the optimizer state checked for fp32."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _tp_oracle(key: str, steps: int) -> Any:
    torch.manual_seed(0)
    model = build_16bit(lambda: tm.TinySmpLM(smp_nn), DTYPES[key])  # no smp.init: smp.nn modules are whole
    scaler = LossScaler.create(1.0, True, dict(FP16_SCALING["dynamic_loss_args"])) if key == "fp16" else None
    return train_16bit(model, tm.batches(steps), lambda m, ids: tm.lm_loss(m(ids).float(), ids), _sgd, DTYPES[key],
                       scaler, clip=1.0)  # fmt: skip


def _tp_sdp_run(key: str, steps: int) -> dict[str, Any]:
    import smp_compat as smp
    from smp_compat.sdp.state_dicts import full_model_state_dict

    torch.set_num_threads(1)
    smp.init({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "ddp": True, key: True})
    torch.manual_seed(0)
    with smp.model_creation(dtype=DTYPES[key]):
        net = tm.TinySmpLM(smp.nn)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(_sgd(model.parameters()), **(FP16_SCALING if key == "fp16" else {}))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    losses, norms = [], []
    for ids in tm.batches(steps):
        opt.zero_grad()
        loss = train_step(tm.my_samples(smp, ids)).reduce_mean().item()
        opt.step()
        losses.append(sum(smp.allgather(loss, smp.WORLD)) / smp.size())
        norms.append(opt._global_grad_norm)
    dist = [p for p in model.parameters() if model.is_distributed_parameter(p)]
    return {
        "losses": losses, "norms": norms, "masters": full_model_state_dict(model), "weights": model.state_dict(),
        "shard_dtype": dist[0].dtype, "moment_dtypes": {v.dtype for v in opt.state[dist[0]].values() if v.dim() > 0},
        "nan": any(bool(q.to_local().isnan().any()) for q in model.parameters()),
    }  # fmt: skip


def test_bf16_model_under_tp2_sdp2_trains_as_the_16bit_oracle() -> None:
    """fp16 takes the same path here (the loss scaler is the sdp optimizer's, covered at sdp 2)."""
    results = run_ranks(_tp_sdp_run, 4, "bf16", tm.STEPS, timeout=240)
    oracle = _tp_oracle("bf16", tm.STEPS)
    for result in results:
        _check_against_oracle(result, oracle, torch.bfloat16)


def _bf16_job(directory: str, resume: bool) -> dict[str, Any]:
    import smp_compat as smp
    from smp_compat.sdp.state_dicts import full_model_state_dict

    torch.set_num_threads(1)
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "bf16": True})
    with smp.model_creation(dtype=torch.bfloat16):
        net = make_model()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(_adamw(LR)(model.parameters()))
    if resume:
        smp.resume_from_checkpoint(directory, tag="bf16", partial=True)
    else:
        train(smp, model, opt, steps=2)
        smp.save_checkpoint(directory, "bf16", partial=True, model=model, optimizer=opt)
        smp.save_checkpoint(directory, "full.pt", partial=False, model=model)
    losses, _ = train(smp, model, opt, steps=2, start=2)
    return {"losses": losses, "masters": full_model_state_dict(model)}


def test_bf16_checkpoints_keep_fp32_masters_in_shards_and_save_the_16bit_model_in_full(tmp_path: Path) -> None:
    """The sharded checkpoint holds the fp32 masters (a bitwise resume); the full one the bf16 model, as SMP's."""
    uninterrupted = run_ranks(_bf16_job, 2, str(tmp_path), False, timeout=120)
    resumed = run_ranks(_bf16_job, 2, str(tmp_path), True, timeout=120)
    for a, b in zip(uninterrupted, resumed):
        assert a["losses"] == b["losses"]
        for name, value in a["masters"].items():
            assert value.dtype == torch.float32 and torch.equal(b["masters"][name], value), name
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert {v.dtype for v in full.values() if isinstance(v, torch.Tensor) and v.is_floating_point()} == {torch.bfloat16}
    merged, _ = merge_sharded(tmp_path / "bf16_partial")
    assert {v.dtype for v in merged.values() if v.is_floating_point()} == {torch.float32}
