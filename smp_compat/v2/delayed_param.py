"""``torch.sagemaker.delayed_param.DelayedParamIniter``: materialize a meta-device model one FSDP unit at a time.

AWS's scripts build the model under ``accelerate.init_empty_weights()`` (parameters on the meta device) and
hand ``get_param_init_fn()`` / ``get_post_param_init_fn()`` to the FSDP call, which calls them for each module
of each unit before sharding it, so no rank ever holds the whole model. A module's parameters are allocated
on the device and initialized by the model's own Hugging Face ``_init_weights(module)`` (or
``init_method_using_config(module)`` when given); what that leaves untouched (e.g. a norm's weight under
older transformers) is initialized as its class does (``reset_parameters``, or ones / zeros for a norm).
Every rank draws the same values in the same order, so replicas agree and shards fit together; tensors whose
initialization HF fixes (norms, biases, rotary frequencies) equal a model built directly on the CPU.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn

from smp_compat.errors import SMPConfigError, SMPError
from smp_compat.v2.tensor_parallel.materialize import whole_during_init

__all__ = ["DelayedParamIniter", "UninitializedStateError"]


class UninitializedStateError(SMPError, RuntimeError):
    """Parameters or buffers are still on the meta device (or uninitialized) where they must be real."""


class DelayedParamIniter:
    """SMP v2's delayed parameter initializer (same constructor and methods)."""

    def __init__(
        self,
        model: nn.Module,
        init_method_using_config: Callable[[nn.Module], None] | None = None,
        verbose: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise SMPConfigError(f"DelayedParamIniter(model=...) takes an nn.Module, not {type(model).__name__}.")
        self.model = model
        self.verbose = verbose
        self._init = init_method_using_config or _hf_init_method(model)

    def get_param_init_fn(self) -> Callable[[nn.Module], None]:
        """FSDP's ``param_init_fn``: allocate ``module``'s own meta tensors on the device and initialize them."""

        def param_init_fn(module: nn.Module) -> None:
            if not _has_meta(module):
                return
            device = _device()
            with whole_during_init(module, device):  # tp pieces: initialized whole, then cut
                _materialize(module, device)
                self._init(module)
                _complete(module, device)
            if self.verbose:
                print(f"DelayedParamIniter: initialized {type(module).__name__}")

        return param_init_fn

    def get_post_param_init_fn(self) -> Callable[[nn.Module], None]:
        """FSDP's ``post_param_init_fn`` (SMP's keyword): tie the weights again, as materializing unties them."""

        def post_param_init_fn(module: nn.Module) -> None:
            tie = getattr(self.model, "tie_weights", None)
            if callable(tie):
                tie()

        return post_param_init_fn

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True) -> Iterator[None]:
        """Around the FSDP call: afterwards every parameter and buffer must be real (not on meta)."""
        yield
        if enabled:
            missing = [name for name, t in _named_state(self.model) if t.is_meta]
            if missing:
                raise UninitializedStateError(
                    f"{len(missing)} parameters/buffers are still on the meta device after FSDP wrapping: "
                    f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}. Pass param_init_fn="
                    "DelayedParamIniter(model).get_param_init_fn() to FullyShardedDataParallel(...)."
                )

    def count_num_params(self, module: nn.Module | None = None) -> int:
        """Number of parameter elements (each shared parameter once, full sizes for sharded ones)."""
        root = self.model if module is None else module
        return sum(p.numel() for p in {id(p): p for p in root.parameters()}.values())


def _hf_init_method(model: nn.Module) -> Callable[[nn.Module], None]:
    init = getattr(model, "_init_weights", None)
    if callable(init):
        return init
    return lambda module: None  # not a Hugging Face model: _complete's class-based initialization only


def _device() -> torch.device:
    """This rank's device: the current GPU in a GPU job, else the CPU."""
    from smp_compat.v2.state import state

    if state.initialized and state.device_mesh.device_type != "cpu":
        return torch.device(state.device_mesh.device_type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _has_meta(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in [*module._parameters.values(), *module._buffers.values()])


def _materialize(module: nn.Module, device: torch.device) -> None:
    """``to_empty`` for the module's own tensors, filled with NaN so the check below sees what init skipped."""
    module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is None:
                continue
            if hasattr(t, "_is_hf_initialized"):
                del t._is_hf_initialized
            if t.is_floating_point():
                t.fill_(float("nan"))


def _complete(module: nn.Module, device: torch.device) -> None:
    """Initialize what the model's own init left as NaN; raise naming what nothing could initialize."""
    left = _nan_tensors(module)
    if left and all(name in module._buffers for name, _ in left):
        _recompute_buffers(module, device, [name for name, _ in left])
        left = _nan_tensors(module)
    if left and callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
        left = _nan_tensors(module)
    if left and any(key in type(module).__name__ for key in ("Norm", "norm")):
        with torch.no_grad():
            for name, t in left:
                (t.fill_(1.0) if name == "weight" else t.zero_())
        left = _nan_tensors(module)
    if left:
        raise UninitializedStateError(
            f"DelayedParamIniter cannot initialize {type(module).__name__}'s {[n for n, _ in left]}: the model's "
            "_init_weights does not cover them; pass init_method_using_config=<function(module)> that does."
        )


def _recompute_buffers(module: nn.Module, device: torch.device, names: list[str]) -> None:
    """Buffers its constructor computes (transformers 4.x rotary frequencies and cos/sin caches), computed again.

    A model built under ``torch.device("meta")`` has them on meta too, and 4.x's ``_init_weights`` does not
    refill them. A second instance of the module's class, built on ``device`` from the module's own attributes
    (``dim``, ``base``, ``config``, ...), holds them; nothing happens where the constructor asks for a value
    the module does not keep.
    """
    kwargs: dict[str, object] = {}
    for name, param in list(inspect.signature(type(module).__init__).parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name == "device":
            kwargs[name] = device
        elif hasattr(module, name):
            kwargs[name] = getattr(module, name)
        elif param.default is param.empty:
            return
    try:
        with torch.device(device):
            fresh = type(module)(**kwargs)
    except Exception:  # an attribute that is not the constructor's argument: _complete names the buffers
        return
    with torch.no_grad():
        for name in names:
            twin = fresh._buffers.get(name)
            if twin is not None and twin.shape == module._buffers[name].shape:
                module._buffers[name].copy_(twin)


def _nan_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    found = []
    for name, t in [*module._parameters.items(), *module._buffers.items()]:
        if t is not None and t.is_floating_point() and bool(_local(t).isnan().any()):
            found.append((name, t))
    return found


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _named_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if b is not None)
