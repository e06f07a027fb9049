"""Hugging Face BERT and RoBERTa under tensor parallelism: the encoder swapped, training equal to stock HF."""

from __future__ import annotations

import pytest
import torch

import transformers  # the test extra installs it: these tests must run, not skip

import tp_models as tm  # noqa: E402
from smp_compat.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.hf  # run again under the oldest supported transformers

CLASSES = 3


def _config(kind: str) -> object:
    cls = transformers.BertConfig if kind == "bert" else transformers.RobertaConfig
    return cls(vocab_size=tm.VOCAB, hidden_size=tm.HIDDEN, num_hidden_layers=2, num_attention_heads=tm.HEADS,
               intermediate_size=2 * tm.HIDDEN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               max_position_embeddings=tm.SEQ + 4, num_labels=CLASSES, pad_token_id=1)  # fmt: skip


def _model(kind: str) -> torch.nn.Module:
    cls = transformers.BertForSequenceClassification if kind == "bert" else transformers.RobertaForSequenceClassification
    return cls(_config(kind))


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[ids[:, 0] % 3 == 0, -2:] = 0  # padding chosen by content: the same on any split of the batch
    return model(input_ids=ids, attention_mask=mask, labels=ids[:, 1] % CLASSES).loss


def _train(kind: str, prescaled: bool) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        hf = _model(kind)
    model = smp.DistributedModel(hf)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    encoder = getattr(model.get_module(), kind).encoder

    losses = tm.train(smp, model, opt, _loss)
    translate = getattr(smp.nn.huggingface, kind)
    to_hf = translate.translate_state_dict_to_hf_bert if kind == "bert" else translate.translate_state_dict_to_hf_roberta
    return {"losses": losses, "hf": to_hf(model.state_dict()), "swapped": hasattr(encoder, "seq_layers")}


@pytest.mark.parametrize(("kind", "prescaled"), [("bert", False), ("bert", True), ("roberta", False)])
def test_encoder_tp2_matches_stock_hf(kind: str, prescaled: bool) -> None:
    results = run_ranks(_train, 2, kind, prescaled, timeout=240)
    ref_losses, ref_params = tm.reference(lambda: _model(kind), loss_fn=_loss)
    torch.testing.assert_close(torch.tensor([r["losses"] for r in results]).mean(0), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    stock = _model(kind)
    for r in results:
        assert r["swapped"]
        stock.load_state_dict(r["hf"], strict=True)
        for name, value in ref_params.items():
            torch.testing.assert_close(r["hf"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
