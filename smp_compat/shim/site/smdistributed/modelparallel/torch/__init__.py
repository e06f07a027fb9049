"""Bootstrap: the first import of ``smdistributed.modelparallel.torch`` turns this name into smp_compat.

It installs smp_compat's import hook (so submodules map to smp_compat's, never a second copy) and
replaces itself in ``sys.modules`` with the smp_compat package, which the import system then returns.
"""

from __future__ import annotations

import sys

import smp_compat  # runs SMP's auto-init rule (SM_HP_MP_PARAMETERS + OMPI_COMM_WORLD_RANK), as SMP's import did
from smp_compat.shim.finder import install_finder

__all__: list[str] = []

install_finder()
sys.modules[__name__] = smp_compat
