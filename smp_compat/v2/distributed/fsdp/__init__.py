"""``torch.sagemaker.distributed.fsdp``: SMP 2.0 - 2.3's FSDP helpers that AWS's HyperPod scripts import
(awsome-distributed-training ``17.SM-modelparallelv2`` and ``11.modelparallel``): ``checkpoint`` (the model
checkpoint helpers of ``--checkpoint_type use_pg_with_util``) and ``fully_sharded_data_parallel``."""

from __future__ import annotations

__all__: list[str] = []
