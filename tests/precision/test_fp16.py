"""fp16/bf16 wrappers (fp32 master weights, loss scaling, clip_master_grads) and delayed initialization."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp_compat.testing import run_ranks
from smp_compat.errors import SMPConfigError

STEPS, BATCH, MB = 3, 8, 2


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _mse_step(smp):  # type: ignore[no-untyped-def]
    """The @smp.step these tests train with: MSE of the model's output, model.backward."""

    @smp.step
    def train_step(model, x, y):  # type: ignore[no-untyped-def]
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return train_step


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


def _train(key: str, overflow_at: int | None, clip: float | None) -> dict:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MB, key: True, "auto_partition": False,
              "default_partition": 0})  # fmt: skip
    dtype = torch.float16 if key == "fp16" else torch.bfloat16
    torch.manual_seed(0)
    with smp.model_creation(dtype=dtype):
        net = _mlp()
    model = smp.DistributedModel(net)
    smp.set_partition(net[2], 1)
    smp.set_partition(net[4], 1)
    scale_args = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**8}} if key == "fp16" else {}
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **scale_args)
    step_index = [0]
    if smp.pp_rank() == 1:  # an overflow in one stage's own parameter gradient only
        net[4].weight.register_hook(lambda g: g * float("inf") if step_index[0] == overflow_at else g)

    train_step = _mse_step(smp)

    scales, overflows, norms, changed = [], [], [], []
    for x, y in _data():
        opt.zero_grad()
        train_step(model, x, y)
        before = [p.detach().clone() for p in model.local_parameters()]
        if clip is not None:
            norms.append(opt.clip_master_grads(clip))
        scales.append(opt.loss_scale)
        opt.step()
        overflows.append(opt.overflow)
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.local_parameters())))
        step_index[0] += 1
    params = {n: p.detach().float().clone() for n, p in model.local_named_parameters()}
    return {"scales": scales, "overflows": overflows, "changed": changed, "norms": norms, "params": params,
            "dtype": str(next(model.local_parameters()).dtype), "inner": type(opt.optimizer).__name__}  # fmt: skip


def test_fp16_dynamic_loss_scale_recovers_from_an_overflow_on_one_stage() -> None:
    for r in run_ranks(_train, 2, "fp16", 1, None, timeout=60):
        assert r["dtype"] == "torch.float16" and r["inner"] == "SGD"
        assert r["overflows"] == [False, True, False]
        assert r["changed"] == [True, False, True]  # the overflowed step is skipped on every stage
        assert r["scales"] == [256.0, 256.0, 128.0]  # and the scale halves for the next step


def _reference_bf16(clip: float | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch: a bf16 model with fp32 master weights, same microbatches."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = _mlp()
    torch.set_default_dtype(torch.float32)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=0.1)
    norms = []
    for x, y in _data():
        model.zero_grad()
        for xm, ym in zip(x.chunk(MB), y.chunk(MB)):
            (F.mse_loss(model(xm.bfloat16()).float(), ym) / MB).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, clip)))
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    return {n: p.detach().float() for n, p in model.named_parameters()}, norms


