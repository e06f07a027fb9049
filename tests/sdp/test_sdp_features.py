"""Sharded DP with SMP's other features: 16-bit, delayed init, activation checkpointing, accumulation APIs."""

from __future__ import annotations

import pytest
import torch
from sdp_helpers import assert_close_to, init_sdp, reference, train
from torch import nn

from smp_compat.config import resolve_config
from smp_compat.errors import SMPConfigError, SMPUnsupportedError
from smp_compat.testing import run_ranks


@pytest.mark.parametrize(
    ("params", "match"),
    [({"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2, "ddp": True}, "pipeline_parallel_degree"),
     ({"sharded_data_parallel_degree": 2, "shard_optimizer_state": True, "ddp": True}, "shard_optimizer_state")],
)  # fmt: skip
def test_sdp_excludes_pipeline_and_optimizer_state_sharding(params: dict, match: str) -> None:
    with pytest.raises(SMPConfigError, match=match):
        resolve_config(params, environ={})


def test_sdp_must_divide_the_data_parallel_degree() -> None:
    cfg = resolve_config({"sharded_data_parallel_degree": 3, "ddp": True}, environ={})
    with pytest.raises(SMPConfigError, match=r"sharded_data_parallel_degree \(3\) must divide the data-parallel"):
        cfg.check_world_size(4)
    cfg.check_world_size(6)


def _precision(sdp: int, key: str) -> dict:
    smp, model, opt = init_sdp(sdp, **{key: True})
    losses, norms = train(smp, model, opt, steps=3)
    p = next(iter(model.parameters()))
    return {"losses": losses, "param_dtype": p.dtype, "grad_dtype": p.grad.dtype, "params": model.state_dict(),
            "scale": opt.loss_scale}  # fmt: skip


@pytest.mark.parametrize("key", ["bf16", "fp16"])
def test_16bit_compute_keeps_fp32_sharded_masters_and_tracks_fp32(key: str) -> None:
    ref = reference(steps=3)
    for result in run_ranks(_precision, 2, 2, key, timeout=180):
        assert result["param_dtype"] == torch.float32 and result["grad_dtype"] == torch.float32
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref[0][:3]), rtol=2e-2, atol=2e-2)
        assert (result["scale"] is None) == (key == "bf16")


def _fp16_overflow(sdp: int) -> dict:
    smp, model, opt = init_sdp(sdp, fp16=True)
    opt.loss_scaler.scale = 2.0**40  # fp16 gradients overflow
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(smp, model, opt, steps=1)
    after = model.state_dict()
    return {"overflow": opt.overflow, "norm": opt._global_grad_norm, "scale": opt.loss_scale,
            "same": all(torch.equal(before[k], after[k]) for k in before)}  # fmt: skip


def test_fp16_overflow_skips_the_step_on_every_rank_and_lowers_the_scale() -> None:
    for result in run_ranks(_fp16_overflow, 2, 2, timeout=120):
        assert result["overflow"] and result["same"] and result["norm"] == -1.0
        assert result["scale"] == 2.0**40  # static scale: kept (a dynamic one halves, see LossScaler)


