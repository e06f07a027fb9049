"""SMP's module paths on every swapped Hugging Face model: the walk AWS's scripts take trains like stock HF.

AWS's v1 scripts (the 2023 notebooks' train.py, train_gpt_simple.py, the GPT-J scripts) take the layers of
any model as ``model.get_module().transformer.seq_layers``, place them with ``smp.set_partition`` over
``seq_layers.children()`` and checkpoint ``c.attention`` / ``c.output``. Per swapped model (GPT-2, GPT-J,
GPT-Neo, GPT-NeoX, BERT, RoBERTa) this test does exactly that at pipeline degree 2 (the other modules on
partition 0, the scripts' ``default_partition``), checks that the paths are the real modules (Hugging Face's
own names reach the same objects; the placement and the recomputation land on them) and that the full state
dict has Hugging Face's keys and values of a one-process stock run. The GPT-NeoX notebook configuration (sdp
2 and 4, fp32 and bf16, resumed) is in tests/core/test_flagship_16bit.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm
from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf  # run again under the oldest supported transformers

MICROBATCHES = 2
_GPT = {"vocab_size": tm.VOCAB, "bos_token_id": 0, "eos_token_id": 0}
_ENCODER = {"vocab_size": tm.VOCAB, "hidden_size": tm.HIDDEN, "num_hidden_layers": 2, "num_attention_heads": tm.HEADS,
            "intermediate_size": 2 * tm.HIDDEN, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "max_position_embeddings": tm.SEQ + 4, "num_labels": 3, "pad_token_id": 1}  # fmt: skip


def _gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=2, n_head=tm.HEADS, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **_GPT))  # fmt: skip


def _gptj() -> torch.nn.Module:
    return transformers.GPTJForCausalLM(transformers.GPTJConfig(
        n_positions=tm.SEQ, n_embd=tm.HIDDEN, n_layer=2, n_head=2, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **_GPT))  # fmt: skip


def _gptneo() -> torch.nn.Module:
    return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        max_position_embeddings=tm.SEQ, hidden_size=tm.HIDDEN, num_layers=2, num_heads=tm.HEADS,
        attention_types=[[["global", "local"], 1]], window_size=3, resid_dropout=0.0, embed_dropout=0.0,
        attention_dropout=0.0, **_GPT))  # fmt: skip


def _gptneox() -> torch.nn.Module:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        max_position_embeddings=4 * tm.SEQ, hidden_size=tm.HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, rotary_pct=1.0, use_parallel_residual=True, hidden_dropout=0.0,
        attention_dropout=0.0, **_GPT))  # fmt: skip


def _bert() -> torch.nn.Module:
    return transformers.BertForSequenceClassification(transformers.BertConfig(**_ENCODER))


def _roberta() -> torch.nn.Module:
    return transformers.RobertaForSequenceClassification(transformers.RobertaConfig(**_ENCODER))


def _mask(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[ids[:, 0] % 3 == 0, -2:] = 0  # right padding chosen by content: the same on any split of the batch
    return mask


def _lm_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=_mask(ids), labels=ids).loss


def _class_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=_mask(ids), labels=ids[:, 1] % 3).loss


# model -> (builder, loss, Hugging Face's path to the swapped module, Hugging Face's name for its layer list)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[..., torch.Tensor], str, str]] = {
    "gpt2": (_gpt2, _lm_loss, "transformer", "h"),
    "gptj": (_gptj, _lm_loss, "transformer", "h"),
    "gptneo": (_gptneo, _lm_loss, "transformer", "h"),
    "gptneox": (_gptneox, _lm_loss, "gpt_neox", "layers"),
    "bert": (_bert, _class_loss, "bert.encoder", "layer"),
    "roberta": (_roberta, _class_loss, "roberta.encoder", "layer"),
}


def _count_calls(module: torch.nn.Module, counts: list[int]) -> None:
    module.register_forward_hook(lambda *_: counts.__setitem__(0, counts[0] + 1))


def _script_walk(smp: Any, model: Any) -> tuple[Any, list[list[int]]]:
    """What AWS's scripts do after ``smp.DistributedModel``: the layers through SMP's path, one partition per
    layer, ``c.attention`` and ``c.output`` checkpointed; each attention's calls counted (its last module, the
    dropout: twice per microbatch when the recomputation runs whole, without torch's early stop)."""
    m = model.get_module()
    transformer_layers = m.transformer.seq_layers
    calls = []
    for i, c in enumerate(transformer_layers.children()):
        smp.set_partition(c, i)
        smp.set_activation_checkpointing(c.attention)
        smp.set_activation_checkpointing(c.output)
        calls.append([0])
        _count_calls(c.attention.dropout2, calls[-1])
    return m, calls


def _alias_names(m: torch.nn.Module) -> list[str]:
    """Modules and parameters listed under the alias (none: it is not registered), duplicates included."""
    names = [n for n, _ in m.named_modules(remove_duplicate=False)]
    names += [n for n, _ in m.named_parameters(remove_duplicate=False)]
    return [n for n in names if n.split(".")[0] == "transformer"]


def _train_all() -> dict[str, dict[str, Any]]:
    """Every model, one after the other in the same two ranks (one fork for all: the test stays fast)."""
    import smp_compat as smp
    from smp_compat.nn.huggingface import to_hf_format

    torch.set_num_threads(1)
    out = {}
    for kind, (make, loss_fn, hf_path, hf_list) in MODELS.items():
        smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "ddp": True, "auto_partition": False,
                  "default_partition": 0})  # fmt: skip
        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=True):
            hf = make()
        model = smp.DistributedModel(hf)
        m, calls = _script_walk(smp, model)
        body = m.get_submodule(hf_path)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            losses = tm.train(smp, model, opt, loss_fn)
        plan = model.pipeline_engine.plan
        out[kind] = {
            "losses": losses, "full": dict(to_hf_format(m, model.state_dict())), "calls": [c[0] for c in calls],
            "same": m.transformer is body and getattr(body, hf_list) is body.seq_layers,
            "stages": [plan.rank_of(f"{hf_path}.seq_layers.{i}.attention") for i in range(len(body.seq_layers))],
            "names": _alias_names(m) if hf_path != "transformer" else [],
            "pp_rank": smp.pp_rank(),
        }  # fmt: skip
        smp.reset()
    return out


def test_script_paths_place_checkpoint_and_train_like_stock_hf() -> None:
    results = run_ranks(_train_all, 2, timeout=300)
    for kind, (make, loss_fn, _, _) in MODELS.items():
        ref_losses, ref_state = tm.reference(make, loss_fn=loss_fn)
        ranks = [r[kind] for r in results]
        torch.testing.assert_close(torch.tensor([r["losses"] for r in ranks]).mean(0), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind}: {m}")  # fmt: skip
        for r in ranks:
            assert r["same"] and r["names"] == [] and r["stages"] == [0, 1], (kind, r)
            mine = r["calls"][r["pp_rank"]]  # the layer this rank owns: forward and recomputation per microbatch
            assert mine == 2 * tm.STEPS * MICROBATCHES and r["calls"][1 - r["pp_rank"]] == 0, (kind, r["calls"])
            if r["pp_rank"] == 0:  # gather_to_rank0: Hugging Face's own keys, nothing twice, stock values
                assert r["full"].keys() == ref_state.keys(), kind
                for name, value in ref_state.items():
                    torch.testing.assert_close(r["full"][name], value, rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{kind} {name}: {m}")  # fmt: skip
