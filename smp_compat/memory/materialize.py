"""Materialize a delayed model on one rank: allocate the parameters it owns and replay their initializers.

The replay mirrors a normal build. First each module's own initializer runs, children before parents
(a module's ``__init__`` initializes its parameters after its children are built): ``reset_parameters()``,
else ``_reset_parameters()`` (``nn.MultiheadAttention``, ``nn.Transformer``). Then each ``transformers``
model's ``_init_weights`` runs over its subtree, children before parents, as ``post_init()`` does.

Each parameter keeps the values its *owner* gave it: the module that created it (else the first module in
module order holding it). A weight tied between an embedding and an output head therefore keeps the
embedding's init, as in a normal build where the head's own init went to the weight it replaced.

Parameters are filled with NaN before the replay. One still NaN afterwards has no initializer: that is fine
when a load fills it before the first step (delayed init, then a pretrained checkpoint, is SMP's usual
pattern), so ``check_initialized`` runs after the loads that wait for partitioning and names what is still
unset, rather than leaving silent garbage. Writes a script made that are not replayed are warned about.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from smp_compat.memory.model_creation import is_hf_model, replace_in_place, replaying, torch_initializer_name
from smp_compat.errors import SMPUnsupportedError

__all__ = ["materialize_local", "check_initialized"]

_UNSET_ATTR = "_smp_delayed_unset"

_MAX_LISTED = 8


def materialize_local(root: nn.Module, modules: list[nn.Module], device: torch.device) -> None:
    """Allocate and initialize the delayed parameters (and any meta buffers) that ``modules`` hold.

    ``modules`` are this rank's own; only their tensors get memory. ``root`` gives names and parents.
    """
    pending = _pending(modules)
    if not pending:
        return
    names = _names(root)
    uncovered = _modules_without_initializer(root, pending)
    unreplayed = [names.get(id(t), "?") for t in pending if getattr(t, "_smp_unreplayed", False)]
    owners = _owners(root, pending)
    for t in pending:
        real = torch.empty_like(t, device=device)
        if real.is_floating_point():
            real.fill_(float("nan"))
        replace_in_place(t, real)
        if hasattr(t, "_is_hf_initialized"):  # a transformers "loaded, skip init" flag: nothing was loaded
            del t._is_hf_initialized
    with torch.no_grad(), replaying():
        _replay(root, pending, owners)
    unset = [(names.get(id(t), "?"), t) for t in pending if _is_unset(t)]
    if unset:  # added to what earlier calls recorded (sharded data parallelism materializes unit by unit)
        earlier_unset, earlier_uncovered = root.__dict__.get(_UNSET_ATTR, ([], set()))
        root.__dict__[_UNSET_ATTR] = (earlier_unset + unset, earlier_uncovered | uncovered)
    if unreplayed:
        warnings.warn(
            f"Delayed parameter initialization cannot replay what was written into {_listing(unreplayed)} "
            "outside an initializer it replays (reset_parameters(), _reset_parameters(), a transformers "
            "model's _init_weights): those parameters have their module's own initialization instead. Apply "
            "custom initialization inside reset_parameters(), or turn delayed_parameter_initialization off.",
            stacklevel=3,
        )


def _pending(modules: list[nn.Module]) -> list[torch.Tensor]:
    """Meta parameters and buffers held directly by ``modules``, each once, in module order."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is not None and t.is_meta and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


def _names(root: nn.Module) -> dict[int, str]:
    names = {id(b): n for n, b in root.named_buffers()}
    names.update({id(p): n for n, p in root.named_parameters()})
    return names


def _modules_without_initializer(root: nn.Module, pending: list[torch.Tensor]) -> set[str]:
    """Types of modules holding a pending tensor with no initializer: own, an ancestor's, or a transformers model's."""
    ids = {id(t) for t in pending}
    missing: set[str] = set()

    def visit(module: nn.Module, covered: bool) -> None:
        covered = covered or is_hf_model(module) or torch_initializer_name(module) is not None
        own = (*module._parameters.values(), *module._buffers.values())
        if not covered and any(t is not None and id(t) in ids for t in own):
            missing.add(type(module).__name__)
        for child in module.children():
            visit(child, covered)

    visit(root, False)
    return missing


