"""The in-place replacement of marked modules by their distributed versions, at ``smp.DistributedModel(...)``.

Outermost first: a replaced module's children are not visited. A marked module that cannot be
replaced (shared weights, sizes not divisible by the tp degree) stays as it is, with one log line.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections import Counter
from typing import Any

import torch
from torch import nn

from smp_compat.globalstate import state
from smp_compat.nn.module import DistributedModule
from smp_compat.nn import registry
from smp_compat.nn.registry import Registration, init_args_of, lookup, mark_of
from smp_compat.partitioning.manual import carry_partition

__all__ = ["swap_modules", "distributed_modules"]

log = logging.getLogger("smp_compat")


def swap_modules(root: nn.Module) -> nn.Module:
    """Replace every outermost marked, supported module under ``root``; return the (possibly new) root.

    Built-in registrations are not installed here: a module can only be marked once they are (by the
    tensor_parallelism context or set_tensor_parallelism), so scripts without tp never import HF models.
    """
    if "transformers" in sys.modules and _has_swappable(root):
        from smp_compat.nn.huggingface.skipped_init import initialize_if_skipped

        initialize_if_skipped(root)  # the script skipped Hugging Face's init because SMP's swap re-initialized
    counts = _param_use_counts(root)
    replaced = _maybe_replace(root, "", counts)
    if replaced is not None:
        _add_smp_paths(replaced)
        return replaced
    before = {id(m) for m in root.modules()}
    _visit(root, "", counts)
    if "transformers" in sys.modules:  # Hugging Face ties in init_weights, which SMP scripts make a no-op
        from smp_compat.nn.huggingface.tying import tie_as_configured

        tie_as_configured(root)
    _add_smp_paths(root)
    if registry.requested and before == {id(m) for m in root.modules()} and not distributed_modules(root):
        log.warning("smp_compat: tensor parallelism was requested but %s has no supported module (built in: "
                    "Hugging Face GPT-2, GPT-Neo, GPT-J, GPT-NeoX, BERT, RoBERTa; others via smp.tp_register); it runs with its plain modules",
                    type(root).__name__)  # fmt: skip
    registry.requested = False  # consumed: one model per process, and tests that build several stay independent
    return root


def _has_swappable(root: nn.Module) -> bool:
    """Whether a module under ``root`` is marked for tensor parallelism and has a distributed version."""
    return any((mark_of(m) or (False,))[0] and lookup(type(m)) is not None for m in root.modules())


def _add_smp_paths(root: nn.Module) -> None:
    """SMP's ``transformer.seq_layers`` path on swapped Hugging Face models (``huggingface/paths.py``)."""
    if "transformers" in sys.modules:
        from smp_compat.nn.huggingface.paths import add_smp_paths

        add_smp_paths(root)


def _visit(parent: nn.Module, prefix: str, counts: dict[int, int]) -> None:
    for name, child in list(parent.named_children()):
        path = f"{prefix}{name}"
        replaced = _maybe_replace(child, path, counts)
        if replaced is not None:
            setattr(parent, name, replaced)
        else:
            _visit(child, path + ".", counts)


def _maybe_replace(module: nn.Module, path: str, counts: dict[int, int]) -> nn.Module | None:
    mark = mark_of(module)
    registration = lookup(type(module))
    if registration is None or mark is None or not mark[0]:
        return None
    registry.requested = False  # a supported module was found: no "nothing supported" line for this model
    where = f"{path or '<root>'} ({type(module).__name__})"
    mark = (mark[0], _without_forced_flags(mark[1]))
    if registration.build is None:  # a tp_register swap cannot keep weights shared with another module
        shared = [n for n, p in module.named_parameters() if counts[id(p)] > _own_uses(module, p)]
        if shared:
            log.warning("smp_compat: %s left unswapped for tensor parallelism: its weights %s are shared with "
                        "another module", where, shared)  # fmt: skip
            return None
    try:
        if registration.build is not None:
            new = registration.build(module, mark[1])
        else:
            new = _build_generic(module, registration, mark[1])
    except ValueError as exc:
        log.warning("smp_compat: %s left unswapped for tensor parallelism: %s", where, exc)
        return None
    new.train(module.training)
    _take_dtype(module, new)
    carry_partition(module, new, _layer_pairs(module, new))
    return new