class _Stack(nn.Module):
    """Only modules with reset_parameters(): every weight can be created on meta and initialized later."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 8)) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _delayed(sdp: int) -> dict:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({"ddp": True, "sharded_data_parallel_degree": sdp, "delayed_parameter_initialization": True})
    torch.manual_seed(0)
    with smp.model_creation():
        module = _Stack()
    assert all(p.is_meta for p in module.parameters())
    model = smp.DistributedModel(module)
    local = sum(p.to_local().numel() for p in model.parameters())
    return {"full": model.state_dict(), "local": local, "total": sum(p.numel() for p in model.parameters())}


def test_delayed_initialization_materializes_shards_with_a_normal_builds_values() -> None:
    torch.manual_seed(0)
    normal = _Stack().state_dict()
    for result in run_ranks(_delayed, 2, 2, timeout=120):
        assert result["local"] == pytest.approx(result["total"] / 2, rel=0.05)
        for name, value in normal.items():
            assert torch.equal(result["full"][name], value), name


def _checkpointed(sdp: int) -> tuple:
    smp, model, opt = init_sdp(sdp)
    for block in model.module.blocks:
        smp.set_activation_checkpointing(block)
    losses, norms = train(smp, model, opt)
    return losses, model.state_dict(), norms


def test_activation_checkpointing_still_matches_plain_pytorch() -> None:
    ref = reference()
    for losses, params, norms in run_ranks(_checkpointed, 2, 2, timeout=180):
        assert_close_to(ref, losses, params, norms)


def _optimizer_api(sdp: int) -> dict:
    smp, model, opt = init_sdp(sdp)
    # AWS's sdp_utils: offsets from p.ds_tensor.ds_numel, then views of optimizer.fp32_partitioned_groups_flat
    offsets, flat_ok = {}, True
    for i, group in enumerate(opt.param_groups):
        offset = 0
        for p in group["params"]:
            offsets[id(p)] = (offset, p.ds_tensor.ds_numel)
            offset += p.ds_tensor.ds_numel
        flat = opt.fp32_partitioned_groups_flat[i]
        for p in group["params"]:
            off, n = offsets[id(p)]
            flat_ok &= torch.equal(flat.narrow(0, off, n), p.to_local().reshape(-1))
    shapes_ok = all(tuple(p.ds_shape) == tuple(p.shape) and p.ds_numel == p.numel() for p in model.parameters())
    try:
        opt.fp16_partitioned_groups_flat
        refused = False
    except SMPUnsupportedError:
        refused = True
    step = __import__("models").lm_train_step(smp)
    x, y = __import__("models").make_batches(1, 16)[0]
    step(model, x[:8], y[:8])
    norm = opt.clip_master_grads(1e-3)
    clipped = opt.clip_master_grads(1e9)
    opt.zero_grad(set_to_none=False)
    zeroed = all(float(p.grad.to_local().abs().sum()) == 0 for p in model.parameters())
    opt.zero_grad()
    return {"flat": flat_ok, "shapes": shapes_ok, "refused": refused, "norm": norm, "clipped": clipped,
            "zeroed": zeroed, "none": all(p.grad is None for p in model.parameters()),
            "inner": type(opt.optimizer).__name__, "groups": opt.fp16_groups[0][0] is opt.param_groups[0]["params"][0],
            "shard_group_size": torch.distributed.get_world_size(opt.ds_param_shard_group)}  # fmt: skip


def test_optimizer_api_and_deepspeed_views_aws_scripts_read() -> None:
    for r in run_ranks(_optimizer_api, 4, 2, timeout=120):
        assert r["flat"] and r["shapes"] and r["refused"] and r["zeroed"] and r["none"] and r["groups"]
        assert r["inner"] == "AdamW" and r["shard_group_size"] == 2
        assert r["norm"] > 1e-3 and r["clipped"] == pytest.approx(1e-3, rel=1e-3)  # returns the norm; clipped to it


def _grad_scaler_overflow_on_one_shard(sdp: int) -> dict:
    from models import causal_mask, lm_loss, make_batches

    smp, model, opt = init_sdp(sdp)
    scaler = smp.amp.GradScaler(init_scale=2.0**8)
    mask = causal_mask(8)

    @smp.step
    def step(model, x, y):  # type: ignore[no-untyped-def]
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(scaler.scale(loss))
        return loss

    x, y = make_batches(1, 16)[0]
    lo = smp.dp_rank() * 8
    step(model, x[lo : lo + 8], y[lo : lo + 8])
    if smp.rank() == 1:  # only this rank's shard overflows: every rank must still skip
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler.step(opt)
    scaler.update()
    after = model.state_dict()
    return {"scale": scaler.get_scale(), "same": all(torch.equal(before[k], after[k]) for k in before)}


def test_smp_amp_grad_scaler_agrees_on_an_overflow_seen_by_one_shard() -> None:
    for result in run_ranks(_grad_scaler_overflow_on_one_shard, 2, 2, timeout=120):
        assert result == {"scale": 128.0, "same": True}


def _mixed_norm(sdp: int) -> list[float]:
    from torch.distributed.tensor import Shard, distribute_tensor

    from smp_compat.sdp.mesh import build_mesh
    from smp_compat.sdp.norms import global_grad_norm

    init_sdp(sdp)
    mesh = build_mesh()
    torch.manual_seed(0)
    full = [torch.randn(6, 3), torch.randn(5), torch.randn(4, 2)]  # 5 rows: uneven over the shards
    placements = [Shard(0)] if mesh.ndim == 1 else [torch.distributed.tensor.Replicate(), Shard(0)]
    sharded = [distribute_tensor(t, mesh, placements) for t in full[:2]]
    mixed = [*sharded, full[2]]
    return [float(global_grad_norm(mixed, p)) for p in (2.0, 1.0, float("inf"))]


@pytest.mark.parametrize(("world", "sdp"), [(2, 2), (4, 2)])
def test_global_norm_of_mixed_sharded_and_plain_gradients_counts_each_element_once(world: int, sdp: int) -> None:
    torch.manual_seed(0)
    full = torch.cat([torch.randn(6, 3).reshape(-1), torch.randn(5), torch.randn(4, 2).reshape(-1)])
    expected = [float(full.norm(2)), float(full.norm(1)), float(full.abs().max())]
    for norms in run_ranks(_mixed_norm, world, sdp, timeout=120):
        assert norms == pytest.approx(expected, rel=1e-6)
