"""smp_compat's stand-in for megatron-core, served as ``megatron`` only where it is not installed: just
``megatron.core.dist_checkpointing.mapping.CheckpointingException``.

AWS's checkpoints.py imports that exception together with SMP's async save and turns both async checkpoint
types off when the import fails; the async save here is smp_compat's (DCP), which needs nothing else from
megatron-core, so requiring the package for one exception class would only block those checkpoint types.
"""

from __future__ import annotations

from smp_compat.v2.standins import absent_names, announce


__all__: list[str] = []

announce("megatron", "megatron-core is not installed: using smp_compat's stand-in for its checkpoint exception.")

__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
