"""The eager pipeline runtime: message transport, cooperative tasks, remote module calls, the engine."""

from __future__ import annotations

__all__: list[str] = []
