"""Bootstrap: the first import of ``smdistributed.modelparallel.torch`` turns this name into smp_compat.

It installs smp_compat's import hook (so submodules map to smp_compat's, never a second copy) and
replaces itself in ``sys.modules`` with the smp_compat package, which the import system then returns.
"""

from __future__ import annotations

import sys

try:
    import smp_compat  # runs SMP's auto-init rule (SM_HP_MP_PARAMETERS + OMPI_COMM_WORLD_RANK), as SMP's import did
except ModuleNotFoundError as _exc:  # another Python than smp_compat's: say so (the sitecustomize's finder words it)
    _finder = sys.modules.get("_smp_compat_v2_finder")
    if _exc.name != "smp_compat" or _finder is None:
        raise
    raise ModuleNotFoundError(_finder.missing_smp_compat(__name__), name=__name__) from None
from smp_compat.shim.finder import install_finder  # noqa: E402 - after the check above

__all__: list[str] = []

install_finder()
sys.modules[__name__] = smp_compat
