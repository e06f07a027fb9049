"""What a step function's signature says (names of its arguments), and the checks of ``non_split_inputs`` /
``input_split_axes`` against it at decoration time."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from smp_compat.errors import StepUsageError

__all__ = ["Params", "check_non_split_type", "check_axes_type", "func_name", "params_of", "validate_split_options"]


@dataclass(frozen=True)
class Params:
    """What name each argument binds to, read once per function from its signature."""

    signature: inspect.Signature
    positional: tuple[str, ...]
    keyword: frozenset[str]
    var_positional: str | None
    var_keyword: str | None
    names: tuple[str, ...]


def validate_split_options(
    func: Callable[..., Any],
    non_split_inputs: Sequence[str] | None,
    input_split_axes: Mapping[str, int] | None,
) -> None:
    """Check ``non_split_inputs``/``input_split_axes`` at decoration time, so typos fail before training.

    Names must be parameters of ``func``; a function with ``**kwargs`` also accepts any other name, which
    then refers to that keyword argument by key.
    """
    names = check_non_split_type(non_split_inputs)
    axes = check_axes_type(input_split_axes)
    if not names and not axes:
        return
    params = params_of(func)
    if params is None:
        raise StepUsageError(
            f"non_split_inputs/input_split_axes were given for {func_name(func)}, but its signature cannot "
            "be read, so the names cannot be matched to arguments. Decorate a plain Python function (def) "
            "instead, or drop these options."
        )
    if params.var_keyword is None:
        unknown = [name for name in (*names, *axes) if name not in params.names]
        if unknown:
            raise StepUsageError(
                f"non_split_inputs/input_split_axes name {unknown}, which are not parameters of "
                f"{func_name(func)}{params.signature}. Its parameters are {list(params.names)}; use those "
                "names exactly as they are spelled in the function definition."
            )
    both = sorted(set(names) & set(axes))
    if both:
        warnings.warn(
            f"{both} appear in both non_split_inputs and input_split_axes of {func_name(func)}; such "
            "arguments are not split, so their input_split_axes entries have no effect. Remove them from "
            "one of the two options.",
            stacklevel=3,
        )


def check_non_split_type(non_split_inputs: Any) -> tuple[str, ...]:
    if non_split_inputs is None:
        return ()
    if isinstance(non_split_inputs, str):
        raise StepUsageError(
            f"non_split_inputs must be a list of parameter names, got the string {non_split_inputs!r}. "
            f"Write non_split_inputs=[{non_split_inputs!r}]."
        )
    if not isinstance(non_split_inputs, (list, tuple)):
        raise StepUsageError(
            f"non_split_inputs must be a list of parameter names, got a {type(non_split_inputs).__name__}: "
            f"{non_split_inputs!r}. Pass a list of str, e.g. non_split_inputs=['mask']."
        )
    bad = [name for name in non_split_inputs if not isinstance(name, str)]
    if bad:
        raise StepUsageError(
            f"non_split_inputs must hold parameter names (str), got {bad!r} in {non_split_inputs!r}. "
            "Name arguments by their parameter name in the step function's definition."
        )
    return tuple(non_split_inputs)


def check_axes_type(input_split_axes: Any) -> dict[str, int]:
    if input_split_axes is None:
        return {}
    if not isinstance(input_split_axes, Mapping):
        raise StepUsageError(
            f"input_split_axes must be a dict from parameter name to batch axis, got a "
            f"{type(input_split_axes).__name__}: {input_split_axes!r}. "
            "Write e.g. input_split_axes={'x': 1}."
        )
    bad = {
        k: v for k, v in input_split_axes.items()
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int)
    }
    if bad:
        raise StepUsageError(
            f"input_split_axes must map parameter names (str) to integer axes, got the entries {bad!r}. "
            "Write e.g. input_split_axes={'x': 1} to split argument x along its second axis."
        )
    return dict(input_split_axes)


def params_of(func: Callable[..., Any]) -> Params | None:
    try:
        return _cached_params(func)
    except TypeError:  # an unhashable callable object: read its signature every time
        return _compute_params(func)


@functools.lru_cache(maxsize=256)
def _cached_params(func: Callable[..., Any]) -> Params | None:
    return _compute_params(func)


def _compute_params(func: Callable[..., Any]) -> Params | None:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    kind = inspect.Parameter
    ps = list(signature.parameters.values())
    return Params(
        signature=signature,
        positional=tuple(p.name for p in ps if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)),
        keyword=frozenset(p.name for p in ps if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)),
        var_positional=next((p.name for p in ps if p.kind == kind.VAR_POSITIONAL), None),
        var_keyword=next((p.name for p in ps if p.kind == kind.VAR_KEYWORD), None),
        names=tuple(p.name for p in ps),
    )


def func_name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or repr(func)
