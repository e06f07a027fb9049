"""Reading an SMP script without running it: every SMP name and config key it uses, as findings.

``smp-compat check`` (``check.py``) reports them. Every use of ``smdistributed.modelparallel.torch`` (under any import alias, ``from ... import`` names and
attribute chains such as ``smp.nn.DistributedLinear`` or ``smp.state.cfg.fp16``) and every config key (dicts
passed to ``smp.init``, ``"parameters"`` of a SageMaker distribution dict, JSON config files) is looked up
in :mod:`smp_compat.cli.support`, the registry the docs table is generated from. Literal config values go
through smp.init's own validation (``SMPConfig``'s field types; ``config.rules`` between keys when the whole
dict is literal; ``check_config.py``). Members used on the objects
SMP returns (``model.local_state_dict()``, ``optimizer.clip_master_grads``, ``loss.reduce_mean()``) are
found by :mod:`smp_compat.cli.check_members`.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from smp_compat.cli.check_config import ConfigValue, config_read, record_config_key, record_config_rules, record_mpi_key
from smp_compat.cli.check_cuda import cuda_calls
from smp_compat.cli.check_members import report_members
from smp_compat.cli.check_v2 import classify_api_v2, record_v2_key, record_v2_rules
from smp_compat.cli.findings import ERROR, FileReport
from smp_compat.cli.support import Status, lookup_api

__all__ = ["check_source"]

PKG = "smdistributed.modelparallel.torch"
PKG_V2 = "torch.sagemaker"
_V2_PARTS = PKG_V2.split(".")
_OWN_V2 = "smp_compat.v2"
_PKG_PARTS = PKG.split(".")
_PARENT_PARTS = _PKG_PARTS[:2]
_OWN_PACKAGE = "smp_compat"
_MAX_VALUE = 40


# ---------------------------------------------------------------- classification


def _classify_api(report: FileReport, parts: list[str], line: int) -> None:
    """Record the SMP name that a full dotted path (``smdistributed.modelparallel.torch.nn.X``, or SMP v2's
    ``torch.sagemaker.X``) refers to."""
    if parts[:2] == _V2_PARTS:
        classify_api_v2(report, parts[2:], line)
    elif parts[: len(_PKG_PARTS)] == _PKG_PARTS:
        rel = parts[len(_PKG_PARTS) :]
        if not rel:
            return
        if rel[:2] == ["state", "cfg"] and len(rel) >= 3:
            config_read(report, rel[2], line)
            return
        found = lookup_api(rel)
        if found is None and _own_addition(rel[0]):
            report.add("api", f"smp_compat.{rel[0]}", line, Status.SUPPORTED, "An smp_compat addition, not part of "
                       "SMP v1: import it from smp_compat.")  # fmt: skip
            return
        if found is None:
            name = f"smp.{rel[0]}"
            report.add("api", name, line, ERROR, f"{name} is not an SMP v1 API that smp_compat knows (a typo, or an "
                       "internal SMP name).", "Check the name against docs/api_support.md.")  # fmt: skip
            return
        entry, covered = found
        name = "smp." + ".".join(rel if entry.group else rel[:covered])
        report.add("api", name, line, entry.status, entry.note, entry.action)
    elif parts[:2] == ["smdistributed", "dataparallel"]:
        report.add("api", "smdistributed.dataparallel", line, Status.UNSUPPORTED, "SageMaker's data-parallel "
                   "library (SMDDP) is a different library, not provided by smp_compat.", "Use torch.distributed "
                   "(DistributedDataParallel, backend nccl), or SMP's own data parallelism (ddp: true).")  # fmt: skip
    elif parts[:2] == _PARENT_PARTS and len(parts) > 2 and parts[2] != "torch":
        name = ".".join(parts[:3])
        if parts[2] == "__version__":
            report.add("api", name, line, Status.SUPPORTED, "The SMP v1 API level smp_compat follows (1.15.0).")
        else:
            report.add("api", name, line, Status.UNSUPPORTED, "Only SMP's PyTorch API (smdistributed.modelparallel"
                       ".torch) is provided.", "Port this part to torch.")  # fmt: skip


def _own_addition(name: str) -> bool:
    """A public smp_compat module or name that SMP never had (timeline, testing): not an error."""
    if name.startswith("_"):
        return False
    return importlib.util.find_spec(f"{_OWN_PACKAGE}.{name}") is not None


# ---------------------------------------------------------------- Python sources


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None when the chain does not start at a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _smp_path(module: str) -> str | None:
    """An imported module path in SMP spelling (smp_compat counts as SMP); None when it is not SMP's."""
    if module == PKG_V2 or module.startswith(PKG_V2 + "."):
        return module
    if module == _OWN_V2 or module.startswith(_OWN_V2 + "."):
        return PKG_V2 + module[len(_OWN_V2) :]
    if module == _OWN_PACKAGE or module.startswith(_OWN_PACKAGE + "."):
        return PKG + module[len(_OWN_PACKAGE) :]
    if module == "smdistributed" or module.startswith("smdistributed."):
        return module
    return None


