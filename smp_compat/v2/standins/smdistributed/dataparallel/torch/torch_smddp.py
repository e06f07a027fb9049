"""Stand-in for ``smdistributed.dataparallel.torch.torch_smddp``, which scripts import to get the ``smddp``
backend: here ``dist.init_process_group("smddp")`` builds nccl on GPUs and gloo on CPU (announced once)."""

from __future__ import annotations

from smp_compat.v2.standins import absent_names
from smp_compat.v2.standins.backend import install_backend_mapping

__all__: list[str] = []

install_backend_mapping()

__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
