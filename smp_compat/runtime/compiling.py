"""``torch.compile`` with a pipeline: compile what runs on this rank, never the pipeline transport.

``smp.DistributedModel(torch.compile(model))`` hands us an ``OptimizedModule``. Partitioning works on
the module inside it (``_orig_mod``), so module and parameter names are the model's own. The user's
compile settings are kept and applied on every rank to what that rank executes: the root forward on
pp_rank 0 (through the user's ``OptimizedModule`` itself) and each module call a rank serves.
Calls into another rank run outside Dynamo (``torch.compiler.disable``), so a compiled graph breaks
at each partition boundary and never traces the process groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from smp_compat.errors import SMPUnsupportedError

__all__ = ["Compiler", "unwrap_compiled", "outside_compiled"]

log = logging.getLogger("smp_compat")


def _optimized_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a PyTorch without Dynamo: nothing can be compiled
        return None
    return OptimizedModule


class Compiler:
    """The user's ``torch.compile`` settings (backend, mode, options), applicable to any function."""

    def __init__(self, compiled: nn.Module) -> None:
        self.compiled = compiled  # the user's OptimizedModule: its forward is the compiled root forward
        self._context = compiled.dynamo_ctx

    def check_pipeline(self) -> None:
        """At pp > 1: refuse ``fullgraph=True`` (calls into other stages are graph breaks), allow segmented
        backwards."""
        if getattr(self._context, "fullgraph", False):
            raise SMPUnsupportedError(
                "torch.compile(..., fullgraph=True) with pipeline_parallel_degree > 1: a call into a module on "
                "another pipeline rank is a graph break, so no single graph can hold the forward. Compile with "
                "fullgraph=False (the default); each rank still compiles what it runs."
            )
        self._allow_partial_backwards()

    def _allow_partial_backwards(self) -> None:
        """The pipeline runs backward in segments over one kept graph (``retain_graph=True``), which
        AOTAutograd refuses for graphs compiled with donated buffers: compile without them."""
        import torch._functorch.config as functorch_config

        if functorch_config.donated_buffer:
            log.debug("torch.compile at pp > 1: torch._functorch.config.donated_buffer set to False")
            functorch_config.donated_buffer = False

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` compiled as ``torch.compile`` would have compiled it. ``fn`` must live outside torch's own
        files, whose frames Dynamo skips (see ``OptimizedModule._initialize``)."""
        return self._context(fn)


def unwrap_compiled(module: nn.Module) -> tuple[nn.Module, Compiler | None]:
    """``(the module to partition, its compiler)``: an ``OptimizedModule`` gives its ``_orig_mod``."""
    optimized = _optimized_module_type()
    if optimized is not None and isinstance(module, optimized):
        return module._orig_mod, Compiler(module)
    return module, None


def outside_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` eagerly even when called from compiled code: a graph break, not a trace into it."""
    return torch.compiler.disable(fn, recursive=True)