@pytest.mark.parametrize("clip", [None, 0.05])
def test_bf16_master_weights_and_clipping_match_plain_pytorch(clip: float | None) -> None:
    results = run_ranks(_train, 2, "bf16", None, clip, timeout=60)
    ref_params, ref_norms = _reference_bf16(clip)
    merged = {**results[0]["params"], **results[1]["params"]}
    for name, value in ref_params.items():
        torch.testing.assert_close(merged[name], value, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")
    if clip is not None:
        assert results[0]["norms"] == results[1]["norms"]  # one global norm over both stages
        torch.testing.assert_close(torch.tensor(results[0]["norms"]), torch.tensor(ref_norms), rtol=2e-2, atol=1e-3)


def _bf16_adagrad_with_added_groups() -> dict:
    """A group added before partitioning gets masters; Adagrad's state from ``__init__`` moves to them."""
    import smp_compat as smp

    smp.init({"bf16": True})
    with smp.model_creation(dtype=torch.bfloat16):
        net = _mlp()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adagrad(net[0].parameters(), lr=0.1, initial_accumulator_value=0.1))
    opt.add_param_group({"params": list(net[2].parameters()), "lr": 0.05})

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x.bfloat16()).float(), y)
        model.backward(loss)
        return loss

    for x, y in _data():
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    try:
        opt.add_param_group({"params": list(net[4].parameters())})
        late = "accepted"
    except smp.SMPUnsupportedError as exc:
        late = str(exc)
    sd = opt.state_dict()
    return {"groups": [g["params"] for g in sd["param_groups"]], "late": late,
            "state": {i: (s["sum"].dtype, float(s["step"])) for i, s in sd["state"].items()}}  # fmt: skip


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.12",
                    reason="torch < 2.12's Adagrad makes state only in __init__: a group added by add_param_group "
                    "fails plain PyTorch the same way (KeyError: 'sum', pytorch/pytorch#53712)")  # fmt: skip
def test_bf16_groups_added_before_partitioning_train_and_later_ones_are_refused() -> None:
    (r,) = run_ranks(_bf16_adagrad_with_added_groups, 1, timeout=60)
    assert r["groups"] == [[0, 1], [2, 3]]
    assert r["state"] == {i: (torch.float32, float(STEPS)) for i in range(4)}  # fp32 masters' state, every step
    assert "add_param_group" in r["late"] and "bf16" in r["late"]


def _delayed(auto: bool) -> dict:
    import smp_compat as smp

    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "delayed_parameter_initialization": True}
    smp.init(config if auto else {**config, "auto_partition": False, "default_partition": 0})
    with smp.model_creation():
        net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    all_meta = all(p.is_meta for p in net.parameters())
    model = smp.DistributedModel(net)
    if not auto:
        for layer in net[4:]:
            smp.set_partition(layer, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    @smp.step
    def train_step(model, x):
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    losses = []
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        opt.zero_grad()
        losses.append(train_step(model, x).reduce_mean().item())
        opt.step()
    local = dict(model.local_named_parameters())
    held = sum(p.numel() for p in net.parameters() if p.numel())
    return {"all_meta_before": all_meta, "held": held, "total": 8 * (64 * 64 + 64), "losses": losses,
            "local": {n: p.detach().clone() for n, p in local.items()}, "pp": smp.pp_rank()}  # fmt: skip


@pytest.mark.parametrize("auto", [False, True])
def test_delayed_initialization_materializes_only_the_local_partition(auto: bool) -> None:
    results = run_ranks(_delayed, 4, auto, timeout=90)
    for r in results:
        assert r["all_meta_before"]
        assert 0 < r["held"] < r["total"]  # this rank never holds the whole model
        assert r["losses"][-1] < r["losses"][0]
    assert sum(r["held"] for r in results if r["pp"] == 0) + sum(r["held"] for r in results if r["pp"] == 1) == 2 * 8 * (64 * 64 + 64)
    by_stage: dict[int, list[dict]] = {}
    for r in results:
        by_stage.setdefault(r["pp"], []).append(r["local"])
    for replicas in by_stage.values():  # data-parallel replicas initialized identically
        for name, value in replicas[0].items():
            assert torch.equal(value, replicas[1][name]), name


def test_delayed_module_without_reset_parameters_is_an_error() -> None:
    import smp_compat as smp

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

    smp.init({"delayed_parameter_initialization": True})
    with smp.model_creation():
        net = Custom()
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, x):
        return model.module.w.sum() + x.sum()

    with pytest.raises(smp.SMPUnsupportedError, match="Custom"):
        train_step(model, torch.zeros(2))


