"""tsm.transform's tensor parallelism trains each supported family exactly like one process of plain PyTorch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import transformers  # the test extra installs it: these tests must run, not skip

import tp_helpers as th
from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf  # run again under the oldest supported transformers

FAMILIES = ["llama", "llama3", "mistral", "gpt_neox"]
NEW_ROPE = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 43)


def _init_tp2() -> object:
    """``tsm.init`` at tp 2 (world 2: tp only; world 4: tp 2 x shard 2); returns the ``torch.sagemaker`` module."""
    import torch.sagemaker as tsm

    world = torch.distributed.get_world_size()
    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": world // 2})
    return tsm


def _train_tp2(family: str) -> dict:
    from torch.distributed.tensor import DTensor

    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    tsm = _init_tp2()
    model = tsm.transform(th.build(family))
    assert tsm.transform(model) is model  # a second call changes nothing
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    losses = th.train(model, th.batches())
    with torch.no_grad():
        logits = model(input_ids=th.batches(1)[0]).logits
    return {"losses": losses, "state": th.full_state(model), "layers": len(layers), "local": local, "logits": logits}


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_one_process(family: str) -> None:
    if family == "llama3" and not NEW_ROPE:
        pytest.skip("llama3 rope scaling needs transformers >= 4.43")
    results = run_ranks(_train_tp2, 2, family, timeout=120)
    ref_losses, ref_state = th.reference(family, th.batches())
    stock = th.build(family)
    total = sum(p.numel() for p in stock.parameters())
    # weights: AdamW turns float-order noise in tiny gradients into steps of up to ~3e-5 after 5 steps (lr 1e-2);
    # a wrong split or reduction moves weights by ~1e-2
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-5, atol=1e-6, msg=f"rank {rank} losses")
        assert r["layers"] == th.LAYERS
        assert total // 2 < r["local"] < total  # the decoder projections are halved, the rest is whole
        assert list(r["state"]) == list(ref_state)  # Hugging Face's names, in Hugging Face's order
        for name, value in ref_state.items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-4, atol=1e-4, msg=f"rank {rank} {name}")
    stock.load_state_dict(results[0]["state"], strict=True)  # the gathered state dict is a stock HF checkpoint
    with torch.no_grad():  # ... of the same model: stock Hugging Face gives the trained tp model's logits
        torch.testing.assert_close(stock(input_ids=th.batches(1)[0]).logits, results[0]["logits"], rtol=1e-4, atol=1e-5)


def _meta_stays_meta() -> dict:
    tsm = _init_tp2()
    with torch.device("meta"):
        model = th.build("llama")
    tsm.transform(model)
    q = model.model.layers[0].self_attn.q_proj.weight
    return {
        "all_meta": all(p.is_meta for p in model.parameters()),
        "q_local": tuple(q.to_local().shape), "q_global": tuple(q.shape),
    }  # fmt: skip


def test_meta_parameters_stay_on_meta() -> None:
    for r in run_ranks(_meta_stays_meta, 2, timeout=60):
        assert r == {"all_meta": True, "q_local": (th.HIDDEN // 2, th.HIDDEN), "q_global": (th.HIDDEN, th.HIDDEN)}


def _from_rank0(family: str) -> dict:
    """Rank 0 holds the weights; every other rank built its model on meta (as AWS's fine-tuning path does)."""
    tsm = _init_tp2()
    rank = torch.distributed.get_rank()
    if rank == 0:
        model = th.build(family)
    else:
        with torch.device("meta"):
            model = th.build(family, seed=rank)
    tsm.transform(model, load_state_dict_from_rank0=True)
    if rank >= 2:  # another tp group: left on meta for FSDP's sync_module_states
        return {"all_meta": all(t.is_meta for t in model.state_dict().values())}
    return {"state": th.full_state(model), "buffers": {k: v.clone() for k, v in model.named_buffers()}}


@pytest.mark.parametrize("world", [2, 4])
def test_load_state_dict_from_rank0_reaches_the_tp_peers(world: int) -> None:
    results = run_ranks(_from_rank0, world, "llama", timeout=90)
    stock = th.build("llama")
    for rank in (0, 1):
        for name, value in stock.state_dict().items():
            torch.testing.assert_close(results[rank]["state"][name], value, rtol=0, atol=0, msg=f"rank {rank} {name}")
        for name, value in stock.named_buffers():  # rotary tables too (not in the state dict)
            torch.testing.assert_close(results[rank]["buffers"][name], value, rtol=0, atol=0, msg=name)
    assert all(r == {"all_meta": True} for r in results[2:])


def _rank0_on_meta() -> None:
    tsm = _init_tp2()
    with torch.device("meta"):
        model = th.build("llama")
    tsm.transform(model, load_state_dict_from_rank0=True)


def test_load_state_dict_from_rank0_refuses_rank0_on_meta() -> None:
    with pytest.raises(AssertionError) as failure:  # RankFailure: both ranks raise, none hangs
        run_ranks(_rank0_on_meta, 2, timeout=60)
    assert str(failure.value).count("SMPConfigError: torch.sagemaker.transform(load_state_dict_from_rank0=True)") == 2


class _AllReduceCounter(TorchDispatchMode):
    """Counts the all-reduces the tensors under it run, after DTensor has turned its ops into collectives.

    Not torch's ``CommDebugMode``: its module tracker pops its parent stack once per forward hook it ever
    registered on a module, so a module instance called in several layers breaks it (``IndexError`` in
    ``_fw_set_module_hook``). transformers 5.25 made ``apply_rotary_pos_emb`` such a module (a hub-kernel
    ``Func`` shared by every layer); a stock, untransformed Llama fails under ``CommDebugMode`` there too."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run and desugar into collectives, then see those
        if "all_reduce" in str(func) or "allreduce" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _all_reduces(family: str) -> int:
    model = _init_tp2().transform(th.build(family))
    ids = th.batches(1)[0]
    with _AllReduceCounter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.count


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_one_all_reduce_per_block_each_way(family: str) -> None:
    """Megatron's count: attention and MLP each all-reduce once forward (row-wise output) and once backward
    (the input gradient of all their column-wise projections together: q, k and v are three)."""
    assert run_ranks(_all_reduces, 2, family, timeout=60) == [th.LAYERS * 2 * 2] * 2
