"""Tests for smp_compat.launch: launcher detection from hand-made environments, precedence, node lists, errors."""

from __future__ import annotations

import pytest

from smp_compat.errors import SMPConfigError
from smp_compat.launch import DEFAULT_PORT, LAUNCHERS, LaunchEnv, detect_launch, expand_slurm_nodelist

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
MPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "2",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[01-08]",
    "SLURMD_NODENAME": "gpu08",
}


def test_default_port_is_smps() -> None:
    assert DEFAULT_PORT == 29760
    assert LAUNCHERS == ("torchrun", "mpi", "slurm", "none")


# ------------------------------------------------------------------ each launcher


def test_torchrun() -> None:
    assert detect_launch(TORCHRUN) == LaunchEnv("torchrun", 5, 8, 1, 4, "10.0.0.1", 29500)


def test_torchrun_without_locals_is_one_node() -> None:
    env = detect_launch({"RANK": "2", "WORLD_SIZE": "3"})
    assert (env.launcher, env.local_rank, env.local_size, env.master_addr) == ("torchrun", 2, 3, "127.0.0.1")
    assert env.master_port == DEFAULT_PORT


def test_torchrun_local_rank_derived_from_local_world_size() -> None:
    env = detect_launch({"RANK": "6", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h0"})
    assert (env.local_rank, env.local_size) == (2, 4)


def test_torchrun_multi_node_without_master_addr_fails() -> None:
    env = {k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}
    with pytest.raises(SMPConfigError, match="MASTER_ADDR"):
        detect_launch(env)


def test_mpi_single_node() -> None:
    assert detect_launch(MPI) == LaunchEnv("mpi", 3, 4, 3, 4, "127.0.0.1", DEFAULT_PORT)


def test_mpi_uses_first_sagemaker_host() -> None:
    env = {**MPI, "OMPI_COMM_WORLD_SIZE": "8", "SM_HOSTS": '["algo-1", "algo-2"]'}
    assert detect_launch(env).master_addr == "algo-1"


def test_mpi_master_addr_beats_sm_hosts() -> None:
    env = {**MPI, "SM_HOSTS": '["algo-1"]', "MASTER_ADDR": "10.1.1.1"}
    assert detect_launch(env).master_addr == "10.1.1.1"


def test_mpi_multi_node_without_address_asks_for_master_addr() -> None:
    env = {**MPI, "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "7"}
    with pytest.raises(SMPConfigError, match="Export MASTER_ADDR") as info:
        detect_launch(env)
    assert "8 processes, 4 on this one" in str(info.value)


@pytest.mark.parametrize("bad", ["algo-1", "[]", '{"a": 1}', "[1, 2]", '[""]'])
def test_mpi_rejects_malformed_sm_hosts(bad: str) -> None:
    with pytest.raises(SMPConfigError, match="SM_HOSTS"):
        detect_launch({**MPI, "SM_HOSTS": bad})


def test_slurm_step_values_win_over_job_values() -> None:
    env = detect_launch(SLURM)
    assert env == LaunchEnv("slurm", 6, 8, 2, 4, "gpu07", DEFAULT_PORT)


def test_slurm_falls_back_to_job_task_count_and_node_list() -> None:
    env = {
        "SLURM_PROCID": "1",
        "SLURM_STEPID": "3",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "1",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_NODELIST": "node[3-4]",
    }
    assert detect_launch(env) == LaunchEnv("slurm", 1, 2, 1, 2, "node3", DEFAULT_PORT)


@pytest.mark.parametrize(
    ("node", "extra", "local_size"),
    [
        ("n1", {}, 2),
        ("n3", {}, 2),
        ("n4", {}, 1),
        ("unknown", {"SLURM_NODEID": "3"}, 1),
        (None, {"SLURM_NODEID": "0"}, 2),
    ],
)
def test_slurm_uneven_tasks_per_node(node: str | None, extra: dict[str, str], local_size: int) -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_STEP_NODELIST": "n[1-4]",
        **extra,
    }
    if node is not None:
        env["SLURMD_NODENAME"] = node
    assert detect_launch(env).local_size == local_size


def test_slurm_uses_ntasks_per_node_when_counts_cannot_be_placed() -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "3",
        "SLURM_LOCALID": "0",
        "SLURM_TASKS_PER_NODE": "2,1",
        "SLURM_NTASKS_PER_NODE": "2",
        "MASTER_ADDR": "head",
    }
    assert detect_launch(env).local_size == 2


def test_slurm_without_any_local_size_fails() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0"}
    with pytest.raises(SMPConfigError, match="--ntasks-per-node"):
        detect_launch(env)


def test_slurm_without_node_list_multi_node_fails() -> None:
    env = {k: v for k, v in SLURM.items() if "NODELIST" not in k}
    with pytest.raises(SMPConfigError, match="MASTER_ADDR"):
        detect_launch(env)


def test_slurm_without_task_count_fails() -> None:
    env = {k: v for k, v in SLURM.items() if k not in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")}
    with pytest.raises(SMPConfigError, match="SLURM_NTASKS"):
        detect_launch(env)


def test_slurm_batch_script_without_step_is_not_a_launch() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert detect_launch(env) == LaunchEnv("none", 0, 1, 0, 1, "127.0.0.1", DEFAULT_PORT)


def test_no_launcher_is_a_world_of_one() -> None:
    assert detect_launch({}) == LaunchEnv("none", 0, 1, 0, 1, "127.0.0.1", DEFAULT_PORT)


def test_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "1234")
    env = detect_launch()
    assert (env.launcher, env.rank, env.world_size, env.master_port) == ("torchrun", 1, 2, 1234)


# ------------------------------------------------------------------ precedence


def test_torchrun_beats_mpi_and_slurm() -> None:
    env = detect_launch({**SLURM, **MPI, **TORCHRUN})
    assert (env.launcher, env.rank, env.world_size) == ("torchrun", 5, 8)


def test_mpi_beats_slurm() -> None:
    env = detect_launch({**SLURM, **MPI})
    assert (env.launcher, env.rank, env.world_size) == ("mpi", 3, 4)


def test_master_addr_beats_node_list() -> None:
    assert detect_launch({**SLURM, "MASTER_ADDR": "head"}).master_addr == "head"


def test_port_precedence() -> None:
    assert detect_launch({}).master_port == DEFAULT_PORT
    assert detect_launch({"MASTER_PORT": "1234"}).master_port == 1234
    assert detect_launch({"MASTER_PORT": "1234"}, ddp_port=4321).master_port == 4321
    assert detect_launch({}, ddp_port=4321).master_port == 4321


def test_empty_values_count_as_unset() -> None:
    env = detect_launch({"RANK": "", "WORLD_SIZE": " ", "MASTER_ADDR": "", "MASTER_PORT": ""})
    assert env == LaunchEnv("none", 0, 1, 0, 1, "127.0.0.1", DEFAULT_PORT)


# ------------------------------------------------------------------ malformed values


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "1", "WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0'"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1'"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 exceeds"),
        ({"RANK": "1"}, "WORLD_SIZE is not"),
        ({"WORLD_SIZE": "4"}, "RANK is not"),
        ({**MPI, "OMPI_COMM_WORLD_RANK": "4"}, "OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4"),
        ({**MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "two"}, "OMPI_COMM_WORLD_LOCAL_SIZE='two'"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not set"),
        ({**SLURM, "SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not below SLURM_STEP_NUM_TASKS=8"),
        ({**SLURM, "SLURM_LOCALID": "4"}, "SLURM_LOCALID=4 is not below SLURM_STEP_TASKS_PER_NODE=4"),
        ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "4(2)"}, "SLURM_STEP_TASKS_PER_NODE='4(2)'"),
        ({**SLURM, "SLURM_STEP_NODELIST": "gpu[07-"}, "SLURM_STEP_NODELIST"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
    ],
)
def test_malformed_environment_names_variable_and_value(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SMPConfigError) as info:
        detect_launch(env)
    assert needle in str(info.value)


