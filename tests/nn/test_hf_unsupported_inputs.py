"""Every Hugging Face swap refuses, by name, what it does not compute (a key/value cache under any of its names,
``use_cache=True``, ``generate()``, per-layer outputs, 5.x's packed positions and extra arguments) under
transformers 4.x and 5.x alike: a swap that ignored a cache would make generation produce wrong text silently."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import transformers

import tp_models as tm
from smp_compat.errors import SMPUnsupportedError
from smp_compat.nn import huggingface
from smp_compat.nn.huggingface import bert, gpt2, gptj, gptneo, gptneox

pytestmark = pytest.mark.hf


@pytest.fixture(autouse=True)
def _no_heads_left_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Swapping records the GPT-NeoX head count process-wide (the translate functions' default); keep these
    models' count from reaching later tests' ranks, which fork from this process."""
    monkeypatch.setattr(gptneox, "_heads_seen", set())


_SMALL = dict(vocab_size=tm.VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_positions=4 * tm.SEQ, n_embd=tm.HIDDEN, n_layer=1, n_head=tm.HEADS, **_SMALL))  # fmt: skip


def _gptneo() -> torch.nn.Module:
    return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        max_position_embeddings=4 * tm.SEQ, hidden_size=tm.HIDDEN, num_layers=1, num_heads=tm.HEADS,
        attention_types=[[["global"], 1]], **_SMALL))  # fmt: skip


def _gptj() -> torch.nn.Module:
    return transformers.GPTJForCausalLM(transformers.GPTJConfig(
        n_positions=4 * tm.SEQ, n_embd=tm.HIDDEN, n_layer=1, n_head=tm.HEADS, rotary_dim=2, **_SMALL))  # fmt: skip


def _gptneox() -> torch.nn.Module:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        max_position_embeddings=4 * tm.SEQ, hidden_size=tm.HIDDEN, num_hidden_layers=1, num_attention_heads=tm.HEADS,
        intermediate_size=2 * tm.HIDDEN, rotary_pct=0.5, **_SMALL))  # fmt: skip


def _bert(cls: Any = transformers.BertModel, config: Any = transformers.BertConfig) -> torch.nn.Module:
    return cls(config(hidden_size=tm.HIDDEN, num_hidden_layers=1, num_attention_heads=tm.HEADS,
                      intermediate_size=2 * tm.HIDDEN, max_position_embeddings=4 * tm.SEQ, **_SMALL))  # fmt: skip


Builder = tuple[Callable[[], torch.nn.Module], str, Any]
"""(stock model, the attribute holding the module the swap replaces, the swap's module)"""
DECODERS: dict[str, Builder] = {
    "GPT-2": (_gpt2, "transformer", gpt2), "GPT-Neo": (_gptneo, "transformer", gptneo),
    "GPT-J": (_gptj, "transformer", gptj), "GPT-NeoX": (_gptneox, "gpt_neox", gptneox)}  # fmt: skip
ENCODERS: dict[str, Builder] = {
    "BERT": (_bert, "encoder", bert),
    "RoBERTa": (lambda: _bert(transformers.RobertaModel, transformers.RobertaConfig), "encoder", bert)}  # fmt: skip


