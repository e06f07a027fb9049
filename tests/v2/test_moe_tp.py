"""Mixtral with tensor parallelism (issue 39, item 2), under the installed transformers (4.x or 5):
``transform`` without ``MoEConfig`` (as the HyperPod scripts call it) and with ``MoEConfig`` at ep 1 split the
attention over tp 2 and keep every expert whole on each tp rank; both train exactly like one process of
stock Hugging Face Mixtral, and the gathered state dict is a stock checkpoint of the same version.

A wrong piece shows at 1e-3 or more: a doubled or missing all-reduce of the attention output or its input
gradient moves the first loss; an expert gradient summed over the tp group is twice too large.
"""

from __future__ import annotations

from typing import Any

import fsdp_job
import moe_job
import pytest
import torch
import torch.distributed as dist
import tp_helpers as th

from smp_compat.testing import run_ranks
from smp_compat.v2.moe.moe_config import MoEConfig

pytestmark = pytest.mark.hf

TOL = 3e-5  # losses
WEIGHT_TOL = 1e-4  # AdamW turns float-order noise in tiny gradients into steps of up to ~4e-5 after 5 steps
EXACT = MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0)  # SMP's layer routing as stock Mixtral


def _init(tp: int, ep: int = 1) -> Any:
    import smp_compat.v2  # noqa: F401 - the torch.sagemaker finder
    import torch.sagemaker as tsm
    from smp_compat.v2.state import reset

    reset()
    tsm.init({"tensor_parallel_degree": tp, "hybrid_shard_degree": dist.get_world_size() // tp,
              "expert_parallel_degree": ep})  # fmt: skip
    return tsm


def _plain_tp_job(with_config: bool) -> dict[str, Any]:
    """tp 2, no FSDP: transform, AdamW on the same batches as the reference, the gathered state dict."""
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    tsm = _init(2)
    model = tsm.transform(moe_job.tiny_mixtral(), config=EXACT if with_config else None)
    assert tsm.transform(model, config=EXACT if with_config else None) is model  # a second call changes nothing
    split = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    losses = th.train(model, th.batches())
    return {"losses": losses, "state": th.full_state(model), "split": split}


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = moe_job.tiny_mixtral()
    losses = th.train(model, th.batches())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("with_config", [False, True], ids=["no-MoEConfig", "MoEConfig-ep1"])
def test_mixtral_tp2_equals_one_process(with_config: bool) -> None:
    results = run_ranks(_plain_tp_job, 2, with_config, timeout=300)
    ref_losses, ref_state = _reference()
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["losses"], ref_losses, rtol=0, atol=TOL, msg=f"rank {rank} losses")
        assert all(".self_attn." in n for n in r["split"]) and len(r["split"]) == 4 * th.LAYERS, r["split"]
        assert list(r["state"]) == list(ref_state), "Hugging Face's names, in Hugging Face's order"
        assert fsdp_job.max_diff(r["state"], ref_state) < WEIGHT_TOL, f"rank {rank}"
    moe_job.tiny_mixtral(seed=3).load_state_dict(results[0]["state"], strict=True)


def _scripted_tp_job() -> dict[str, Any]:
    """The scripts' path at tp 2 (world 2): transform(config=MoEConfig(aux_loss)), FSDP, clipping, AdamW;
    the final FULL save."""
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    torch.set_num_threads(1)
    tsm = _init(2)
    model = tsm.transform(moe_job.tiny_mixtral(), config=MoEConfig(moe_load_balancing="aux_loss"))
    model = fsdp_job.wrap_as_scripts(model, layer=TransformerLayer)
    losses = fsdp_job.train_steps(model, fsdp_job.adamw(model), tsm.state.dp_rank, range(fsdp_job.STEPS))
    return {"losses": losses, "full": fsdp_job.full_params(model), "loaded": moe_job.full_load_round_trip(model)}


def test_mixtral_moeconfig_tp2_with_fsdp_equals_one_process() -> None:
    results = run_ranks(_scripted_tp_job, 2, timeout=300)
    ref_losses, ref_params = moe_job.reference_training(1, MoEConfig(moe_load_balancing="aux_loss"))
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=0, atol=TOL,
                                   msg=lambda m: f"rank {rank} losses: {m}")  # fmt: skip
    full = results[0]["full"]
    assert full.keys() == ref_params.keys() and results[1]["full"] == {}
    assert fsdp_job.max_diff(full, ref_params) < WEIGHT_TOL, "the full save: the trained weights, Hugging Face names"
    moe_job.tiny_mixtral(seed=3).load_state_dict(full, strict=True)
    assert fsdp_job.max_diff(results[0]["loaded"], moe_job.tiny_mixtral(seed=11).state_dict()) == 0, "full load"
