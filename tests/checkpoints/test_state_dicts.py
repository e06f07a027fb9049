"""Model and optimizer state dicts across pipeline ranks: full, partial, plain PyTorch, deferred loads (§2.3, §2.4)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import smp_compat as smp
from models import causal_mask, lm_loss, make_batches, make_model
from smp_compat.errors import CheckpointError
from smp_compat.testing import run_ranks

__all__: list[str] = []

# The first optimizer of a process imports torch._dynamo (seconds); do it once here so that forked
# ranks inherit it instead of each paying for it.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}
BATCH = 4



# ---------------------------------------------------------------------------- rank-side helpers


def _place(model: Any, first_on_rank1: int) -> None:
    """Blocks from ``first_on_rank1`` on, and ln_f, on pipeline rank 1; the rest on rank 0."""
    for i, block in enumerate(model.module.blocks):
        smp.set_partition(block, 1 if i >= first_on_rank1 else 0)
    smp.set_partition(model.module.ln_f, 1)


def _steps() -> tuple[Any, Any]:
    mask = causal_mask(8)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(loss)
        return loss

    @smp.step
    def eval_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x, attention_mask=mask)

    return train_step, eval_step


def _train(model: Any, opt: Any, train_step: Any, steps: int) -> None:
    for x, y in make_batches(steps, BATCH):
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()


def _local_params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.local_named_parameters()}


def _probe() -> torch.Tensor:
    return make_batches(1, BATCH, seed=99)[0][0]


def _gather_after_training(first_on_rank1: int) -> dict[str, Any]:
    smp.init(PP2)
    model = smp.DistributedModel(make_model())
    _place(model, first_on_rank1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    train_step, eval_step = _steps()
    _train(model, opt, train_step, 2)
    with torch.no_grad():
        logits = eval_step(model, _probe()).concat()
    full = model.state_dict()
    everywhere = model.state_dict(gather_to_rank0=False)  # on rank 1 the tied pair arrives from rank 0
    return {
        "pp": smp.pp_rank(),
        "full": full,
        "tied_shared": bool(full) and full["embed.weight"].data_ptr() == full["head.weight"].data_ptr(),
        "tied_shared_everywhere": everywhere["embed.weight"].data_ptr() == everywhere["head.weight"].data_ptr(),
        "everywhere": everywhere,
        "local": model.local_state_dict(),
        "params": _local_params(model),
        "logits": logits,
        "opt_full": opt.state_dict(),
        "opt_root": opt.state_dict(gather_to_rank0=True),
        "opt_local": opt.local_state_dict(),
    }


def _load_plain(plain_before: dict, plain_after: dict) -> dict[str, Any]:
    """A plain PyTorch dict before the first step (deferred), another one after partitioning (immediate)."""
    smp.init(PP2)
    model = smp.DistributedModel(make_model())
    _place(model, 2)
    result = model.load_state_dict(plain_before)
    untouched = torch.equal(model.module.embed.weight, make_model().embed.weight)  # deferred: not yet copied
    _, eval_step = _steps()
    with torch.no_grad():
        first = eval_step(model, _probe()).concat()
    loaded_first = _local_params(model)
    model.load_state_dict(plain_after)
    with torch.no_grad():
        second = eval_step(model, _probe()).concat()
    return {
        "result": (list(result.missing_keys), list(result.unexpected_keys)),
        "untouched": untouched,
        "first": first,
        "second": second,
        "loaded_first": loaded_first,
        "loaded_second": _local_params(model),
    }


def _load_parts(parts: list[dict], opt_parts: list[dict], first_on_rank1: int, same_partition_load: bool) -> dict:
    """Each rank loads the part saved by its pipeline rank, under the given partition."""
    from smp_compat.checkpoints import deferred_loads, state_dicts

    merges = []
    real = state_dicts.merge_model_parts
    state_dicts.merge_model_parts = lambda p: (merges.append(1), real(p))[1]  # type: ignore[assignment]
    smp.init(PP2)
    model = smp.DistributedModel(make_model(seed=3))
    _place(model, first_on_rank1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    model.load_state_dict(parts[smp.pp_rank()], same_partition_load=same_partition_load)
    opt.load_state_dict(opt_parts[smp.pp_rank()])
    reusable = deferred_loads.saved_partition(model)  # what a partitioner may reuse (SMP's same_partition_load)
    _, eval_step = _steps()
    with torch.no_grad():
        eval_step(model, _probe())
    return {"params": _local_params(model), "merged": bool(merges), "opt_full": opt.state_dict(), "reusable": reusable}


# ---------------------------------------------------------------------------- pp = 2


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    return run_ranks(_gather_after_training, 2, 2, timeout=60)


def test_full_state_dict_gathers_to_rank0_in_plain_pytorch_order(trained: list[dict[str, Any]]) -> None:
    root, other = trained
    plain_keys = list(make_model().state_dict().keys())
    assert list(root["full"].keys()) == plain_keys
    assert other["full"] == {}  # gather_to_rank0: the other pipeline ranks get an empty dict
    assert root["tied_shared"]  # tied weights under both names, one storage, as plain PyTorch
    for r in trained:
        assert list(r["everywhere"].keys()) == plain_keys
        assert r["tied_shared_everywhere"]  # also where the tied pair was gathered from another rank
        for name, value in r["params"].items():
            assert torch.equal(root["full"][name], value)
            assert root["full"][name].device.type == "cpu"


def test_full_state_dict_loads_into_the_plain_model_with_identical_outputs(trained: list[dict[str, Any]]) -> None:
    plain = make_model(seed=5)
    plain.load_state_dict(trained[0]["full"])  # strict: every key, nothing extra
    with torch.no_grad():  # one thread, as the ranks ran (tests/conftest.py)
        logits = plain(_probe(), attention_mask=causal_mask(8))
    assert torch.equal(logits, trained[0]["logits"])


def test_local_state_dict_holds_this_ranks_entries_and_markers(trained: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for r in trained:
        local = r["local"]
        assert local["_smp_is_partial"] is True
        info = local["_smp_load_info"]
        assert info["pipeline_parallel_degree"] == 2 and info["tensor_parallel_degree"] == 1
        assert info["partition_info"]["assignment"]["blocks.3.ln1"] == 1
        keys = {k for k in local if not k.startswith("_smp_")}
        assert not keys & seen
        seen |= keys
        assert {n for n in r["params"]} <= keys
    assert seen == set(make_model().state_dict().keys())
    assert {"embed.weight", "head.weight", "pos"} <= {k for k in trained[0]["local"]}


def test_full_optimizer_state_dict_is_plain_torch_format(trained: list[dict[str, Any]]) -> None:
    root, other = trained
    plain = make_model()
    names = [n for n, _ in plain.named_parameters()]
    for r in trained:
        full = r["opt_full"]
        assert sorted(full["state"]) == list(range(len(names)))  # Adam state for every parameter
        assert [g["params"] for g in full["param_groups"]] == [list(range(len(names)))]
    assert other["opt_root"] == {} and sorted(root["opt_root"]["state"]) == list(range(len(names)))
    # The state of each parameter is exactly its owner's local state.
    for r in trained:
        local = r["opt_local"]
        assert local["_smp_is_partial"] is True and local["_smp_param_names"] == names
        assert {names[i] for i in local["state"]} == set(r["params"])
        for i, s in local["state"].items():
            for key, value in s.items():
                assert torch.equal(root["opt_full"]["state"][i][key], value)
    reference = torch.optim.Adam(plain.parameters(), lr=1e-2)
    reference.load_state_dict(root["opt_full"])  # loads into plain PyTorch
    assert len(reference.state) == len(names)


def test_plain_pytorch_dict_loads_into_a_partitioned_model(tmp_path: Any) -> None:
    before, after = make_model(seed=7), make_model(seed=9)
    results = run_ranks(_load_plain, 2, before.state_dict(), after.state_dict(), timeout=60)
    with torch.no_grad():  # one thread, as the ranks ran (tests/conftest.py)
        expect_first = before(_probe(), attention_mask=causal_mask(8))
        expect_second = after(_probe(), attention_mask=causal_mask(8))
    for r in results:
        assert r["result"] == ([], [])
        assert r["untouched"]  # deferred until partitioning, as SMP
        for name, value in r["loaded_first"].items():
            assert torch.equal(value, before.state_dict()[name])
        for name, value in r["loaded_second"].items():
            assert torch.equal(value, after.state_dict()[name])
        assert torch.equal(r["first"], expect_first)
        assert torch.equal(r["second"], expect_second)


@pytest.mark.parametrize(("first_on_rank1", "same", "merges"), [(2, True, False), (1, True, True), (2, False, True)])
def test_partial_dicts_load_under_the_same_or_another_partition(
    trained: list[dict[str, Any]], first_on_rank1: int, same: bool, merges: bool
) -> None:
    parts = [r["local"] for r in trained]
    opt_parts = [r["opt_local"] for r in trained]
    results = run_ranks(_load_parts, 2, parts, opt_parts, first_on_rank1, same, timeout=60)
    full = trained[0]["full"]
    saved = trained[0]["local"]["_smp_load_info"]["partition_info"]["assignment"]
    for r in results:
        assert r["merged"] is merges
        assert r["reusable"] == (saved if same else None)
        for name, value in r["params"].items():
            assert torch.equal(value, full[name])
        for i, s in trained[0]["opt_full"]["state"].items():
            for key, value in s.items():
                assert torch.equal(r["opt_full"]["state"][i][key], value)


# ---------------------------------------------------------------------------- pp = 1 (in process)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def _pp1(seed: int = 0) -> tuple[Any, Any, Any]:
    smp.init({})
    torch.manual_seed(seed)
    model = smp.DistributedModel(Net())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    @smp.step
    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    return model, opt, step


def _partition(model: Any) -> None:
    """Partitioning happens in the first step call; an evaluation step does it without training."""

    @smp.step
    def look(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with torch.no_grad():
        look(model, torch.zeros(8, 4))


def _run(model: Any, opt: Any, step: Any, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        opt.zero_grad()
        step(model, torch.randn(8, 4, generator=g))
        opt.step()


def test_pp1_state_dicts_are_plain_pytorch() -> None:
    model, opt, step = _pp1()
    _run(model, opt, step, 2)
    sd = model.state_dict()
    assert list(sd) == list(Net().state_dict())
    assert getattr(sd, "_metadata", None) is not None  # torch's version info survives (BatchNorm needs it)
    local = model.local_state_dict()
    assert local["_smp_is_partial"] is True and local["_smp_load_info"]["partition_info"] is None
    osd = opt.state_dict()
    assert set(osd) == {"state", "param_groups"} and sorted(osd["state"]) == [0, 1, 2, 3]
    assert opt.local_state_dict()["_smp_param_names"] == ["lin.weight", "lin.bias", "norm.weight", "norm.bias"]


# AWS's 2021-22 GPT-2 script passes SMP's second argument: optimizer.load_state_dict(sd, args.gather_if_shard)
@pytest.mark.parametrize("extra", [(), (1,)], ids=["sd", "sd_gather_if_shard"])
def test_pp1_loads_are_deferred_to_the_first_step_and_survive_exactly(extra: tuple[int, ...]) -> None:
    model, opt, step = _pp1()
    _run(model, opt, step, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.local_state_dict())  # live views
    _run(model, opt, step, 1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    smp.reset()
    model, opt, step = _pp1(seed=1)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt, *extra)
    assert not torch.equal(model.module.lin.weight, saved_model["lin.weight"])  # not copied yet
    assert len(opt.state) == 0
    _run(model, opt, step, 1)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_strict_name_mismatch_fails_at_the_call() -> None:
    model, _, _ = _pp1()
    sd = Net().state_dict()
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"unexpected keys 'extra.weight'.*strict=False"):
        model.load_state_dict(sd)
    del sd["extra.weight"], sd["lin.bias"]
    with pytest.raises(CheckpointError, match=r"missing keys 'lin.bias'"):
        model.load_state_dict(sd)
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["lin.bias"] and result.unexpected_keys == []


def test_wrapper_prefix_and_translate_function() -> None:
    model, _, _ = _pp1()
    source = Net()
    prefixed = {f"module.{k}": v for k, v in source.state_dict().items()}
    model.load_state_dict(prefixed)  # DDP / SMP wrapper prefix dropped
    _partition(model)
    assert torch.equal(model.module.lin.weight, source.lin.weight)
    renamed = {k.replace("lin.", "linear."): v * 2 for k, v in source.state_dict().items()}
    model.load_state_dict(renamed, translate_function=lambda d: {k.replace("linear.", "lin."): v for k, v in d.items()})
    assert torch.equal(model.module.lin.weight, source.lin.weight * 2)


def test_bad_inputs_raise_checkpoint_errors() -> None:
    model, opt, _ = _pp1()
    with pytest.raises(CheckpointError, match="expects a dict"):
        model.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"lin.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="sizes"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})
    with pytest.raises(CheckpointError, match="partial"):
        opt.load_local_optimizer_state_dict(opt.state_dict())


def test_size_mismatch_is_a_checkpoint_error() -> None:
    model, _, _ = _pp1()
    _partition(model)
    sd = Net().state_dict()
    sd["lin.weight"] = torch.zeros(2, 2)
    with pytest.raises(CheckpointError, match="size mismatch"):
        model.load_state_dict(sd)