def _swapped(builder: Builder) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model with its swap at tp = 1, the stock model with the same weights), both in eval mode."""
    make, attr, swap = builder
    torch.manual_seed(0)
    stock = make().eval()
    model = copy.deepcopy(stock)
    setattr(model, attr, swap._build(getattr(model, attr), {}))
    return model, stock


def _ids() -> torch.Tensor:
    return torch.randint(1, tm.VOCAB, (2, tm.SEQ), generator=torch.Generator().manual_seed(0))


def test_every_swap_is_covered() -> None:
    """A swap added later must be added here too (each swapped class is built by one of the builders)."""
    built = {type(m).__name__ for b in (*DECODERS.values(), *ENCODERS.values()) for m in _swapped(b)[0].modules()}
    assert {cls.__name__ for cls, *_ in huggingface._TRANSLATORS} <= built


def _refused(call: Callable[[], Any], *words: str) -> None:
    with pytest.raises(SMPUnsupportedError) as caught:
        call()
    assert all(w in str(caught.value) for w in words), str(caught.value)


def _generate_refused_or_equal(model: torch.nn.Module, stock: torch.nn.Module, ids: torch.Tensor) -> None:
    """generate() hands the swap a cache or use_cache=True, refused; except where a 4.x model's
    prepare_inputs_for_generation passes neither (GPT-NeoX in 4.40): then every step feeds the whole sequence
    again, and the text must be stock Hugging Face's."""
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    try:
        ours = model.generate(ids, **kwargs)
    except SMPUnsupportedError as exc:
        assert "cache" in str(exc)
        return
    assert transformers.__version__.startswith("4."), "under transformers 5 every swap must refuse generate()"
    assert torch.equal(ours, stock.generate(ids, **kwargs))


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_swap_refuses_caches_and_generate(name: str) -> None:
    model, stock = _swapped(DECODERS[name])
    ids = _ids()
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # a plain forward, use_cache left to its default, works
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        _refused(lambda: model(input_ids=ids, past_key_values=transformers.DynamicCache(), use_cache=True),
                 "KV cache", name)  # fmt: skip
        _refused(lambda: model(input_ids=ids, use_cache=True), "use_cache=True")
        _generate_refused_or_equal(model, stock, ids)
        _refused(lambda: model(input_ids=ids, output_attentions=True), "output_attentions")
        _refused(lambda: model(input_ids=ids, output_hidden_states=True), "output_hidden_states")
        packed = torch.tensor([[0, 1, 2, 0, 1, 2]]).expand(2, -1)  # transformers 5: two packed sequences
        _refused(lambda: model(input_ids=ids, position_ids=packed), "packed")
        model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=packed)  # with a mask: no packing


def test_decoder_swap_refuses_a_cache_handed_to_the_swapped_module_itself() -> None:
    """The swapped module directly, under each name a cache has had (4.x, 5.x, a layer's)."""
    inner, ids = _swapped(DECODERS["GPT-NeoX"])[0].gpt_neox, _ids()
    for name in ("past_key_values", "cache", "layer_past"):
        _refused(lambda: inner(input_ids=ids, **{name: transformers.DynamicCache()}), "KV cache")
    _refused(lambda: inner(input_ids=ids, cache_position=torch.arange(tm.SEQ)), "cache_position")
    _refused(lambda: inner(input_ids=ids, cu_seq_lens_q=torch.tensor([0, tm.SEQ])), "cu_seq_lens_q")


@pytest.mark.parametrize("name", ENCODERS)
def test_encoder_swap_refuses_what_it_does_not_compute(name: str) -> None:
    model, ids = _swapped(ENCODERS[name])[0], _ids()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
        _refused(lambda: model(input_ids=ids, output_attentions=True), "output_attentions")
        _refused(lambda: model(input_ids=ids, output_hidden_states=True), "output_hidden_states")
        h = torch.zeros(2, tm.SEQ, tm.HIDDEN)
        _refused(lambda: model.encoder(h, past_key_values=transformers.DynamicCache()), "KV cache")
        _refused(lambda: model.encoder(h, head_mask=torch.ones(1, tm.HEADS)), "head_mask")


def _hooked_gpt2_generates() -> str:
    import smp_compat as smp
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    smp.init({})
    smp.tp_register_with_module(GPT2Block, smp.nn.DistributedTransformerLayer, *gpt2.get_hf_gpt2_transformer_layer_hooks())
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_positions=4 * tm.SEQ, n_embd=tm.HIDDEN, n_layer=2, n_head=tm.HEADS, **_SMALL))  # fmt: skip
    for block in hf.transformer.h:
        smp.set_tensor_parallelism(block)
    model = smp.DistributedModel(hf).get_module().eval()
    ids = _ids()
    try:
        with torch.no_grad():
            model(input_ids=ids)  # one forward with the default use_cache works
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)
    except SMPUnsupportedError as exc:
        return str(exc)
    return ""


def test_gpt2_block_hooks_refuse_generate() -> None:
    """The layer-level hooks leave HF's GPT2Model, which hands the blocks a cache they never fill: generation's
    second step (the new token alone with that cache) must be refused, not computed without its history."""
    from smp_compat.testing import run_ranks

    assert "KV cache" in run_ranks(_hooked_gpt2_generates, 1, timeout=120)[0]
