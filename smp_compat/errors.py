"""Exception types raised by smp_compat.

Every user error is one of these: each subclasses the builtin a user would expect, so
``except ValueError`` keeps working, and each message says what was wrong, the value seen,
and what to do.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SMPError",
    "SMPConfigError",
    "SMPNotInitializedError",
    "SMPUnsupportedError",
    "TensorSplitError",
    "StepUsageError",
    "FwdExecutionNotInStepFnError",
    "MultipleDistributedModelError",
    "DistributedModelNotCreatedError",
    "DDPNotEnabledError",
    "PartitionError",
    "CheckpointError",
    "RemoteError",
    "SMPTimeoutError",
    "ParameterOwnershipError",
    "StandinMissingError",
]


class SMPError(Exception):
    """Base class of every error smp_compat raises on purpose."""


class SMPConfigError(SMPError, ValueError):
    """The configuration is invalid: unknown key, wrong type, out of bounds, or inconsistent."""


class SMPNotInitializedError(SMPError, RuntimeError):
    """An API that needs ``smp.init()`` was called before it."""


class SMPUnsupportedError(SMPError, NotImplementedError):
    """A feature of SMP v1 that smp_compat does not implement (yet); the message names it."""


class TensorSplitError(SMPError, ValueError):
    """A step input cannot be split evenly into microbatches."""


class StepUsageError(SMPError, RuntimeError):
    """An API was used in the wrong place relative to ``@smp.step`` (e.g. backward outside a step)."""


class FwdExecutionNotInStepFnError(StepUsageError):
    """The DistributedModel was called outside an ``@smp.step`` function where that is not allowed."""


class MultipleDistributedModelError(SMPError, RuntimeError):
    """A second DistributedModel was created in one process."""


class DistributedModelNotCreatedError(SMPError, RuntimeError):
    """An API that needs the DistributedModel (e.g. DistributedOptimizer) was called before it exists."""


class DDPNotEnabledError(SMPError, RuntimeError):
    """A torch.distributed process group was asked for while the config has ``ddp: False``."""


class PartitionError(SMPError, ValueError):
    """A manual or automatic partition is invalid (index out of range, shared parameters split...)."""


class CheckpointError(SMPError, RuntimeError):
    """A checkpoint cannot be written or read (missing parts, degree mismatch, bad tag...)."""


class RemoteError(SMPError, RuntimeError):
    """Another rank of the job failed; the message carries its rank and original error.

    ``root`` (a ``smp_compat.failure.RootCause``) names the original exception, rank and module.
    """

    def __init__(self, message: str, root: Any = None) -> None:
        super().__init__(message)
        self.root = root


class SMPTimeoutError(SMPError, TimeoutError):
    """A rank waited too long for another; the message names what it waited for."""


class ParameterOwnershipError(SMPError, RuntimeError):
    """The optimizer holds a parameter that does not belong to the DistributedModel."""


class StandinMissingError(SMPError, ImportError):
    """A name smp_compat's stand-in for an absent package (Transformer Engine, megatron-core, SMDDP) lacks.

    An ImportError, as if the package were not installed, so the ``except ImportError`` guards libraries put
    around optional GPU packages take their "not installed" branch.
    """

