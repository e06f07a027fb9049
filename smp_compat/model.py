"""``smp.DistributedModel``: the one wrapped model of the process.

At pp = 1 it runs the module locally and averages gradients over the data-parallel group when a
step call returns. At pp > 1 it hands partitioning and execution to the pipeline engine.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from smp_compat import sdp
from smp_compat.checkpoints import deferred_loads, optimizer_state, state_dicts
from smp_compat.memory.activation_checkpointing import apply_activation_checkpointing
from smp_compat.memory.materialize import check_initialized, materialize_local
from smp_compat.precision.module16 import check_built_in_16_bit, to_16bit, to_float32
from smp_compat.runtime.compiling import Compiler, unwrap_compiled
from smp_compat.runtime.hf_state import refuse_filled_cache
from smp_compat.errors import (
    FwdExecutionNotInStepFnError,
    MultipleDistributedModelError,
    SMPConfigError,
    SMPUnsupportedError,
    StepUsageError,
)
from smp_compat.globalstate import process_group, state
from smp_compat.nn.queries import TensorParallelQueries
from smp_compat.stepping import grads
from smp_compat.stepping.step import active_call, current_microbatch, in_step, is_tracing

__all__ = ["DistributedModel"]

Hook = Callable[[Any, Any], None]


class DistributedModel(TensorParallelQueries, nn.Module):
    """SMP's model wrapper; ``model.module`` / ``get_module()`` is the user's module."""

    def __init__(
        self,
        module: nn.Module,
        trace_device: str = "gpu",
        trace_execution_times: bool = False,
        trace_memory_usage: bool = False,
        overlapping_allreduce: bool = True,
        backward_passes_per_step: int = 1,
        average_grads_across_microbatches: bool = True,
        bucket_cap_mb: float = 100,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = True,
    ) -> None:
        state.require_init("smp.DistributedModel")
        if state.model is not None:
            raise MultipleDistributedModelError(
                "A DistributedModel already exists in this process; SMP allows one. Wrap your whole model "
                "once (put several networks under one nn.Module if you need more than one)."
            )
        _check_model_args(module, trace_device, backward_passes_per_step, bucket_cap_mb)
        if (state.cfg.fp16 or state.cfg.bf16) and not sdp.enabled():
            check_built_in_16_bit(module)
        super().__init__()
        module, compiler = unwrap_compiled(module)  # torch.compile(model): partition the model itself
        self.module = _swap_for_tensor_parallelism(module)
        self.compiler: Compiler | None = compiler
        self.trace_device = trace_device
        self.trace_execution_times = trace_execution_times and trace_device != "cpu"
        self.trace_memory_usage = trace_memory_usage
        self.overlapping_allreduce = overlapping_allreduce
        self.backward_passes_per_step = backward_passes_per_step
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.bucket_cap_mb = bucket_cap_mb
        self.broadcast_buffers = broadcast_buffers
        self._partitioned = False
        self._post_partition_hooks: OrderedDict[int, Hook] = OrderedDict()
        self._post_step_hooks: OrderedDict[int, Hook] = OrderedDict()
        self._steps_with_backward = 0
        self._step_calls = 0
        self._backward_ran = False
        self._pending_state_dict: Any = None  # a load waiting for partitioning (checkpoints/deferred_loads.py)
        self._partition_actions: list[Callable[[DistributedModel], None]] = []
        self.pipeline_engine: Any = None
        self._sdp_units: list[nn.Module] | None = None
        self._sdp_built_dtypes: dict[str, torch.dtype] = {}  # 16-bit parameters upcast to fp32 masters
        self._sdp_all_reduce = True  # FSDP2's default
        self._plain_forward = False  # a training forward outside @smp.step: optimizer.step() reduces gradients
        state.model = self
        if sdp.enabled():
            self._shard()

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if state.cfg.pipeline_parallel_degree > 1 and not in_step():
            raise FwdExecutionNotInStepFnError(
                "The DistributedModel was called outside an @smp.step function. With "
                f"pipeline_parallel_degree={state.cfg.pipeline_parallel_degree} every forward pass must run "
                "inside a function decorated with @smp.step (put evaluation in its own step function and "
                "call it under torch.no_grad())."
            )
        if state.cfg.pipeline_parallel_degree > 1:
            refuse_filled_cache(args, kwargs)
        if not in_step() and self.distributed_modules():
            self._start_plain_step()
        run = self._root_forward()
        if state.cfg.fp16 or state.cfg.bf16:
            args, kwargs = to_16bit((args, kwargs))
            return to_float32(run(*args, **kwargs))
        return run(*args, **kwargs)

    def _root_forward(self) -> Callable[..., Any]:
        """The user's compiled module when there is one (not while the partitioner traces the model)."""
        if self.compiler is None or is_tracing():
            return self.module
        return self.compiler.compiled

    def backward(self, tensors: Any, grad_tensors: Any = None, **unsupported: Any) -> None:
        """Replaces ``loss.backward()`` inside a step; scales by 1/microbatches when averaging."""
        if unsupported:
            raise SMPUnsupportedError(
                f"model.backward() does not support {sorted(unsupported)} (SMP did not either: "
                "retain_graph and create_graph are unsupported)."
            )
        if not in_step():
            raise StepUsageError(
                "model.backward() was called outside an @smp.step function. Call it inside the step "
                "function, in place of loss.backward()."
            )
        if is_tracing():
            return
        tensors, grad_tensors = self._scaled_seeds(tensors, grad_tensors)
        if self._sdp_units is not None:
            self._set_gradient_sync()
        self._backward_ran = True
        if self.pipeline_engine is not None:
            self.pipeline_engine.backward(tensors, grad_tensors)
        else:
            torch.autograd.backward(tensors, grad_tensors)

    def _start_plain_step(self) -> None:
        """SMP allowed tensor-parallel models at pp = 1 without @smp.step: partition at the first forward,
        and let optimizer.step() reduce the gradients of a plain loss.backward()."""
        if not self._partitioned:
            self._partition(None, [])
        if torch.is_grad_enabled() and self.training:
            self._plain_forward = True

    def reduce_plain_gradients(self) -> None:
        """Called by the DistributedOptimizer's step: reduce gradients of a backward run outside @smp.step."""
        if self._plain_forward:
            self._plain_forward = False
            if state.cfg.fp16 or state.cfg.bf16:
                raise SMPUnsupportedError("fp16/bf16 training without @smp.step (plain loss.backward() and "
                                          "optimizer.step()); put the forward and backward in an @smp.step function")
            self._average_gradients()

    def _scaled_seeds(self, tensors: Any, grad_tensors: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        call = active_call()
        divisor = call.num_microbatches if self.average_grads_across_microbatches and call is not None else 1
        if grad_tensors is None:  # one fill per seed, not ones_like and a division (two kernels per microbatch)
            _require_scalars(tensors)
            grad_tensors = [torch.full_like(t, _seed_value(t.dtype, divisor)) for t in tensors]
        else:
            grad_tensors = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors)
            if divisor > 1:
                grad_tensors = [g / divisor for g in grad_tensors]
        scale = getattr(state.optimizer, "loss_scale", None)
        if scale is not None and state.cfg.fp16:  # SMP: the loss is cast to float and multiplied by the scale
            tensors = [t.float() for t in tensors]
            grad_tensors = [g.float() * scale for g in grad_tensors]
        return tensors, grad_tensors

    # ------------------------------------------------------------------ sharded data parallelism
    def _shard(self) -> None:
        """sdp > 1: shard now (scripts build parameter groups right after wrapping), as SMP did."""
        from smp_compat.sdp.masters import built_dtypes, sixteen_bit_training
        from smp_compat.sdp.state_dicts import attach_ds_views
        from smp_compat.sdp.wrap import shard_module

        self._sdp_built_dtypes = built_dtypes(self.module) if sixteen_bit_training() else {}
        self._sdp_units = shard_module(self.module, self.broadcast_buffers)
        attach_ds_views(self.module)

    def _set_gradient_sync(self) -> None:
        """SMP's accumulation: reduce-scatter in every backward (gradients stay sharded), all-reduce across
        replicas of the sharding group only in the last backward before an optimizer step."""
        call = active_call()
        last_mb = call is None or current_microbatch() in (None, call.num_microbatches - 1)
        boundary = (self._steps_with_backward + 1) % self.backward_passes_per_step == 0
        all_reduce = last_mb and boundary
        if all_reduce != self._sdp_all_reduce:  # the setters walk every module: only on a change
            self.module.set_requires_all_reduce(all_reduce)  # type: ignore[operator]
            self._sdp_all_reduce = all_reduce

    # ------------------------------------------------------------------ step life cycle
    def runs_step_body(self) -> bool:
        """Only pp_rank 0 runs the step body; the other stages serve module calls."""
        return state.topology.coords(state.rank).pp_rank == 0

    def _prepare_for_step(self, step_fn: Any, microbatches: list[tuple[tuple, dict]]) -> None:
        self._backward_ran = False  # a failed step never reached _finish_step: its backward does not count
        if not self._partitioned:
            self._partition(step_fn, microbatches)

    def _partition(self, step_fn: Any, microbatches: list[tuple[tuple, dict]]) -> None:
        """pp = 1: place the module, make replicas identical; pp > 1: let the engine partition."""
        if state.cfg.pipeline_parallel_degree > 1:
            from smp_compat.runtime.engine import PipelineEngine

            self.pipeline_engine = PipelineEngine.create(self, step_fn, microbatches)
        elif self._sdp_units is None:  # sharded data parallelism placed the model at wrapping
            materialize_local(self.module, list(self.module.modules()), state.device)
            self.module.to(state.device)
        self._partitioned = True
        apply_activation_checkpointing(self)
        deferred_loads.apply_pending_model_loads(self)  # before fp16 masters are copied from the weights
        check_initialized(self.module)  # a delayed parameter with no initializer must have been loaded
        if self._sdp_units is None:  # FSDP made the shards from dp rank 0's values
            self._sync_replicas()
        for action in self._partition_actions:
            action(self)
        optimizer_state.apply_pending_optimizer_loads()  # after masters and sharding exist
        for hook in list(self._post_partition_hooks.values()):
            hook(self, state.optimizer)

    def _sync_replicas(self) -> None:
        """Broadcast local parameters and buffers from dp rank 0, as SMP did at the first step."""
        topo = state.topology
        if topo.dp_size == 1:
            return
        src = topo.get_dp_group(state.rank)[0]
        tensors = [p.data for p in self.local_parameters()]
        if topo.tp_size > 1:
            from smp_compat.nn.grads import sync_replicas

            sync_replicas(list(self.local_parameters()) + (list(self.local_buffers()) if self.broadcast_buffers else []))
            return
        if self.broadcast_buffers:
            tensors += [b for b in self.local_buffers()]
        grads.broadcast_tensors(tensors, src, process_group("dp"), topo.dp_size)

    def _finish_step(self) -> None:
        """Gradient sync (every ``backward_passes_per_step`` steps with backward) and first-step hooks."""
        self._step_calls += 1
        if self._backward_ran:
            self._backward_ran = False
            self._steps_with_backward += 1
            if self._steps_with_backward % self.backward_passes_per_step == 0:
                self._average_gradients()
        if self._step_calls == 1:
            for hook in list(self._post_step_hooks.values()):
                hook(self, state.optimizer)

    def _average_gradients(self) -> None:
        if self._sdp_units is not None:  # FSDP reduced them over rdp in backward; the tp part is left
            from smp_compat.sdp.tp import reduce_tp_gradients

            reduce_tp_gradients(self.module.parameters())
            return
        if state.topology.dp_size == 1:
            return
        params = [p for p in self.local_parameters() if p.requires_grad]
        if self.distributed_modules():
            from smp_compat.nn.grads import reduce_gradients

            reduce_gradients(params, self.bucket_cap_mb)
            return
        grads.average_gradients(params, process_group("dp"), state.topology.dp_size, self.bucket_cap_mb)

    # ------------------------------------------------------------------ hooks
    def after_partition(self, action: Callable[[DistributedModel], None]) -> None:
        """Run ``action(model)`` once partitioned (now, if it is): library-internal, before user hooks."""
        if self._partitioned:
            action(self)
        else:
            self._partition_actions.append(action)

    def register_post_partition_hook(self, hook: Hook) -> RemovableHandle:
        """``hook(model, optimizer)`` runs once, after partitioning, before the first forward."""
        handle = RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        return handle

    def register_post_step_hook(self, hook: Hook) -> RemovableHandle:
        """``hook(model, optimizer)`` runs once, at the end of the first step call."""
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------------ introspection
    @property
    def partitioned(self) -> bool:
        return self._partitioned

    def get_module(self) -> nn.Module:
        return self.module

    def _require_partitioned(self, what: str) -> None:
        if not self._partitioned:
            raise StepUsageError(
                f"model.{what}() is only defined after partitioning, which happens in the first @smp.step "
                "call. Call it after the first step, or in a post-partition hook."
            )

    def _owns(self, module: nn.Module) -> bool:
        return self.pipeline_engine is None or self.pipeline_engine.is_local_module(module)

    def local_modules(self) -> Iterator[nn.Module]:
        return (m for _, m in self.local_named_modules())

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        self._require_partitioned("local_named_modules")
        return ((n, m) for n, m in self.module.named_modules() if self._owns(m))

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        self._require_partitioned("local_named_parameters")
        if self.pipeline_engine is not None:
            return iter(self.pipeline_engine.local_named_parameters())
        return self.module.named_parameters()

    def local_parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.local_named_parameters())

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_partitioned("local_named_buffers")
        if self.pipeline_engine is not None:
            return iter(self.pipeline_engine.local_named_buffers())
        return self.module.named_buffers()

    def local_buffers(self) -> Iterator[torch.Tensor]:
        return (b for _, b in self.local_named_buffers())

    def is_local_parameter(self, param: nn.Parameter | str) -> bool:
        names = dict(self.local_named_parameters())
        return param in names if isinstance(param, str) else any(p is param for p in names.values())

    def is_local_buffer(self, buf: torch.Tensor | str) -> bool:
        names = dict(self.local_named_buffers())
        return buf in names if isinstance(buf, str) else any(b is buf for b in names.values())

    def get_param_name(self, param: nn.Parameter) -> str:
        for name, p in self.module.named_parameters():
            if p is param:
                return name
        raise KeyError("this parameter does not belong to the DistributedModel")

    def cpu(self) -> DistributedModel:
        raise SMPUnsupportedError("DistributedModel.cpu() (gathering a partitioned model onto the CPU)")

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise SMPUnsupportedError("DistributedModel.join() (DDP uneven-input join)")

    def register_comm_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise SMPUnsupportedError("DistributedModel.register_comm_hook() (DDP communication hooks)")

    # ------------------------------------------------------------------ state dicts
    def state_dict(  # type: ignore[override]
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        cast_to_cpu: bool = True,
        gather_to_rank0: bool = True,
    ) -> dict[str, Any]:
        """The full model under the user module's own names (plain PyTorch's keys and order).

        Collective over the pipeline group once partitioned: call it on every rank of the group.
        With ``gather_to_rank0`` only pp_rank 0 gets the dict; the other pipeline ranks get ``{}``.
        """
        if self._sdp_units is not None:
            from smp_compat.sdp.masters import cast_to_built_dtypes
            from smp_compat.sdp.state_dicts import full_model_state_dict

            return cast_to_built_dtypes(full_model_state_dict(self, cast_to_cpu), self._sdp_built_dtypes)
        return state_dicts.model_state_dict(self, destination, prefix, keep_vars, cast_to_cpu, gather_to_rank0)

    def local_state_dict(
        self, destination: Any = None, prefix: str = "", keep_vars: bool = False, **_: Any
    ) -> dict[str, Any]:
        """This rank's entries, marked ``_smp_is_partial`` with ``_smp_load_info`` (degrees and partition).

        Under sharded data parallelism: the sharded form (DTensors holding this rank's shards).
        """
        if self._sdp_units is not None:
            from smp_compat.sdp.state_dicts import sharded_model_state_dict

            return sharded_model_state_dict(self)
        return state_dicts.model_local_state_dict(self, destination, prefix, keep_vars)

    def load_state_dict(  # type: ignore[override]
        self,
        state_dict: Mapping[str, Any],
        strict: bool = True,
        translate_function: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
        same_partition_load: bool = True,
        **_: Any,
    ) -> Any:
        """Load a full, partial or plain PyTorch dict; before partitioning the copy waits for it (as in SMP)."""
        if self._sdp_units is not None:  # already sharded: load now, collectively
            from smp_compat.sdp.state_dicts import load_model_state_dict

            return load_model_state_dict(self, state_dict, strict, translate_function)
        return state_dicts.load_model_state(self, state_dict, strict, translate_function, same_partition_load)


