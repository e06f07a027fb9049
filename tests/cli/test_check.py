"""``smp-compat check`` on SMP scripts in the style of AWS's examples: every use found, with its line and status."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from smp_compat import cli
from smp_compat.cli.check import ERROR, FileReport, check_file, check_source
from smp_compat.cli.support import API, CONFIG, METHODS, Status, config_value_status
from smp_compat.config import SMPConfig
from smp_compat.errors import SMPConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "smp_scripts"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
S, P, U = Status.SUPPORTED.value, Status.PARTIAL.value, Status.UNSUPPORTED.value


def api(name: str) -> str:
    """The registry's status of smp.<name> (the part of the expectation that follows the package's progress)."""
    return API[name].status.value


def method(name: str) -> str:
    """The registry's status of a member (``DistributedModel.backward``) of an object SMP returns."""
    return METHODS[name].status.value


def key(name: str, value: Any = None, known: bool = True) -> str:
    return config_value_status(name, value, known)[0].value


def read(name: str) -> str:
    """Reading smp.state.cfg.<name>: partial for a key accepted but not acted on, else supported."""
    return P if CONFIG[name].status is Status.PARTIAL else S


def _findings(report: FileReport) -> list[tuple[str, str, list[int], str]]:
    assert report.error is None, report.error
    return [(f.kind, f.name, f.lines, f.status) for f in report.sorted_findings()]


GPT2 = [
    ("api", "smp.nn.FusedLayerNorm", [9, 39], api("nn.FusedLayerNorm")),
    ("api", "smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2", [10, 100], api("nn.huggingface")),
    ("api", "smp.step", [14, 21], S),
    ("member", "DistributedModel.backward", [17], method("DistributedModel.backward")),
    ("member", "StepOutput.reduce_mean", [31, 88], method("StepOutput.reduce_mean")),
    ("api", "smp.get_dp_process_group", [32], S),
    ("api", "smp.dp_size", [33], S),
    ("config", "ddp", [55], S),
    ("config", "tensor_parallel_degree", [56], key("tensor_parallel_degree", known=False)),  # an expression
    ("config", "pipeline_parallel_degree", [57], S),
    ("config", "microbatches", [58], S),
    ("config", "fp16", [59], key("fp16", known=False)),
    ("config", "shard_optimizer_state", [60], key("shard_optimizer_state", True)),
    ("config", "prescaled_batch", [61], S),  # the default
    ("config", "offload_activations", [62], S),  # the default
    ("config", "optimize", [63], S),  # the default
    ("config", "placement_strategy", [64], S),
    ("config", "auto_partition", [65], S),
    ("config", "delayed_parameter_initialization", [67], key("delayed_parameter_initialization", True)),
    ("api", "smp.init", [68], S),
    ("api", "smdistributed.modelparallel.__version__", [69], S),
    ("api", "smp.tp_size", [69, 74], S),
    ("api", "smp.local_rank", [71], S),
    ("api", "smp.tp_register_with_module", [73], api("tp_register_with_module")),
    ("api", "smp.nn.DistributedAttentionLayer", [73], api("nn.DistributedAttentionLayer")),
    ("api", "smp.model_creation", [74], api("model_creation")),
    ("api", "smp.DistributedModel", [77], S),
    ("member", "DistributedModel.get_module", [78, 81], method("DistributedModel.get_module")),
    ("api", "smp.set_activation_checkpointing", [79], api("set_activation_checkpointing")),
    ("api", "smp.DistributedOptimizer", [82], api("DistributedOptimizer")),
    ("api", "smp.resume_from_checkpoint", [83], api("resume_from_checkpoint")),
    ("member", "DistributedOptimizer.zero_grad", [87], method("DistributedOptimizer.zero_grad")),
    ("member", "DistributedOptimizer.clip_master_grads", [89], method("DistributedOptimizer.clip_master_grads")),
    ("member", "DistributedOptimizer.step", [90], method("DistributedOptimizer.step")),
    ("api", "smp.rank", [91, 99], S),
    ("api", "smp.save_checkpoint", [94], api("save_checkpoint")),
    ("api", "smp.rdp_rank", [97], S),
    ("member", "DistributedModel.state_dict", [98], method("DistributedModel.state_dict")),
    ("api", "smp.barrier", [101], S),
]

