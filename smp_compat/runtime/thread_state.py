"""The step caller's thread-local torch state, carried into the engine's own threads.

Torch keeps autocast, inference mode, the torch-function mode stack (which holds ``torch.set_default_device``
and ``with torch.device(...)``), the saved-tensor hooks and the current CUDA device per OS thread.
The engine runs microbatches and served calls on worker threads (tasks.py), where none of that is set: so
``with torch.autocast("cpu", dtype=torch.bfloat16): train_step(...)`` ran in bf16 at pp = 1 and silently in
fp32 at pp = 2. Every task now runs under the state of the thread that called the step on its rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack

from smp_compat.errors import SMPUnsupportedError

__all__ = ["CallerState", "amp_state", "autocast_as", "cuda_device_setter"]

_AMP_DEVICE_TYPES = ("cpu", "cuda")

Amp = dict[str, tuple[bool, torch.dtype]]


def amp_state() -> Amp:
    """This thread's autocast settings per device type: (enabled, dtype)."""
    return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AMP_DEVICE_TYPES}


@contextlib.contextmanager
def autocast_as(amp: Amp) -> Iterator[None]:
    """Autocast exactly as ``amp`` says (on or off per device type), entering only what differs from now."""
    with contextlib.ExitStack() as stack:
        for device_type, (enabled, dtype) in amp.items():
            same = torch.is_autocast_enabled(device_type) == enabled
            if same and (not enabled or torch.get_autocast_dtype(device_type) == dtype):
                continue
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield


@dataclass(frozen=True)
class CallerState:
    """What a task must share with the thread that called the step (grad mode travels in ``StepCall``).

    Not the current CUDA stream: tasks stay on the default stream, where the receiver threads put incoming
    tensors, so no kernel reads a tensor before its copy is done.
    """

    amp: Amp
    inference_mode: bool
    function_modes: tuple[Any, ...]
    saved_tensor_hooks: tuple[Callable[..., Any], Callable[..., Any]] | None

    @classmethod
    def capture(cls) -> CallerState:
        """The calling thread's state; raises for what cannot be carried over (dispatch modes)."""
        if torch._C._len_torch_dispatch_stack() > 0:
            raise SMPUnsupportedError(
                "a TorchDispatchMode (for example FlopCounterMode or FakeTensorMode) is active around an @smp.step "
                "call with pipeline_parallel_degree > 1. The pipeline runs microbatches on its own threads, where "
                "the mode would not apply; enter it inside the step function instead."
            )
        return cls(
            amp=amp_state(),
            inference_mode=torch.is_inference_mode_enabled(),
            function_modes=tuple(_get_current_function_mode_stack()),
            saved_tensor_hooks=torch._C._autograd._top_saved_tensors_default_hooks(True),
        )

    @functools.cached_property
    def is_default(self) -> bool:
        """Nothing to apply: a fresh thread already has this state (the common case costs one check)."""
        return (
            not any(enabled for enabled, _ in self.amp.values())
            and not self.inference_mode
            and not self.function_modes
            and self.saved_tensor_hooks is None
        )

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the body under this state, in a thread that has none of it."""
        if self.is_default:
            yield
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(autocast_as(self.amp))
            if self.inference_mode:
                stack.enter_context(torch.inference_mode())
            for mode in self.function_modes:
                torch._C._push_on_torch_function_stack(mode)
                stack.callback(torch._C._pop_torch_function_stack)
            if self.saved_tensor_hooks is not None:
                torch._C._autograd._push_saved_tensors_default_hooks(*self.saved_tensor_hooks)
                stack.callback(torch._C._autograd._pop_saved_tensors_default_hooks)
            yield


def cuda_device_setter(device: torch.device) -> Callable[[], None]:
    """Called in a new engine thread, makes ``device`` (the rank's compute device) current there.

    A thread starts on CUDA device 0: without this, an engine thread's ``device="cuda"`` tensors landed on
    GPU 0, and its first CUDA call opened a context there, in every process of the node.
    """
    if device.type != "cuda":
        return lambda: None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return lambda: torch.cuda.set_device(index)
