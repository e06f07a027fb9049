"""Automatic partitioning: cost each module subtree, cut the module tree into units, balance them.

Our own design in the spirit of SMP's (SMP_REFERENCE §4.5); deterministic for the same inputs:
1. Cost. A module's own memory is 3 x its parameter bytes (optimizer state; a shared parameter counts
   once, at its first holder in execution order) + its buffer bytes + its traced output bytes; its own
   compute is its traced exclusive time, or 1 when times were not measured. Both are normalized by the
   root's totals and mixed by ``memory_weight``; a subtree's cost is the sum over its modules.
2. Units. Starting from [root], every unit with children whose cost exceeds half a rank's fair share
   is replaced by [its own module, then its children in execution order]. A module without state has
   no unit of its own: its own cost joins its first child's unit, since it runs with its subtree.
3. Split. The unit sequence is cut into min(pp, units) contiguous segments minimizing the largest
   segment cost (exact dynamic programming); segment i goes to rank i, so the root stays on rank 0.
4. Modules that share a parameter all take the rank of the first of them in execution order.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from smp_compat.errors import PartitionError
from smp_compat.partitioning.plan import PartitionPlan, owns_state, shared_groups
from smp_compat.partitioning.trace import TraceResult

__all__ = ["auto_plan", "split_min_max"]

_EXPAND_FRACTION = 0.5
_PARAM_MEMORY_FACTOR = 3


@dataclass
class _Tree:
    """The module hierarchy in ``named_modules`` preorder: a subtree is the index range [i, end[i])."""

    names: list[str]
    modules: list[nn.Module]
    children: list[list[int]]
    end: list[int]


def _build_tree(root: nn.Module) -> _Tree:
    named = list(root.named_modules())
    names = [name for name, _ in named]
    index = {name: i for i, name in enumerate(names)}
    children: list[list[int]] = [[] for _ in names]
    parents = [-1] * len(names)
    for i, name in enumerate(names[1:], start=1):
        parent = index[name.rpartition(".")[0]]
        parents[i] = parent
        children[parent].append(i)
    end = list(range(1, len(names) + 1))
    for i in range(len(names) - 1, 0, -1):
        end[parents[i]] = max(end[parents[i]], end[i])
    return _Tree(names, [module for _, module in named], children, end)


def _exec_keys(tree: _Tree, trace: TraceResult) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Each module's own execution key and its subtree's earliest one.

    Called modules sort by first call; never-called ones after, in registration order. A container
    that is never called itself (nn.ModuleList) sorts where its first descendant ran.
    """
    first: dict[str, int] = {}
    for position, name in enumerate(trace.order):
        first.setdefault(name, position)
    own = [(0, first[name]) if name in first else (1, i) for i, name in enumerate(tree.names)]
    subtree = list(own)
    for i in range(len(tree.names) - 1, -1, -1):
        for child in tree.children[i]:
            if subtree[child] < subtree[i]:
                subtree[i] = subtree[child]
    return own, subtree


def _own_memory(tree: _Tree, trace: TraceResult, own_key: list[tuple[int, int]]) -> list[float]:
    """Own memory per module; a shared tensor is charged to its first holder in execution order."""
    memory = [float(trace.output_bytes.get(name, 0)) for name in tree.names]
    seen: set[int] = set()
    for i in sorted(range(len(tree.names)), key=own_key.__getitem__):
        module = tree.modules[i]
        for tensors, factor in ((module._parameters, _PARAM_MEMORY_FACTOR), (module._buffers, 1)):
            for tensor in tensors.values():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    memory[i] += factor * tensor.numel() * tensor.element_size()
    return memory


def _subtree_sums(tree: _Tree, own: list[float]) -> list[float]:
    total = list(own)
    for i in range(len(own) - 1, -1, -1):
        for child in tree.children[i]:
            total[i] += total[child]
    return total


def _costs(
    tree: _Tree, trace: TraceResult, own_key: list[tuple[int, int]], memory_weight: float
) -> tuple[list[float], list[float]]:
    """(own cost, subtree cost) per module, normalized so that the root's subtree costs about 1."""
    own_mem = _own_memory(tree, trace, own_key)
    if trace.exclusive_time:
        own_comp = [float(trace.exclusive_time.get(name, 0.0)) for name in tree.names]
    else:
        own_comp = [1.0] * len(tree.names)
    sub_mem, sub_comp = _subtree_sums(tree, own_mem), _subtree_sums(tree, own_comp)
    mem_scale = 1.0 / sub_mem[0] if sub_mem[0] > 0 else 0.0
    comp_scale = 1.0 / sub_comp[0] if sub_comp[0] > 0 else 0.0

    def mix(comp: float, mem: float) -> float:
        return (1.0 - memory_weight) * comp * comp_scale + memory_weight * mem * mem_scale

    own = [mix(c, m) for c, m in zip(own_comp, own_mem, strict=True)]
    sub = [mix(c, m) for c, m in zip(sub_comp, sub_mem, strict=True)]
    return own, sub