MNIST = [
    ("api", "smp.step", [42, 51], S),
    ("member", "DistributedModel.backward", [47], method("DistributedModel.backward")),
    ("api", "smp.init", [59], S),
    ("api", "smp.local_rank", [60, 63], S),
    ("api", "smp.barrier", [65, 86, 93, 98], S),
    ("api", "smp.DistributedModel", [69], S),
    ("api", "smp.amp.GradScaler", [70], api("amp.GradScaler")),
    ("api", "smp.DistributedOptimizer", [71], api("DistributedOptimizer")),
    ("member", "DistributedOptimizer.zero_grad", [75], method("DistributedOptimizer.zero_grad")),
    ("member", "StepOutput.reduce_mean", [77], method("StepOutput.reduce_mean")),
    ("api", "smp.rank", [80], S),
    ("api", "smp.mp_rank", [83], S),
    ("api", "smp.dp_rank", [87, 94], S),
    ("api", "smp.save", [88], S),
    ("member", "DistributedModel.local_state_dict", [89], method("DistributedModel.local_state_dict")),
    ("member", "DistributedOptimizer.local_state_dict", [89], method("DistributedOptimizer.local_state_dict")),
    ("api", "smp.load", [95], S),
    ("member", "DistributedModel.load_state_dict", [96], method("DistributedModel.load_state_dict")),
    ("member", "DistributedOptimizer.load_state_dict", [97], method("DistributedOptimizer.load_state_dict")),
]

HF = [
    ("api", "smp.StepOutput", [10, 43], S),
    ("api", "smp.allgather", [10, 38], S),
    ("api", "smp.step", [21, 30], S),
    ("api", "smp.CommGroup", [38], S),
    ("config read", "smp.state.cfg.fp16", [49, 50], read("fp16")),
    ("config read", "smp.state.cfg.bf16", [49], read("bf16")),
    ("config read", "smp.state.cfg.prescaled_batch", [52, 64], read("prescaled_batch")),
    ("config read", "smp.state.cfg.partitions", [54], S),
    ("config read", "smp.state.cfg.microbatchs", [54], ERROR),  # a typo: the config has no such key
    ("api", "smp.DistributedModel", [55], S),
    ("api", "smp.DistributedOptimizer", [56], api("DistributedOptimizer")),
    ("member", "DistributedModel.register_post_step_hook", [57], method("DistributedModel.register_post_step_hook")),
    ("member", "DistributedOptimizer.load_state_dict", [57], method("DistributedOptimizer.load_state_dict")),
    ("member", "DistributedOptimizer.state_dict", [57], method("DistributedOptimizer.state_dict")),
    ("api", "smp.is_initialized", [62], S),
    ("api", "smp.rdp_rank", [64, 69], S),
    ("api", "smp.dp_rank", [64], S),
    ("api", "smp.rdp_size", [64], S),
    ("api", "smp.local_rank", [64], S),
    ("api", "smp.save", [70], S),
    ("api", "smp.barrier", [71], S),
]

LAUNCHER = [
    ("config", "partitions", [8], ERROR),  # smp.init refuses sharded data parallelism with pipeline stages
    ("config", "microbatches", [9], S),
    ("config", "placement_strategy", [10], S),
    ("config", "pipeline", [11], S),
    ("config", "optimize", [12], key("optimize", "memory")),
    ("config", "ddp", [13], S),
    ("config", "tensor_parallel_degree", [14], S),  # 1: the default
    ("config", "sharded_data_parallel_degree", [15], ERROR),  # 4, with partitions 2: the same cross-key rule
    ("config", "memory_weigth", [16], ERROR),
    ("launch", "mpi.enabled", [21], S),
    ("launch", "mpi.processes_per_host", [22], S),
    ("launch", "mpi.custom_mpi_options", [23], P),
]

