"""smp.nn kernel flags keep the numerics (single process, tp = 1), and FlashAttentionLayer equals plain attention."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

import smp_compat as smp


def _layer(**flags: object) -> smp.nn.DistributedTransformerLayer:
    torch.manual_seed(0)
    return smp.nn.DistributedTransformerLayer(
        num_attention_heads=4, attention_head_size=8, hidden_size=32, intermediate_size=64, attention_dropout_prob=0.0,
        hidden_dropout_prob=0.0, causal_mask_size=8, pre_layernorm=True, post_layernorm=False, **flags)  # fmt: skip


@pytest.mark.parametrize(
    "flags",
    [{"flash_attention": True}, {"attention_in_fp32": True}, {"query_key_layer_scaling": True, "layer_idx": 3},
     {"fused_softmax": True, "fused_bias_gelu": True, "fused_dropout": True}, {"fp32_residual_addition": True}],
)  # fmt: skip
def test_kernel_flags_keep_the_numerics(flags: dict) -> None:
    x = torch.randn(2, 8, 32)
    mask = torch.zeros(2, 1, 1, 8)
    mask[1, ..., -3:] = torch.finfo(torch.float32).min
    plain, flagged = _layer(), _layer(**flags)
    torch.testing.assert_close(flagged((x, mask))[0], plain((x, mask))[0], rtol=1e-5, atol=1e-6)


def test_unknown_flag_is_a_type_error_and_alibi_unsupported() -> None:
    with pytest.raises(TypeError, match="fused_sofmax"):
        _layer(fused_sofmax=True)
    with pytest.raises(smp.SMPUnsupportedError, match="ALiBi"):
        _layer(use_alibi=True)


def test_flash_attention_layer_equals_plain_attention() -> None:
    torch.manual_seed(0)
    b, s, h, d = 2, 6, 3, 4
    qkv = torch.randn(b, s, 3, h, d)
    layer = smp.nn.FlashAttentionLayer(attention_dropout_prob=0.0, attention_head_size=d)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    expected = F.softmax(scores, -1) @ v
    torch.testing.assert_close(layer(qkv, causal=True), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(smp.SMPUnsupportedError):
        smp.nn.FlashAttentionLayer(triton_flash_attention=True)


def test_smp_nn_modules_equal_torch_at_tp1() -> None:
    torch.manual_seed(0)
    lin = smp.nn.DistributedLinear(6, 5)
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 5)  # same RNG draws: DistributedLinear initializes a full nn.Linear first
    x = torch.randn(3, 6)
    torch.testing.assert_close(lin(x), ref(x))
    assert isinstance(smp.nn.FusedLayerNorm(4), torch.nn.LayerNorm)
    with pytest.raises(smp.SMPUnsupportedError, match="max_norm"):
        smp.nn.DistributedEmbedding(10, 4, max_norm=1.0)


@pytest.mark.hf
def test_unsupported_hf_model_falls_back_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    import transformers
    smp.init({})
    config = transformers.BloomConfig(vocab_size=16, hidden_size=8, n_layer=1, n_head=2)  # not swapped by SMP v1 either
    with smp.tensor_parallelism():
        bloom = transformers.BloomModel(config)
    with caplog.at_level(logging.WARNING, logger="smp_compat"):
        model = smp.DistributedModel(bloom)
    assert model.get_module() is bloom and not model.distributed_modules()
    lines = [r.getMessage() for r in caplog.records if "tensor parallelism" in r.getMessage()]
    assert len(lines) == 1 and "BloomModel has no supported module" in lines[0]


def test_smp_nn_resolves_through_the_smdistributed_shim() -> None:
    from smp_compat import shim

    shim.install()
    try:
        import smdistributed.modelparallel.torch as smp_alias
        from smdistributed.modelparallel.torch.nn import DistributedTransformerLMHead
        from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2
        from smdistributed.modelparallel.torch.nn.huggingface.roberta import translate_state_dict_to_smdistributed

        assert smp_alias.nn is smp.nn and DistributedTransformerLMHead is smp.nn.DistributedTransformerLMHead
        assert translate_state_dict_to_hf_gpt2 is smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2
        assert callable(translate_state_dict_to_smdistributed)
    finally:
        shim.uninstall()
