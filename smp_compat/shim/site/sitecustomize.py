"""Runs at the start of every Python process whose PYTHONPATH holds this folder (``smp-compat run``'s workers,
and launches with ``smp-compat env``'s environment): installs smp_compat's SMP v2 import hook, so that
``import torch.sagemaker`` (and Transformer Engine, megatron-core's exception, SMDDP where absent) resolve,
and the hook that fixes Hugging Face's Trainer in an SMP job as transformers loads (smp_compat/trainer).

Cheap and inert: it loads two standard-library-only files by path (no torch, no smp_compat import); the v2
hook acts only when a script imports one of those names and no installed package provides it, the Trainer
hook only when ``transformers.training_args`` or ``transformers.trainer`` loads in an SMP job. Python runs
only the first ``sitecustomize`` on ``sys.path``, so this one then runs the next one, if any.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_FINDER = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "v2", "finder.py")
_TRAINER_HOOK = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "trainer", "hook.py")


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


def _install_trainer_hook() -> None:
    """smp_compat's fixes to Hugging Face's Trainer, applied as transformers loads (smp_compat/trainer)."""
    if os.path.isfile(_TRAINER_HOOK):
        _exec_file("_smp_compat_trainer_hook", _TRAINER_HOOK)
        sys.modules["_smp_compat_trainer_hook"].install_hook()


def _run_next_sitecustomize() -> None:
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    after = entries[entries.index(_HERE) + 1 :] if _HERE in entries else []
    for entry in after:
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            _exec_file("_smp_compat_next_sitecustomize", candidate)
            return


_install_v2_finder()
_install_trainer_hook()
_run_next_sitecustomize()
