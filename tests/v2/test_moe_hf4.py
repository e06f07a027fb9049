"""transformers 4.x Mixtral names for the stacked experts (smp_compat/v2/moe/hf4.py), without transformers:
w1 and w3 are the two halves of gate_up_proj's rows, w2 is down_proj, in 4.x's key order, and back."""

from __future__ import annotations

import torch

from smp_compat.v2.moe.hf4 import from_hf4_names, to_hf4_names

E, I, H = 3, 4, 5
LAYER = "model.layers.{}.block_sparse_moe."


def _stacked() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(7, H, generator=g)}
    for n in range(2):
        sd[LAYER.format(n) + "gate.weight"] = torch.randn(E, H, generator=g)
        sd[LAYER.format(n) + "experts.gate_up_proj"] = torch.randn(E, 2 * I, H, generator=g)
        sd[LAYER.format(n) + "experts.down_proj"] = torch.randn(E, H, I, generator=g)
        sd[f"model.layers.{n}.post_attention_layernorm.weight"] = torch.randn(H, generator=g)
    return sd


def test_stacked_experts_get_4x_names_in_4x_order_and_come_back() -> None:
    stacked = _stacked()
    sd = dict(stacked)
    to_hf4_names(sd)
    layer0 = [k for k in sd if k.startswith(LAYER.format(0))]
    assert layer0 == [LAYER.format(0) + "gate.weight"] + [
        LAYER.format(0) + f"experts.{i}.{w}.weight" for i in range(E) for w in ("w1", "w2", "w3")
    ]
    assert list(sd)[-1] == "model.layers.1.post_attention_layernorm.weight"
    gate_up, down = stacked[LAYER.format(1) + "experts.gate_up_proj"], stacked[LAYER.format(1) + "experts.down_proj"]
    for i in range(E):
        assert torch.equal(sd[LAYER.format(1) + f"experts.{i}.w1.weight"], gate_up[i, :I])
        assert torch.equal(sd[LAYER.format(1) + f"experts.{i}.w3.weight"], gate_up[i, I:])
        assert torch.equal(sd[LAYER.format(1) + f"experts.{i}.w2.weight"], down[i])
    storage = sd[LAYER.format(1) + "experts.0.w1.weight"].untyped_storage()
    assert storage.data_ptr() != gate_up.untyped_storage().data_ptr(), "copies: safetensors refuses shared storage"
    from_hf4_names(sd, set(stacked))
    assert sd.keys() == stacked.keys() and all(torch.equal(sd[k], stacked[k]) for k in sd)


def test_other_layouts_and_incomplete_experts_are_left_alone() -> None:
    five = {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(E, 2 * I, H)}  # transformers 5's own names
    sd = dict(five)
    to_hf4_names(sd)
    assert sd.keys() == five.keys()
    stacked = _stacked()
    sd = dict(stacked)
    to_hf4_names(sd)
    del sd[LAYER.format(0) + "experts.2.w3.weight"]  # a strict load must name what is missing: no stacking
    from_hf4_names(sd, set(stacked))
    assert LAYER.format(0) + "experts.gate_up_proj" not in sd and LAYER.format(1) + "experts.gate_up_proj" in sd
    plain = dict(sd)
    from_hf4_names(plain, set())  # a model that holds per-expert modules itself (stock 4.x under FSDP)
    assert plain.keys() == sd.keys()
