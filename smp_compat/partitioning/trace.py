"""Tracing one forward pass: module execution order, output sizes, call counts and (optionally) times.

Times from the traced pass alone are poor costs: it is the first pass (cold caches, first-call work) and
one sample. With ``timing_runs`` the root's calls are replayed that many times more (no grad, RNG and
buffers restored) and each module's time is its smallest over the replays: interference only ever adds
time. Off CUDA the clock is the tracing thread's CPU time, so a pause of the process (another process
taking the core) does not land on whichever module was running.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["TIMING_RUNS", "TraceResult", "output_bytes", "trace_modules"]

TIMING_RUNS = 5  # replays of the root's calls when times are measured for the auto-partitioner

log = logging.getLogger("smp_compat")


@dataclass
class TraceResult:
    """What the auto-partitioner learns from one traced forward pass (SMP traced microbatch 0).

    Only modules that were called appear in ``output_bytes``, ``calls`` and ``exclusive_time``.
    """

    order: list[str] = field(default_factory=list)
    output_bytes: dict[str, int] = field(default_factory=dict)
    exclusive_time: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)


def output_bytes(output: Any) -> int:
    """Bytes of the tensors in a module output (any pytree; dataclass fields are walked too).

    A tensor that appears twice counts once; non-tensor leaves count 0.
    """
    seen: set[int] = set()
    total = 0
    pending = [output]
    while pending:
        leaves, _ = tree_flatten(pending.pop())
        for leaf in leaves:
            if id(leaf) in seen:
                continue
            seen.add(id(leaf))
            if isinstance(leaf, torch.Tensor):
                total += _tensor_bytes(leaf)
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
                pending.extend(getattr(leaf, f.name, None) for f in dataclasses.fields(leaf))
    return total


def _tensor_bytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.numel() * tensor.element_size()
    except (RuntimeError, NotImplementedError):  # exotic layouts: not worth failing the trace over
        return 0


class _Recorder:
    """Hook state for one trace: a stack of open calls gives each module its time minus its children's."""

    def __init__(self, measure_time: bool) -> None:
        self.result = TraceResult()
        self.measure_time = measure_time
        self.sync = measure_time and torch.cuda.is_available() and torch.cuda.is_initialized()
        self.frames: list[list[Any]] = []  # [name, start, children's time]

    def _now(self) -> float:
        """Wall time after a device sync on CUDA. Else the CPU time of this thread, which runs the model:
        a pause of the process (another process taking the core) then lands on no module, and other
        threads' work is not counted. The thread takes its share of torch's parallel ops (and waits for
        the rest, typically busily), so its CPU time follows the op's wall time on an idle machine."""
        if self.sync:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    def pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            calls = self.result.calls
            if name not in calls:
                self.result.order.append(name)
                calls[name] = 0
            calls[name] += 1
            if self.measure_time:
                self.frames.append([name, self._now(), 0.0])

        return hook

    def post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if name not in self.result.output_bytes:
                self.result.output_bytes[name] = output_bytes(output)
            if self.measure_time:
                self._close(name)

        return hook

    def _close(self, name: str) -> None:
        # Unwind to this module's frame; frames left open by a module whose post hook never ran are dropped.
        while self.frames and self.frames[-1][0] != name:
            self.frames.pop()
        if not self.frames:
            return
        _, start, children = self.frames.pop()
        elapsed = self._now() - start
        times = self.result.exclusive_time
        times[name] = times.get(name, 0.0) + max(0.0, elapsed - children)
        if self.frames:
            self.frames[-1][2] += elapsed


def _hooked(root: nn.Module, recorder: _Recorder, run: Callable[[], Any]) -> None:
    """``run()`` under ``torch.no_grad()`` with the recorder's hooks on every module of ``root``."""
    handles = []
    try:
        for name, module in root.named_modules():
            handles.append(module.register_forward_pre_hook(recorder.pre(name)))
            handles.append(module.register_forward_hook(recorder.post(name), always_call=True))
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()


def _retime(root: nn.Module, calls: list[tuple[Any, Any]], runs: int) -> dict[str, float]:
    """Each module's smallest exclusive time over ``runs`` replays of the root's recorded calls.

    The replays leave no trace: RNG states and buffers (BatchNorm statistics) are restored afterwards.
    """
    best: dict[str, float] = {}
    buffers = [(b, b.detach().clone()) for b in root.buffers()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            for _ in range(runs):
                recorder = _Recorder(measure_time=True)
                _hooked(root, recorder, lambda: [root(*args, **kwargs) for args, kwargs in calls])
                for name, seconds in recorder.result.exclusive_time.items():
                    best[name] = min(seconds, best.get(name, seconds))
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return best


def trace_modules(
    root: nn.Module, run: Callable[[], Any], measure_time: bool = False, timing_runs: int = 0
) -> TraceResult:
    """Run ``run()`` once under ``torch.no_grad()`` with hooks on every module of ``root``.

    Records the order of first calls, the output size of each module's first call, call counts, and
    with ``measure_time`` each module's time excluding its children (summed over calls). With
    ``timing_runs`` > 0 too, those times come from replaying the root's calls (see the module docstring);
    a module called only outside the root keeps its time from ``run()``, and so does every module when a
    replay raises (logged as a warning). Replays run the model's forward and its hooks again.
    """
    recorder = _Recorder(measure_time)
    calls: list[tuple[Any, Any]] = []
    capture = root.register_forward_pre_hook(lambda _m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    try:
        _hooked(root, recorder, run)
    finally:
        capture.remove()
    if measure_time and timing_runs > 0 and calls:
        try:
            recorder.result.exclusive_time.update(_retime(root, calls, timing_runs))
        except Exception as exc:  # noqa: BLE001 - the traced pass ran; a forward that cannot run twice keeps its times
            log.warning("auto-partition: replaying the traced forward pass to time modules failed (%s: %s); "
                        "using the times of the traced pass alone", type(exc).__name__, exc)  # fmt: skip
    return recorder.result
