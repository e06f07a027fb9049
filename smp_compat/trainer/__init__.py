"""Hugging Face's ``Trainer`` on SMP v1: smp_compat's corrections to transformers' own SMP code path.

transformers' ``Trainer`` has an SMP v1 path (``is_sagemaker_mp_enabled()``) that SageMaker users ran on
GPUs with the real library. Where that path is broken on stock PyTorch, on a CPU, or behind accelerate's
wrappers, ``fixes.py`` corrects it (each fix is listed in docs/porting.md, "Hugging Face's Trainer"). The
fixes are installed by an import hook (``hook.py``): by ``smp-compat run``'s ``sitecustomize`` in every job it
launches, and by ``import smp_compat`` under any other launcher. They apply only in an SMP job (the
environment transformers itself tests) and only to the transformers versions they were written for.
"""

from __future__ import annotations

import sys

from smp_compat.trainer.hook import TARGETS, install_hook, patch_now

__all__ = ["install"]


def install() -> None:
    """Install the import hook, and fix the target modules that are already loaded (and finished loading)."""
    install_hook()
    for name in TARGETS:
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is not None and not getattr(spec, "_initializing", False):
            patch_now(module)
