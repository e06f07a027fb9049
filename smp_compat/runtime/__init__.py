"""The eager pipeline runtime (pp > 1): message transport, cooperative tasks, remote module calls, the engine.

``engine.py`` partitions the model on the first step (``planning.py``, ``placement.py``) and drives the
step's microbatches (``microbatches.py``); ``dispatch.py`` turns a module call into a local or remote one,
``remote.py`` carries autograd across ranks, ``serving.py`` is the owner side of a call, ``tasks.py``
takes turns, ``transport.py`` moves the bytes. May import the core and the feature folders (stepping,
partitioning, memory, ...); the public wrappers (``model.py``) import it, never the other way round.
"""

from __future__ import annotations

__all__: list[str] = []
