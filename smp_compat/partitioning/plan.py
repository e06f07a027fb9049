"""The partition plan: which pipeline rank owns each module that holds state, and its checks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from smp_compat.errors import PartitionError

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "PartitionPlan",
    "check_shared_together",
    "owns_state",
    "shared_groups",
    "shared_tensors",
    "state_modules",
    "validate_plan",
]

_METHODS = ("manual", "auto")
_MAX_LISTED = 10


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters and buffers a module holds directly (not through children), None slots skipped."""
    for attr, param in module._parameters.items():
        if param is not None:
            yield attr, param
    for attr, buffer in module._buffers.items():
        if buffer is not None:
            yield attr, buffer


def owns_state(module: nn.Module) -> bool:
    """True if the module directly holds a parameter or buffer (so it gets a rank of its own)."""
    return next(_own_tensors(module), None) is not None


def state_modules(root: nn.Module) -> list[str]:
    """Qualified names of the modules that directly own a parameter or buffer; only these get a rank.

    Every other module runs on its caller's rank (SMP >= 1.13), so placing it would mean nothing.
    """
    return [name for name, module in root.named_modules() if owns_state(module)]


def shared_tensors(root: nn.Module) -> list[tuple[str, list[str]]]:
    """Every parameter or buffer held directly by two or more modules: (qualified name, holder names).

    The qualified name is the one under its first holder; holders are in ``named_modules`` order.
    """
    holders: dict[int, tuple[str, list[str]]] = {}
    for name, module in root.named_modules():
        for attr, tensor in _own_tensors(module):
            entry = holders.setdefault(id(tensor), (_qualify(name, attr), []))
            if name not in entry[1]:
                entry[1].append(name)
    return [entry for entry in holders.values() if len(entry[1]) >= 2]


def shared_groups(root: nn.Module) -> list[list[str]]:
    """Groups (size >= 2) of state modules linked by shared tensors (connected components).

    A tied embedding and output head form one group; groups are ordered by their first member, and
    members follow ``named_modules`` order, so the result is the same on every rank.
    """
    order = {name: index for index, name in enumerate(state_modules(root))}
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        parent.setdefault(name, name)
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for _, names in shared_tensors(root):
        for other in names[1:]:
            first, second = find(names[0]), find(other)
            if first != second:
                low, high = sorted((first, second), key=order.__getitem__)
                parent[high] = low
    groups: dict[str, list[str]] = {}
    for name in sorted(parent, key=order.__getitem__):
        groups.setdefault(find(name), []).append(name)
    return sorted(groups.values(), key=lambda members: order[members[0]])


