"""Delayed parameter initialization gives the model what a normal build gives it (up to random draws).

Each test builds the same model twice, normally and under ``smp.model_creation()`` with
``delayed_parameter_initialization``, and compares: buffers exactly, parameters by distribution (mean and
std per tensor within a statistical tolerance; constant tensors exactly), tied weights by identity and init.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from smp_compat.testing import run_ranks

SEQ, DIM = 16, 64


def _assert_same_distribution(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Same values for constant tensors; otherwise mean and std within ~4 standard errors of each other."""
    got, ref = got.detach().float(), ref.detach().float()
    assert got.shape == ref.shape, name
    assert not torch.isnan(got).any(), f"{name} holds NaN (never initialized)"
    if ref.numel() < 2 or ref.std() == 0:
        assert torch.equal(got, ref), f"{name}: {got.flatten()[:4]} vs {ref.flatten()[:4]}"
        return
    n, std = ref.numel(), ref.std().item()
    mean_gap = abs(got.mean().item() - ref.mean().item())
    assert mean_gap < 6 * std / math.sqrt(n), f"{name}: mean {got.mean()} vs {ref.mean()}"
    assert abs(got.std().item() / std - 1) < 6 / math.sqrt(2 * n), f"{name}: std {got.std()} vs {std}"


class RotaryBlock(nn.Module):
    """A module with reset_parameters() and constant buffers computed in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(DIM, DIM))
        self.register_buffer("causal_mask", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (x @ self.weight) @ x.transpose(-1, -2)
        scores = scores.masked_fill(~self.causal_mask[: x.shape[-2], : x.shape[-2]], float("-inf"))
        return torch.softmax(scores, -1) @ x * self.inv_freq.repeat(2)


class TiedLM(nn.Module):
    """Embedding, attention, norm and an output head tied to the embedding (nn.MultiheadAttention if ``mha``)."""

    def __init__(self, vocab: int = 1000, head_first: bool = False, mha: bool = False) -> None:
        super().__init__()
        if head_first:  # the head creates the weight; the embedding takes it over
            self.head = nn.Linear(DIM, vocab, bias=False)
            self.emb = nn.Embedding(vocab, DIM)
            self.emb.weight = self.head.weight
        else:
            self.emb = nn.Embedding(vocab, DIM)
            self.head = nn.Linear(DIM, vocab, bias=False)
            self.head.weight = self.emb.weight
        self.block = RotaryBlock()
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True) if mha else None
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.block(h) + (self.attn(h, h, h, need_weights=False)[0] if self.attn is not None else 0)
        return self.head(self.norm(self.fc(h)))


def _delayed(build, config: dict | None = None):
    import smp_compat as smp

    smp.init({"delayed_parameter_initialization": True, **(config or {})})
    with smp.model_creation():
        return build()


def _train(model, steps: int = 4, vocab: int = 1000) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train a few steps; return the losses and the parameters as materialized (before the first update)."""
    import smp_compat as smp

    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(model, tokens):
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))
        model.backward(loss)
        return loss

    tokens = torch.randint(0, vocab, (4, SEQ), generator=torch.Generator().manual_seed(0))
    losses, fresh = [], {}
    for step in range(steps):
        opt.zero_grad()
        losses.append(train_step(model, tokens).reduce_mean().item())
        if step == 0:
            fresh = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        opt.step()
    return losses, fresh


def test_buffers_made_in_init_keep_their_values() -> None:
    import smp_compat as smp

    net = _delayed(TiedLM)
    assert all(p.is_meta for p in net.parameters())
    built_real = not any(b.is_meta for b in net.buffers())
    model = smp.DistributedModel(net)
    _train(model, steps=1)
    ref = TiedLM()
    for name, buffer in ref.named_buffers():
        assert torch.equal(dict(net.named_buffers())[name], buffer), name
    assert built_real  # buffers hold their values from construction on


def _rotary_pp2() -> dict:
    import smp_compat as smp

    torch.set_num_threads(1)
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}
    net = _delayed(lambda: nn.Sequential(RotaryBlock(), RotaryBlock()), config)
    model = smp.DistributedModel(net)
    smp.set_partition(net[1], 1)

    @smp.step
    def train_step(model, x):
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    train_step(model, torch.randn(4, SEQ, DIM))
    return {"buffers": {n: b.clone() for n, b in model.local_named_buffers()},
            "params": {n: p.detach().clone() for n, p in model.local_named_parameters()}}  # fmt: skip


