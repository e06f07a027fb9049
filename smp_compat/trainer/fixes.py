"""The corrections to transformers' SMP code path, one function each (named in docs/porting.md).

Each patch wraps one transformers (or accelerate) member and changes it only while this process is an SMP
job; the wrapped original runs unchanged otherwise. ``patch_module`` applies the ones for a module once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from smp_compat.errors import SMPUnsupportedError
from smp_compat.globalstate import state
from smp_compat.trainer.hook import is_smp_job
from smp_compat.trainer.loading import TrainerSMP

__all__ = ["SUPPORTED", "patch_module"]

log = logging.getLogger("smp_compat")

SUPPORTED = ((4, 40), (6, 0))
"""transformers versions the fixes were written for: 4.40 (inclusive) to 6.0 (exclusive)."""

_DONE = "_smp_compat_trainer_fixed"


def patch_module(module: ModuleType) -> None:
    """Apply the fixes for ``transformers.training_args`` or ``transformers.trainer`` (once per module)."""
    if module.__dict__.get(_DONE) or not _supported():
        return
    if module.__name__ == "transformers.training_args":
        _fix_setup_devices(module.TrainingArguments)
    elif module.__name__ == "transformers.trainer":
        # training_args may have been loading when smp_compat was first imported (transformers imports SMP
        # halfway through it) with no hook installed yet to catch its end: it has finished by now
        arguments = sys.modules.get("transformers.training_args")
        if arguments is not None and not arguments.__dict__.get(_DONE):
            patch_module(arguments)
        _fix_accelerated_optimizer()
        _fix_clip_grad_norm()
        _fix_train_dataloader(module.Trainer)
        _fix_wrap_model(module.Trainer)
        if "smp" in module.__dict__:  # transformers imported SMP (it decides on the same environment)
            module.smp = TrainerSMP(module.smp)
    module.__dict__[_DONE] = True


def _supported() -> bool:
    """Only the versions the fixes were written and tested for; any other one is left alone, with a warning."""
    import transformers

    parts = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if SUPPORTED[0] <= parts < SUPPORTED[1]:
        return True
    log.warning("transformers %s is outside %s..%s: smp_compat leaves its Trainer's SMP path as it is",
                transformers.__version__, SUPPORTED[0], SUPPORTED[1])  # fmt: skip
    return False


# ------------------------------------------------------------------ fix 1: the device
def _fix_setup_devices(cls: type) -> None:
    """``TrainingArguments._setup_devices`` under SMP calls ``torch.cuda.set_device(local_rank)`` (fails on a
    CPU build; with ``--use_cpu`` it reaches an unset ``device``). Under SMP the device is the one ``smp.init``
    chose (local rank's GPU, shared round-robin when fewer; else the CPU); the rest of the method runs as is."""
    descriptor = cls.__dict__["_setup_devices"]  # functools' cached_property; 4.40: transformers' own (a property)
    original = getattr(descriptor, "func", None) or descriptor.fget

    def _setup_devices(self: Any) -> torch.device:
        if not is_smp_job():
            return original(self)
        device = state.device if state.initialized else torch.device("cpu")
        use_cpu, set_device = getattr(self, "use_cpu", False), torch.cuda.set_device
        torch.cuda.set_device = lambda *_: None  # smp.init already set this rank's GPU
        try:
            if use_cpu:
                self.use_cpu = False  # transformers' SMP branch, not its single-process CPU one
            original(self)
        finally:
            torch.cuda.set_device = set_device
            if use_cpu:
                self.use_cpu = use_cpu
        self._n_gpu = 1 if device.type == "cuda" else 0
        return device

    replacement = type(descriptor)(_setup_devices)
    if hasattr(replacement, "__set_name__"):
        replacement.__set_name__(cls, "_setup_devices")
    setattr(cls, "_setup_devices", replacement)


# ------------------------------------------------------------------ fix 4: SMP's optimizer behind accelerate's wrapper
def _fix_accelerated_optimizer() -> None:
    """The Trainer hands SMP's optimizer to ``accelerator.prepare``, then calls SMP's own members on the
    ``AcceleratedOptimizer`` it gets back (``local_state_dict``, ``clip_master_grads``): those are forwarded
    to SMP's optimizer. Only for SMP's optimizer; a member the wrapper has itself is never shadowed."""
    from accelerate.optimizer import AcceleratedOptimizer

    if "__getattr__" in AcceleratedOptimizer.__dict__:
        return

    def __getattr__(self: Any, name: str) -> Any:  # noqa: N807 - only reached for names the wrapper lacks
        inner = self.__dict__.get("optimizer")
        if inner is not None and inner is state.optimizer and not name.startswith("__"):
            return getattr(inner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    AcceleratedOptimizer.__getattr__ = __getattr__  # type: ignore[attr-defined]


# ------------------------------------------------------------------ fix 4c: clipping by the whole model's norm
def _fix_clip_grad_norm() -> None:
    """In fp32 the Trainer clips with ``accelerator.clip_grad_norm_(model.parameters(), max_norm)``: under a
    pipeline each rank would take the norm of its own stage's gradients and clip by that. Under SMP the norm
    is the whole model's (every stage, tensor-parallel shards once), as ``clip_master_grads`` takes it in fp16
    and as torch takes it in one process."""
    from accelerate import Accelerator

    original = Accelerator.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2, **kwargs: Any) -> Any:
        if not is_smp_job() or state.model is None or not state.model.partitioned:
            return original(self, parameters, max_norm, norm_type, **kwargs)
        return clip_whole_model(parameters, max_norm, norm_type)

    Accelerator.clip_grad_norm_ = clip_grad_norm_


def clip_whole_model(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over the DistributedModel's local gradients, by the global norm."""
    from smp_compat.precision.master_norm import global_norm

    local = list(state.model.local_parameters())
    params = [p for p in parameters if p.grad is not None]
    total = global_norm([(p, p) for p in params], local, float(norm_type), sharded=False)
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        for p in params:
            p.grad.detach().mul_(coefficient)
    return torch.tensor(total)


# ------------------------------------------------------------------ fix 4b: wrapping (transformers 5)
def _fix_wrap_model(cls: type) -> None:
    """Two breaks of transformers 5's SMP branch around ``_wrap_model``, where 4.x was right:

    * evaluation wraps ``self.model`` again (5.x tests ``isinstance(model, DistributedModel)`` on the
      unwrapped model, 4.x tested ``self.model_wrapped``): SMP allows one DistributedModel, so the one the
      Trainer made is returned;
    * ``_prepare_for_training`` delays the optimizer under SMP (it must follow ``smp.DistributedModel``) but
      never makes it on SMP's branch (``accelerator.prepare(None)``, then a scheduler over ``None``): it is
      created right after wrapping for training, as 4.x's ``create_optimizer_and_scheduler`` did there. Only
      where ``_prepare_for_training`` exists (5.x): 4.x makes it itself, and its ``create_optimizer`` would
      wrap the optimizer in ``smp.DistributedOptimizer`` a second time."""
    original = cls._wrap_model
    makes_optimizer = hasattr(cls, "_prepare_for_training")

    @functools.wraps(original)
    def _wrap_model(self: Any, model: Any, training: bool = True, *args: Any, **kwargs: Any) -> Any:
        if not is_smp_job():
            return original(self, model, training, *args, **kwargs)
        existing = state.model
        if existing is not None and (model is existing or model is existing.module):
            wrapped = existing
        else:
            wrapped = original(self, model, training, *args, **kwargs)
        if makes_optimizer and training and self.optimizer is None and state.model is not None:
            self.create_optimizer()
        return wrapped

    cls._wrap_model = _wrap_model


# ------------------------------------------------------------------ fix 7: data-parallel replicas see their own data
def _fix_train_dataloader(cls: type) -> None:
    """Under SMP the Trainer's accelerator is not distributed, so every data-parallel replica got the same
    batches while the Trainer counted ``args.world_size`` (SMP's dp size) of them. The training loader is
    sharded over the replicas as accelerate shards it under DDP: replica ``args.process_index`` of
    ``args.world_size`` (rdp under ``prescaled_batch``, as the Trainer counts them), same sampler seed."""
    original = cls.get_train_dataloader

    @functools.wraps(original)
    def get_train_dataloader(self: Any, *args: Any, **kwargs: Any) -> Any:
        replicas = self.args.world_size
        if not is_smp_job() or replicas <= 1:
            return original(self, *args, **kwargs)
        with _sharded_as_ddp(self.accelerator, replicas, self.args.process_index):
            return original(self, *args, **kwargs)

    cls.get_train_dataloader = get_train_dataloader


class _ReplicaView:
    """accelerate's state as seen by ``prepare_data_loader``: ``replicas`` processes, this one ``index``."""

    def __init__(self, inner: Any, replicas: int, index: int) -> None:
        self.__dict__.update(_inner=inner, num_processes=replicas, process_index=index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _sharded_as_ddp(accelerator: Any, replicas: int, index: int) -> Iterator[None]:
    inner = accelerator.state
    if getattr(inner, "num_processes", 1) not in (1, replicas):
        raise SMPUnsupportedError(
            f"accelerate sees {inner.num_processes} processes in this SMP job, not 1: the Trainer's data cannot be "
            "sharded over SMP's data-parallel replicas. Do not launch the job with `accelerate launch`."
        )
    accelerator.state = _ReplicaView(inner, replicas, index)
    try:
        yield
    finally:
        accelerator.state = inner

