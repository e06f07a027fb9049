"""``torch.sagemaker.distributed.checkpoint``: SMP v2's DCP front end (async save, load, local state dicts).

Importing it puts ``smp_compat.v2.dcp_compat``'s pass-through wrappers on torch's DCP functions.
"""

from smp_compat.v2 import dcp_compat as _dcp_compat

_dcp_compat.install()
