"""Backend names this machine cannot build, mapped to ones it can: SageMaker's ``smddp`` -> nccl on GPUs, gloo on
CPU; ``nccl`` on a torch without CUDA -> gloo. Each mapping is announced once.

AWS's scripts call ``dist.init_process_group(args.distributed_backend)`` (default ``smddp``; 6 of the 9
notebooks pass ``nccl``) *before* ``tsm.init()``, so the mapping wraps ``init_process_group`` as soon as
``torch.sagemaker`` (smp_compat.v2) is imported; a real SMDDP install (its backend registered) keeps its name.
The same wrapper gives a restarted attempt's env:// rendezvous its own keys (``v2/restart_store.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from smp_compat.v2.standins import announce

__all__ = ["install_backend_mapping", "mapped_backend"]

_MARK = "_smp_compat_backend_mapping"


def mapped_backend(backend: Any) -> Any:
    """The backend to build for ``backend``: unchanged unless it is smddp (not registered) or nccl without CUDA."""
    if not isinstance(backend, str):
        return backend
    name = backend.lower()
    cuda = torch.cuda.is_available()
    if name == "smddp" and "smddp" not in dist.Backend.backend_list:
        chosen = "nccl" if cuda else "gloo"
        announce("smddp", f'backend "smddp" (SageMaker\'s SMDDP, not installed here) runs as "{chosen}".')
        return chosen
    if name == "nccl" and not cuda:
        announce("nccl", 'backend "nccl" needs CUDA, which this torch cannot use: running on "gloo" instead.')
        return "gloo"
    return backend


def install_backend_mapping() -> None:
    """Wrap ``torch.distributed.init_process_group`` once so that its backend goes through :func:`mapped_backend`
    (and a restarted attempt's rendezvous through ``restart_store.with_attempt_store``)."""
    original = dist.init_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        from smp_compat.v2.restart_store import with_attempt_store

        return original(mapped_backend(backend), *args, **with_attempt_store(args, kwargs))

    setattr(init_process_group, _MARK, True)
    dist.init_process_group = init_process_group
