"""Tensor parallelism with the other features: bf16 + clip_master_grads, activation checkpointing, partial saves."""

from __future__ import annotations

import os

import pytest
import torch

import tp_models as tm
from smp_compat.testing import run_ranks


def _bf16_norm(tp: int) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": tp, "ddp": True, "bf16": True})
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.bfloat16):
        net = tm.TinySmpLM(smp.nn)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    ids = tm.my_samples(smp, tm.batches(1)[0])
    opt.zero_grad()
    loss = train_step(ids).reduce_mean().item()
    squares = {True: 0.0, False: 0.0}  # distributed or not -> sum of squared gradient entries on this rank
    for p in model.parameters():
        squares[model.is_distributed_parameter(p)] += float(p.grad.float().pow(2).sum())
    expected = (squares[False] + sum(smp.allgather(squares[True], smp.TP_GROUP))) ** 0.5  # replicated: once
    norm = opt.clip_master_grads(1e9)
    opt.step()
    return {"norm": norm, "loss": loss, "expected": expected}


def test_bf16_clip_master_grads_counts_replicated_gradients_once() -> None:
    tp2 = run_ranks(_bf16_norm, 2, 2, timeout=120)
    tp1 = run_ranks(_bf16_norm, 2, 1, timeout=120)  # dp = 2 without tensor parallelism: the same global batch
    for r in tp2:
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-5)
    assert tp2[0]["norm"] == pytest.approx(tp1[0]["norm"], rel=2e-2)  # bf16 rounding differs with the layout


def _checkpointed(prescaled: bool, attention_dropout: float = 0.0, checkpointed: bool = True) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    model = smp.DistributedModel(tm.TinySmpLM(smp.nn, attention_dropout=attention_dropout))
    if checkpointed:
        smp.set_activation_checkpointing(model.get_module().transformer.seq_layers[0])
        smp.set_activation_checkpointing(model.get_module().transformer.seq_layers[1].attention)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    losses = []
    for ids in tm.batches():
        opt.zero_grad()
        losses.append(train_step(tm.my_samples(smp, ids)).reduce_mean().item())
        opt.step()
    return {"losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("prescaled", [False, True])
def test_activation_checkpointing_of_seq_layers_under_tp(prescaled: bool) -> None:
    import smp_compat as smp

    results = run_ranks(_checkpointed, 2, prescaled, timeout=120)
    ref_losses, ref_params = tm.reference(lambda: tm.TinySmpLM(smp.nn))
    torch.testing.assert_close(torch.tensor([r["losses"] for r in results]).mean(0), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    for name, value in ref_params.items():
        torch.testing.assert_close(results[0]["params"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_checkpointed_attention_dropout_recomputes_the_same_masks() -> None:
    """The recomputation in backward must draw the masks the forward drew: it drew others (wrong gradients)."""
    plain = run_ranks(_checkpointed, 2, False, 0.3, False, timeout=120)
    checkpointed = run_ranks(_checkpointed, 2, False, 0.3, True, timeout=120)
    for a, b in zip(plain, checkpointed):
        assert a["losses"] == b["losses"]
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), name


def _partial_save_load(path: str) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    torch.manual_seed(0)
    model = smp.DistributedModel(tm.TinySmpLM(smp.nn))
    model(tm.my_samples(smp, tm.batches(1)[0]))  # partitions (pp = 1, no @smp.step needed)
    if smp.rdp_rank() == 0:
        smp.save(model.local_state_dict(), path, partial=True)
    smp.barrier()
    files = sorted(f for f in os.listdir(os.path.dirname(path)) if not f.endswith(".hmac"))  # digests aside
    before = {k: v.clone() for k, v in model.local_state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(smp.load(path, partial=True))
    after = model.local_state_dict()
    full = model.state_dict()
    model.load_state_dict(full)  # a full dict is cut back to this rank's shards
    return {"files": files, "restored": all(torch.equal(after[k], v) for k, v in before.items()),
            "full_restored": all(torch.equal(model.local_state_dict()[k], v) for k, v in before.items()),
            "full_shape": tuple(full["proj.weight"].shape), "local_shape": tuple(before["proj.weight"].shape)}  # fmt: skip


def test_partial_save_names_and_full_state_dict_round_trip(tmp_path) -> None:
    results = run_ranks(_partial_save_load, 2, str(tmp_path / "ckpt.pt"), timeout=120)
    for r in results:
        assert r["files"] == ["ckpt.pt_0_0.pt", "ckpt.pt_0_1.pt"]  # {f}_{pp_rank}_{tp_rank}.pt (SMP >= 1.10)
        assert r["restored"] and r["full_restored"]
        assert r["full_shape"] == (tm.HIDDEN, tm.HIDDEN) and r["local_shape"] == (tm.HIDDEN, tm.HIDDEN // 2)


def _delayed(tp: int) -> dict:
    import transformers
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": tp, "ddp": True, "delayed_parameter_initialization": True})
    config = transformers.GPT2Config(vocab_size=tm.VOCAB, n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=2,
                                     n_head=tm.HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = transformers.GPT2LMHeadModel(config)
    meta_before = all(p.is_meta for p in hf.parameters())
    model = smp.DistributedModel(hf)
    torch.manual_seed(5)  # materialization draws from the global RNG at partitioning, on every rank alike
    ids = tm.batches(1)[0]
    model(input_ids=ids)  # pp = 1: the first forward partitions and materializes
    return {"meta_before": meta_before, "local": sum(p.numel() for p in model.parameters()),
            "full": {k: v.clone() for k, v in model.state_dict().items()}}  # fmt: skip


@pytest.mark.hf
def test_delayed_initialization_materializes_only_the_shards() -> None:
    tp2 = run_ranks(_delayed, 2, 2, timeout=180)
    tp1 = run_ranks(_delayed, 1, 1, timeout=120)[0]
    assert tp1["meta_before"] and all(r["meta_before"] for r in tp2)
    for r in tp2:
        h = tm.HIDDEN
        sharded_per_layer = 4 * h * h + 3 * h + 2 * 4 * h * h + 4 * h  # q/k/v (+bias), dense, fc1 (+bias), fc2
        assert r["local"] == tp1["local"] - 2 * sharded_per_layer // 2  # only this rank's shards were allocated
        for name, value in tp1["full"].items():  # same RNG draws: whole tensors, then slices
            torch.testing.assert_close(r["full"][name], value, msg=lambda m: f"{name}: {m}")
