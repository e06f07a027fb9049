"""``smp-compat check``, continued: every ``torch.cuda`` call in the script itself, and what it does without a GPU.

AWS's SMP scripts call ``torch.cuda`` unguarded (``set_device``, ``synchronize``, ``nvtx``, ``cudart()``...).
``smp-compat run`` answers the ones its CPU mode serves (``smp_compat/host/cuda_on_cpu.py``) on a machine with
no CUDA device; some others already answer harmlessly in plain torch there; the rest raise. One hint per
call name, with its lines, says which of the three it is (a call under ``if torch.cuda.is_available():``, or
``device_count()``, is fine on CPU either way).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from smp_compat.host.cuda_on_cpu import SERVED

__all__ = ["HARMLESS", "cuda_calls"]

_GUARDS = ("is_available", "device_count")
_NOT_LISTED = ("is_available", "is_initialized")
"""The tests that guard the other calls (False without a GPU, as they should be)."""

HARMLESS: dict[str, str] = {
    "empty_cache": "does nothing",
    "memory_allocated": "0",
    "max_memory_allocated": "0",
    "memory_reserved": "0",
    "max_memory_reserved": "0",
    "memory_cached": "0",
    "max_memory_cached": "0",
    "memory_stats": "an empty dict",
    "manual_seed": "does nothing",
    "manual_seed_all": "does nothing",
    "seed": "does nothing",
    "seed_all": "does nothing",
}
"""``torch.cuda`` calls that plain torch already answers without raising on a machine without CUDA."""


def cuda_calls(tree: ast.Module) -> list[str]:
    """One hint per ``torch.cuda`` call name: its lines, and what it does on a machine without a GPU."""
    lines: dict[str, list[int]] = {}
    unguarded: dict[str, bool] = {}
    for node, guarded in _cuda_calls(tree, guarded=False):
        name = _cuda_name(node.func)
        if name is None or name in _NOT_LISTED:
            continue
        lines.setdefault(name, []).append(node.lineno)
        unguarded[name] = unguarded.get(name, False) or not guarded
    return [_hint(name, found, unguarded[name]) for name, found in sorted(lines.items(), key=lambda x: x[1][0])]


def _hint(name: str, found: list[int], unguarded: bool) -> str:
    unique = sorted(set(found))
    where = f"line {unique[0]}" if len(unique) == 1 else "lines " + ", ".join(str(n) for n in unique)
    call = f"torch.cuda.{name}()"
    if not unguarded:
        return f"{where}: {call} is only under a CUDA-availability test: fine without a GPU."
    if name in SERVED:
        return f"{where}: {call} without a GPU: served by smp-compat run's CPU mode ({SERVED[name][1]})."
    if name in HARMLESS:
        return f"{where}: {call} without a GPU: runs as it is ({HARMLESS[name]})."
    return (f"{where}: {call} fails without a GPU and the CPU mode does not serve it; put it under "
            "`if torch.cuda.is_available():` to run the script on CPU too.")  # fmt: skip


def _cuda_calls(node: ast.AST, guarded: bool) -> Iterator[tuple[ast.Call, bool]]:
    """Every call, with whether a CUDA test encloses it (either branch of ``if not torch.cuda.is_available()``)."""
    if isinstance(node, ast.Call):
        yield node, guarded
    if isinstance(node, (ast.If, ast.IfExp)) and _tests_cuda(node.test):
        guarded = True
    for child in ast.iter_child_nodes(node):
        yield from _cuda_calls(child, guarded)


def _cuda_name(func: ast.AST) -> str | None:
    """``torch.cuda.nvtx.range_push`` or ``cuda.nvtx.range_push`` (``from torch import cuda``) -> ``nvtx.range_push``."""
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or not parts:
        return None
    parts.append(func.id)
    parts.reverse()
    if parts[:2] == ["torch", "cuda"] and len(parts) > 2:
        return ".".join(parts[2:])
    if parts[0] == "cuda" and len(parts) > 1:
        return ".".join(parts[1:])
    return None


def _tests_cuda(test: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in _GUARDS for n in ast.walk(test))
