"""A swapped Hugging Face LM head follows ``config.tie_word_embeddings`` whatever the script did to ``init_weights``.

AWS's scripts replace ``PreTrainedModel.init_weights`` by a no-op (SMP replaced the whole model by its own,
whose LM head was the embedding matrix). Hugging Face ties ``lm_head`` to the input embedding inside
``init_weights``, so without a tie of the swap's own the head trained as a second matrix, and the exported
model was not the trained one (``from_pretrained`` ties them again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm  # noqa: E402
from smp_compat.testing import run_ranks  # noqa: E402


def _gpt2(tie: bool = True) -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tm.VOCAB, n_positions=4 * tm.SEQ, n_embd=tm.HIDDEN, n_layer=2, n_head=tm.HEADS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie))  # fmt: skip


def _gptneo(tie: bool) -> torch.nn.Module:
    return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=tm.VOCAB, max_position_embeddings=tm.SEQ, hidden_size=tm.HIDDEN, num_layers=2, num_heads=tm.HEADS,
        attention_types=[[["global", "local"], 1]], window_size=3, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=tie))  # fmt: skip


def _gptj(tie: bool) -> torch.nn.Module:
    return transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=tm.VOCAB, n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=2, n_head=2, rotary_dim=4,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie))  # fmt: skip


def _gptneox(tie: bool) -> torch.nn.Module:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=tm.VOCAB, max_position_embeddings=tm.SEQ, hidden_size=tm.HIDDEN, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=24, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie))  # fmt: skip


MODELS: dict[str, Callable[[bool], torch.nn.Module]] = {"gpt2": _gpt2, "gptneo": _gptneo, "gptj": _gptj, "gptneox": _gptneox}


def _no_op_init_weights() -> None:
    """What AWS's scripts do before building the model (in a forked rank: the test process keeps the original)."""
    transformers.PreTrainedModel.init_weights = lambda self, *args, **kwargs: None


@contextlib.contextmanager
def _no_op_init_weights_here() -> Iterator[None]:
    original = transformers.PreTrainedModel.init_weights
    _no_op_init_weights()
    try:
        yield
    finally:
        transformers.PreTrainedModel.init_weights = original


def _unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _heads_and_embeddings(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return model.get_output_embeddings().weight, model.get_input_embeddings().weight


def _swap_every_model() -> dict[str, Any]:
    """tp = 1, each model swapped by the swap itself (one DistributedModel per process), both tie settings."""
    import smp_compat as smp
    from smp_compat.nn.swap import swap_modules

    smp.init({})
    _no_op_init_weights()
    out = {}
    for name, build in MODELS.items():
        for tie in (True, False):
            with smp.model_creation(tensor_parallelism=True):
                model = build(tie)
            swapped = swap_modules(model)
            head, embedding = _heads_and_embeddings(swapped)
            out[f"{name}-{tie}"] = {"tied": head is embedding, "numel": _unique_numel(swapped),
                                    "swapped": hasattr(swapped.base_model, "seq_layers")}  # fmt: skip
    return out


def test_every_swap_with_an_lm_head_ties_as_its_config_says() -> None:
    results = run_ranks(_swap_every_model, 1, timeout=120)[0]
    for name, build in MODELS.items():
        for tie in (True, False):
            stock = build(tie)  # stock Hugging Face, its own init_weights: tied where the config says
            r = results[f"{name}-{tie}"]
            assert r["swapped"], name
            assert r["tied"] == tie, (name, tie)
            assert r["numel"] == _unique_numel(stock), (name, tie)


def _train_gpt2(tp: int, pp: int, directory: str) -> dict[str, Any]:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "ddp": True, "microbatches": pp})
    _no_op_init_weights()
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = _gpt2()
    model = smp.DistributedModel(hf)
    shapes = [getattr(p, "_smp_tp_shape", p.shape) for p in model.parameters()]  # whole sizes, before partitioning
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    mine = tm.train(smp, model, opt, tm.hf_padded_loss)
    losses = torch.tensor(smp.allgather(mine, smp.DP_GROUP)).mean(0).tolist()  # over every sample of the batch
    head, embedding = _heads_and_embeddings(model.get_module())
    tied = head is embedding
    smp.save_checkpoint(directory, "fullmodel.pt", partial=False, model=model)  # Hugging Face's format
    return {"losses": losses, "tied": tied, "numel": sum(torch.Size(s).numel() for s in shapes)}


def _reference_gpt2() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Stock Hugging Face built under the same no-op init_weights, then initialized and tied as its config says
    (what ``DistributedModel`` does for a model the script left uninitialized for SMP's swap)."""

    def build() -> torch.nn.Module:
        with _no_op_init_weights_here():
            model = _gpt2()
        init = getattr(model, "initialize_weights", None)  # transformers 5; 4.x: apply(_initialize_weights)
        init() if callable(init) else model.apply(model._initialize_weights)
        model.tie_weights()
        return model

    return tm.reference(build, loss_fn=tm.hf_padded_loss)


def _check_gpt2(results: list[dict[str, Any]], directory: Any) -> None:
    ref_losses, ref_params = _reference_gpt2()
    stock = _gpt2()
    for r in results:
        assert r["tied"] and r["numel"] == _unique_numel(stock)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    stock.load_state_dict(torch.load(directory / "fullmodel.pt", weights_only=True), strict=True)
    exported = stock.state_dict()  # what from_pretrained gives: tied again, so a second head would be lost here
    for name, value in ref_params.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_gpt2_with_a_no_op_init_weights_trains_and_exports_a_tied_head_at_tp2(tmp_path) -> None:
    _check_gpt2(run_ranks(_train_gpt2, 2, 2, 1, str(tmp_path), timeout=180), tmp_path)


def test_gpt2_with_a_no_op_init_weights_keeps_its_tied_head_with_the_embedding_under_pp2(tmp_path) -> None:
    """Tied modules share a stage (auto partition puts them together; placing them apart raises PartitionError)."""
    _check_gpt2(run_ranks(_train_gpt2, 2, 1, 2, str(tmp_path), timeout=180), tmp_path)
