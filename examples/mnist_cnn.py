"""An MNIST-style CNN trained with SMP v1, shaped like AWS's own SMP test script, on synthetic data.

The script imports ``smdistributed.modelparallel.torch`` and runs unchanged under ``smp-compat run``; with
plain ``python`` it falls back to ``import smp_compat as smp`` (a world of one, one stage). CPU is fine:

    smp-compat run --nproc-per-node 2 examples/mnist_cnn.py
    python examples/mnist_cnn.py

Two processes give two pipeline stages (the config below is the one AWS's notebook used: ``partitions``
2, 4 microbatches, ``spread`` placement, ddp); four processes add data parallelism (pp 2 x dp 2). As in
AWS's script: a ``GroupedNet`` of two sub-networks left to the automatic partitioner, one ``@smp.step`` for
training and one for evaluation, the data sharded by ``smp.dp_rank()``, and the evaluation sums taken over
the microbatches. ``--amp`` runs the forward under autocast (bf16 on CPU, fp16 on GPUs) with
``smp.amp.GradScaler``, as AWS's version did on GPUs; without it the script trains exactly like plain
PyTorch. ``--inductor`` compiles the model with ``torch.compile`` before wrapping it, as AWS's test did
(each stage compiles the modules it runs). ``--save-dir`` ends with AWS's checkpoint checks: a partial and
a full ``smp.save``, then ``smp.load`` of both, compared with what was saved.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

try:
    import smdistributed.modelparallel.torch as smp

    SMP_IMPORT = "smdistributed.modelparallel.torch"
except ImportError:  # not launched through `smp-compat run`: use smp_compat directly
    import smp_compat as smp

    SMP_IMPORT = "smp_compat"

__all__ = [
    "DEFAULT_CONFIG", "SMP_IMPORT", "GroupedNet", "Net1", "Net2", "make_data", "make_model", "main", "parse_args",
    "script_config", "test_step", "train_step",
]  # fmt: skip

DEFAULT_CONFIG = {
    "partitions": 2,
    "microbatches": 4,
    "placement_strategy": "spread",
    "pipeline": "interleaved",
    "optimize": "speed",
    "ddp": True,
}
"""The SMP parameters of AWS's MNIST notebook; a launcher config (SM_HP_MP_PARAMETERS) overrides them."""


def script_config() -> dict[str, object]:
    """DEFAULT_CONFIG, with one stage when started without a launcher (``python examples/mnist_cnn.py``)."""
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
    return {**DEFAULT_CONFIG, "partitions": 2 if world >= 2 else 1}


class Net1(nn.Module):
    """The convolutional half."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return torch.flatten(F.max_pool2d(x, 2), 1)


class Net2(nn.Module):
    """The fully connected half."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class GroupedNet(nn.Module):
    """Both halves; the automatic partitioner decides which stage runs what."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = Net1()
        self.net2 = Net2()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.net1(x))


def make_model(seed: int = 0) -> nn.Module:
    """The CNN with fixed initial weights (the same on every rank and in a plain-PyTorch reference)."""
    torch.manual_seed(seed)
    return GroupedNet()


def make_data(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic 28x28 "digits": one fixed random template per class plus noise (learnable in a few steps)."""
    templates = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=generator)
    return templates[labels] + 2.0 * torch.randn(count, 1, 28, 28, generator=generator), labels


AMP: dict[str, object] = {"scaler": None}
"""Set by ``--amp``: the GradScaler, which the step function uses to scale the loss."""


def _autocast() -> torch.autocast:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    return torch.autocast(device, dtype=dtype, enabled=AMP["scaler"] is not None)


