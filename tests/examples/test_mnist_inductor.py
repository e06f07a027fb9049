"""examples/mnist_cnn.py --inductor (AWS's MNIST test mode) at pp = 2 trains like plain PyTorch."""

from __future__ import annotations

import sys

import torch

from smp_compat.testing import run_ranks


def _mnist_compiled(out: str) -> None:
    """examples/mnist_cnn.py --inductor on this rank, compiled with aot_eager (inductor's C++ builds take minutes
    on this machine; the run above checked inductor itself)."""
    import functools

    from test_examples_porting import MNIST, MNIST_ARGS, _load

    torch.compile = functools.partial(torch.compile, backend="aot_eager")  # a forked rank: not undone
    example = _load(MNIST)
    sys.modules[example.__name__] = example  # Dynamo looks the model's module up by name
    example.main([*MNIST_ARGS, "--inductor", "--out", out])


def test_mnist_example_with_inductor_flag_at_pp2_matches_plain_pytorch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from test_examples_porting import MNIST, _check_mnist, _load, _mnist_reference

    out = tmp_path / "mnist.pt"
    run_ranks(_mnist_compiled, 2, str(out), timeout=240)
    result = torch.load(out)
    assert result["pp_size"] == 2
    _check_mnist(result, _mnist_reference(_load(MNIST)))