@pytest.mark.parametrize("port", [0, -1, 65536, True, "29500"])
def test_bad_ddp_port(port: object) -> None:
    with pytest.raises(SMPConfigError, match="ddp_port"):
        detect_launch({}, ddp_port=port)  # type: ignore[arg-type]


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        detect_launch({"RANK": "x", "WORLD_SIZE": "1"})


# ------------------------------------------------------------------ node lists


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu5", ["gpu5"]),
        ("", []),
        ("a,b , c", ["a", "b", "c"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[5]", ["n5"]),
        ("rack[1-2]-n[0-1]", ["rack1-n0", "rack1-n1", "rack2-n0", "rack2-n1"]),
        ("ip-10-0-[1-2]-5.ec2", ["ip-10-0-1-5.ec2", "ip-10-0-2-5.ec2"]),
        ("a[1,3],b[2-3],c", ["a1", "a3", "b2", "b3", "c"]),
    ],
)
def test_expand_slurm_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n1-2]", "n[[1]]", "n[a-b]", "n[3-1]", "n[]", "n[1,,2]", None])
def test_expand_slurm_nodelist_rejects_malformed(bad: object) -> None:
    with pytest.raises(SMPConfigError, match="malformed"):
        expand_slurm_nodelist(bad)  # type: ignore[arg-type]
