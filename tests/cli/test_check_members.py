"""``smp-compat check`` follows the objects SMP returns and reports the members a script uses on them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from smp_compat import cli
from smp_compat.cli.findings import FileReport
from smp_compat.cli.scan import check_source
from smp_compat.cli.support import METHODS, Status

S, P, U = Status.SUPPORTED.value, Status.PARTIAL.value, Status.UNSUPPORTED.value


def status(name: str) -> str:
    return METHODS[name].status.value


def _report(code: str) -> FileReport:
    report = check_source(textwrap.dedent(code).lstrip())
    assert report.error is None, report.error
    return report


def _members(code: str) -> list[tuple[str, list[int], str]]:
    return [(f.name, f.lines, f.status) for f in _report(code).sorted_findings() if f.kind == "member"]


def test_model_and_optimizer_members_with_the_registry_status() -> None:
    found = _members("""
        import torch
        import smdistributed.modelparallel.torch as smp
        smp.init({"fp16": True})
        net = Net()
        net.custom_init()
        model = smp.DistributedModel(net)
        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
        model.train()
        optimizer.zero_grad()
        optimizer.clip_master_grads(1.0)
        torch.save(model.local_state_dict(), "m.pt")
        model.cpu()
        optimizer.optimizer.param_groups
    """)
    assert found == [
        ("DistributedOptimizer.zero_grad", [9], status("DistributedOptimizer.zero_grad")),
        ("DistributedOptimizer.clip_master_grads", [10], P),
        ("DistributedModel.local_state_dict", [11], S),
        ("DistributedModel.cpu", [12], U),
        ("DistributedOptimizer.optimizer", [13], P),
    ]  # net.custom_init() is before wrapping; model.train(), model.parameters() are torch.nn.Module's own


def test_step_outputs_through_unpacking_subscripts_and_direct_calls() -> None:
    found = _members("""
        import smdistributed.modelparallel.torch as smp

        @smp.step
        def train_step(model, data):
            out = model(data)
            model.backward(out.sum())
            return out, out.sum()

        @smp.step()
        def eval_step(model, data):
            return {"loss": model(data).sum()}

        def forward_only(model, data):
            return model(data)

        fwd = smp.step(forward_only)
        model = smp.DistributedModel(Net())
        logits, loss = train_step(model, batch)
        loss.reduce_mean()
        logits.concat()
        results = train_step(model, batch)
        results[1].reduce_sum()
        eval_step(model, batch)["loss"].stack()
        fwd(model, batch).outputs
    """)
    assert found == [
        ("DistributedModel.backward", [6], S),
        ("StepOutput.reduce_mean", [19], S),
        ("StepOutput.concat", [20], S),
        ("StepOutput.reduce_sum", [22], S),
        ("StepOutput.stack", [23], S),
        ("StepOutput.outputs", [24], S),
    ]  # model.backward: `model` inside the step function is the DistributedModel passed at line 18


def test_attributes_aliases_rebinding_and_the_scripts_own_functions() -> None:
    found = _members("""
        import torch
        import smp_compat as smp

        def wrap(net):
            model = smp.DistributedModel(net)
            return model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        class Trainer:
            def __init__(self, net):
                self.model, self.optimizer = wrap(net)

            @smp.step
            def step(self, model, batch):
                model.backward(model(batch))

            def fit(self, batch):
                self.step(self.model, batch)
                self.optimizer.step()
                m = self.model
                m.local_parameters()

        def save(model):
            model.local_state_dict()

        def unused(model):
            model.get_module()

        model = Net()
        model.eval()
        model = smp.DistributedModel(model) if True else model
        save(model)
        smp.state.optimizer.local_state_dict()
        model = None
        model.partitioned
    """)
    assert found == [
        ("DistributedModel.backward", [14], S),
        ("DistributedOptimizer.step", [18], S),
        ("DistributedModel.local_parameters", [20], S),
        ("DistributedModel.local_state_dict", [23], S),
        ("DistributedOptimizer.local_state_dict", [32], S),
    ]  # unused() is never called with the model; `model.partitioned` comes after `model = None`


def test_hooks_receive_the_model_and_the_optimizer() -> None:
    found = _members("""
        import smdistributed.modelparallel.torch as smp
        model = smp.DistributedModel(Net())

        def after_partition(m, opt):
            m.local_modules()
            opt.local_state_dict()

        model.register_post_partition_hook(after_partition)
        model.register_post_step_hook(lambda m, o: o.load_state_dict(o.state_dict()))
    """)
    assert found == [
        ("DistributedModel.local_modules", [5], S),
        ("DistributedOptimizer.local_state_dict", [6], S),
        ("DistributedModel.register_post_partition_hook", [8], S),
        ("DistributedModel.register_post_step_hook", [9], S),
        ("DistributedOptimizer.load_state_dict", [9], S),
        ("DistributedOptimizer.state_dict", [9], S),
    ]


def test_members_the_objects_lack_are_hinted_not_counted() -> None:
    report = _report("""
        import smdistributed.modelparallel.torch as smp

        @smp.step
        def train_step(model, x):
            return model(x), model(x)

        model = smp.DistributedModel(Net())
        optimizer = smp.DistributedOptimizer(make_optimizer(model))
        model.generate(x)
        out, loss = train_step(model, x)
        loss.item()
        optimizer.my_own_method()
    """)
    assert [f.kind for f in report.findings] == ["api", "api", "api"]  # smp.step, DistributedModel/Optimizer
    assert report.hints == [
        "line 9: `model.generate`: generate is not a member of SMP's DistributedModel nor of torch.nn.Module; "
        "the wrapper does not forward the wrapped module's attributes: use model.get_module().generate.",
        "line 11: `loss.item`: a StepOutput has no item (it holds one value per microbatch): reduce it first, "
        "e.g. .reduce_mean() or .concat().",
    ]  # the optimizer may be any torch optimizer class: its own members are not judged


def test_unsupported_member_sets_the_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import smdistributed.modelparallel.torch as smp
        model = smp.DistributedModel(Net())
        model.join()
    """))
    assert cli.main(["check", str(script)]) == 1
    out = capsys.readouterr().out
    assert "DistributedModel.join" in out and "unsupported" in out