def _units(
    tree: _Tree, sub_cost: list[float], subtree_key: list[tuple[int, int]], threshold: float
) -> list[tuple[int, bool]]:
    """The unit sequence: (module index, True for "only this module", False for "its whole subtree")."""
    units: list[tuple[int, bool]] = []
    stack = [0]
    while stack:
        i = stack.pop()
        if tree.children[i] and sub_cost[i] > threshold:
            units.append((i, True))
            stack.extend(sorted(tree.children[i], key=subtree_key.__getitem__, reverse=True))
        else:
            units.append((i, False))
    return units


def _fold_stateless(
    tree: _Tree, units: list[tuple[int, bool]], own_cost: list[float], sub_cost: list[float]
) -> tuple[list[tuple[int, bool]], list[float]]:
    """Units and their costs, with each expanded stateless module's own cost charged to the unit after it.

    A module without state runs where its subtree's state lives (``runtime/placement.py``), never apart
    from it, so a cut between its own compute and its first child would balance a split that never runs.
    The unit after an expanded module is always its first child.
    """
    kept: list[tuple[int, bool]] = []
    costs: list[float] = []
    carried = 0.0
    for i, only_self in units:
        if only_self and not owns_state(tree.modules[i]):
            carried += own_cost[i]
            continue
        kept.append((i, only_self))
        costs.append((own_cost[i] if only_self else sub_cost[i]) + carried)
        carried = 0.0
    return kept, costs


def split_min_max(costs: list[float], segments: int) -> list[int]:
    """Cut ``costs`` into ``segments`` non-empty contiguous runs minimizing the largest run's sum.

    Returns the segment index of each item. Exact O(segments x n) DP: the best last cut moves right as
    the prefix grows, because the best (j-1)-segment cost is nondecreasing in the prefix length.
    """
    n = len(costs)
    if not 1 <= segments <= n:
        raise ValueError(f"cannot cut {n} items into {segments} non-empty segments")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    best = prefix[:]  # best[m]: lowest max over the first m items in j segments (j = 1 now)
    cuts: list[list[int]] = []
    for j in range(2, segments + 1):
        new = [float("inf")] * (n + 1)
        cut = [0] * (n + 1)
        m = j - 1
        for i in range(j, n - (segments - j) + 1):
            total = prefix[i]
            current = max(best[m], total - prefix[m])
            while m + 1 < i:  # advance while not worse: lands on the rightmost best cut
                candidate = max(best[m + 1], total - prefix[m + 1])
                if candidate > current:
                    break
                m, current = m + 1, candidate
            new[i], cut[i] = current, m
        best = new
        cuts.append(cut)
    owner = [0] * n
    stop = n
    for j in range(segments, 1, -1):
        start = cuts[j - 2][stop]
        owner[start:stop] = [j - 1] * (stop - start)
        stop = start
    return owner


def _place_units(tree: _Tree, units: list[tuple[int, bool]], owner: list[int]) -> dict[int, int]:
    """Module index -> rank for every state module, from the units' segments."""
    placed: dict[int, int] = {}
    for (i, only_self), rank in zip(units, owner, strict=True):
        members = (i,) if only_self else range(i, tree.end[i])
        for member in members:
            if owns_state(tree.modules[member]):
                placed[member] = rank
    return placed


def _co_locate_shared(root: nn.Module, tree: _Tree, placed: dict[int, int], own_key: list[tuple[int, int]]) -> None:
    """Every group of modules sharing a tensor goes to the rank of its first member in execution order."""
    index = {name: i for i, name in enumerate(tree.names)}
    for group in shared_groups(root):
        members = [index[name] for name in group]
        rank = 0 if 0 in members else placed[min(members, key=own_key.__getitem__)]
        for member in members:
            placed[member] = rank


def _check_args(pp_size: int, memory_weight: float) -> None:
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise PartitionError(f"auto_plan needs pp_size as an int >= 1, got {pp_size!r}.")
    if isinstance(memory_weight, bool) or not isinstance(memory_weight, (int, float)) or not 0 <= memory_weight <= 1:
        raise PartitionError(
            f"memory_weight must be a number in [0, 1], got {memory_weight!r}. Set memory_weight in the config "
            "to a value from 0.0 (balance compute only) to 1.0 (balance memory only)."
        )


def auto_plan(root: nn.Module, trace: TraceResult, pp_size: int, memory_weight: float) -> PartitionPlan:
    """Place every state module of ``root`` on one of ``pp_size`` ranks, balancing the estimated cost."""
    _check_args(pp_size, memory_weight)
    tree = _build_tree(root)
    own_key, subtree_key = _exec_keys(tree, trace)
    own_cost, sub_cost = _costs(tree, trace, own_key, float(memory_weight))
    if pp_size == 1:
        placed = {i: 0 for i, module in enumerate(tree.modules) if owns_state(module)}
    else:
        threshold = sub_cost[0] / pp_size * _EXPAND_FRACTION
        units, unit_costs = _fold_stateless(tree, _units(tree, sub_cost, subtree_key, threshold), own_cost, sub_cost)
        placed = _place_units(tree, units, split_min_max(unit_costs, min(pp_size, len(units))))
        _co_locate_shared(root, tree, placed, own_key)
    if 0 in placed:
        placed[0] = 0
    assignment = {tree.names[i]: placed[i] for i in sorted(placed)}
    costs = {name: sub_cost[i] for i, name in enumerate(tree.names)}
    return PartitionPlan(assignment=assignment, pp_size=pp_size, method="auto", costs=costs)