def test_buffers_and_parameters_at_pp2_are_each_ranks_own_and_real() -> None:
    results = run_ranks(_rotary_pp2, 2, timeout=120)
    ref = nn.Sequential(RotaryBlock(), RotaryBlock())
    assert [set(r["params"]) for r in results] == [{"0.weight"}, {"1.weight"}]
    for r in results:
        for name, value in r["buffers"].items():
            assert torch.equal(value, dict(ref.named_buffers())[name]), name
        for name, value in r["params"].items():
            _assert_same_distribution(name, value, dict(ref.named_parameters())[name])
    assert sorted(n for r in results for n in r["buffers"]) == sorted(n for n, _ in ref.named_buffers())


@pytest.mark.parametrize("head_first", [False, True])
def test_parameters_have_the_distribution_of_a_normal_build(head_first: bool) -> None:
    import smp_compat as smp

    net = _delayed(lambda: TiedLM(head_first=head_first))
    model = smp.DistributedModel(net)
    losses, fresh = _train(model)
    assert losses[-1] < losses[0]
    assert net.head.weight is net.emb.weight
    ref = dict(TiedLM(head_first=head_first).named_parameters())
    for name, param in fresh.items():
        _assert_same_distribution(name, param, ref[name])
    # the tied weight keeps its creator's init: Embedding N(0, 1), or Linear U(+-1/sqrt(in)) when the head made it
    creator_std = 1 / math.sqrt(3 * DIM) if head_first else 1.0
    tied = fresh["head.weight" if head_first else "emb.weight"]
    assert abs(tied.std().item() - creator_std) < 0.05 * creator_std


def test_multihead_attention_is_initialized_by_its_own_init() -> None:
    import smp_compat as smp

    net = _delayed(lambda: nn.MultiheadAttention(DIM, 4, batch_first=True))
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, x):
        out = model(x, x, x, need_weights=False)[0]
        model.backward(out.pow(2).mean())
        return out

    train_step(model, torch.randn(2, SEQ, DIM))
    ref = nn.MultiheadAttention(DIM, 4, batch_first=True)
    for name, param in ref.named_parameters():
        _assert_same_distribution(name, dict(net.named_parameters())[name], param)


def test_writes_after_construction_warn_once_naming_the_parameters() -> None:
    import smp_compat as smp

    net = _delayed(TiedLM)
    nn.init.normal_(net.fc.weight, std=0.02)  # a script's own init: not replayed
    net.norm.bias.data.fill_(0.5)
    net.fc.reset_parameters()  # an initializer that is replayed: no warning for it...
    nn.init.normal_(net.fc.weight, std=0.02)  # ...but this later write is not replayed
    model = smp.DistributedModel(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, steps=2)
    messages = [str(w.message) for w in caught if "cannot replay" in str(w.message)]
    assert len(messages) == 1, messages
    assert "fc.weight" in messages[0] and "norm.bias" in messages[0]
    assert "fc.bias" not in messages[0] and "emb.weight" not in messages[0]


class InitLoopLM(nn.Module):
    """nanoGPT's pattern: an init loop in ``__init__``, outside any reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, DIM)
        self.fc = nn.Linear(DIM, 100)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(tokens))


def test_init_loop_in_a_models_init_warns() -> None:
    import smp_compat as smp

    model = smp.DistributedModel(_delayed(InitLoopLM))
    with pytest.warns(UserWarning, match="cannot replay") as caught:
        _train(model, steps=1, vocab=100)
    message = next(str(w.message) for w in caught if "cannot replay" in str(w.message))
    assert "fc.weight" in message and "emb.weight" not in message and "fc.bias" not in message


def test_construction_inits_do_not_warn() -> None:
    import smp_compat as smp

    net = _delayed(lambda: TiedLM(mha=True))
    model = smp.DistributedModel(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, steps=1)
    assert not [w for w in caught if "cannot replay" in str(w.message)]


def test_module_without_initializer_names_its_type_and_the_fix() -> None:
    import smp_compat as smp

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(DIM))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    model = smp.DistributedModel(_delayed(lambda: nn.Sequential(nn.Linear(DIM, DIM), Scale())))

    @smp.step
    def train_step(model, x):
        return model(x).sum()

    with pytest.raises(smp.SMPUnsupportedError, match=r"Scale.*reset_parameters\(\)"):
        train_step(model, torch.zeros(2, DIM))


def test_a_load_before_the_first_step_fills_parameters_without_an_initializer() -> None:
    """Delayed init, then a pretrained checkpoint (SMP's usual pattern): no initializer is needed."""
    import smp_compat as smp

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(DIM))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    pretrained = nn.Sequential(nn.Linear(DIM, DIM), Scale())
    model = smp.DistributedModel(_delayed(lambda: nn.Sequential(nn.Linear(DIM, DIM), Scale())))
    model.load_state_dict(pretrained.state_dict())

    @smp.step
    def forward_step(model, x):
        return model(x)

    x = torch.randn(2, DIM)
    torch.testing.assert_close(forward_step(model, x).concat(), pretrained(x), rtol=0, atol=0)