DISTRIBUTION_JSON = [
    ("config", "pipeline_parallel_degree", [6], S),
    ("config", "microbatches", [7], S),
    ("config", "ddp", [8], S),
    ("config", "fp16", [9], key("fp16", True)),
    ("config", "tensor_parallel_degree", [10], key("tensor_parallel_degree", 2)),
    ("config", "active_microbatches", [11], S),
    ("config", "deterministic_server", [12], S),
    ("config", "bucket_cap_mb", [13], ERROR),  # a DistributedModel argument, not a config key
    ("launch", "mpi.enabled", [18], S),
    ("launch", "mpi.processes_per_host", [19], S),
    ("launch", "mpi.custom_mpi_options", [20], P),
]


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [("gpt2_tp_fp16.py", GPT2), ("mnist_gradscaler.py", MNIST), ("hf_trainer_style.py", HF),
     ("launch_estimator.py", LAUNCHER), ("distribution.json", DISTRIBUTION_JSON)],
)  # fmt: skip
def test_fixture_findings_are_exact(fixture: str, expected: list[tuple[str, str, list[int], str]]) -> None:
    assert _findings(check_file(FIXTURES / fixture)) == expected


def test_values_and_advice_are_reported() -> None:
    report = check_file(FIXTURES / "gpt2_tp_fp16.py")
    by_name = {f.name: f for f in report.findings}
    assert by_name["tensor_parallel_degree"].values == ["args.tensor_parallel_degree"]
    assert by_name["auto_partition"].values == ["True"]
    assert "torch.nn.LayerNorm" in by_name["smp.nn.FusedLayerNorm"].note
    typo = {f.name: f for f in check_file(FIXTURES / "launch_estimator.py").findings}["memory_weigth"]
    assert "'memory_weight'" in typo.action


def test_init_without_dict_hints_at_the_launcher_config() -> None:
    report = check_file(FIXTURES / "mnist_gradscaler.py")
    assert report.hints[0].startswith("line 59: smp.init() without a dict"), report.hints


def test_every_cuda_call_is_listed_with_what_it_does_without_a_gpu() -> None:
    """AWS's examples call torch.cuda unguarded: each call is named with the CPU mode's answer, plain torch's
    harmless one, or the advice to guard it."""
    hints = check_file(FIXTURES / "mnist_gradscaler.py").hints
    assert hints[1:] == ["line 60: torch.cuda.set_device() without a GPU: served by smp-compat run's CPU mode (does "
                         "nothing)."]  # fmt: skip
    report = check_source(textwrap.dedent("""
        import torch
        from torch import cuda
        import smdistributed.modelparallel.torch as smp
        if torch.cuda.is_available():
            torch.cuda.get_device_name(smp.local_rank())
        if not torch.cuda.is_available() or smp.local_rank() > 8:
            pass
        else:
            cuda.get_device_name(smp.local_rank())
        device = smp.rank() % torch.cuda.device_count()
        cuda.nvtx.range_push("step")
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.synchronize(); torch.cuda.synchronize()
        torch.cuda.memory_allocated(device=device)
        torch.cuda.mem_get_info()
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        torch.set_device = None  # not CUDA's
    """))
    hints = {h.split(": ", 1)[1].split("()")[0] + "()": h for h in report.hints}
    assert list(hints) == ["torch.cuda.get_device_name()", "torch.cuda.device_count()", "torch.cuda.nvtx.range_push()",
                           "torch.cuda.cudart()", "torch.cuda.synchronize()", "torch.cuda.memory_allocated()",
                           "torch.cuda.mem_get_info()", "torch.cuda.set_device()"]  # fmt: skip
    assert hints["torch.cuda.get_device_name()"].startswith("lines 6, 10: ") and "only under" in hints["torch.cuda.get_device_name()"]
    assert "served by smp-compat run's CPU mode (returns 1" in hints["torch.cuda.device_count()"]
    assert "CPU mode (does nothing (returns depth 0))" in hints["torch.cuda.nvtx.range_push()"]
    assert "cudaProfilerStart/Stop do nothing" in hints["torch.cuda.cudart()"]
    assert hints["torch.cuda.synchronize()"].startswith("line 14: ")
    assert "runs as it is (0)" in hints["torch.cuda.memory_allocated()"]
    assert hints["torch.cuda.mem_get_info()"].startswith("line 16: torch.cuda.mem_get_info() fails without a GPU")
    assert "only under a CUDA-availability test" in hints["torch.cuda.set_device()"]


