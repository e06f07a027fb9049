"""Combination-matrix fidelity (issue 10): feature combinations against plain single-process PyTorch.

Each feature passed its own test while some combinations trained the wrong model (16-bit with
``shard_optimizer_state``), so this test trains combinations of

    topology pp x dp in {1x1, 1x2, 2x1, 2x2} x precision {fp32, fp16, bf16}
    x shard_optimizer_state x activation checkpointing x delayed initialization
    x accumulation (microbatches 2 and backward_passes_per_step 2, against 1 and 1)

and compares every cell with plain PyTorch on the same global batches: the losses, every parameter,
and data-parallel replicas identical bit for bit. fp32 is held to rtol 1e-5; 16-bit to the tolerance
explained in docs/differences.md ("Combination-matrix tolerances").

The full product (4 x 3 x 2^4, less impossible cells) is too slow for CI, so the cells are a covering
design: PAIRWISE covers every pair of levels of every two factors (delayed initialization off), ALL_ON
has every feature on at pp = 2 x dp = 2 for each precision, and DELAYED pairs delayed initialization
with every level of every other factor. Cells with the same world size share one set of ranks
(``smp.reset()`` between cells), so the matrix costs three short-lived worlds.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from models import causal_mask, lm_loss, lm_train_step, make_batches, make_model, place_blocks_by_stage
from smp_compat.testing import run_ranks

STEPS, GLOBAL_BATCH, LR, MOMENTUM = 3, 8, 0.05, 0.9
FP16_SCALE = 2.0**10  # static: a skipped step would only test the scaler (covered in test_fp16/test_sharding_16bit)
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# (rtol, atol) on parameters and losses; why these: docs/differences.md, "Combination-matrix tolerances"
TOLERANCE = {"fp32": (1e-5, 1e-6)} | {
    name: (2 * torch.finfo(dtype).eps, torch.finfo(dtype).eps / 4) for name, dtype in DTYPES.items() if dtype
}  # 16-bit: two units in the last place of the weight (each parameter is stored in 16 bits)


@dataclass(frozen=True)
class Cell:
    pp: int
    dp: int
    precision: str
    shard: bool = False
    ckpt: bool = False
    delayed: bool = False
    accum: bool = False

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def passes(self) -> int:
        """Step calls per optimizer step (``backward_passes_per_step``)."""
        return 2 if self.accum else 1

    def __str__(self) -> str:
        flags = [f for f, on in (("shard", self.shard), ("ckpt", self.ckpt), ("delayed", self.delayed),
                                 ("accum", self.accum)) if on]  # fmt: skip
        return f"pp{self.pp}xdp{self.dp}-{self.precision}" + "".join(f"+{f}" for f in flags)


def _cell(topology: str, precision: str, shard: int, ckpt: int, accum: int, delayed: int = 0) -> Cell:
    pp, dp = (int(n) for n in topology.split("x"))
    return Cell(pp, dp, precision, bool(shard), bool(ckpt), bool(delayed), bool(accum))


# every pair of levels of (topology, precision, shard, ckpt, accum) appears in some cell (shard needs dp = 2)
PAIRWISE = [
    _cell("1x1", "fp32", 0, 0, 1), _cell("1x1", "fp16", 0, 1, 1), _cell("1x1", "bf16", 0, 0, 0),
    _cell("1x2", "fp32", 1, 0, 0), _cell("1x2", "fp16", 1, 0, 0), _cell("1x2", "bf16", 0, 1, 1),
    _cell("2x1", "fp32", 0, 1, 0), _cell("2x1", "fp16", 0, 0, 1), _cell("2x1", "bf16", 0, 0, 0),
    _cell("2x2", "fp32", 1, 0, 1), _cell("2x2", "fp16", 0, 0, 0), _cell("2x2", "bf16", 1, 1, 0),
]  # fmt: skip
ALL_ON = [_cell("2x2", precision, 1, 1, 1) for precision in DTYPES]
# delayed initialization with every level of every other factor
DELAYED = [
    _cell("1x1", "fp32", 0, 1, 0, delayed=1), _cell("1x2", "fp16", 1, 0, 1, delayed=1),
    _cell("2x1", "bf16", 0, 1, 1, delayed=1), _cell("2x2", "bf16", 1, 1, 1, delayed=1),
]  # fmt: skip


# ---------------------------------------------------------------- plain PyTorch, the oracle
def _build(precision: str) -> torch.nn.Module:
    """The model as ``smp.model_creation(dtype=...)`` builds it: constructed with the 16-bit default dtype."""
    previous = torch.get_default_dtype()
    if DTYPES[precision] is not None:
        torch.set_default_dtype(DTYPES[precision])
    try:
        return make_model()
    finally:
        torch.set_default_dtype(previous)


def _batches(passes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_batches(STEPS * passes, GLOBAL_BATCH)


def reference(precision: str, passes: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, whole global batch; 16-bit: a 16-bit model with fp32 master weights (SMP's recipe)."""
    model = _build(precision)
    sixteen = DTYPES[precision] is not None
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()] if sixteen else None
    opt = torch.optim.SGD(masters or model.parameters(), lr=LR, momentum=MOMENTUM)
    scale = FP16_SCALE if precision == "fp16" else 1.0
    mask = causal_mask(8).to(DTYPES[precision] or torch.float32)
    losses, batches = [], iter(_batches(passes))
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        for _ in range(passes):  # accumulation: gradients of the passes add up, as in plain PyTorch
            x, y = next(batches)
            loss = lm_loss(model(x, attention_mask=mask).float(), y)
            (loss * scale).backward()
            losses.append(loss.item())
        if masters is not None:
            for p, m in zip(model.parameters(), masters):
                m.grad = p.grad.float() / scale
        opt.step()
        if masters is not None:
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters):
                    p.copy_(m)
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- the SMP side, one cell
def _train_cell(cell: Cell) -> dict:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": cell.pp, "microbatches": 2 if cell.accum else 1, "ddp": cell.dp > 1,
              "shard_optimizer_state": cell.shard, "delayed_parameter_initialization": cell.delayed,
              **({cell.precision: True} if cell.precision != "fp32" else {}),
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    with smp.model_creation(dtype=DTYPES[cell.precision]):
        net = make_model()
    model = smp.DistributedModel(net, backward_passes_per_step=cell.passes)
    if cell.delayed:  # each rank would draw its own values: start from the oracle's (a pretrained-load pattern)
        model.load_state_dict(_build(cell.precision).state_dict())
    if cell.pp > 1:
        place_blocks_by_stage(smp, model)
    if cell.ckpt:
        for block in net.blocks:
            smp.set_activation_checkpointing(block)
    scale = {"static_loss_scale": FP16_SCALE} if cell.precision == "fp16" else {}
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), **scale)
    train_step = lm_train_step(smp)
    per_rank = GLOBAL_BATCH // cell.dp
    lo = smp.dp_rank() * per_rank
    losses, batches = [], iter(_batches(cell.passes))
    for _ in range(STEPS):
        opt.zero_grad()
        for _ in range(cell.passes):
            x, y = next(batches)
            out = train_step(model, x[lo : lo + per_rank], y[lo : lo + per_rank])
            losses.append(sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / cell.dp)
        opt.step()
    result = {"losses": losses, "overflow": bool(getattr(opt, "overflow", False)),
              "params": {n: p.detach().float().clone() for n, p in model.local_named_parameters()}}  # fmt: skip
    smp.reset()
    return result