def _literal(node: ast.AST) -> tuple[Any, bool]:
    try:
        return ast.literal_eval(node), True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None, False


def _whole_literal(node: ast.AST) -> bool:
    """A dict display whose keys are all written out (no ``**other``): what smp.init gets is exactly this."""
    return isinstance(node, ast.Dict) and all(_const_str(key) is not None for key in node.keys)


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class _Source:
    """One parsed script: import aliases, dict-valued variables, and the walk that reports SMP uses."""

    def __init__(self, tree: ast.Module, text: str, report: FileReport, path: Path | None) -> None:
        self.tree, self.text, self.report, self.path = tree, text, report, path
        self.aliases: dict[str, str] = {}
        self.dict_vars: dict[str, list[tuple[str | None, ast.AST, int]]] = {}
        self.returns: dict[str, list[ast.AST]] = {}  # function name -> the expressions it returns
        self.seen_dicts: set[int] = set()

    # ---- pass 1: names
    def collect(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                self._import(node)
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                self._assignment(node)
            elif isinstance(node, ast.Call):
                self._update_call(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.returns.setdefault(node.name, []).extend(
                    sub.value for sub in ast.walk(node) if isinstance(sub, ast.Return) and sub.value is not None
                )

    def _import(self, node: ast.Import) -> None:
        for alias in node.names:
            path = _smp_path(alias.name)
            if path is None:
                continue
            if alias.asname:
                self.aliases[alias.asname] = path
                _classify_api(self.report, path.split("."), node.lineno)
            else:  # `import a.b.c` binds `a`
                root = alias.name.split(".")[0]
                self.aliases[root] = _smp_path(root) or root

    def _import_from(self, node: ast.ImportFrom) -> None:
        base = _smp_path(node.module or "") if node.level == 0 else None
        if base is None:
            return
        for alias in node.names:
            if alias.name == "*":
                self.report.hints.append(f"line {node.lineno}: `from {node.module} import *` hides which SMP names "
                                         "are used; import them by name to have them checked.")  # fmt: skip
                continue
            path = f"{base}.{alias.name}"
            self.aliases[alias.asname or alias.name] = path
            _classify_api(self.report, path.split("."), node.lineno)

    def _assignment(self, node: ast.Assign | ast.AnnAssign) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if node.value is None:
            return
        for target in targets:
            if isinstance(target, ast.Name):
                self.dict_vars.setdefault(target.id, []).append((None, node.value, node.lineno))
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                key = _const_str(target.slice)
                if key is not None:
                    self.dict_vars.setdefault(target.value.id, []).append((key, node.value, node.lineno))

    def _update_call(self, node: ast.Call) -> None:
        """``cfg.update({...})`` / ``cfg.update(key=value)`` add keys to the dict variable ``cfg``."""
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "update" and isinstance(func.value, ast.Name):
            entries = self.dict_vars.setdefault(func.value.id, [])
            entries.extend((None, arg, node.lineno) for arg in node.args)
            entries.extend((kw.arg, kw.value, node.lineno) for kw in node.keywords if kw.arg)

    # ---- pass 2: uses
    def walk(self) -> None:
        self._visit(self.tree)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Dict):
                self._distribution_dict(node)

    def _visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.Attribute):
            parts = _chain(node)
            if parts is not None and parts[0] in self.aliases:
                self._use(parts, node.lineno)
                return
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in self.aliases:
            self._use([node.id], node.lineno)
        elif isinstance(node, ast.Call):
            self._maybe_init(node)
        for child in ast.iter_child_nodes(node):
            self._visit(child)

    def _use(self, parts: list[str], line: int) -> None:
        _classify_api(self.report, self.aliases[parts[0]].split(".") + parts[1:], line)

    def _resolve(self, node: ast.AST) -> list[str] | None:
        parts = _chain(node)
        if parts is None or parts[0] not in self.aliases:
            return None
        return self.aliases[parts[0]].split(".") + parts[1:]

    def _maybe_init(self, node: ast.Call) -> None:
        resolved = self._resolve(node.func)
        v2 = resolved == [*_V2_PARTS, "init"]
        if resolved != [*_PKG_PARTS, "init"] and not v2:
            return
        config = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "config"), None)
        if config is None and v2:
            self.report.hints.append(
                f"line {node.lineno}: tsm.init() without an argument takes its config from the launcher "
                "(SM_HP_MP_PARAMETERS): check your estimator's distribution too, e.g. "
                "`smp-compat check train.py distribution.json`."
            )
            return
        if config is None:
            self.report.hints.append(
                f"line {node.lineno}: smp.init() without a dict takes its config from the launcher "
                "(SM_HP_MP_PARAMETERS): check your estimator's distribution too, e.g. "
                "`smp-compat check script.py distribution.json`."
            )
            return
        path = _const_str(config)
        if path is not None:
            self._config_file(path, node.lineno)
            return
        self._parameters(config, node.lineno, allow_distribution=True, v2=v2)

    def _config_file(self, path: str, line: int) -> None:
        """``smp.init("config.json")``: the file is checked too when it sits where the path points."""
        base = self.path.parent if self.path is not None else Path.cwd()
        candidate = base / path
        if candidate.is_file():
            self.report.hints.append(f"line {line}: smp.init reads {path!r}; its keys are listed under that file.")
            self.report.config_files.append(candidate)
        else:
            self.report.hints.append(f"line {line}: smp.init reads the config file {path!r}, which is not beside the "
                                     "script; pass it to `smp-compat check` to have its keys checked.")  # fmt: skip

    # ---- config dicts
    def _items(self, node: ast.AST, depth: int = 0) -> Iterator[tuple[str | None, ast.AST, int]]:
        """(key, value node, line) of a dict expression: a literal, dict(...), or a variable built up in the file."""
        if depth > 8:
            return
        if isinstance(node, ast.Dict):
            self.seen_dicts.add(id(node))
            for key, value in zip(node.keys, node.values, strict=True):
                if key is None:  # {**other}
                    yield from self._items(value, depth + 1)
                else:
                    yield _const_str(key), value, key.lineno
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.returns:
            for value in self.returns[node.func.id]:  # smp.init(script_config()): what the function returns
                yield from self._items(value, depth + 1)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            for arg in node.args:
                yield from self._items(arg, depth + 1)
            for kw in node.keywords:
                if kw.arg is None:
                    yield from self._items(kw.value, depth + 1)
                else:
                    yield kw.arg, kw.value, kw.value.lineno
        elif isinstance(node, ast.Name):
            for key, value, line in self.dict_vars.get(node.id, []):
                if key is None:
                    yield from self._items(value, depth + 1)
                else:
                    yield key, value, line

    def _parameters(self, node: ast.AST, line: int, allow_distribution: bool = False, v2: bool = False) -> None:
        """Report the keys of an SMP parameters dict (or of a distribution dict, when smp.init gets one)."""
        items = list(self._items(node))
        keys = {key for key, _, _ in items}
        if allow_distribution and keys & {"smdistributed", "modelparallel"}:
            self._distribution_items(items, v2 or "torch_distributed" in keys)
            return
        if v2:
            self._v2_parameters(node, items)
            return
        values = []
        for key, value, key_line in items:
            if key is not None:
                literal, known = _literal(value)
                record_config_key(self.report, key, key_line, literal, known, self._shown(value, literal, known))
                values.append(ConfigValue(key, key_line, literal, known))
        if _whole_literal(node):  # a dict built up elsewhere may be changed before smp.init: no rules judged
            record_config_rules(self.report, values)

    def _v2_parameters(self, node: ast.AST, items: list[tuple[str | None, ast.AST, int]]) -> None:
        values = []
        for key, value, key_line in items:
            if key is not None:
                literal, known = _literal(value)
                record_v2_key(self.report, key, key_line, literal, known, self._shown(value, literal, known))
                values.append((key, key_line, literal, known))
        if _whole_literal(node):
            record_v2_rules(self.report, values)

    def _shown(self, node: ast.AST, literal: Any, known: bool) -> str:
        text = repr(literal) if known else (ast.get_source_segment(self.text, node) or "<expression>")
        text = " ".join(text.split())
        return text if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 3] + "..."

    def _distribution_dict(self, node: ast.Dict) -> None:
        """A dict literal anywhere (an estimator's ``distribution=``) with SMP's sections."""
        if id(node) in self.seen_dicts:
            return
        keys = {_const_str(k) for k in node.keys if k is not None}
        if "smdistributed" in keys or "modelparallel" in keys or {"enabled", "parameters"} <= keys:
            self._distribution_items(list(self._items(node)), "torch_distributed" in keys)

    def _distribution_items(self, items: list[tuple[str | None, ast.AST, int]], v2: bool = False) -> None:
        """A distribution dict's sections; ``v2``: it has ``torch_distributed`` (SageMaker's SMP v2 launch)."""
        for key, value, line in items:
            if key == "smdistributed":
                self._distribution_items(list(self._items(value)), v2)
            elif key == "modelparallel":
                self._distribution_items(list(self._items(value)), v2)
            elif key == "parameters":
                self._parameters(value, line, v2=v2)
            elif key == "mpi":
                for mpi_key, mpi_value, mpi_line in self._items(value):
                    if mpi_key is not None:
                        literal, known = _literal(mpi_value)
                        record_mpi_key(self.report, mpi_key, mpi_line, self._shown(mpi_value, literal, known))


def check_source(text: str, path: str = "<string>", file_path: Path | None = None) -> FileReport:
    """Check the text of one Python script."""
    report = FileReport(path)
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as exc:
        report.error = f"cannot parse: {exc.msg} (line {exc.lineno})"
        return report
    source = _Source(tree, text, report, file_path)
    source.collect()
    source.walk()
    report.hints.extend(cuda_calls(tree))
    if source.aliases:  # objects SMP returns exist only where SMP is imported
        report_members(report, tree, source._resolve, text)
    return report
