"""``torch.sagemaker.moe.moe_layer.MoELayer``: SMP's expert block. AWS's scripts only ask ``isinstance`` of it (fp8
activation checkpointing with MoE); no model holds one until expert parallelism lands (issue 35)."""

from __future__ import annotations

from smp_compat.v2.nn.refused import RefusedModule

__all__ = ["MoELayer"]


class MoELayer(RefusedModule):
    _why = "mixture-of-experts layers and expert parallelism are not supported yet (issue 35)."
