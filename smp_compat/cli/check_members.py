"""``smp-compat check``, continued: the members a script uses on the objects SMP hands it.

``smp.DistributedModel(...)``, ``smp.DistributedOptimizer(...)`` and calls of ``@smp.step`` functions
return objects whose members are SMP API too (``model.local_state_dict()``, ``optimizer.clip_master_grads``,
``loss.reduce_mean()``). :mod:`smp_compat.cli.check_flow` finds which names and attributes hold them; each
``obj.member`` on one is reported with the status of ``support.METHODS``. Members that ``torch.nn.Module``
or ``torch.optim.Optimizer`` have and the registry does not list are torch's own and work as in torch: they
are not reported. A member a DistributedModel or a StepOutput lacks is a hint, not a finding.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from smp_compat.cli.check_flow import MODEL, OPTIMIZER, OUTPUT, STEP, Flow, Resolver
from smp_compat.cli.support import METHODS

if TYPE_CHECKING:
    from smp_compat.cli.findings import FileReport

__all__ = ["Member", "members", "report_members"]

_SECTION = {MODEL: MODEL, OPTIMIZER: OPTIMIZER, OUTPUT: OUTPUT, STEP: OUTPUT}
_TORCH_BASE = {MODEL: torch.nn.Module, OPTIMIZER: torch.optim.Optimizer}


@dataclass
class Member:
    """One use of a member of a tracked object: ``DistributedModel.local_state_dict`` at a line."""

    section: str
    name: str
    line: int
    shown: str  # the expression as written, for hints
    sure: bool  # False for a step result that may be a structure of StepOutputs rather than one


def members(tree: ast.Module, resolve: Resolver, text: str) -> list[Member]:
    """Every ``obj.member`` of the file whose ``obj`` holds a DistributedModel, its optimizer or a step output."""
    flow = Flow(tree, resolve)
    flow.bind_parameters()
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)) or node.attr.startswith("__"):
            continue
        scope = flow.scope_of.get(id(node))
        value = flow.value(node.value, scope) if scope is not None else None
        if isinstance(value, str) and value in _SECTION:
            shown = ast.get_source_segment(text, node) or node.attr
            found.append(Member(_SECTION[value], node.attr, node.lineno, shown, value != STEP))
    return sorted(found, key=lambda m: m.line)


def report_members(report: FileReport, tree: ast.Module, resolve: Resolver, text: str) -> None:
    """Add a ``member`` finding per registry member used (hints for members the objects lack)."""
    try:
        found = members(tree, resolve, text)
    except RecursionError:  # a pathological chain of assignments; the module-level findings still stand
        report.hints.append("members of the objects SMP returns were not checked: the file nests too deeply.")
        return
    for member in found:
        entry = METHODS.get(f"{member.section}.{member.name}")
        if entry is not None:
            report.add("member", entry.name, member.line, entry.status, entry.note, entry.action)
            continue
        base = _TORCH_BASE.get(member.section)
        if member.section == OPTIMIZER or (base is not None and hasattr(base, member.name)) or not member.sure:
            continue  # torch's own member, or the user's optimizer class's, or not known to be a StepOutput
        hint = _unknown(member)
        if hint not in report.hints:
            report.hints.append(hint)


def _unknown(member: Member) -> str:
    if member.section == MODEL:
        return (f"line {member.line}: `{member.shown}`: {member.name} is not a member of SMP's DistributedModel nor "
                "of torch.nn.Module; the wrapper does not forward the wrapped module's attributes: use "
                f"model.get_module().{member.name}.")  # fmt: skip
    return (f"line {member.line}: `{member.shown}`: a StepOutput has no {member.name} (it holds one value per "
            "microbatch): reduce it first, e.g. .reduce_mean() or .concat().")  # fmt: skip
