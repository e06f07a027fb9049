"""``python -m smp_compat.cli``: the same as the ``smp-compat`` console script (``smp_compat.cli:main``)."""

from __future__ import annotations

import sys

from smp_compat.cli import main

sys.exit(main())
