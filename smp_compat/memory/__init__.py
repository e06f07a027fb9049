"""Features that trade compute or communication for memory: activation checkpointing
(``activation_checkpointing.py``), delayed parameter initialization (``model_creation.py``) and
optimizer-state sharding over data parallelism (``optimizer_sharding.py``).

May import the core, ``partitioning`` and ``stepping``; never the runtime, the public wrappers or the CLI.
"""

from __future__ import annotations

__all__: list[str] = []
