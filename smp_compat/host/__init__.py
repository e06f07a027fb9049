"""What smp_compat needs from the machine it runs on, checked or tuned before any training code runs.

``torch_floor.py`` checks at ``import smp_compat`` that this torch has every API the package uses (one
error naming what is missing, not an AttributeError inside a step); ``heap.py`` tunes glibc's heap so a CPU
pipeline's threads keep freed memory (applied in ``smp.init``); ``cuda_on_cpu.py`` answers a script's own
``torch.cuda`` calls on a machine without CUDA (armed by the launcher's ``sitecustomize``, standard library
only until torch is imported). Part of the core: imports only ``smp_compat.errors``.
"""

from __future__ import annotations

__all__: list[str] = []
