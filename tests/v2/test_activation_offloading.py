"""Activation offloading (issue 35 item 3): ``sm_activation_offloading`` and the scripts' own ``offload_wrapper``.

AWS's train_lib.py applies torch's ``offload_wrapper`` (``save_on_cpu(pin_memory=True)`` around the whole
forward) when ``tsm.state.sm_activation_offloading`` is true, after REENTRANT activation checkpointing of the
decoder layers. Here, through tsm.init, tsm.transform and the FSDP façade (hybrid_shard_degree 2): offloading
on and off give bit-identical losses and weights, and a probe on the offloading hook shows what leaves the
device: every tensor saved for backward in the forward is packed into a separate host copy, and with
checkpointing those are the checkpointed layers' inputs plus the unwrapped modules' activations. On CPU the host copy is not a saving (the
"device" is the host); the drop in accelerator memory needs a GPU run (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import cp_job
import fsdp_job
import pytest
import torch
import torch.distributed as dist

from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf

DEGREES = {"hybrid_shard_degree": 2, "activation_loading_horizon": 3}


def _train(offload: bool, packed: list[tuple[int, bool, bool]]) -> dict[str, Any]:
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as ckpt
    from smp_compat.v2.state import reset

    import smp_compat.v2  # noqa: F401
    import torch.sagemaker as tsm
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    reset()
    tsm.init({**DEGREES, "sm_activation_offloading": offload})
    model = fsdp_job.wrap_as_scripts(tsm.transform(cp_job.build("llama")), layer=TransformerLayer)
    if not tsm.state.sm_activation_offloading:  # the scripts' gate: no offload_wrapper
        model = model._checkpoint_wrapped_module
    assert isinstance(model, ckpt.OffloadWrapper) == offload
    opt = fsdp_job.adamw(model)
    losses = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        ids = fsdp_job.batch(step, tsm.state.dp_rank)
        packed.clear()
        loss = model(input_ids=ids, attention_mask=None, labels=ids)["loss"]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": fsdp_job.full_params(model), "horizon": tsm.state.activation_loading_horizon}


def _job() -> dict[str, Any]:
    """Both runs in one job; the probe records (bytes, packed copy on the host, copy shares the storage)."""
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as ckpt

    packed: list[tuple[int, bool, bool]] = []
    stock = ckpt.save_on_cpu

    class Probe(stock):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pack = self.pack_hook

            def recording(tensor: torch.Tensor) -> Any:
                device, copy = pack(tensor)
                packed.append((tensor.numel() * tensor.element_size(), copy.device.type == "cpu",
                               copy.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()))  # fmt: skip
                return device, copy

            self.pack_hook = recording

    ckpt.save_on_cpu = Probe
    on = _train(True, packed)
    on["packed"] = list(packed)
    off = _train(False, packed)
    off["packed"] = list(packed)
    dist.barrier()
    return {"on": on, "off": off}


def test_offloading_on_and_off_train_identically_and_saved_activations_go_to_host_copies() -> None:
    results = run_ranks(_job, 2, timeout=300)
    for rank, r in enumerate(results):
        on, off = r["on"], r["off"]
        assert on["losses"] == off["losses"], f"rank {rank}"  # bit for bit
        assert on["horizon"] == 3
        assert off["packed"] == [], f"rank {rank}: nothing is offloaded without the wrapper"
        assert on["packed"] and all(host and not shared for _, host, shared in on["packed"]), f"rank {rank}"
    assert fsdp_job.max_diff(results[0]["on"]["params"], results[0]["off"]["params"]) == 0.0
    # with REENTRANT checkpointing the 2 decoder layers keep only their input (B x S x hidden fp32 = 4 KiB);
    # the rest is the unwrapped embeddings, final norm, head and loss
    layer_input = fsdp_job.BATCH * fsdp_job.SEQ * 32 * 4
    assert sum(1 for size, _, _ in results[0]["on"]["packed"] if size == layer_input) >= 2
