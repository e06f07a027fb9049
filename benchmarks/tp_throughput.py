"""tp step time: smp_compat's smp.nn.DistributedTransformer against torch's own parallelize_module
(ColwiseParallel on q/k/v/fc1, RowwiseParallel on the two output projections) on the same transformer.

Both run in the same processes, from the same weights, on the same batch (prescaled: the tp group shares
it), in alternating rounds; the figure of merit is the median over rounds of smp's throughput divided by
torch's (target >= 0.95). It also tallies the bytes smp_compat's collectives move per layer and step
against the Megatron minimum (two all-reduces of the activations forward, two backward).

    python benchmarks/tp_throughput.py [--tp 2 --width 256 --heads 8 --layers 4 --batch 8 --seq 128]

Without a launcher it forks --tp CPU ranks (gloo); under torchrun each process is one rank (NCCL on GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["main", "bench", "TorchLayer"]

TARGET = 0.95


class TorchLayer(nn.Module):
    """The same pre-LN layer as smp.nn.DistributedTransformerLayer, in plain nn.Linear modules for torch's TP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_size = width // heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.dense = (nn.Linear(width, width) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, s, -1, self.head_size).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / self.head_size**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores + torch.zeros(s, s, device=x.device).masked_fill(~causal, torch.finfo(x.dtype).min)
        ctx = (F.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.dense(ctx)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _torch_model(args: argparse.Namespace, full: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """Plain layers with the smp model's whole weights, then torch's Colwise/Rowwise plan on a 1-D tp mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layers = nn.Sequential(*(TorchLayer(args.width, args.heads) for _ in range(args.layers))).to(device)
    names = {"ln1": "attention.layernorm", "ln2": "output.layernorm", "q": "attention.query", "k": "attention.key",
             "v": "attention.value", "dense": "attention.dense", "fc1": "output.dense1", "fc2": "output.dense2"}  # fmt: skip
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for ours, theirs in names.items():
                sep = "." if "layernorm" in theirs else "_"
                getattr(layer, ours).weight.copy_(full[f"seq_layers.{i}.{theirs}{sep}weight"])
                getattr(layer, ours).bias.copy_(full[f"seq_layers.{i}.{theirs}{sep}bias"])
    mesh = init_device_mesh(device.type, (args.tp,))
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "dense": RowwiseParallel(),
            "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}  # fmt: skip
    for layer in layers:
        parallelize_module(layer, mesh, plan)
    return layers


class _Tally:
    """Bytes through smp_compat's tp collectives (wraps the helpers in smp_compat.nn.comm)."""

    def __init__(self) -> None:
        from smp_compat.nn import comm

        self.comm, self.bytes, self.on = comm, 0, False
        for name in ("_all_reduce", "_all_gather_dim0", "_reduce_scatter_dim0"):
            original = getattr(comm, name)

            def counted(x: torch.Tensor, _f: Any = original) -> torch.Tensor:
                if self.on:
                    self.bytes += x.numel() * x.element_size()
                return _f(x)

            setattr(comm, name, counted)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(step: Any, steps: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / steps


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import smp_compat as smp

    torch.set_num_threads(args.threads)
    smp.init({"tensor_parallel_degree": args.tp, "ddp": True, "prescaled_batch": True})
    tally = _Tally()
    device = smp.state.device
    torch.manual_seed(0)
    ours = smp.nn.DistributedTransformer(
        args.layers, args.heads, args.width // args.heads, args.width, 4 * args.width, 0.0, 0.0,
        causal_mask_size=args.seq, pre_layernorm=True, post_layernorm=False, use_normal_initialization=True)  # fmt: skip
    model = smp.DistributedModel(ours)
    model.to(device)
    opt_a = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    theirs = _torch_model(args, model.state_dict(), device)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.seq, args.width, generator=torch.Generator().manual_seed(1)).to(device)

    @smp.step
    def smp_fwd_bwd(batch: torch.Tensor) -> torch.Tensor:
        loss = model((batch, None))[0].pow(2).mean()
        model.backward(loss)
        return loss

    def step_a() -> float:
        opt_a.zero_grad()
        loss = smp_fwd_bwd(x).reduce_mean()
        opt_a.step()
        return loss.item()

    def step_b() -> float:
        opt_b.zero_grad()
        loss = theirs(x).pow(2).mean()
        loss.backward()
        opt_b.step()
        return loss.item()

    first = {"smp": step_a(), "torch": step_b()}
    tally.on = True
    step_a()
    tally.on = False
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm_mode:
        step_b()
    for _ in range(args.warmup):
        step_a(), step_b()
    rounds = []
    for r in range(args.rounds):
        order = [("smp", step_a), ("torch", step_b)][:: 1 if r % 2 == 0 else -1]
        times = {name: _time(fn, args.steps, device) for name, fn in order}
        rounds.append(times)
    elt = x.element_size()
    minimum = 4 * args.batch * args.seq * args.width * elt  # Megatron: 2 all-reduces forward, 2 backward, per layer
    return {"first_step_loss": first, "rounds": rounds, "bytes_per_layer": tally.bytes / args.layers,
            "megatron_min_bytes_per_layer": minimum, "torch_comm_counts": {str(k): v for k, v in comm_mode.get_comm_counts().items()},
            "device": str(device)}  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tp", 2), ("width", 256), ("heads", 8), ("layers", 4), ("batch", 8), ("seq", 128),
                          ("rounds", 5), ("steps", 5), ("warmup", 2), ("threads", 1)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "RANK" in os.environ:
        result = bench(args)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        from smp_compat.testing import run_ranks

        result = run_ranks(bench, args.tp, args, timeout=600)[0]
    ratios = [r["torch"] / r["smp"] for r in result["rounds"]]  # smp throughput / torch throughput
    result["ratio_median"] = statistics.median(ratios)
    result["args"] = vars(args)
    print(f"device {result['device']}, tp {args.tp}, width {args.width}, layers {args.layers}, batch {args.batch}, seq {args.seq}")
    for i, r in enumerate(result["rounds"]):
        print(f"round {i}: smp {1e3 * r['smp']:.2f} ms/step, torch parallelize_module {1e3 * r['torch']:.2f} ms/step, "
              f"ratio {r['torch'] / r['smp']:.3f}")  # fmt: skip
    print(f"median throughput ratio smp/torch: {result['ratio_median']:.3f} (target >= {TARGET})")
    print(f"bytes per layer and step: smp {result['bytes_per_layer']:.0f}, Megatron minimum "
          f"{result['megatron_min_bytes_per_layer']:.0f} ({result['bytes_per_layer'] / result['megatron_min_bytes_per_layer']:.2f}x); "
          f"torch collectives per step: {result['torch_comm_counts']}")  # fmt: skip
    print(f"first-step loss: smp {result['first_step_loss']['smp']:.6f}, torch {result['first_step_loss']['torch']:.6f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0 if result["ratio_median"] >= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