def _take_dtype(old: nn.Module, new: nn.Module) -> None:
    """The new module's own floating parameters take the dtype of those of the module it replaces: the model
    was built under ``smp.model_creation(dtype=...)``, whose default dtype was restored before the swap (on the
    meta device under delayed initialization too; materializing keeps the dtype). Modules the new one reuses
    (Hugging Face's embeddings) keep theirs; buffers (rotary tables, masks) are left as built, as Hugging Face
    builds them in fp32 whatever the default dtype."""
    dtypes = Counter(p.dtype for p in old.parameters() if p.is_floating_point())
    if not dtypes:
        return
    dtype = dtypes.most_common(1)[0][0]
    reused = {id(p) for p in old.parameters()}
    for p in new.parameters():
        if id(p) not in reused and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)  # in place: the object and its tensor-parallel markers stay


def _layer_pairs(old: nn.Module, new: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """The i-th block of ``old``'s block list (Hugging Face's ``h`` / ``layer``) and the new ``seq_layers[i]``."""
    layers = getattr(new, "seq_layers", None)
    if not isinstance(layers, nn.Sequential):
        return []
    for child in old.children():
        if isinstance(child, nn.ModuleList | nn.Sequential) and len(child) == len(layers):
            return list(zip(child, layers))
    return []


def _without_forced_flags(overrides: dict[str, Any]) -> dict[str, Any]:
    """SMP 1.15 forced ``distribute_embedding`` on under sharded DP x tp, and AWS's scripts pass it there:
    accepted in that combination, where FSDP2 shards the embedding over the rdp group like every parameter."""
    sdp_tp = state.initialized and state.cfg.sharded_data_parallel_degree > 1 and state.topology.tp_size > 1
    if not (sdp_tp and overrides.get("distribute_embedding")):
        return overrides
    log.info("smp_compat: distribute_embedding=True under sharded data parallelism x tensor parallelism: "
             "the embedding is sharded over the rdp group by FSDP2 (not split over tp); numerics are unchanged")
    return {k: v for k, v in overrides.items() if k != "distribute_embedding"}


def _build_generic(module: nn.Module, reg: Registration, overrides: dict[str, Any]) -> nn.Module:
    recorded = init_args_of(module)
    if recorded is None:
        raise ValueError("its constructor arguments were not recorded (register the class before creating it)")
    args, kwargs = recorded
    if reg.init_hook is not None:
        args, kwargs = reg.init_hook(*args, **kwargs)
        args, kwargs = tuple(args), dict(kwargs)
    accepted = inspect.signature(reg.dist_cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs.update({k: v for k, v in overrides.items() if takes_any or k in accepted})
    device = next((p.device for p in module.parameters()), None)
    with torch.device(device) if device is not None else _nullcontext():
        new = reg.dist_cls(*args, **kwargs)
    if reg.forward_hook is not None:
        hook = reg.forward_hook
        new.register_forward_pre_hook(lambda _m, a, k: _as_args_kwargs(hook(*a, **k)), with_kwargs=True)
    if reg.return_hook is not None:
        ret = reg.return_hook
        new.register_forward_hook(lambda _m, _a, out: ret(out))
    return new


def _as_args_kwargs(value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = value
    return tuple(args), dict(kwargs)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _param_use_counts(root: nn.Module) -> dict[int, int]:
    """How many (module, name) slots hold each parameter object in the whole model."""
    counts: dict[int, int] = {}
    for module in root.modules():
        for p in module._parameters.values():
            if p is not None:
                counts[id(p)] = counts.get(id(p), 0) + 1
    return counts


def _own_uses(module: nn.Module, param: nn.Parameter) -> int:
    return sum(1 for m in module.modules() for p in m._parameters.values() if p is param)


def distributed_modules(root: nn.Module) -> list[nn.Module]:
    """Outermost ``DistributedModule`` instances under ``root``."""
    found: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        if isinstance(module, DistributedModule):
            found.append(module)
            return
        for child in module.children():
            walk(child)

    walk(root)
    return found