def _fp16_run(path: str, steps: range, save_after: int | None, resume: str | None) -> dict[str, torch.Tensor]:
    """``resume``: "before" smp.DistributedModel (the loads wait for the model and optimizer) or "after" the
    optimizer."""
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1, "fp16": True, "auto_partition": False,
              "default_partition": 0})  # fmt: skip
    if resume == "before":
        smp.resume_from_checkpoint(path)
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.float16):
        net = _mlp()
    model = smp.DistributedModel(net)
    smp.set_partition(net[2], 1)
    smp.set_partition(net[4], 1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2.0**8, "scale_window": 2})  # fmt: skip
    if resume == "after":
        smp.resume_from_checkpoint(path)

    train_step = _mse_step(smp)

    data = _data()
    for i in steps:
        opt.zero_grad()
        train_step(model, *data[i])
        opt.step()
        if save_after == i:
            smp.save_checkpoint(path, tag=f"step{i}", model=model, optimizer=opt)
    fp16_state = opt.local_fp16_state_dict()
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"params": params, "masters": fp16_state["fp32_master_params"], "scale": opt.loss_scale}


@pytest.mark.parametrize("when", ["after", "before"])
def test_fp16_checkpoint_resume_is_bitwise(tmp_path, when: str) -> None:
    """Also when resumed before the optimizer exists: its fp16_states part (scale, masters) once was dropped."""
    straight = run_ranks(_fp16_run, 2, str(tmp_path), range(3), 1, None, timeout=90)
    resumed = run_ranks(_fp16_run, 2, str(tmp_path), range(2, 3), None, when, timeout=90)
    for a, b in zip(straight, resumed):
        assert a["scale"] == b["scale"]
        for key in ("params", "masters"):
            assert a[key].keys() == b[key].keys()
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), (key, name)


@pytest.mark.parametrize("key", ["fp16", "bf16"])
def test_a_model_built_in_fp32_is_refused_with_the_fix(key: str) -> None:
    """SMP required smp.model_creation(dtype=...) for fp16; without it the first layer failed deep in torch."""

    def wrap() -> str:
        import smp_compat as smp
        from smp_compat.errors import SMPConfigError

        smp.init({key: True})
        try:
            smp.DistributedModel(_mlp())
        except SMPConfigError as exc:
            return str(exc)
        return "accepted"

    (message,) = run_ranks(wrap, 1, timeout=60)
    assert "every parameter of the model is float32" in message and "smp.model_creation(dtype=torch." in message


def test_dynamic_loss_scaler_restores_its_hysteresis_when_the_scale_grows() -> None:
    """Megatron's DynamicLossScaler.update_scale (SMP's): growth resets the overflows still tolerated."""
    from smp_compat.precision.fp16 import LossScaler

    args = {"init_scale": 1024.0, "scale_window": 2, "min_scale": 1, "delayed_shift": 2}
    scaler = LossScaler.create(1.0, True, args)
    scales = []
    for overflow in [True, False, False, True, True, False, False, True, False, False]:
        scaler.update(overflow)
        scales.append(scaler.scale)
    assert scales == [1024, 1024, 2048, 2048, 1024, 1024, 2048, 2048, 2048, 4096]
    with pytest.raises(SMPConfigError, match="scale_windows"):  # a typo raised a bare TypeError
        LossScaler.create(1.0, True, {"scale_windows": 2})


def _load_after_first_step(key: str) -> dict[str, bool]:
    """A model load once the masters exist, then a step with lr=0: the loaded weights must stay."""
    import smp_compat as smp

    smp.init({key: True})
    with smp.model_creation(dtype=torch.float16 if key == "fp16" else torch.bfloat16):
        model = smp.DistributedModel(_mlp())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    train_step = _mse_step(smp)

    data = _data()
    for i, lr in enumerate((0.5, 0.0)):
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        train_step(model, *data[i])
        opt.step()
        if i == 0:
            model.load_state_dict({k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()})
    return {"weights": all(bool((p == 0.25).all()) for p in model.local_parameters()),
            "masters": all(bool((m == 0.25).all()) for _, m in opt.master_params())}  # fmt: skip


@pytest.mark.parametrize("key", ["fp16", "bf16"])
def test_a_model_load_after_partitioning_is_kept_by_the_next_step(key: str) -> None:
    (r,) = run_ranks(_load_after_first_step, 1, key, timeout=60)
    assert r == {"weights": True, "masters": True}
