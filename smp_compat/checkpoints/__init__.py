"""Saved training state: ``smp.save`` / ``smp.load`` files, model and optimizer state dicts across pipeline
ranks, ``smp.save_checkpoint`` folders, and converters to and from plain PyTorch.

``serialization.py`` writes and reads single files (atomically through ``atomic.py``, safely); ``state_dicts.py`` (model) and
``optimizer_state.py`` gather and load state dicts, ``deferred_loads.py`` holds loads that wait for
partitioning; ``folders.py`` writes SMP's checkpoint folders and ``resume.py`` reads them back;
``convert.py`` works offline on saved files. May import the core only; never the runtime, the public
wrappers (model, optimizer) or the CLI.
(Activation checkpointing is a memory feature: see ``smp_compat.memory``.)
"""

from __future__ import annotations

__all__: list[str] = []
