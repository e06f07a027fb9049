"""``python -m smp_compat.selftest [options]``: one rank of the selftest (``smp-compat selftest`` launches it)."""

from __future__ import annotations

import sys

from smp_compat.selftest import main

sys.exit(main())
