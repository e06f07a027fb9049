"""``torch.sagemaker.context_parallel.utils``: SMP's set-up of Transformer Engine's context parallelism.

``setup_transformer_engine_cp_groups(model, cp_global_ranks, cp_process_group)`` hands the cp group to every
Transformer Engine attention module of the model. HyperPod's training adapter imports it at module top and calls
it only when the model holds TE attention modules, which need the real Transformer Engine (a CUDA build). Here
context parallelism is smp_compat's own (``tsm.transform(model, cp_comm_type=...)``), so a call is refused by name.
"""

from __future__ import annotations

from typing import Any, NoReturn

from smp_compat.errors import SMPUnsupportedError

__all__ = ["setup_transformer_engine_cp_groups"]


def setup_transformer_engine_cp_groups(model: Any, cp_global_ranks: Any, cp_process_group: Any,
                                       *args: Any, **kwargs: Any) -> NoReturn:  # fmt: skip
    """Importable; calling it raises SMPUnsupportedError (Transformer Engine's context parallelism needs TE)."""
    raise SMPUnsupportedError(
        "torch.sagemaker.context_parallel.utils.setup_transformer_engine_cp_groups is not supported by smp_compat: "
        "it configures Transformer Engine's attention modules, which need the real Transformer Engine (a CUDA "
        "build). Build the model with the Hugging Face attention and let tsm.transform(model, cp_comm_type='p2p' or "
        "'all_gather') apply smp_compat's context parallelism."
    )
