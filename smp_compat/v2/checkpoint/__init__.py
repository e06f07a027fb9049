"""``torch.sagemaker.checkpoint``: helpers the v2 scripts use around their checkpoint folders.

Importing it (the scripts' checkpoints.py does, before ``from torch.distributed import checkpoint``) also puts
the pass-through wrappers of ``smp_compat.v2.dcp_compat`` on torch's DCP functions; they act only after
``tsm.init()``.
"""

from smp_compat.v2 import dcp_compat as _dcp_compat

_dcp_compat.install()
