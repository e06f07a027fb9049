"""Objects that are not data: safe loading must refuse them unless the file is signed or trusted."""

from __future__ import annotations

from typing import Any

__all__ = ["Opaque", "opaque_function"]


class Opaque:
    """A script's own class that pickles through its own ``__reduce__`` (a callable of its choosing)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (Opaque, (self.name,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.name == self.name


def opaque_function() -> None:
    """A function: pickled by name, called by nothing, still refused."""