@smp.step
def train_step(model: nn.Module, data: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs once per microbatch: forward, loss, ``model.backward``; the outputs come back as StepOutputs."""
    with _autocast():
        output = model(data)
        loss = F.nll_loss(output.float(), target, reduction="mean")
    scaler = AMP["scaler"]
    model.backward(scaler.scale(loss) if scaler is not None else loss)
    return output, loss


@smp.step
def test_step(model: nn.Module, data: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss and correct predictions of one microbatch."""
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum")
    correct = output.argmax(dim=1).eq(target).sum()
    return loss, correct


def _shard(images: torch.Tensor, labels: torch.Tensor, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's part of every global batch (what AWS's SplitDataset did by dp_rank)."""
    per_rank = batch // smp.dp_size()
    start = smp.dp_rank() * per_rank
    batches = []
    for offset in range(0, len(images) - batch + 1, batch):
        sl = slice(offset + start, offset + start + per_rank)
        batches.append((images[sl], labels[sl]))
    return batches


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, epoch: int) -> list[float]:
    model.train()
    losses = []
    for batch_idx, (data, target) in enumerate(batches):
        optimizer.zero_grad()
        _, loss_mb = train_step(model, data, target)
        # Average over microbatches, then over data-parallel replicas (each saw a different shard).
        loss = sum(smp.allgather(loss_mb.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size()
        scaler = AMP["scaler"]
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        losses.append(loss)
        if smp.rank() == 0:
            print(f"epoch {epoch} batch {batch_idx}: loss {loss:.6f}", flush=True)
    return losses


def test(model: nn.Module, batches: list) -> tuple[float, float]:
    model.eval()
    test_loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for data, target in batches:
            loss_batch, correct_batch = test_step(model, data, target)
            test_loss += sum(loss_batch).item()
            correct += int(sum(correct_batch))
            seen += len(target)
    totals = smp.allgather((test_loss, correct, seen), smp.DP_GROUP)
    test_loss, correct, seen = (sum(t[i] for t in totals) for i in range(3))
    if smp.mp_rank() == 0 and smp.dp_rank() == 0:
        print(f"test: average loss {test_loss / seen:.4f}, accuracy {correct}/{seen}", flush=True)
    return test_loss / seen, correct / seen


def check_save_and_load(model: nn.Module, folder: str) -> None:
    """AWS's checks: partial save on dp_rank 0 of each stage, full save on rank 0, then load both back."""
    os.makedirs(folder, exist_ok=True)
    partial_file, full_file = os.path.join(folder, "model_partial.pt"), os.path.join(folder, "model_full.pt")
    local = model.local_state_dict()
    if smp.dp_rank() == 0:
        smp.save(local, partial_file, partial=True)
    full = model.state_dict()  # every rank takes part; pp_rank 0 gets the dict
    if smp.rank() == 0:
        smp.save(full, full_file, partial=False)
    smp.barrier()
    loaded = smp.load(partial_file, partial=True)
    assert all(torch.equal(loaded[k], v) for k, v in local.items() if torch.is_tensor(v)), "partial load differs"
    model.load_state_dict(smp.load(full_file, partial=False))
    if smp.rank() == 0:
        print(f"saved and loaded {partial_file} (partial) and {full_file} (full)", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch per step")
    parser.add_argument("--train-samples", type=int, default=256)
    parser.add_argument("--test-samples", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta learning rate")
    parser.add_argument("--out", help="rank 0 saves losses, test results and final parameters here")
    parser.add_argument("--amp", action="store_true", help="autocast + smp.amp.GradScaler, as AWS's GPU version")
    parser.add_argument("--inductor", action="store_true", help="torch.compile the model (inductor) before wrapping it")
    parser.add_argument("--save-dir", help="partial and full smp.save / smp.load round trip in this folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if not smp.is_initialized():  # under mpirun with SM_HP_MP_PARAMETERS, importing smp already initialized
        smp.init(script_config())
    if torch.cuda.is_available():
        torch.cuda.set_device(smp.local_rank())

    train_batches = _shard(*make_data(args.train_samples, seed=1), args.batch_size)
    test_batches = _shard(*make_data(args.test_samples, seed=2), args.batch_size)
    model = make_model()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    if args.inductor:
        model = torch.compile(model)
    # SMP moves each partition to its device: no model.to(device) here.
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    if args.amp:
        AMP["scaler"] = smp.amp.GradScaler()

    losses: list[float] = []
    for epoch in range(1, args.epochs + 1):
        losses += train(model, optimizer, train_batches, epoch)
        test_loss, accuracy = test(model, test_batches)

    if args.save_dir:
        check_save_and_load(model, args.save_dir)
    if args.out:
        params = model.state_dict()  # a collective over the pipeline stages: every rank takes part
        if smp.rank() == 0:
            result = {"losses": losses, "test_loss": test_loss, "accuracy": accuracy, "params": params,
                      "pp_size": smp.pp_size(), "dp_size": smp.dp_size(), "smp_import": SMP_IMPORT}  # fmt: skip
            torch.save(result, args.out)
    smp.barrier()


if __name__ == "__main__":
    main()
