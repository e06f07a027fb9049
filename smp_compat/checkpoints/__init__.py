"""Saved training state: ``smp.save`` / ``smp.load`` files, model and optimizer state dicts across pipeline
ranks, ``smp.save_checkpoint`` folders, and converters to and from plain PyTorch.

``serialization.py`` writes and reads single files (atomically, safely); ``state_dicts.py`` gathers and
loads state dicts; ``folders.py`` is SMP's checkpoint folder layout; ``convert.py`` works offline on saved
files. May import the core and ``stepping``; never the runtime, the public wrappers or the CLI.
(Activation checkpointing is a memory feature: see ``smp_compat.memory``.)
"""

from __future__ import annotations

__all__: list[str] = []
