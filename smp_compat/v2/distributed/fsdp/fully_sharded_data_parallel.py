"""``torch.sagemaker.distributed.fsdp.fully_sharded_data_parallel``: the FSDP hook SMP 2.0 exported for its
tensor-parallel layers.

``register_tp_processing_pre_comm_hook`` let SMP's own tensor-parallel modules prepare their pieces before FSDP's
communication. AWS's 2023 HyperPod script (``11.modelparallel/train_lib.py``) imports it at module top and never
calls it. Here tensor parallelism is DTensor over ``device_mesh["tp"]`` under FSDP2, which communicates the
tensor-parallel pieces itself, so there is nothing such a hook could do: a call is refused by name rather than
accepted and ignored.
"""

from __future__ import annotations

from typing import Any, NoReturn

from smp_compat.errors import SMPUnsupportedError

__all__ = ["register_tp_processing_pre_comm_hook"]


def register_tp_processing_pre_comm_hook(*args: Any, **kwargs: Any) -> NoReturn:
    """Importable; calling it raises SMPUnsupportedError (DTensor tensor parallelism needs no such hook)."""
    raise SMPUnsupportedError(
        "torch.sagemaker.distributed.fsdp.fully_sharded_data_parallel.register_tp_processing_pre_comm_hook is not "
        "supported by smp_compat: its tensor parallelism is DTensor under FSDP2, which gathers and reduces the "
        "tensor-parallel pieces itself, so no pre-communication hook is needed. Remove the call."
    )
