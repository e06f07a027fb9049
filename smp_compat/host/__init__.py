"""What smp_compat needs from the machine it runs on, checked or tuned before any training code runs.

``torch_floor.py`` checks at ``import smp_compat`` that this torch has every API the package uses (one
error naming what is missing, not an AttributeError inside a step); ``heap.py`` tunes glibc's heap so a CPU
pipeline's threads keep freed memory (applied in ``smp.init``). Part of the core: imports only
``smp_compat.errors``, and nothing when imported itself, so ``smp_compat.host.heap`` loads without torch.
"""

from __future__ import annotations

__all__: list[str] = []
