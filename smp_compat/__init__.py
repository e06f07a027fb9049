"""smp_compat: SageMaker model parallelism v1 (``smdistributed.modelparallel.torch``) on plain PyTorch.

Use it as ``import smp_compat as smp``, or run an unmodified SMP script through ``smp-compat run``.
"""

from __future__ import annotations

import os as _os
import warnings as _warnings

# torch without numpy warns at import in every process; nothing here needs numpy. Only that message.
_warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from smp_compat.host.torch_floor import check_torch as _check_torch

_check_torch()  # an older torch: one error naming what it lacks, not an ImportError deep inside

from smp_compat import amp
from smp_compat import nn
from smp_compat import patches as patches
from smp_compat.patches import checkpoint as _patches_checkpoint  # noqa: F401 - smp.patches.checkpoint
from smp_compat.memory.activation_checkpointing import checkpoint, checkpoint_sequential, set_activation_checkpointing
from smp_compat.memory.model_creation import delay_param_initialization, model_creation
from smp_compat.comm import (
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    RDP_GROUP,
    TP_GROUP,
    WORLD,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    gather,
    mp_barrier,
    pp_barrier,
    rdp_barrier,
    recv_from,
    send,
    tp_barrier,
)
from smp_compat.errors import (
    DDPNotEnabledError,
    FwdExecutionNotInStepFnError,
    MultipleDistributedModelError,
    SMPConfigError,
    SMPError,
    SMPUnsupportedError,
    TensorSplitError,
)
from smp_compat.model import DistributedModel
from smp_compat.nn.registry import set_tensor_parallelism, tensor_parallelism, tp_register, tp_register_with_module
from smp_compat.optimizer import DistributedOptimizer
from smp_compat.partitioning import partition, set_partition
from smp_compat.ranks import (
    dp_rank,
    dp_size,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_process_group,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    num_microbatches,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    size,
    tp_rank,
    tp_size,
)
from smp_compat.checkpoints.folders import save_checkpoint
from smp_compat.checkpoints.resume import resume_from_checkpoint
from smp_compat.checkpoints.serialization import load, save
from smp_compat.globalstate import init, is_initialized, reset, shutdown, state
from smp_compat.stepping.step import is_tracing, step
from smp_compat.stepping.output import StepOutput
from smp_compat.sdp.wrap import register_parameter

__version__ = "0.1.0"

__all__ = [
    "init", "is_initialized", "reset", "shutdown", "state", "is_tracing", "num_microbatches",
    "step", "StepOutput", "DistributedModel", "DistributedOptimizer", "partition", "set_partition",
    "rank", "size", "local_rank", "local_size", "pp_rank", "pp_size", "tp_rank", "tp_size",
    "dp_rank", "dp_size", "rdp_rank", "rdp_size", "mp_rank", "mp_size",
    "get_pp_group", "get_dp_group", "get_mp_group", "get_tp_group", "get_rdp_group",
    "get_world_process_group", "get_pp_process_group", "get_dp_process_group",
    "get_mp_process_group", "get_tp_process_group", "get_rdp_process_group",
    "CommGroup", "RankType", "WORLD", "PP_GROUP", "TP_GROUP", "RDP_GROUP", "DP_GROUP", "MP_GROUP",
    "broadcast", "send", "recv_from", "allgather", "gather", "barrier",
    "dp_barrier", "mp_barrier", "pp_barrier", "tp_barrier", "rdp_barrier",
    "save", "load", "save_checkpoint", "resume_from_checkpoint",
    "amp", "patches", "set_activation_checkpointing", "checkpoint", "checkpoint_sequential",
    "model_creation", "delay_param_initialization", "register_parameter", "nn",
    "tensor_parallelism", "set_tensor_parallelism", "tp_register", "tp_register_with_module",
    "SMPError", "SMPConfigError", "SMPUnsupportedError", "TensorSplitError",
    "FwdExecutionNotInStepFnError", "MultipleDistributedModelError", "DDPNotEnabledError",
]  # fmt: skip


def _auto_init() -> None:
    """SMP initialized itself on import inside SageMaker (config and MPI variables both set)."""
    env = _os.environ
    if env.get("SMP_MANUAL_INIT") == "1":
        return
    if "SM_HP_MP_PARAMETERS" in env and "OMPI_COMM_WORLD_RANK" in env:
        init()


_auto_init()

from smp_compat.trainer import install as _install_trainer_fixes

_install_trainer_fixes()  # Hugging Face's Trainer in an SMP job: smp_compat/trainer (nothing outside SMP jobs)
