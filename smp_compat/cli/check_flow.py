"""The flow analysis behind ``smp-compat check``'s member findings (:mod:`smp_compat.cli.check_members`).

It follows, through one file and without running it, the objects that ``smp.DistributedModel(...)``,
``smp.DistributedOptimizer(...)``, ``smp.state.model``/``optimizer`` and calls of ``@smp.step`` functions
return: assignments (tuple unpacking of step outputs included), simple aliasing, ``self.x`` attributes, and
the parameters and return values of the script's own functions (and of the hooks registered on the model).
Inside one function a use sees the last binding before it, so ``model = smp.DistributedModel(model)`` tracks
``model`` from that line on; names of an enclosing scope and attributes are flow-insensitive.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Union

__all__ = ["MODEL", "OPTIMIZER", "OUTPUT", "STEP", "Flow", "Resolver", "Value"]

MODEL, OPTIMIZER, OUTPUT = "DistributedModel", "DistributedOptimizer", "StepOutput"
STEP, _SEQ, _MAP = "step result", "step results", "step result dict"
"""A step call's result: a StepOutput or a structure of them (unknown), a sequence of them, a dict of them."""

Value = Union[str, tuple["Value", ...], None]  # noqa: UP007 - a recursive alias needs the string form
Pos = tuple[int, int]
Resolver = Callable[[ast.AST], "list[str] | None"]
_PKG = ["smdistributed", "modelparallel", "torch"]
_HOOK_METHODS = ("register_post_step_hook", "register_post_partition_hook")
_ROUNDS = 6  # parameter bindings reach a fixed point in (call depth) rounds; scripts are shallow


def _pos(node: ast.AST) -> Pos:
    return node.lineno, node.col_offset  # type: ignore[attr-defined]


def _end(node: ast.AST) -> Pos:
    return node.end_lineno or node.lineno, node.end_col_offset or 0  # type: ignore[attr-defined]


@dataclass(eq=False)
class _Binding:
    """A name (or attribute) bound at ``pos`` to ``expr`` (element ``path`` of it), or to a fixed ``value``."""

    pos: Pos
    scope: _Scope
    expr: ast.AST | None = None
    path: tuple[int, ...] = ()
    value: Value = None


@dataclass(eq=False)
class _Scope:
    """A module, class or function body: its bindings by name, in source order."""

    node: ast.AST
    parent: _Scope | None
    kind: str  # "module", "class", "function"
    bindings: dict[str, list[_Binding]] = field(default_factory=dict)
    outer: set[str] = field(default_factory=set)  # names declared global / nonlocal
    self_name: str | None = None  # a method's first parameter
    cls: ast.ClassDef | None = None  # the class a method belongs to

    def bind(self, name: str, binding: _Binding) -> None:
        self.bindings.setdefault(name, []).append(binding)


