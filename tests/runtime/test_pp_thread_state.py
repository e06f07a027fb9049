"""Thread-local torch state around an @smp.step call applies in the pipeline's own threads too.

At pp = 1 the step body runs in the caller's thread and sees its autocast, saved-tensor hooks, default device
and inference mode. At pp > 1 the body and the served module calls run on the engine's worker threads; before
``runtime/thread_state.py`` they silently ran without that state (fp32 instead of bf16, for one).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from smp_compat.errors import SMPUnsupportedError
from smp_compat.runtime.thread_state import CallerState, cuda_device_setter
from smp_compat.testing import run_ranks

STEPS, BATCH, MICROBATCHES, LR = 2, 8, 2, 0.1
TIMEOUT = 90


class Recorder(nn.Module):
    """A Linear that notes the thread-local state its forward ran under (on whichever rank owns it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.seen: list[tuple[bool, str, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(_observed())
        return self.lin(x)


def _observed() -> tuple[bool, str, bool]:
    return torch.is_autocast_enabled("cpu"), str(torch.get_default_device()), torch.is_inference_mode_enabled()


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), Recorder(), nn.Tanh(), nn.Linear(32, 4))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


class _Compressed:
    """Saved-tensor hooks that keep activations in bf16: they change the gradients, so dropping them shows."""

    def __init__(self) -> None:
        self.packed = 0

    def pack(self, t: torch.Tensor) -> tuple[torch.dtype, torch.Tensor]:
        self.packed += 1
        return t.dtype, t.to(torch.bfloat16)

    @staticmethod
    def unpack(saved: tuple[torch.dtype, torch.Tensor]) -> torch.Tensor:
        dtype, t = saved
        return t.to(dtype)


def _around(kind: str, hooks: _Compressed) -> Any:
    if kind == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)


def _reference(kind: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: the state around each microbatch's forward, loss and backward, as at pp = 1."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    hooks = _Compressed()
    losses = []
    for x, y in _data():
        opt.zero_grad()
        chunks = MICROBATCHES * dp
        total = 0.0
        for xm, ym in zip(x.chunk(chunks), y.chunk(chunks)):
            with _around(kind, hooks):
                loss = F.mse_loss(model(xm).float(), ym)
                (loss / chunks).backward()
            total += loss.item() / chunks
        opt.step()
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train(kind: str, dp: int, pipeline: str) -> dict[str, Any]:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "pipeline": pipeline,
              "auto_partition": False, "default_partition": 0, "ddp": dp > 1})  # fmt: skip
    net = _mlp()
    for index in (2, 3, 4):
        smp.set_partition(net[index], 1)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    hooks = _Compressed()
    body_seen = []

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        body_seen.append(_observed())
        loss = F.mse_loss(model(x).float(), y)
        model.backward(loss)
        return loss

    losses = []
    per_rank = BATCH // smp.dp_size()
    lo = smp.dp_rank() * per_rank
    for x, y in _data():
        opt.zero_grad()
        with _around(kind, hooks):
            local = train_step(model, x[lo : lo + per_rank], y[lo : lo + per_rank]).reduce_mean().item()
        losses.append(sum(smp.allgather(local, smp.DP_GROUP)) / smp.dp_size())
        opt.step()
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"losses": losses, "params": params, "body": body_seen, "module": net[2].seen, "packed": hooks.packed}


@pytest.mark.parametrize(
    ("kind", "dp", "pipeline"),
    [("autocast", 1, "interleaved"), ("autocast", 2, "simple"), ("saved_tensor_hooks", 1, "interleaved")],
)
def test_state_around_the_step_call_applies_on_every_stage(kind: str, dp: int, pipeline: str) -> None:
    results = run_ranks(_train, 2 * dp, kind, dp, pipeline, timeout=TIMEOUT)
    ref_losses, ref_params = _reference(kind, dp)
    merged = {k: v for r in results for k, v in r["params"].items()}
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, value in ref_params.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if kind == "autocast":
        assert all(seen[0] for seen in results[0]["body"]), "rank 0's microbatches ran without autocast"
        assert all(seen[0] for seen in results[1]["module"]), "rank 1's served calls ran without autocast"
    else:
        assert results[0]["packed"] > 0 and results[1]["packed"] > 0, "a stage's activations skipped the hooks"


def _modes() -> dict[str, Any]:
    """A training step under ``torch.device("meta")`` (a function mode), then an eval step in inference mode."""
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0})  # fmt: skip
    net = _mlp()
    for index in (2, 3, 4):
        smp.set_partition(net[index], 1)
    model = smp.DistributedModel(net)
    body_seen = []

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        body_seen.append(_observed())
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    @smp.step
    def eval_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        body_seen.append(_observed())
        return model(x)

    x, y = _data()[0]
    with torch.device("meta"):  # factories without a device make meta tensors; the model's math is unaffected
        train_step(model, x, y)
    with torch.inference_mode():
        out = eval_step(model, x).concat()
    return {"body": body_seen, "module": net[2].seen, "out": out.clone()}


def test_default_device_and_inference_mode_apply_in_the_pipelines_threads() -> None:
    rank0, rank1 = run_ranks(_modes, 2, timeout=TIMEOUT)
    train, evaluation = [(False, "meta", False)] * MICROBATCHES, [(False, "cpu", True)] * MICROBATCHES
    assert rank0["body"] == train + evaluation
    assert rank1["module"] == train + evaluation
    with torch.no_grad():
        torch.testing.assert_close(rank0["out"], _mlp()(_data()[0][0]), rtol=1e-6, atol=1e-7)


def _under_dispatch_mode() -> str:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0})  # fmt: skip
    net = _mlp()
    smp.set_partition(net[4], 1)
    model = smp.DistributedModel(net)

    @smp.step
    def eval_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    try:
        with FlopCounterMode(display=False):
            eval_step(model, _data()[0][0])
    except SMPUnsupportedError as exc:
        return str(exc)
    return "no error"


def test_a_dispatch_mode_around_a_pipelined_step_is_refused_by_name_on_every_rank() -> None:
    for message in run_ranks(_under_dispatch_mode, 2, timeout=TIMEOUT):
        assert "TorchDispatchMode" in message and "inside the step function" in message


def test_captured_state_applies_in_a_fresh_thread_and_is_gone_after() -> None:
    hooks = _Compressed()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.device("meta"), torch.autograd.graph.saved_tensors_hooks(
        hooks.pack, hooks.unpack
    ):
        state = CallerState.capture()
    seen: dict[str, Any] = {}

    def in_thread() -> None:
        seen["before"] = _observed()
        with state.applied():
            seen["inside"] = _observed()
            w = torch.ones(3, device="cpu", requires_grad=True)
            (w * w).sum()
            seen["packed"] = hooks.packed
        seen["after"] = _observed()

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen["before"] == seen["after"] == (False, "cpu", False)
    assert seen["inside"] == (True, "meta", False)
    assert seen["packed"] == 2
    assert CallerState.capture().is_default


def test_engine_threads_take_the_ranks_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    cuda_device_setter(torch.device("cpu"))()
    assert calls == []
    cuda_device_setter(torch.device("cuda", 3))()
    assert calls == [3]
