"""Every Hugging Face swap maps the activations smp.nn has and refuses the others by name (ValueError, so
``DistributedModel`` leaves the model unswapped with a warning instead of training a different function)."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from smp_compat.nn.huggingface import bert, gpt2, gptj, gptneo, gptneox

pytestmark = pytest.mark.hf  # run again under the oldest supported transformers

SWAPS: list[tuple[Any, Any, str]] = [
    (gpt2, lambda act: transformers.GPT2Config(n_embd=8, n_head=2, activation_function=act), "activation_function"),
    (gptneo, lambda act: transformers.GPTNeoConfig(hidden_size=8, num_heads=2, num_layers=2,
                                                   attention_types=[[["global"], 2]], activation_function=act),
     "activation_function"),  # fmt: skip
    (gptj, lambda act: transformers.GPTJConfig(n_embd=8, n_head=2, rotary_dim=4, activation_function=act),
     "activation_function"),  # fmt: skip
    (bert, lambda act: transformers.BertConfig(hidden_size=8, num_attention_heads=2, hidden_act=act), "hidden_act"),
    (gptneox, lambda act: transformers.GPTNeoXConfig(hidden_size=8, num_attention_heads=2, rotary_pct=1.0,
                                                     hidden_act=act), "hidden_act"),  # fmt: skip
]


@pytest.mark.parametrize("swap, config, field", SWAPS, ids=lambda v: getattr(v, "__name__", "").split(".")[-1])
def test_supported_activation_is_mapped(swap: Any, config: Any, field: str) -> None:
    assert swap._layer_kwargs(config("gelu_pytorch_tanh"))["activation"] == "gelu_tanh"


@pytest.mark.parametrize("swap, config, field", SWAPS, ids=lambda v: getattr(v, "__name__", "").split(".")[-1])
def test_unsupported_activation_is_refused_by_name(swap: Any, config: Any, field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} 'silu' is not supported"):
        swap._layer_kwargs(config("silu"))
