"""Runs at the start of every Python process whose PYTHONPATH holds this folder (``smp-compat run``'s workers,
and launches with ``smp-compat env``'s environment): installs smp_compat's SMP v2 import hook, so that
``import torch.sagemaker`` (and Transformer Engine, megatron-core's exception, SMDDP where absent) resolve,
the hook that fixes Hugging Face's Trainer in an SMP job as transformers loads (smp_compat/trainer), and the
CPU mode for the script's own ``torch.cuda`` calls on a machine without CUDA (smp_compat/host/cuda_on_cpu.py).

Cheap and inert: it loads three standard-library-only files by path (no torch, no smp_compat import); the v2
hook acts only when a script imports one of those names and no installed package provides it, the Trainer
hook only when ``transformers.training_args`` or ``transformers.trainer`` loads in an SMP job, the CPU mode
only once torch is imported and finds no CUDA device. Python runs
only the first ``sitecustomize`` on ``sys.path``, so this one then runs the next one, if any.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))
_FINDER = os.path.join(_PACKAGE, "v2", "finder.py")
_HOOKS = (  # per hook: its module's name once loaded, its file in smp_compat, the function that installs it
    ("_smp_compat_cuda_on_cpu", ("host", "cuda_on_cpu.py"), "install_on_torch_import"),  # torch.cuda on a CPU
    ("_smp_compat_trainer_hook", ("trainer", "hook.py"), "install_hook"),  # Hugging Face's Trainer in an SMP job
)


def _exec_file(name: str, path: str) -> None:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _install_v2_finder() -> None:
    if os.path.isfile(_FINDER):
        _exec_file("_smp_compat_v2_finder", _FINDER)
        sys.modules["_smp_compat_v2_finder"].install_finder()


def _install_hooks() -> None:
    """The CPU mode for the script's torch.cuda calls (armed for when torch is imported) and the Trainer's
    fixes (applied as transformers loads), each loaded by path from smp_compat."""
    for name, parts, install in _HOOKS:
        path = os.path.join(_PACKAGE, *parts)
        if os.path.isfile(path):
            _exec_file(name, path)
            getattr(sys.modules[name], install)()


def _run_next_sitecustomize() -> None:
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    after = entries[entries.index(_HERE) + 1 :] if _HERE in entries else []
    for entry in after:
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            _exec_file("_smp_compat_next_sitecustomize", candidate)
            return


_install_v2_finder()
_install_hooks()
_run_next_sitecustomize()
