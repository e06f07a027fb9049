"""What crosses to another rank. A module passed as an argument is refused (its copy would train, silently),
and so is a call made from a backward pass (torch.utils.checkpoint's recomputation: gradients went missing).
One tensor in several calls to another rank, each case checked against plain PyTorch (the harness of
test_pp_semantics.py): sent twice in one call (``attn(h, h, h)``), sent under ``no_grad`` and then with grad
(a teacher pass before the student's), and detached in place after it came back.

The engine sends a tensor the owner already holds as a reference to the owner's copy. The second place in
one call referred to a copy not stored yet (a KeyError on the owner); a copy sent under ``no_grad`` stood in
for the tensor in the later call with grad (its gradient was lost, silently); and a copy that passes
gradient back stood in for a tensor detached since (gradient flowed where plain PyTorch sends none).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import smp_compat as smp
from smp_compat.errors import SMPUnsupportedError
from smp_compat.testing import RankFailure, run_ranks
from test_pp_semantics import CASES, D, D_IN, D_OUT, TIMEOUT, _check_against_reference, _config, _plain_loss, _train_ranks


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(u)) * v


class SameTensorTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
            self.pair = Pair()
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).unsqueeze(1)
        a, _ = self.attn(h, h, h, need_weights=False)
        s = a.squeeze(1)
        return self.out(self.pair(s, s))


class TeacherStudent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.teacher = nn.Linear(D, D)
            self.student = nn.Linear(D, D)
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        with torch.no_grad():
            target = self.teacher(h)
        s = self.student(h)
        return self.out(s + 0.5 * (s - target).pow(2))


class DetachInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.mid = nn.Linear(D, D)
            self.mid2 = nn.Linear(D, D)
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        o = self.mid(h)
        o.detach_()
        return self.out(self.mid2(o) + h)


CASES.update({
    "same_tensor_twice": (SameTensorTwice, _plain_loss),
    "teacher_student": (TeacherStudent, _plain_loss),
    "detach_in_place": (DetachInPlace, _plain_loss),
})  # fmt: skip


@pytest.mark.parametrize(("mb", "pipeline"), [(1, "interleaved"), (4, "simple")])
@pytest.mark.parametrize("case", ["same_tensor_twice", "teacher_student", "detach_in_place"])
def test_one_tensor_in_several_calls_trains_like_plain_pytorch(case: str, mb: int, pipeline: str) -> None:
    _check_against_reference(case, run_ranks(_train_ranks, 2, case, _config(mb, pipeline), timeout=TIMEOUT))


class TakesAModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, helper: nn.Module) -> torch.Tensor:
        return helper(torch.tanh(self.lin(h)))


class PassesAModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.helper = nn.Linear(D, D)
        with smp.partition(1):
            self.mid = TakesAModule()
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.inp(x), self.helper))


CASES["passes_a_module"] = (PassesAModule, _plain_loss)


def test_a_module_passed_to_another_rank_is_refused() -> None:
    with pytest.raises(RankFailure, match=rf"{SMPUnsupportedError.__name__}: a Linear with parameters is passed"):
        run_ranks(_train_ranks, 2, "passes_a_module", _config(1, "interleaved"), timeout=TIMEOUT)


class CheckpointsARemoteCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.mid = nn.Linear(D, D)
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.mid(torch.tanh(t))), self.inp(x),
                                              use_reentrant=True)  # fmt: skip
        return self.out(h)


CASES["checkpoints_a_remote_call"] = (CheckpointsARemoteCall, _plain_loss)


def test_a_checkpoint_recomputing_a_call_to_another_rank_is_refused() -> None:
    with pytest.raises(RankFailure, match="mid lives on another pipeline rank and was called during a backward"):
        run_ranks(_train_ranks, 2, "checkpoints_a_remote_call", _config(1, "interleaved"), timeout=TIMEOUT)