# ---------------------------------------------------------------- import styles and config shapes


def _check(code: str) -> list[tuple[str, str, list[int], str]]:
    return _findings(check_source(textwrap.dedent(code).lstrip()))


def test_every_import_style_is_followed() -> None:
    found = _check("""
        import smdistributed.modelparallel.torch
        from smdistributed.modelparallel import torch as mp
        from smdistributed.modelparallel.torch import rank as global_rank, nn as smpnn
        import smp_compat as compat
        smdistributed.modelparallel.torch.barrier()
        mp.dp_rank()
        global_rank()
        smpnn.DistributedLinear(4, 4)
        compat.pp_size()
        mp.no_such_function()
        compat.timeline.enable()
        import smdistributed.dataparallel.torch.distributed as sdp
    """)
    assert found == [
        ("api", "smp.rank", [3, 7], S),
        ("api", "smp.nn", [3], api("nn")),
        ("api", "smp.barrier", [5], S),
        ("api", "smp.dp_rank", [6], S),
        ("api", "smp.nn.DistributedLinear", [8], api("nn.DistributedLinear")),
        ("api", "smp.pp_size", [9], S),
        ("api", "smp.no_such_function", [10], ERROR),
        ("api", "smp_compat.timeline", [11], S),  # smp_compat's own addition: not an error
        ("api", "smdistributed.dataparallel", [12], U),  # SageMaker's other library
    ]


def test_config_dicts_built_in_every_usual_way() -> None:
    found = _check("""
        import smdistributed.modelparallel.torch as smp
        base = dict(microbatches=4, ddp=True)
        cfg = {**base, "pipeline_parallel_degree": 2}
        cfg["placement_strategy"] = "spread"
        cfg.update({"memory_weight": 0.5}, optimize="speed")
        smp.init(cfg)
    """)
    assert found == [
        ("config", "microbatches", [2], S),
        ("config", "ddp", [2], S),
        ("config", "pipeline_parallel_degree", [3], S),
        ("config", "placement_strategy", [4], S),
        ("config", "memory_weight", [5], S),
        ("config", "optimize", [5], S),
        ("api", "smp.init", [6], S),
    ]


def test_config_returned_by_a_function_of_the_script() -> None:
    found = _check("""
        import os
        import smdistributed.modelparallel.torch as smp
        DEFAULTS = {"microbatches": 4}
        def script_config(world):
            if world > 1:
                return {**DEFAULTS, "partitions": 2}
            return {**DEFAULTS, "tensor_parallel_degree": world}
        smp.init(script_config(int(os.environ.get("WORLD_SIZE", 1))))
    """)
    assert found == [
        ("config", "microbatches", [3], S),
        ("config", "partitions", [6], S),
        ("config", "tensor_parallel_degree", [7], key("tensor_parallel_degree", known=False)),
        ("api", "smp.init", [8], S),
    ]


def test_distribution_dict_passed_to_init_and_unused_dicts_ignored() -> None:
    found = _check("""
        import smdistributed.modelparallel.torch as smp
        unrelated = {"microbatches": 3, "lr": 0.1}
        smp.init({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2, "bogus": 1}}}})
    """)
    assert found == [("api", "smp.init", [3], S), ("config", "partitions", [3], S), ("config", "bogus", [3], ERROR)]
    # `unrelated` is never passed to smp.init and has no SMP section: its keys are not SMP's


