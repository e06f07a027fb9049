"""``torch.sagemaker.moe.moe_config.MoEConfig``: SMP's mixture-of-experts options, with SMP's defaults.

AWS's scripts build one and pass it as ``transform(model, config=...)`` to run Mixtral with SMP's MoE layer and
expert parallelism (smp_compat/v2/moe/convert.py). ``global_token_shuffle`` and ``moe_all_to_all_dispatcher``
are accepted; tokens always travel by all-to-all over the ep group. ``random_seed`` and
``use_cpu_initialization`` change nothing here (the experts are sliced from the model as built).
"""

from __future__ import annotations

from dataclasses import dataclass

from smp_compat.errors import SMPConfigError

__all__ = ["MoEConfig", "LOAD_BALANCING"]

LOAD_BALANCING = ("sinkhorn", "balanced", "aux_loss", "none")


@dataclass
class MoEConfig:
    """SMP's MoE settings: use SMP's MoE layer, router load balancing and its loss weights, token dispatch."""

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001
    use_cpu_initialization: bool = False

    def __post_init__(self) -> None:
        if self.moe_load_balancing not in LOAD_BALANCING:
            raise SMPConfigError(
                f"MoEConfig: moe_load_balancing must be one of {LOAD_BALANCING}; got {self.moe_load_balancing!r}"
            )