class Flow:
    """Scopes, bindings and the evaluation of expressions to the SMP objects they hold."""

    def __init__(self, tree: ast.Module, resolve: Resolver) -> None:
        self.resolve = resolve
        self.scope_of: dict[int, _Scope] = {}
        self.attrs: dict[tuple[int, str], list[_Binding]] = {}  # (id(class) or 0, "a.b") -> bindings
        self.defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.methods: dict[tuple[int, str], list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.steps: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.params: dict[int, dict[str, _Binding]] = {}  # id(function) -> parameter bindings
        self.inner: dict[int, _Scope] = {}  # id(function) -> its body's scope
        self.calls: list[ast.Call] = []
        self.memo: dict[int, Value] = {}
        self.active: set[int] = set()
        self.module = _Scope(tree, None, "module")
        self._build(tree, self.module)
        self._step_aliases(tree)

    # ---- building
    def _build(self, node: ast.AST, scope: _Scope) -> None:
        for child in ast.iter_child_nodes(node):
            self._node(child, scope)

    def _node(self, node: ast.AST, scope: _Scope) -> None:
        """Record ``node`` (and what it binds) in ``scope``; functions and classes open their own scopes."""
        self.scope_of[id(node)] = scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            self._function(node, scope)
        elif isinstance(node, ast.ClassDef):
            scope.bind(node.name, _Binding(_pos(node), scope))
            for sub in node.decorator_list + node.bases + node.keywords:
                self._node(sub, scope)
            inner = _Scope(node, scope, "class", cls=node)
            for stmt in node.body:
                self._node(stmt, inner)
        else:
            self._statement(node, scope)
            self._build(node, scope)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, scope: _Scope) -> None:
        if not isinstance(node, ast.Lambda):
            scope.bind(node.name, _Binding(_pos(node), scope))
            for sub in node.decorator_list:
                self._node(sub, scope)
            if scope.kind == "class":
                self.methods.setdefault((id(scope.node), node.name), []).append(node)
            else:
                self.defs.setdefault(node.name, []).append(node)
            if any(self._is_step(d) for d in node.decorator_list):
                self.steps.setdefault(node.name, []).append(node)
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self._node(default, scope)
        inner = self.inner[id(node)] = _Scope(node, scope, "function")
        args = node.args.posonlyargs + node.args.args
        static = not isinstance(node, ast.Lambda) and any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list
        )
        if scope.kind == "class" and args and not static:
            inner.self_name, inner.cls = args[0].arg, scope.cls
        params = self.params[id(node)] = {}
        for arg in [*args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]:
            if arg is not None:
                params[arg.arg] = _Binding(_pos(node), inner)
                inner.bind(arg.arg, params[arg.arg])
        for stmt in [node.body] if isinstance(node, ast.Lambda) else node.body:
            self._node(stmt, inner)

    def _statement(self, node: ast.AST, scope: _Scope) -> None:
        """Record what ``node`` binds in ``scope`` (values are evaluated lazily, when a use asks)."""
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._target(target, scope, _Binding(_end(node), scope, node.value))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self._target(node.target, scope, _Binding(_end(node), scope, node.value))
        elif isinstance(node, ast.NamedExpr):
            self._target(node.target, scope, _Binding(_end(node), scope, node.value))
        elif isinstance(node, ast.AugAssign):
            self._target(node.target, scope, _Binding(_end(node), scope))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._target(node.target, scope, _Binding(_end(node.target), scope))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._target(node.optional_vars, scope, _Binding(_end(node.optional_vars), scope))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                scope.bind((alias.asname or alias.name).split(".")[0], _Binding(_end(node), scope))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            scope.bind(node.name, _Binding(_pos(node), scope))
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            scope.outer.update(node.names)
        elif isinstance(node, ast.Call):
            self.calls.append(node)

    def _target(self, target: ast.AST, scope: _Scope, binding: _Binding) -> None:
        if isinstance(target, ast.Name):
            scope.bind(target.id, binding)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for i, elt in enumerate(target.elts):
                if isinstance(elt, ast.Starred):  # positions after a starred target are unknown
                    for rest in target.elts[i:]:
                        self._target(rest.value if isinstance(rest, ast.Starred) else rest, scope,
                                     _Binding(binding.pos, scope))  # fmt: skip
                    return
                self._target(elt, scope, _Binding(binding.pos, scope, binding.expr, (*binding.path, i)))
        elif isinstance(target, ast.Attribute):
            key = self._attr_key(target, scope)
            if key is not None:
                self.attrs.setdefault(key, []).append(binding)

    def _is_step(self, node: ast.AST) -> bool:
        """``@smp.step``, ``@smp.step(...)``."""
        func = node.func if isinstance(node, ast.Call) else node
        return self.resolve(func) == [*_PKG, "step"]

    def _step_aliases(self, tree: ast.Module) -> None:
        """``train = smp.step(fn)`` and ``smp.step(...)(fn)``: ``train`` calls ``fn`` as a step function."""
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args):
                continue
            call, wrapped = node.value, node.value.args[0]
            if self._is_step(call.func) and isinstance(wrapped, ast.Name) and wrapped.id in self.defs:
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.steps.setdefault(target.id, []).extend(self.defs[wrapped.id])

    # ---- attributes
    def _attr_key(self, node: ast.Attribute, scope: _Scope) -> tuple[int, str] | None:
        """``self.model`` in any method of a class is one key; other ``a.b`` chains are keyed by their text."""
        parts: list[str] = []
        root: ast.AST = node
        while isinstance(root, ast.Attribute):
            parts.append(root.attr)
            root = root.value
        if not isinstance(root, ast.Name):
            return None
        defining = self._defining(scope, root.id)
        if defining is not None and defining.self_name == root.id and defining.cls is not None:
            return id(defining.cls), ".".join(reversed(parts))
        return 0, ".".join([root.id, *reversed(parts)])

    def _defining(self, scope: _Scope, name: str) -> _Scope | None:
        """The scope a use of ``name`` in ``scope`` reads (classes are skipped from inner functions)."""
        current: _Scope | None = scope
        first = True
        while current is not None:
            if current.kind != "class" or first:
                if name in current.outer:
                    return self.module if current.kind != "module" else current
                if name in current.bindings:
                    return current
            first = False
            current = current.parent
        return None

    # ---- evaluation
    def value(self, node: ast.AST, scope: _Scope) -> Value:
        """What ``node`` holds: MODEL, OPTIMIZER, a step result, a tuple of those, or None (anything else)."""
        if id(node) in self.active:  # a cycle through parameters or return values
            return None
        self.active.add(id(node))
        try:
            return self._value(node, scope)
        finally:
            self.active.discard(id(node))

    def _value(self, node: ast.AST, scope: _Scope) -> Value:
        if isinstance(node, ast.Name):
            return self._name(node.id, scope, _pos(node))
        if isinstance(node, ast.Attribute):
            path = self.resolve(node)
            if path is not None:
                return {"model": MODEL, "optimizer": OPTIMIZER}.get(path[-1]) if path[:-1] == [*_PKG, "state"] else None
            key = self._attr_key(node, scope)
            return _last(self._binding_value(b) for b in self.attrs.get(key, [])) if key else None
        if isinstance(node, ast.Call):
            return self._call(node, scope)
        if isinstance(node, ast.Subscript):
            return _subscript(self.value(node.value, scope), node.slice)
        if isinstance(node, (ast.Tuple, ast.List)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return tuple(self.value(e, scope) for e in node.elts)
        if isinstance(node, ast.NamedExpr):
            return self.value(node.value, scope)
        if isinstance(node, ast.IfExp):
            return self.value(node.body, scope) or self.value(node.orelse, scope)
        return None

    def _name(self, name: str, scope: _Scope, pos: Pos) -> Value:
        defining = self._defining(scope, name)
        if defining is None:
            return None
        bindings = defining.bindings[name]
        if defining is scope:  # flow-sensitive: the last binding before the use
            before = [b for b in bindings if b.pos <= pos]
            return self._binding_value(before[-1]) if before else None
        return _last(self._binding_value(b) for b in bindings)

    def _binding_value(self, binding: _Binding) -> Value:
        if binding.expr is None:
            return binding.value
        key = id(binding)
        if key not in self.memo:
            value = self.value(binding.expr, binding.scope)
            for index in binding.path:
                value = _element(value, index)
            self.memo[key] = value
        return self.memo[key]

    def _call(self, node: ast.Call, scope: _Scope) -> Value:
        path = self.resolve(node.func)
        if path == [*_PKG, "DistributedModel"]:
            return MODEL
        if path == [*_PKG, "DistributedOptimizer"]:
            return OPTIMIZER
        step, functions = self._callees(node, scope)
        if step:
            return _step_result(functions)
        results = [self.value(r, self.inner[id(f)]) for f in functions for r in _returns(f)]
        return _merge(results)

    def _callees(self, node: ast.Call, scope: _Scope) -> tuple[bool, list[ast.FunctionDef | ast.AsyncFunctionDef]]:
        """The script's functions a call may run, and whether they are step functions."""
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in self.steps:
                return True, self.steps[func.id]
            return False, self.defs.get(func.id, [])
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            defining = self._defining(scope, func.value.id)
            if defining is not None and defining.self_name == func.value.id and defining.cls is not None:
                methods = self.methods.get((id(defining.cls), func.attr), [])
                return any(self._is_step(d) for m in methods for d in m.decorator_list), methods
        return False, []

    # ---- parameters
    def bind_parameters(self) -> None:
        """Give each function's parameters what its calls pass, until nothing changes."""
        for _ in range(_ROUNDS):
            self.memo.clear()
            changed = False
            for call in self.calls:
                scope = self.scope_of[id(call)]
                step, functions = self._callees(call, scope)
                method = isinstance(call.func, ast.Attribute)
                for function in functions:
                    for name, value in self._arguments(call, scope, function, method):
                        if step and value not in (MODEL, OPTIMIZER):
                            value = None  # other arguments are split into microbatches
                        changed |= self._bind(function, name, value)
                for function in self._hooks(call, scope):  # SMP calls hook(model, optimizer)
                    args = function.args.posonlyargs + function.args.args
                    for arg, value in zip(args, (MODEL, OPTIMIZER)):
                        changed |= self._bind(function, arg.arg, value)
            if not changed:
                break
        self.memo.clear()

    def _bind(self, function: ast.AST, name: str, value: Value) -> bool:
        binding = self.params[id(function)].get(name)
        if binding is None or value is None or binding.value is not None:
            return False
        binding.value = value
        return True

    def _hooks(self, call: ast.Call, scope: _Scope) -> list[ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda]:
        """The hook of ``model.register_post_step_hook(hook)`` / ``register_post_partition_hook``."""
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr in _HOOK_METHODS and call.args):
            return []
        if self.value(func.value, scope) != MODEL:
            return []
        hook = call.args[0]
        if isinstance(hook, ast.Lambda):
            return [hook]
        return list(self.defs.get(hook.id, [])) if isinstance(hook, ast.Name) else []

    def _arguments(self, call: ast.Call, scope: _Scope, function: ast.AST, method: bool) -> Iterator[tuple[str, Value]]:
        args = function.args  # type: ignore[attr-defined]
        positional = [a.arg for a in args.posonlyargs + args.args][1 if method else 0 :]
        for name, arg in zip(positional, call.args):
            if isinstance(arg, ast.Starred):
                return
            yield name, self.value(arg, scope)
        for keyword in call.keywords:
            if keyword.arg is not None:
                yield keyword.arg, self.value(keyword.value, scope)


