"""pp = 2 x tp = 2 with the other features: bf16 + clip_master_grads, activation checkpointing of seq_layers,
partial smp.save file names, and a partial save_checkpoint / resume that continues as if uninterrupted."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import tp_models as tm
from smp_compat.testing import run_ranks

STEPS, SAVE_AFTER = 3, 2


def _setup(extra: dict | None = None, dtype: torch.dtype | None = None) -> tuple[Any, Any, Any, Any]:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 2,
              "auto_partition": False, "default_partition": 0, **(extra or {})})  # fmt: skip
    torch.manual_seed(0)
    with smp.model_creation(dtype=dtype):
        net = tm.TinySmpLM(smp.nn)
    model = smp.DistributedModel(net)
    smp.set_partition(model.get_module().transformer.seq_layers[1], 1)
    smp.set_partition(model.get_module().proj, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    return smp, model, opt, train_step


def _steps(smp: Any, opt: Any, train_step: Any, first: int, last: int) -> list[float]:
    losses = []
    for ids in tm.batches(STEPS)[first:last]:
        opt.zero_grad()
        losses.append(train_step(tm.my_samples(smp, ids)).reduce_mean().item())
        opt.step()
    return losses


def _bf16_norm() -> dict:
    smp, model, opt, train_step = _setup({"bf16": True}, torch.bfloat16)
    opt.zero_grad()
    train_step(tm.my_samples(smp, tm.batches(1)[0]))
    squares = {True: 0.0, False: 0.0}  # distributed or not -> this rank's sum of squared gradient entries
    for p in model.local_parameters():
        squares[model.is_distributed_parameter(p)] += float(p.grad.float().pow(2).sum())
    shards = sum(smp.allgather(squares[True], smp.WORLD))  # every tp shard of every stage
    replicated = sum(smp.allgather(squares[False] if smp.tp_rank() == 0 else 0.0, smp.WORLD))  # once per stage
    norm = opt.clip_master_grads(1e9)
    opt.step()
    return {"norm": float(norm), "expected": (shards + replicated) ** 0.5, "stage_has_both": all(squares.values())}


def test_bf16_clip_master_grads_norm_over_tp_shards_once_and_stages_summed() -> None:
    for r in run_ranks(_bf16_norm, 4, timeout=180):
        assert r["stage_has_both"]
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-4)


def _checkpointed(prescaled: bool) -> dict:
    smp, model, opt, train_step = _setup({"prescaled_batch": prescaled, "pipeline": "interleaved",
                                          "microbatches": 4})  # fmt: skip
    layers = model.get_module().transformer.seq_layers
    smp.set_activation_checkpointing(layers[0])  # on stage 0
    smp.set_activation_checkpointing(layers[1].attention)  # on stage 1
    losses = _steps(smp, opt, train_step, 0, STEPS)
    return {"losses": losses, "full": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("prescaled", [False, True])
def test_activation_checkpointing_of_seq_layers_at_pp2_tp2(prescaled: bool) -> None:
    import smp_compat as smp

    results = run_ranks(_checkpointed, 4, prescaled, timeout=180)
    ref_losses, ref_params = tm.reference(lambda: tm.TinySmpLM(smp.nn))
    torch.testing.assert_close(torch.tensor([r["losses"] for r in results]).mean(0), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    full = [r["full"] for r in results if r["full"]]
    assert len(full) == 2  # pp_rank 0 of each tp rank (gather_to_rank0)
    for name, value in ref_params.items():
        for f in full:
            torch.testing.assert_close(f[name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _straight(directory: str) -> dict:
    smp, model, opt, train_step = _setup()
    losses = _steps(smp, opt, train_step, 0, SAVE_AFTER)
    smp.save_checkpoint(directory, "half", model=model, optimizer=opt, user_content={"step": SAVE_AFTER})
    if smp.rdp_rank() == 0:
        smp.save(model.local_state_dict(), os.path.join(directory, "weights.pt"), partial=True)
    smp.barrier()
    losses += _steps(smp, opt, train_step, SAVE_AFTER, STEPS)
    local = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    files = sorted(f for f in os.listdir(directory) if not f.endswith(".hmac"))  # keyed digests aside
    return {"losses": losses, "local": local, "files": files, "rank": smp.rank()}


def _resumed(directory: str) -> dict:
    smp, model, opt, train_step = _setup()
    content = smp.resume_from_checkpoint(directory)
    losses = _steps(smp, opt, train_step, content["step"], STEPS)
    local = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"losses": losses, "local": local, "rank": smp.rank()}


def test_partial_checkpoint_resume_continues_as_uninterrupted(tmp_path: Any) -> None:
    straight = run_ranks(_straight, 4, str(tmp_path), timeout=180)
    resumed = run_ranks(_resumed, 4, str(tmp_path), timeout=180)
    # smp.save(partial=True): {f}_{pp_rank}_{tp_rank}.pt, one file per (stage, tp shard)
    weights = sorted(f for f in straight[0]["files"] if f.startswith("weights.pt"))
    assert weights == ["weights.pt_0_0.pt", "weights.pt_0_1.pt", "weights.pt_1_0.pt", "weights.pt_1_1.pt"]
    for a, b in zip(sorted(straight, key=lambda r: r["rank"]), sorted(resumed, key=lambda r: r["rank"])):
        assert a["losses"][SAVE_AFTER:] == b["losses"]
        assert a["local"].keys() == b["local"].keys() and a["local"]
        for name, value in a["local"].items():
            assert torch.equal(value, b["local"][name]), name


def _full_gpt2_checkpoint(directory: str) -> None:
    import transformers

    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 2,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    config = transformers.GPT2Config(vocab_size=tm.VOCAB, n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=2,
                                     n_head=tm.HEADS)  # fmt: skip
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        model = smp.DistributedModel(transformers.GPT2LMHeadModel(config))
    smp.set_partition(model.get_module().transformer.seq_layers[1], 1)
    smp.set_partition(model.get_module().transformer.ln_f, 1)

    @smp.step
    def forward(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    with torch.no_grad():
        forward(tm.my_samples(smp, tm.batches(1)[0]))  # partitions
    smp.save_checkpoint(directory, "hf", partial=False, model=model)  # translate_if_full: HF's own names


@pytest.mark.hf
def test_full_checkpoint_of_gpt2_at_pp2_tp2_loads_into_stock_hf(tmp_path: Any) -> None:
    import transformers

    run_ranks(_full_gpt2_checkpoint, 4, str(tmp_path), timeout=180)
    config = transformers.GPT2Config(vocab_size=tm.VOCAB, n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=2,
                                     n_head=tm.HEADS)  # fmt: skip
    torch.manual_seed(0)
    expected = transformers.GPT2LMHeadModel(config).state_dict()  # the swap keeps HF's weights
    saved = torch.load(tmp_path / "hf", weights_only=True)
    transformers.GPT2LMHeadModel(config).load_state_dict(saved, strict=True)
    for name, value in saved.items():
        torch.testing.assert_close(value, expected[name], msg=lambda m: f"{name}: {m}")


def _contexts_survive_the_swap() -> dict:
    import smp_compat as smp

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(tm.HIDDEN, 2 * tm.HIDDEN), torch.nn.Linear(2 * tm.HIDDEN, tm.HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.relu(self.fc1(x)))

    class DistBlock(smp.nn.DistributedModule):
        def __init__(self) -> None:
            super().__init__()
            self.output = smp.nn.DistributedTransformerOutputLayer(tm.HIDDEN, 2 * tm.HIDDEN, 0.0, "relu",
                                                                   pre_layernorm=True, post_layernorm=False)  # fmt: skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.output(x)

    smp.tp_register_with_module(Block, DistBlock)
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 2,
              "auto_partition": False, "default_partition": 0})  # fmt: skip

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(tm.VOCAB, tm.HIDDEN)
            with smp.tensor_parallelism():
                self.first = Block()
                with smp.partition(1):
                    self.second = Block()
            self.head = torch.nn.Linear(tm.HIDDEN, tm.VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.second(self.first(self.embedding(ids))))

    model = smp.DistributedModel(Net())

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    train_step(tm.my_samples(smp, tm.batches(1)[0]))
    plan = model.pipeline_engine.plan
    return {"types": (type(model.get_module().first).__name__, type(model.get_module().second).__name__),
            "stages": {n: plan.rank_of(n) for n in ("first.output", "second.output", "second.output.layernorm")}}


@pytest.mark.hf
def test_smp_partition_of_a_swapped_module_survives_the_swap() -> None:
    """A block created under smp.partition(1) and swapped for its distributed version stays on stage 1."""
    for r in run_ranks(_contexts_survive_the_swap, 4, timeout=120):
        assert r["types"] == ("DistBlock", "DistBlock")
        assert r["stages"] == {"first.output": 0, "second.output": 1, "second.output.layernorm": 1}