def test_init_with_a_json_path_checks_that_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "smp.json").write_text('{\n  "microbatches": 2,\n  "tensor_paralel_degree": 4\n}\n')  # a typo blocks
    script = tmp_path / "train.py"
    script.write_text('import smdistributed.modelparallel.torch as smp\nsmp.init("smp.json")\n')
    assert cli.main(["check", "--json", str(script)]) == 1
    files = json.loads(capsys.readouterr().out)["files"]
    assert [f["path"] for f in files] == [str(script), str(tmp_path / "smp.json")]
    assert [(x["name"], x["lines"], x["status"]) for x in files[1]["findings"]] == [
        ("microbatches", [2], S), ("tensor_paralel_degree", [3], ERROR),
    ]  # fmt: skip


# ---------------------------------------------------------------- the command


def test_a_helper_file_without_smp_names_still_shows_its_cuda_calls(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """AWS's memory_tracker.py imports no SMP name; its torch.cuda calls are listed all the same."""
    path = tmp_path / "memory_tracker.py"
    path.write_text("import torch\nlocal_rank = 3 % torch.cuda.device_count()\ntorch.cuda.synchronize()\n")
    cli.main(["check", str(path)])
    out = " ".join(capsys.readouterr().out.split())
    assert "no SMP API or config key found" in out
    assert "note: line 2: torch.cuda.device_count() without a GPU: served by" in out
    assert "note: line 3: torch.cuda.synchronize() without a GPU: served by" in out


def test_exit_status_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", str(FIXTURES)]) == 1  # the fixtures use APIs smp_compat lacks
    out = capsys.readouterr().out
    assert "gpt2_tp_fp16.py: SMP API" in out and "launch_estimator.py: config" in out
    assert "Change the unsupported and error rows" in out


def test_the_shipped_examples_need_no_change(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", str(EXAMPLES)]) == 0, capsys.readouterr().out
    assert "Nothing blocks running under smp_compat." in capsys.readouterr().out


def test_json_output_and_unreadable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import smdistributed.modelparallel.torch as smp\ndef (:\n")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert cli.main(["check", "--json", str(broken), str(bad_json), str(FIXTURES / "mnist_gradscaler.py")]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["files"][0]["error"].startswith("cannot parse: invalid syntax (line 2)")
    assert data["files"][1]["error"].startswith("not valid JSON")
    statuses = [status for *_, status in MNIST]
    assert data["summary"] == {s: statuses.count(s) for s in (S, P, U, ERROR)}


# ---------------------------------------------------------------- values smp.init rejects


def _statuses(code: str) -> dict[str, str]:
    return {name: status for kind, name, _, status in _check(code) if kind == "config"}


def _notes(report: FileReport) -> dict[str, str]:
    return {f.name: f.note for f in report.findings if f.kind == "config"}


def _init_message(config: dict[str, Any]) -> str:
    with pytest.raises(SMPConfigError) as info:
        SMPConfig(**config)
    return str(info.value)


def test_literal_values_that_smp_init_rejects_are_errors() -> None:
    code = """
        import smdistributed.modelparallel.torch as smp
        smp.init({"partitions": 2, "microbatches": 4, "memory_weight": 1, "ddp": "true",
                  "placement_strategy": "Cluster"})
    """
    report = check_source(textwrap.dedent(code).lstrip())
    assert _statuses(code) == {
        "partitions": S, "microbatches": S, "memory_weight": ERROR, "ddp": ERROR, "placement_strategy": ERROR,
    }  # fmt: skip
    notes = _notes(report)
    for name, value in [("memory_weight", 1), ("ddp", "true"), ("placement_strategy", "Cluster")]:
        problem = notes[name].removeprefix("smp.init rejects this value: ")
        assert problem != notes[name] and problem in _init_message({name: value})  # smp.init's own wording
    assert "write 1.0" in notes["memory_weight"] and 'write "cluster"' in notes["placement_strategy"]


def test_json_config_values_and_cross_key_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"partitions": 2, "microbatches": 4, "memory_weight": 1, "ddp": "true",
              "sharded_data_parallel_degree": 2}  # fmt: skip
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config, indent=2))
    report = check_file(path)
    assert [(name, status) for _, name, _, status in _findings(report)] == [
        ("partitions", S), ("microbatches", S), ("memory_weight", ERROR), ("ddp", ERROR),
        ("sharded_data_parallel_degree", S),
    ]  # fmt: skip
    path.write_text(json.dumps({**config, "memory_weight": 1.0, "ddp": True}))  # rules: once every value is valid
    report = check_file(path)
    assert {name for _, name, _, status in _findings(report) if status == ERROR} == {
        "partitions", "sharded_data_parallel_degree"}
    rule = _init_message({"partitions": 2, "sharded_data_parallel_degree": 2})
    notes = _notes(report)
    for name in ("partitions", "sharded_data_parallel_degree"):
        assert notes[name].startswith("smp.init rejects this combination: ")
        assert notes[name].removeprefix("smp.init rejects this combination: ") in rule
    assert cli.main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "Change the unsupported and error rows" in out and "Nothing blocks" not in out
    fixed = {**config, "memory_weight": 1.0, "ddp": True, "sharded_data_parallel_degree": 1}
    path.write_text(json.dumps(fixed))
    assert cli.main(["check", str(path)]) == 0, capsys.readouterr().out
    SMPConfig(**fixed)  # what check passes, smp.init takes


