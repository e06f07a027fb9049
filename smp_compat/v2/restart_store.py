"""A restarted attempt's keys for the process group an SMP v2 script makes itself, under torchrun's static
rendezvous.

AWS's v2 scripts call ``dist.init_process_group(backend)`` (env://) before ``tsm.init()``. Under torchrun's
static rendezvous every worker joins the agent's store, which keeps the keys of an attempt that died, and
stock torch adds no prefix per attempt there; a restarted rank can read a dead rank's address and fail in
``Gloo connectFullMesh ... Connection refused`` or hang (4 of 4 restarts failed on the 2-core machine). So
where ``launch.attempt_prefix`` names one (the prefix every node agrees on, docs/design.md "Restarts"), the
script's call joins the same store under it, as ``smp.init`` does for v1.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from smp_compat.launch import attempt_prefix, attempt_store

__all__ = ["with_attempt_store"]


def with_attempt_store(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``init_process_group``'s keywords, with a store under the attempt's prefix where a restarted attempt
    would otherwise rendezvous through env:// in the agent's store; unchanged everywhere else."""
    if args or kwargs.get("store") is not None or kwargs.get("init_method") not in (None, "env://"):
        return kwargs  # the script chose how to rendezvous
    prefix = attempt_prefix(os.environ)
    if prefix is None:
        return kwargs
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    timeout = kwargs.get("timeout") or dist.constants.default_pg_timeout
    store = attempt_store(prefix, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, timeout)
    rest = {k: v for k, v in kwargs.items() if k not in ("init_method", "rank", "world_size")}
    return {**rest, "store": store, "rank": rank, "world_size": world_size}