def test_parameter_an_initializer_leaves_unset_is_an_error() -> None:
    import smp_compat as smp

    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.empty(DIM))
            self.b = nn.Parameter(torch.zeros(DIM))  # set in __init__ only
            self.reset_parameters()

        def reset_parameters(self) -> None:
            nn.init.normal_(self.a)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.a + self.b

    model = smp.DistributedModel(_delayed(Partial))

    @smp.step
    def train_step(model, x):
        return model(x).sum()

    with pytest.raises(smp.SMPUnsupportedError, match=r"\bb\b.*uninitialized"):
        train_step(model, torch.zeros(2, DIM))


# ---------------------------------------------------------------------- transformers GPT-2


def _gpt2_config():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)


def _gpt2(pp: int) -> dict:
    """One rank: delayed GPT-2 at ``pp`` stages; its local parameters, buffers and losses."""
    import transformers

    import smp_compat as smp

    torch.set_num_threads(1)
    config = {"pipeline_parallel_degree": pp, "microbatches": 2, "auto_partition": False, "default_partition": 0}
    net = _delayed(lambda: transformers.GPT2LMHeadModel(_gpt2_config()), config)
    model = smp.DistributedModel(net)
    if pp > 1:
        smp.set_partition(net.transformer.h[1], 1)
        smp.set_partition(net.transformer.ln_f, 1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(model, tokens):
        loss = model(input_ids=tokens, labels=tokens).loss
        model.backward(loss)
        return loss

    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    fresh = {}
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            opt.zero_grad()
            losses.append(train_step(model, tokens).reduce_mean().item())
            if step == 0:
                fresh = {n: p.detach().clone() for n, p in model.local_named_parameters()}
            opt.step()
    unreplayed = [str(w.message) for w in caught if "cannot replay" in str(w.message)]
    return {"losses": losses, "fresh": fresh, "tied": net.lm_head.weight is net.transformer.wte.weight,
            "unreplayed": unreplayed,
            "buffers": {n: b.clone() for n, b in model.local_named_buffers()}}  # fmt: skip


def _check_gpt2(results: list[dict]) -> None:
    import transformers

    torch.manual_seed(3)
    ref = transformers.GPT2LMHeadModel(_gpt2_config())
    ref_params = dict(ref.named_parameters())
    ref_buffers = dict(ref.named_buffers())
    seen = set()
    for r in results:
        assert r["tied"] and not r["unreplayed"]
        assert r["losses"][-1] < r["losses"][0] - 0.5, r["losses"]
        for name, value in r["fresh"].items():
            _assert_same_distribution(name, value, ref_params[name])
            seen.add(name)
        for name, value in r["buffers"].items():
            assert torch.equal(value, ref_buffers[name]), name
    assert seen == set(ref_params)  # every parameter was materialized on some rank


@pytest.mark.hf
def test_hf_gpt2_delayed_at_pp1() -> None:
    _check_gpt2([_gpt2(1)])


@pytest.mark.hf
def test_hf_gpt2_delayed_at_pp2() -> None:
    results = run_ranks(_gpt2, 2, 2, timeout=180)
    assert results[0]["losses"] == results[1]["losses"]
    assert not set(results[0]["fresh"]) & set(results[1]["fresh"])  # each rank materialized only its own
    _check_gpt2(results)
