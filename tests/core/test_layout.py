"""The package's shape holds: imports go one way between layers, and every public SMP name still resolves.

Layers, lowest first (docs/design.md has the map). A module may import from a lower layer or from its own
folder; anything else only under ``TYPE_CHECKING`` or inside a function (where a cycle is unavoidable).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import smp_compat
from smp_compat import shim
from smp_compat.cli.support import API, Status

__all__: list[str] = []

PACKAGE = Path(smp_compat.__file__).resolve().parent

LAYERS: dict[str, int] = {
    "errors": 0,
    "config": 1, "host": 1, "module_manager": 1, "launch": 1, "topology": 1, "failure": 1, "timeline": 1,
    "globalstate": 2,
    "comm": 3, "ranks": 3,
    "stepping": 4, "partitioning": 4, "precision": 4, "checkpoints": 4,
    "memory": 5,
    "runtime": 6, "nn": 6, "sdp": 6, "v2": 6,
    "model": 7, "optimizer": 7, "amp": 7, "patches": 7, "trainer": 7,
    "__init__": 8, "shim": 8, "testing": 8,
    "selftest": 9,
    "cli": 10,
}  # fmt: skip
"""Top-level module or folder -> layer. A new folder gets a line here (and one in docs/design.md's map)."""


def _unit(path: Path) -> str:
    """The top-level module or folder a file belongs to (``__init__`` for the package's own __init__.py)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _module_level_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """smp_compat modules imported when the module is imported: not in functions, not under TYPE_CHECKING."""
    found: list[tuple[str, int]] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("smp_compat"):
                names = [node.module] if node.module != "smp_compat" else [f"smp_compat.{a.name}" for a in node.names]
                found.extend((name, node.lineno) for name in names)
            elif isinstance(node, ast.Import):
                found.extend((a.name, node.lineno) for a in node.names if a.name.startswith("smp_compat"))

    visit(tree.body)
    return found


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "site" not in p.relative_to(PACKAGE).parts)


def test_every_top_level_module_and_folder_has_a_layer() -> None:
    units = {_unit(p) for p in _sources()}
    assert not units - set(LAYERS), f"place these in LAYERS (and docs/design.md): {sorted(units - set(LAYERS))}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    unit = _unit(path)
    wrong = []
    for name, line in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
        parts = name.split(".")
        target = parts[1] if len(parts) > 1 else "__init__"
        if target != unit and LAYERS.get(target, 99) >= LAYERS[unit]:
            wrong.append(f"line {line}: {name} (layer {LAYERS.get(target)}) from layer {LAYERS[unit]}")
    assert not wrong, f"{path.relative_to(PACKAGE)} imports upward or sideways: {wrong}"


V1_FEATURES = frozenset({
    "globalstate", "comm", "ranks", "stepping", "partitioning", "precision", "memory", "runtime", "nn", "sdp",
    "model", "optimizer", "amp", "patches", "topology",
})  # fmt: skip
"""SMP v1's features: smp_compat/v2 (SMP v2) never imports them and they never import it, even inside a function;
both may use the shared core (errors, config's sources, launch, failure, checkpoints' signing, ...)."""


def _all_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """Every smp_compat module a file imports, wherever the import statement is."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("smp_compat"):
            names = [node.module] if node.module != "smp_compat" else [f"smp_compat.{a.name}" for a in node.names]
            found.extend((name, node.lineno) for name in names)
        elif isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name.startswith("smp_compat"))
    return found


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_smp_v1_and_v2_features_never_import_each_other(path: Path) -> None:
    unit = _unit(path)
    if unit != "v2" and unit not in V1_FEATURES:
        return
    forbidden = V1_FEATURES | {"__init__"} if unit == "v2" else {"v2"}
    wrong = [f"line {line}: {name}" for name, line in _all_imports(ast.parse(path.read_text(encoding="utf-8")))
             if (name.split(".")[1] if name.count(".") else "__init__") in forbidden]  # fmt: skip
    assert not wrong, f"{path.relative_to(PACKAGE)} crosses between SMP v1 and v2: {wrong}"


def test_folders_say_what_lives_there_and_what_they_may_import() -> None:
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc, f"{init.relative_to(PACKAGE)} has no module docstring"


def _public_smp_names() -> list[str]:
    """Every SMP name the registry marks as (partly) supported (``amp.GradScaler`` too), and ``smp_compat.__all__``."""
    registered = {name for name, entry in API.items() if entry.status is not Status.UNSUPPORTED and not entry.group}
    return sorted(registered | set(smp_compat.__all__))


def _resolve(root: object, dotted: str) -> object:
    value = root
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.usefixtures("installed_shim")
@pytest.mark.parametrize("name", _public_smp_names())
def test_public_smp_name_resolves_through_smp_compat_and_the_shim(name: str) -> None:
    smp = importlib.import_module("smdistributed.modelparallel.torch")
    assert smp is smp_compat
    ours = _resolve(smp_compat, name)
    assert _resolve(smp, name) is ours
    module, _, attr = name.rpartition(".")
    if module:  # a name in an SMP submodule: `from smdistributed.modelparallel.torch.amp import GradScaler`
        alias = importlib.import_module(f"smdistributed.modelparallel.torch.{module}")
        assert getattr(alias, attr) is ours


@pytest.fixture
def installed_shim() -> object:
    shim.install()
    yield
    shim.uninstall()
