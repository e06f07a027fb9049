"""Which SMP a script is written for, read from its imports: for a launch with no config (``smp-compat run``
without ``--config``, an estimator without ``distribution``, no ``SM_HP_MP_PARAMETERS``).

With no config the launch used to assume SMP v1 (v1's layout in ``--dry-run``, ``sagemaker_mpi_enabled``),
also for an SMP v2 script. AWS's v2 entry points import ``torch.sagemaker`` one module down
(``train_external.py`` imports ``train_lib``, which imports it), so the script's own modules beside it are
read too (not executed), breadth first, up to ``_MAX_FILES``.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ScriptImports", "script_imports"]

_V2 = "torch.sagemaker"
_V1 = "smdistributed.modelparallel"
_MAX_FILES = 64


@dataclass(frozen=True)
class ScriptImports:
    """Where the script (or a module of its own) first imports each SMP: ``file:line``, or None."""

    v2: str | None
    v1: str | None


def script_imports(script: Path) -> ScriptImports:
    """Read ``script`` and the modules it imports from its own folder for ``torch.sagemaker`` / SMP v1 imports."""
    found: dict[str, str] = {}
    queue, seen = deque([script.resolve()]), {script.resolve()}
    while queue and len(seen) <= _MAX_FILES:
        path = queue.popleft()
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            for name in _imported(node):
                for smp in (_V2, _V1):
                    if (name == smp or name.startswith(smp + ".")) and smp not in found:
                        found[smp] = f"{path.name}:{node.lineno}"
                local = _local_module(script.resolve().parent, name)
                if local is not None and local not in seen:
                    seen.add(local)
                    queue.append(local)
    return ScriptImports(found.get(_V2), found.get(_V1))


def _imported(node: ast.AST) -> list[str]:
    """The dotted names an import statement brings in (``from torch import sagemaker`` -> ``torch.sagemaker``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return []


def _local_module(folder: Path, name: str) -> Path | None:
    """``train_lib`` -> ``folder/train_lib.py`` (or a package's ``__init__.py``) when the script ships it."""
    parts = name.split(".")
    for candidate in (folder.joinpath(*parts).with_suffix(".py"), folder.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate.resolve()
    return None