def _walk(module: nn.Module, hf_owner: nn.Module | None) -> Iterator[tuple[nn.Module, nn.Module | None]]:
    """(module, nearest transformers model at or above it) in post-order (children first), each once."""
    seen: set[int] = set()

    def visit(m: nn.Module, owner: nn.Module | None) -> Iterator[tuple[nn.Module, nn.Module | None]]:
        if id(m) in seen:
            return
        seen.add(id(m))
        owner = m if is_hf_model(m) else owner
        for child in m.children():
            yield from visit(child, owner)
        yield m, owner

    yield from visit(module, hf_owner)


def _owners(root: nn.Module, pending: list[torch.Tensor]) -> dict[int, nn.Module]:
    """The module whose initializer a pending tensor keeps: its creator if still holding it, else the first holder."""
    holders: dict[int, list[nn.Module]] = {}
    for module in root.modules():
        for t in module._parameters.values():
            if t is not None:
                holders.setdefault(id(t), []).append(module)
    owners = {}
    for t in pending:
        found = holders.get(id(t), [])
        creator = getattr(t, "_smp_creator", None)
        owner = creator if any(m is creator for m in found) else (found[0] if found else None)
        if owner is not None:
            owners[id(t)] = owner
    return owners


def _replay(root: nn.Module, pending: list[torch.Tensor], owners: dict[int, nn.Module]) -> None:
    """Run the construction-time initializers, then the transformers ones, over modules with pending state."""
    ids = {id(t) for t in pending}
    order = [(m, hf) for m, hf in _walk(root, None) if _has_pending(m, ids)]
    for module, _ in order:
        name = torch_initializer_name(module)
        if name is not None:
            _run_owned(module, getattr(module, name), ids, owners)
    for module, hf_owner in order:
        if hf_owner is not None:
            _run_owned(module, lambda m=module, o=hf_owner: o._init_weights(m), ids, owners)


def _has_pending(module: nn.Module, ids: set[int]) -> bool:
    return any(id(t) in ids for t in (*module.parameters(), *module.buffers()))


def _run_owned(module: nn.Module, init: Callable[[], object], ids: set[int], owners: dict[int, nn.Module]) -> None:
    """Run ``init``, keeping the values of tied parameters ``module`` holds but does not own."""
    held = [p for p in module._parameters.values() if p is not None and id(p) in ids]
    tied = [p for p in held if owners.get(id(p)) is not module]
    saved = [p.detach().clone() for p in tied]
    init()
    for p, value in zip(tied, saved):
        p.copy_(value)


def _is_unset(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.numel() > 0 and bool(torch.isnan(t).any())


def check_initialized(root: nn.Module) -> None:
    """After the loads that wait for partitioning: a delayed parameter that neither an initializer nor a load
    set is an error naming it (and the module types that have no initializer)."""
    recorded = root.__dict__.pop(_UNSET_ATTR, None)
    if recorded is None:
        return
    unset, uncovered = recorded
    left = [name for name, t in unset if _is_unset(t)]
    if not left:
        return
    without = f" (modules without reset_parameters() or _reset_parameters(): {', '.join(sorted(uncovered))})"
    raise SMPUnsupportedError(
        f"delayed initialization left {_listing(left)} uninitialized: no initializer sets them"
        f"{without if uncovered else ''} and no load filled them before the first step. Initialize them in the "
        "module's reset_parameters() (a transformers model's _init_weights also counts), load them "
        "(model.load_state_dict or smp.resume_from_checkpoint before the first step), or create the model "
        "outside smp.delay_param_initialization() / smp.model_creation()"
    )


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")