def _swap_for_tensor_parallelism(module: nn.Module) -> nn.Module:
    """Replace marked supported modules by smp.nn ones, in place (SMP does it in DistributedModel's constructor)."""
    from smp_compat.nn.swap import swap_modules

    return swap_modules(module)


def _check_model_args(module: Any, trace_device: str, backward_passes: Any, bucket_cap_mb: Any) -> None:
    if not isinstance(module, nn.Module):
        raise SMPConfigError(f"smp.DistributedModel expects an nn.Module, got {type(module).__name__}.")
    if trace_device not in ("gpu", "cpu"):
        raise SMPConfigError(f'trace_device must be "gpu" or "cpu", got {trace_device!r}.')
    if not isinstance(backward_passes, int) or isinstance(backward_passes, bool) or backward_passes < 1:
        raise SMPConfigError(f"backward_passes_per_step must be an int >= 1, got {backward_passes!r}.")
    if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
        raise SMPConfigError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}.")


def _require_scalars(tensors: list[torch.Tensor]) -> None:
    """Without grad_tensors only a one-element tensor has an implied gradient, as in ``loss.backward()``;
    seeding a per-sample loss with ones would silently train on its sum."""
    for t in tensors:
        if t.numel() != 1:
            raise StepUsageError(
                f"model.backward() got a tensor of shape {tuple(t.shape)} and no grad_tensors: only a scalar's "
                "gradient is implied (loss.backward() raises the same). Reduce the loss first (loss.mean()), or "
                "pass grad_tensors."
            )


@functools.lru_cache(maxsize=64)
def _seed_value(dtype: torch.dtype, divisor: int) -> float:
    """``1 / divisor`` rounded exactly as ``torch.ones(dtype) / divisor`` rounds it (the seed SMP scales by)."""
    return (torch.ones((), dtype=dtype, device="cpu") / divisor).item()  # a Python number: any default device