def test_estimator_distribution_values_are_validated() -> None:
    found = _statuses("""
        from sagemaker.pytorch import PyTorch
        smp_options = {"enabled": True, "parameters": {"partitions": 2, "microbatches": 4, "ddp": True,
                                                      "memory_weight": 1.0, "sharded_data_parallel_degree": 2}}
        est = PyTorch(entry_point="train.py", distribution={"smdistributed": {"modelparallel": smp_options}})
    """)
    assert found == {"partitions": ERROR, "microbatches": S, "ddp": S, "memory_weight": S,
                     "sharded_data_parallel_degree": ERROR}  # fmt: skip


def test_a_rule_broken_only_through_a_default_is_an_error_in_a_whole_literal() -> None:
    found = _statuses("""
        import smdistributed.modelparallel.torch as smp
        smp.init({"tensor_parallel_degree": 2, "microbatches": 4})
    """)
    assert found == {"tensor_parallel_degree": ERROR, "microbatches": S}  # ddp left out: False, as smp.init sees it


def test_values_the_scanner_cannot_read_are_never_errors() -> None:
    assert set(_statuses("""
        import smdistributed.modelparallel.torch as smp
        smp.init({"ddp": args.ddp > 0, "tensor_parallel_degree": 2, "horovod": True,
                  "memory_weight": args.memory_weight, "placement_strategy": args.placement_strategy})
    """).values()) <= {S, P}  # ddp may be True at run time: neither rule that involves it can be judged
    assert set(_statuses("""
        import smdistributed.modelparallel.torch as smp
        smp.init({**vars(args), "tensor_parallel_degree": 2})
    """).values()) <= {S, P}  # ddp may come from vars(args)
    assert set(_statuses("""
        import smdistributed.modelparallel.torch as smp
        cfg = {"tensor_parallel_degree": 2}
        if args.dp:
            cfg["ddp"] = True
        smp.init(cfg)
    """).values()) <= {S, P}  # set under a condition: not known to be False either
    assert set(_statuses("""
        import smdistributed.modelparallel.torch as smp
        cfg = {"tensor_parallel_degree": 2, "ddp": True}
        cfg.update(overrides)
        smp.init(cfg)
    """).values()) <= {S, P}  # overrides may set ddp back to False


def test_partly_literal_dicts_judge_each_literal_value_but_no_rule() -> None:
    found = _statuses("""
        import smdistributed.modelparallel.torch as smp
        smp.init({**vars(args), "memory_weight": 1, "ddp": args.ddp,
                  "sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2})
    """)
    assert found["memory_weight"] == ERROR and found["ddp"] == S  # a literal value is judged even so
    assert found["sharded_data_parallel_degree"] == S  # values read at run time: no rule between keys judged
    found = _statuses("""
        import smdistributed.modelparallel.torch as smp
        smp.init({"partitions": 2, "pipeline_parallel_degree": 4})
    """)
    assert found == {"partitions": ERROR, "pipeline_parallel_degree": ERROR}  # two spellings, two values
