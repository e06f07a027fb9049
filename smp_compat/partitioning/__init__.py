"""Partitioning: where each module with state lives in the pipeline (manual contexts, tracing, auto plan).

``manual.py`` is ``smp.partition`` / ``smp.set_partition``, ``trace.py`` records a forward pass, ``auto.py``
cuts the traced module tree into stages, ``plan.py`` is the plan both produce. May import the core only;
the runtime applies the plan.
"""

from __future__ import annotations

from smp_compat.partitioning.auto import auto_plan
from smp_compat.partitioning.manual import clear_records, manual_plan, partition, set_partition
from smp_compat.partitioning.plan import PartitionPlan, shared_groups, shared_tensors, state_modules, validate_plan
from smp_compat.partitioning.trace import TraceResult, trace_modules

__all__ = [
    "PartitionPlan",
    "TraceResult",
    "auto_plan",
    "clear_records",
    "manual_plan",
    "partition",
    "set_partition",
    "shared_groups",
    "shared_tensors",
    "state_modules",
    "trace_modules",
    "validate_plan",
]