def _train_cells(cells: list[Cell]) -> list[dict]:
    """Several cells on one set of ranks (the process group outlives ``smp.reset()``)."""
    return [_train_cell(cell) for cell in cells]


# ---------------------------------------------------------------- checks
def _problems(cell: Cell, per_rank: list[dict], oracle: tuple[list[float], dict[str, torch.Tensor]]) -> list[str]:
    ref_losses, ref_params = oracle
    rtol, atol = TOLERANCE[cell.precision]
    problems = []
    replicas: dict[str, list[torch.Tensor]] = {}
    for r in per_rank:
        if r["overflow"]:
            problems.append("the last optimizer step was skipped (overflow)")
        if not torch.allclose(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol):
            problems.append(f"losses {r['losses']} != plain PyTorch {ref_losses}")
        for name, value in r["params"].items():
            replicas.setdefault(name, []).append(value)
    if set(replicas) != set(ref_params):
        problems.append(f"parameters {sorted(replicas)} != {sorted(ref_params)}")
    for name, values in replicas.items():
        if len(values) != cell.dp or any(not torch.equal(v, values[0]) for v in values):
            problems.append(f"{name}: data-parallel replicas differ (or {len(values)} != dp copies)")
        elif name in ref_params and not torch.allclose(values[0], ref_params[name], rtol=rtol, atol=atol):
            worst = (values[0] - ref_params[name]).abs().max().item()
            problems.append(f"{name}: differs from plain PyTorch by up to {worst:.3g} (rtol {rtol}, atol {atol})")
    return problems


def _run_world(cells: list[Cell]) -> None:
    world = cells[0].world
    assert all(c.world == world for c in cells)
    outcomes = run_ranks(_train_cells, world, cells, timeout=60 + 30 * len(cells))
    oracles: dict[tuple[str, int], tuple[list[float], dict[str, torch.Tensor]]] = {}
    failures = []
    for i, cell in enumerate(cells):
        key = (cell.precision, cell.passes)
        if key not in oracles:
            oracles[key] = reference(*key)
        problems = _problems(cell, [outcome[i] for outcome in outcomes], oracles[key])
        failures += [f"{cell}: {p}" for p in dict.fromkeys(problems)]  # every rank reports the same losses
    assert not failures, "\n".join(failures)


def _by_world(cells: list[Cell]) -> dict[int, list[Cell]]:
    out: dict[int, list[Cell]] = {}
    for cell in cells:
        out.setdefault(cell.world, []).append(cell)
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_combinations_match_plain_pytorch(world: int) -> None:
    _run_world(_by_world(PAIRWISE + ALL_ON)[world])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_delayed_initialization_combinations_match_plain_pytorch(world: int) -> None:
    _run_world(_by_world(DELAYED)[world])


def test_the_design_covers_every_pair() -> None:
    """PAIRWISE really is pairwise; DELAYED meets every level of every other factor."""
    def levels(c: Cell) -> tuple:
        return (f"{c.pp}x{c.dp}", c.precision, c.shard, c.ckpt, c.accum)

    domains = [{"1x1", "1x2", "2x1", "2x2"}, set(DTYPES), {False, True}, {False, True}, {False, True}]
    seen = {(i, levels(c)[i], j, levels(c)[j]) for c in PAIRWISE for i in range(5) for j in range(i + 1, 5)}
    for i in range(5):
        for j in range(i + 1, 5):
            for a in domains[i]:
                for b in domains[j]:
                    if i == 0 and j == 2 and b and not a.endswith("x2"):
                        continue  # shard_optimizer_state needs data parallelism
                    assert (i, a, j, b) in seen, (i, a, j, b)
    for i, domain in enumerate(domains):
        assert {levels(c)[i] for c in DELAYED} == domain
    assert all(not c.shard or c.dp > 1 for c in PAIRWISE + ALL_ON + DELAYED)
