"""SMP's flash-attention modules (``torch.sagemaker.nn.attn``, ``nn.huggingface.llama_flashattn``) as working
modules: the same results as plain softmax attention up to rounding, called as AWS's 2023 HyperPod scripts
(awsome-distributed-training ``11.modelparallel/train_utils.py``) call them."""

from __future__ import annotations

import functools
import inspect
import math

import pytest
import torch

from smp_compat.errors import SMPConfigError, SMPUnsupportedError
from smp_compat.v2.nn.attn import FlashGroupedQueryAttention, FlashSelfAttention


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Softmax attention written out, b h s d; k/v heads repeated for grouped queries."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def _qkv(heads: int = 4, kv_heads: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, 6, 8, generator=gen, dtype=torch.float64),
            torch.randn(2, kv_heads, 6, 8, generator=gen, dtype=torch.float64),
            torch.randn(2, kv_heads, 6, 8, generator=gen, dtype=torch.float64))  # fmt: skip


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["b h s d", "b s h d"])
@pytest.mark.parametrize("packed", [False, True])
def test_flash_self_attention_equals_plain_attention(causal: bool, layout: str, packed: bool) -> None:
    q, k, v = _qkv()
    expected = _plain(q, k, v, causal)
    if layout == "b s h d":
        q, k, v, expected = (t.transpose(1, 2) for t in (q, k, v, expected))
    heads_dim = 1 if layout == "b h s d" else 2
    qkv = torch.cat([q, k, v], dim=heads_dim) if packed else (q, k, v)
    out = FlashSelfAttention(attention_dropout_prob=0.0)(qkv, causal=causal, layout=layout)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["b h s d", "b s h d"])
@pytest.mark.parametrize("packed", [False, True])
def test_flash_grouped_query_attention_equals_plain_attention(layout: str, packed: bool) -> None:
    q, k, v = _qkv(heads=4, kv_heads=2)
    expected = _plain(q, k, v, causal=True)
    if layout == "b s h d":
        q, k, v, expected = (t.transpose(1, 2) for t in (q, k, v, expected))
    heads_dim = 1 if layout == "b h s d" else 2
    kv = torch.cat([k, v], dim=heads_dim) if packed else (k, v)
    out = FlashGroupedQueryAttention()(q, kv, causal=True, layout=layout)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_cast_dtype_and_refusals() -> None:
    q, k, v = (t.float() for t in _qkv())
    out = FlashSelfAttention()((q, k, v), causal=True, cast_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _plain(q, k, v, True), rtol=2e-2, atol=2e-2)
    with pytest.raises(SMPConfigError, match="layout"):
        FlashSelfAttention()((q, k, v), layout="s b h d")
    with pytest.raises(SMPUnsupportedError, match="use_alibi"):
        FlashSelfAttention()((q, k, v), attn_mask=torch.zeros(2, 1, 1, 6))
    with pytest.raises(SMPConfigError, match="multiple"):
        FlashGroupedQueryAttention()(q[:, :3], (k[:, :2], v[:, :2]), layout="b h s d")


def test_dropout_only_while_training() -> None:
    q, k, v = (t.float() for t in _qkv())
    module = FlashSelfAttention(attention_dropout_prob=0.5).eval()
    torch.testing.assert_close(module((q, k, v), causal=True), _plain(q, k, v, True))
    module.train()
    assert not torch.allclose(module((q, k, v), causal=True), _plain(q, k, v, True))


@pytest.mark.hf
def test_the_2023_scripts_gpt_neox_patch_gives_the_models_results() -> None:
    """11.modelparallel's create_model with use_smp_flash_attn: ``flashmod`` + a replaced ``_attn`` per layer
    (transformers whose GPT-NeoX attention still calls ``_attn``; newer ones ignore the patch), logits equal."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=32)  # fmt: skip
    model = GPTNeoXForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (2, 12))
    expected = model(tokens).logits

    def new_attn(self, q, k, v, attention_mask=None, head_mask=None):  # the script's function, verbatim in kind
        return self.flashmod((q, k, v), causal=True, cast_dtype=torch.float32, layout="b h s d"), None

    calls = []
    for layer in model.gpt_neox.layers:
        layer.attention.flashmod = FlashSelfAttention(attention_dropout_prob=0.0)
        layer.attention.flashmod.register_forward_hook(lambda *_: calls.append(1))
        layer.attention._attn = functools.partial(new_attn, layer.attention)
    torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    calls_attn = "._attn(" in inspect.getsource(type(model.gpt_neox.layers[0].attention).forward)
    assert len(calls) == (2 if calls_attn else 0)


@pytest.mark.hf
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_llama_flash_attention_replaces_the_layers_attention(implementation: str) -> None:
    """As 11.modelparallel does it: ``LlamaFlashAttention(model.config)`` per layer, q/k/v/o weights copied;
    logits and gradients equal the model's own attention, with and without padding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from smp_compat.v2.nn.huggingface.llama_flashattn import LlamaFlashAttention

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation=implementation)  # fmt: skip
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding in the second row
    expected = [model(tokens).logits, model(tokens, attention_mask=mask).logits]
    expected[0].sum().backward()
    expected_grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.zero_grad()

    for index, layer in enumerate(model.model.layers):
        previous = layer.self_attn
        layer.self_attn = LlamaFlashAttention(model.config)
        layer.self_attn.layer_idx = index
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.copy_(getattr(previous, name).weight)
    assert model.config._attn_implementation == implementation  # the model's own config is untouched
    calls = []
    for layer in model.model.layers:
        layer.self_attn.flash_attn.register_forward_hook(lambda *_: calls.append(1))
    got = [model(tokens).logits, model(tokens, attention_mask=mask).logits]
    from smp_compat.v2.nn.huggingface import llama_flashattn

    # the flash module computed every layer's attention (transformers < 4.48: their SDPA class's own sdpa call)
    assert len(calls) == (0 if llama_flashattn._SDPA_CLASSES else 4)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1][:, 3:], expected[1][:, 3:], rtol=1e-5, atol=1e-5)  # padded rows' tokens
    got[0].sum().backward()
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj.weight.grad, expected_grad,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