def _last(values: Iterator[Value]) -> Value:
    """The last tracked value among bindings (flow-insensitive uses)."""
    found: Value = None
    for value in values:
        if value is not None:
            found = value
    return found


def _element(value: Value, index: int) -> Value:
    """Element ``index`` of an unpacked value: unpacking a step result means it is a sequence of StepOutputs."""
    if isinstance(value, tuple):
        return value[index] if index < len(value) else None
    return OUTPUT if value in (STEP, _SEQ) else None


def _subscript(value: Value, index: ast.AST) -> Value:
    if isinstance(value, tuple):
        if isinstance(index, ast.Constant) and isinstance(index.value, int) and -len(value) <= index.value < len(value):
            return value[index.value]
        return None
    if value in (_SEQ, _MAP):
        return OUTPUT
    return STEP if value == STEP else None  # a StepOutput's item is a tensor, a structure's a StepOutput


def _returns(function: ast.AST) -> list[ast.AST]:
    """The expressions a function returns (not those of functions nested in it)."""
    if isinstance(function, ast.Lambda):
        return [function.body]
    found: list[ast.AST] = []
    stack = list(function.body)  # type: ignore[attr-defined]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and node.value is not None:
            found.append(node.value)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _step_result(functions: list[ast.FunctionDef | ast.AsyncFunctionDef]) -> Value:
    """What a step call returns: each returned tensor becomes a StepOutput, inside the returned structure."""
    returned = [r for f in functions for r in _returns(f)]
    if not returned:
        return None
    if all(isinstance(r, (ast.Tuple, ast.List)) for r in returned):
        return _SEQ
    if all(isinstance(r, ast.Dict) for r in returned):
        return _MAP
    return STEP


def _merge(values: list[Value]) -> Value:
    """A function's result over its return statements: tuples element by element, else the first tracked."""
    tuples = [v for v in values if isinstance(v, tuple)]
    if tuples and len(tuples) == len(values) and len({len(t) for t in tuples}) == 1:
        return tuple(_last(iter(column)) for column in zip(*tuples))
    return next((v for v in values if v is not None and not isinstance(v, tuple)), None)
