"""``smp-compat check``, continued: CUDA calls in the script itself that fail on a machine without a GPU.

smp_compat runs an SMP script on CPU, but the script's own ``torch.cuda.set_device(smp.local_rank())`` (in
AWS's examples, unguarded) raises there before the first step. A hint names each such call that no
``if torch.cuda.is_available():`` (or ``device_count()``) encloses.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

__all__ = ["unguarded_cuda_calls"]

_GUARDS = ("is_available", "device_count")


def unguarded_cuda_calls(tree: ast.Module) -> list[str]:
    """One hint per ``torch.cuda.set_device(...)`` call outside a CUDA-availability test."""
    return [
        f"line {node.lineno}: torch.cuda.set_device(...) fails on a machine without a GPU; put it under "
        "`if torch.cuda.is_available():` to run the script on CPU too."
        for node in _calls_outside_guards(tree, guarded=False)
    ]


def _calls_outside_guards(node: ast.AST, guarded: bool) -> Iterator[ast.Call]:
    """Either branch of a CUDA test counts as guarded (``if not torch.cuda.is_available(): ... else: ...``)."""
    if isinstance(node, ast.Call) and not guarded and _is_set_device(node.func):
        yield node
    if isinstance(node, (ast.If, ast.IfExp)) and _tests_cuda(node.test):
        guarded = True
    for child in ast.iter_child_nodes(node):
        yield from _calls_outside_guards(child, guarded)


def _is_set_device(func: ast.AST) -> bool:
    """``torch.cuda.set_device`` or ``cuda.set_device`` (``from torch import cuda``)."""
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "set_device"
        and isinstance(func.value, (ast.Attribute, ast.Name))
        and (func.value.attr if isinstance(func.value, ast.Attribute) else func.value.id) == "cuda"
    )


def _tests_cuda(test: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in _GUARDS for n in ast.walk(test))