def _qualify(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def _display(name: str) -> str:
    return name if name else "(root)"


def _listing(names: list[str]) -> str:
    """A short, readable list of module names for error messages."""
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


@dataclass(frozen=True)
class PartitionPlan:
    """The placement of every state module on a pipeline rank, as the runtime consumes it.

    ``costs`` holds the estimated normalized subtree cost of each module (auto plans), for display.
    """

    assignment: dict[str, int]
    pp_size: int
    method: str
    costs: dict[str, float] = field(default_factory=dict)

    def rank_of(self, name: str) -> int | None:
        """The rank of a state module; None for modules without state (they run on the caller's rank)."""
        return self.assignment.get(name)

    def param_bytes_per_rank(self, root: nn.Module) -> list[int]:
        """Parameter bytes each rank holds; a shared parameter counts once, on its first holder's rank."""
        return self._param_totals(root)[1]

    def _param_totals(self, root: nn.Module) -> tuple[list[int], list[int]]:
        """(parameter count, parameter bytes) per rank, each shared parameter counted once."""
        counts, sizes = [0] * self.pp_size, [0] * self.pp_size
        seen: set[int] = set()
        for name, module in root.named_modules():
            rank = self.assignment.get(name)
            if rank is None or not 0 <= rank < self.pp_size:
                continue
            for param in module._parameters.values():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    counts[rank] += param.numel()
                    sizes[rank] += param.numel() * param.element_size()
        return counts, sizes

    def rows(self, root: nn.Module) -> list[tuple[str, int, int, float | None]]:
        """(module, rank, own parameter count, cost) for every assigned module, in ``named_modules`` order."""
        result = []
        for name, module in root.named_modules():
            rank = self.assignment.get(name)
            if rank is None:
                continue
            count = sum(p.numel() for p in module._parameters.values() if p is not None)
            result.append((name, rank, count, self.costs.get(name)))
        return result

    def render(self, root: nn.Module) -> Table:
        """A readable table of the plan, with per-rank parameter totals in the caption (rank 0 logs it)."""
        from rich.table import Table

        table = Table(title=f"Partition assignments ({self.method}, pp={self.pp_size})")
        table.add_column("module")
        for column in ("rank", "parameters", "est. cost"):
            table.add_column(column, justify="right")
        for name, rank, count, cost in self.rows(root):
            table.add_row(_display(name), str(rank), f"{count:,}", "-" if cost is None else f"{cost:.4f}")
        counts, sizes = self._param_totals(root)
        table.caption = "per rank: " + "; ".join(
            f"{r}: {c:,} parameters ({human_bytes(b)})" for r, (c, b) in enumerate(zip(counts, sizes, strict=True))
        )
        return table

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form, for broadcasting the plan to other ranks and for saving it."""
        return {
            "assignment": dict(self.assignment),
            "pp_size": self.pp_size,
            "method": self.method,
            "costs": dict(self.costs),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartitionPlan:
        """Rebuild a plan from ``to_dict`` output (possibly after a JSON round trip)."""
        missing = [key for key in ("assignment", "pp_size", "method") if key not in d]
        if missing:
            raise PartitionError(
                f"A saved partition plan lacks the keys {missing} (keys seen: {sorted(d)}). The plan was not "
                "written by PartitionPlan.to_dict(); re-create it instead of loading it."
            )
        assignment = {str(k): _as_int(v, f"rank of module {k!r}") for k, v in d["assignment"].items()}
        pp_size = _as_int(d["pp_size"], "pp_size")
        if d["method"] not in _METHODS:
            raise PartitionError(
                f"A saved partition plan has method {d['method']!r}; expected one of {_METHODS}. "
                "Re-create the plan instead of loading it."
            )
        costs = {str(k): float(v) for k, v in d.get("costs", {}).items()}
        return cls(assignment=assignment, pp_size=pp_size, method=d["method"], costs=costs)


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PartitionError(
            f"A saved partition plan has {what} = {value!r}, which is not an integer. Re-create the plan "
            "instead of loading it."
        )
    return value


def human_bytes(count: int) -> str:
    """1234567 -> '1.2 MiB' (tables of the plan and of `smp-compat plan`)."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def validate_plan(root: nn.Module, plan: PartitionPlan) -> None:
    """Raise PartitionError if the runtime could not execute ``plan`` on ``root``.

    Checks: ranks in [0, pp_size); every state module assigned and every name a module of ``root``;
    the root's own state on rank 0; modules sharing a parameter on one rank.
    """
    if isinstance(plan.pp_size, bool) or not isinstance(plan.pp_size, int) or plan.pp_size < 1:
        raise PartitionError(f"A partition plan needs pp_size >= 1, got {plan.pp_size!r}.")
    _check_ranks(plan)
    _check_names(root, plan)
    if plan.assignment.get("", 0) != 0:
        raise PartitionError(
            f"The root module's own parameters/buffers are assigned to rank {plan.assignment['']}, but the root "
            "always lives on pipeline rank 0 (SMP places the DistributedModel's top-level module there). Assign "
            "the root to 0, or move its parameters into a child module."
        )
    check_shared_together(root, plan.assignment)


def _check_ranks(plan: PartitionPlan) -> None:
    bad = sorted(
        (name for name, rank in plan.assignment.items() if not isinstance(rank, int) or not 0 <= rank < plan.pp_size)
    )
    if bad:
        seen = {plan.assignment[name] for name in bad}
        raise PartitionError(
            f"Modules {_listing([_display(n) for n in bad])} are assigned to ranks {sorted(seen, key=str)}, outside "
            f"[0, {plan.pp_size - 1}] (pipeline_parallel_degree={plan.pp_size}). Use partition indices from 0 to "
            f"{plan.pp_size - 1}."
        )


def _check_names(root: nn.Module, plan: PartitionPlan) -> None:
    known = {name for name, _ in root.named_modules()}
    unknown = sorted(name for name in plan.assignment if name not in known)
    if unknown:
        raise PartitionError(
            f"The partition plan names modules that this model does not have: {_listing(unknown)}. The plan was "
            "made for another model; re-create it for this one."
        )
    missing = [name for name in state_modules(root) if name not in plan.assignment]
    if missing:
        raise PartitionError(
            f"The partition plan gives no rank to {_listing([_display(n) for n in missing])}, which hold parameters "
            "or buffers. Every module with state needs a rank; re-create the plan for this model."
        )


def check_shared_together(root: nn.Module, assignment: dict[str, int]) -> None:
    """Modules holding one tensor must share a rank: a parameter cannot live on two ranks at once."""
    for tensor_name, holders in shared_tensors(root):
        ranks = {holder: assignment.get(holder) for holder in holders}
        if len(set(ranks.values())) > 1:
            placed = ", ".join(f"{_display(h)!r} on rank {r}" for h, r in ranks.items())
            raise PartitionError(
                f"Modules {placed} share the parameter/buffer {tensor_name!r} but are assigned to different ranks. "
                "A shared parameter can live on only one rank: place these modules together (same smp.partition "
                "block or smp.set_partition index)."
            )
