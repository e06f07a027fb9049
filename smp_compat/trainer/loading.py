"""The ``smp`` that transformers' trainer module calls: smp_compat, with two Trainer-specific corrections.

transformers' ``trainer.py`` imports SMP as a module global, ``smp``; in an SMP job smp_compat replaces that
global (only there) by :class:`TrainerSMP`, which is smp_compat for every name but two:

* ``DistributedModel`` (fix 6): the Trainer builds its model in fp32 and relies on SMP >= 1.10 for
  ``"fp16": true``. SMP's documentation puts the model in fp16 before ``DistributedModel`` (built under
  ``smp.model_creation(dtype=torch.float16)``), its 16-bit module holding the fp16 weights and
  ``DistributedOptimizer`` keeping fp32 masters made from them. The Trainer's fp32 model is cast to fp16 here,
  the weights it would have had if built that way; smp_compat's own DistributedModel keeps refusing an fp32
  model under fp16 for other scripts.
* ``resume_from_checkpoint`` (fix 5): the Trainer asks for ``tag="pytorch_model.bin"`` whenever a checkpoint
  has weights, but writes ``model.safetensors`` by default. The safetensors file is read instead when the
  ``.bin`` is absent, tied weights (left out of safetensors files) filled from the weight they are tied to.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

import torch
from torch import nn

from smp_compat.checkpoints.resume import load_full_model_state
from smp_compat.errors import CheckpointError
from smp_compat.globalstate import state

__all__ = ["TrainerSMP", "fill_tied", "to_fp16_for_smp"]

log = logging.getLogger("smp_compat")

_BIN, _SAFE = "pytorch_model.bin", "model.safetensors"


class TrainerSMP:
    """smp_compat for transformers' ``trainer.py``, but for ``DistributedModel`` and ``resume_from_checkpoint``."""

    def __init__(self, smp: ModuleType) -> None:
        self._smp = smp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._smp, name)

    def DistributedModel(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - SMP's name
        to_fp16_for_smp(module)
        return self._smp.DistributedModel(module, *args, **kwargs)

    def resume_from_checkpoint(self, path: Any, tag: str | None = None, partial: bool = True, **kwargs: Any) -> Any:
        folder = os.fspath(path)
        if not partial and tag == _BIN and not os.path.isfile(os.path.join(folder, _BIN)):
            safe = os.path.join(folder, _SAFE)
            if os.path.isfile(safe):
                return _resume_safetensors(safe, bool(kwargs.get("strict", True)))
        return self._smp.resume_from_checkpoint(path, tag=tag, partial=partial, **kwargs)


def to_fp16_for_smp(module: nn.Module) -> None:
    """Under ``"fp16": true``, an all-fp32 model becomes the fp16 model SMP's documentation builds (in place)."""
    cfg = state.cfg
    floating = [p.dtype for p in module.parameters() if p.is_floating_point()]
    if cfg is not None and cfg.fp16 and floating and all(d == torch.float32 for d in floating):
        log.info("fp16: the Trainer's fp32 model is cast to fp16 before smp.DistributedModel (as SMP builds it); "
                 "DistributedOptimizer keeps fp32 master weights")  # fmt: skip
        module.to(torch.float16)


def _resume_safetensors(file: str, strict: bool) -> None:
    """The full model of a ``model.safetensors`` file, loaded (or queued) as ``resume_from_checkpoint`` loads one."""
    from safetensors.torch import load_file

    if state.model is None:
        raise CheckpointError(
            f"{file}: the Trainer resumes its model after wrapping it; smp.DistributedModel does not exist yet"
        )
    state_dict = fill_tied(state.model.module, load_file(file, device="cpu"))
    load_full_model_state(state_dict, strict)


def fill_tied(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the names safetensors files leave out for tied parameters, from the name they are tied to."""
    by_param: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    for names in by_param.values():
        present = next((n for n in names if n in state_dict), None)
        for name in names:
            if present is not None and name not in state_dict:
                state_dict[name] = state_dict[present]
    return state_dict
