"""``smp.DistributedModel(torch.compile(model))`` at pp = 2 trains like plain PyTorch, and each rank compiles
what it runs: the transport stays out of every graph (graph breaks at the partition boundaries)."""

from __future__ import annotations

import time

import torch
from torch import nn

from models import causal_mask, lm_loss, lm_train_step, make_batches, make_model, train_smp
from smp_compat.testing import run_ranks

STEPS, GLOBAL_BATCH, LAYERS = 2, 4, 2


class GraphCounter:
    """A Dynamo backend that runs each graph eagerly and remembers the parameter-free ops it saw."""

    def __init__(self) -> None:
        self.graphs: list[list[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward


def _pipeline(config: dict, backend: object) -> dict:
    import smp_compat as smp

    torch._dynamo.reset()
    smp.init(config)
    counter = GraphCounter() if backend == "count" else None
    model = smp.DistributedModel(torch.compile(make_model(layers=LAYERS), backend=counter or backend))
    smp.set_partition(model.module.blocks[1], 1)  # rank 0 -> rank 1 -> rank 0 (tied head): two boundaries
    smp.set_partition(model.module.ln_f, 1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    losses = train_smp(smp, model, opt, lm_train_step(smp), STEPS, GLOBAL_BATCH)
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    graphs = counter.graphs if counter is not None else []
    return {"losses": losses, "params": params, "graphs": graphs}


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model(layers=LAYERS)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in make_batches(STEPS, GLOBAL_BATCH):
        opt.zero_grad()
        loss = lm_loss(model(x, attention_mask=causal_mask(8)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _check(results: list[dict], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    ref_losses, ref_params = _reference()
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol)
        merged.update(r["params"])
    assert set(merged) == set(ref_params)  # the model's own names: no "_orig_mod." prefix
    for name, ref in ref_params.items():
        torch.testing.assert_close(merged[name], ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


CONFIG = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}


def test_compiled_model_at_pp2_matches_plain_pytorch_and_compiles_on_both_ranks() -> None:
    results = run_ranks(_pipeline, 2, CONFIG, "count", timeout=180)
    _check(results)
    rank0, rank1 = (r["graphs"] for r in results)
    assert rank0 and rank1, "each rank compiles what it runs"
    # rank 1 serves blocks[1] and ln_f: its graphs hold the attention and layer norms, nothing else's
    assert any(any("layer_norm" in op for op in g) for g in rank1)
    assert not any(any("embedding" in op for op in g) for g in rank1)
    assert any(any("embedding" in op for op in g) for g in rank0)


def test_compiled_model_with_aot_autograd_at_pp2_matches_plain_pytorch() -> None:
    """Compiled backward graphs (AOTAutograd) under the engine's segmented backward."""
    _check(run_ranks(_pipeline, 2, CONFIG, "aot_eager", timeout=180))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _inductor_pipeline(config: dict, x: torch.Tensor) -> torch.Tensor:
    import smp_compat as smp

    smp.init(config)
    model = smp.DistributedModel(torch.compile(_mlp()))  # inductor, the default backend
    smp.set_partition(model.module[2], 1)
    smp.set_partition(model.module[4], 1)

    @smp.step
    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with torch.no_grad():  # forward graphs only: each inductor build takes seconds here (AOT training above)
        return forward(model, x).concat()


def test_inductor_at_pp2_matches_plain_pytorch() -> None:
    started = time.monotonic()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    for output in run_ranks(_inductor_pipeline, 2, CONFIG, x, timeout=240):
        torch.testing.assert_close(output, _mlp()(x).detach(), rtol=1e-5, atol=1e-6)
    print(f"inductor pp=2 run took {time.monotonic() - started:.1f} s")


def _fullgraph(config: dict) -> str:
    import smp_compat as smp
    from smp_compat.errors import SMPUnsupportedError

    smp.init(config)
    model = smp.DistributedModel(torch.compile(_mlp(), backend="eager", fullgraph=True))
    smp.set_partition(model.module[4], 1)

    @smp.step
    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    try:
        step(model, torch.randn(4, 8))
    except SMPUnsupportedError as exc:
        return str(exc)
    return "no error"


def test_fullgraph_compile_at_pp2_is_refused_clearly() -> None:
    for message in run_ranks(_fullgraph, 2, CONFIG, timeout=60):
        assert "fullgraph=True" in message and "fullgraph=False" in message


def test_checkpoint_of_a_compiled_plain_pytorch_model_loads_and_names_stay_plain() -> None:
    """torch.compile(model).state_dict() prefixes every key with ``_orig_mod.``; our names are the model's."""
    import smp_compat as smp

    smp.init({})
    source = torch.compile(_mlp(), backend="eager")
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    model = smp.DistributedModel(torch.compile(_mlp(), backend="eager"))
    result = model.load_state_dict(source.state_dict())
    assert not result.missing_keys and not result.unexpected_keys

    @smp.step
    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x = torch.randn(4, 8)
    torch.testing.assert_close(forward(model, x).concat(), source(x))  # the load applies at partitioning
    assert list(model.state_dict()) == [k.removeprefix("_orig_mod.") for k in source.state_dict()]
