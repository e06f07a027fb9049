"""torch elastic restarts meet no key of the attempt that died (issue 33).

``smp-compat run`` and ``smp-compat env`` export ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (c10d rendezvous:
a fresh store every round) unless the user set it; under the static rendezvous, which ignores it, a
restarted attempt's process group keys its store by attempt. The kill-and-restart loop itself is
test_restarts_soak.py (``-m soak``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from smp_compat.cli import main
from smp_compat.cli.run import plan_launch
from smp_compat.launch import SHARE_STORE_ENV, STATIC_RENDEZVOUS_ENV, attempt_prefix

__all__: list[str] = []

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_dp.py"


def test_run_exports_the_switch_unless_the_user_set_it() -> None:
    assert plan_launch(["--max-restarts", "1", str(SCRIPT)], environ={}).env_updates[SHARE_STORE_ENV] == "1"
    kept = plan_launch(["--standalone", str(SCRIPT)], environ={SHARE_STORE_ENV: "0"}).env_updates
    assert SHARE_STORE_ENV not in kept  # theirs stays in the environment the launcher inherits


def test_env_prints_it_too(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARE_STORE_ENV, raising=False)
    assert main(["env"]) == 0
    assert f"export {SHARE_STORE_ENV}=1" in capsys.readouterr().out.splitlines()
    monkeypatch.setenv(SHARE_STORE_ENV, "0")
    assert main(["env"]) == 0
    assert SHARE_STORE_ENV not in capsys.readouterr().out


def _elastic(count: int, agent_store: bool = True, nodes: int = 1, **extra: str) -> dict[str, str]:
    env = {"TORCHELASTIC_RESTART_COUNT": str(count), "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
           "GROUP_WORLD_SIZE": str(nodes)}  # fmt: skip
    return {**env, **extra}


def test_only_a_restarted_attempt_on_the_agents_store_gets_a_prefix_every_node_agrees_on() -> None:
    assert attempt_prefix({}) is None  # not under torchrun
    assert attempt_prefix(_elastic(0)) is None  # the first attempt: nothing stale to meet
    assert attempt_prefix(_elastic(2)) == "smp_compat/attempt2/"  # one agent: its count is the job's
    assert attempt_prefix(_elastic(1, agent_store=False)) is None  # a fresh store per round already
    assert attempt_prefix(_elastic(1, nodes=2, **{SHARE_STORE_ENV: "1"})) == "smp_compat/attempt1/"  # static
    # several agents sharing a c10d store: a node restarted for a newcomer keeps its count, so counts can differ
    assert attempt_prefix(_elastic(1, nodes=2)) is None
    # the user's 0 under torchrun's static rendezvous: smp-compat run says it is static, so the prefix stays
    assert attempt_prefix(_elastic(1, nodes=2, **{SHARE_STORE_ENV: "0", STATIC_RENDEZVOUS_ENV: "1"})) == (
        "smp_compat/attempt1/")
    assert attempt_prefix(_elastic(1, nodes=2, **{SHARE_STORE_ENV: "0", STATIC_RENDEZVOUS_ENV: "0"})) is None


@pytest.mark.parametrize(("options", "static"), [
    ([], "1"), (["--master-port", "29500"], "1"), (["--rdzv-backend=static"], "1"), (["--standalone"], "0"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29500"], "0"), (["--rdzv_backend=etcd-v2"], "0"),
])  # fmt: skip
def test_run_tells_the_workers_whether_the_rendezvous_is_static(options: list[str], static: str) -> None:
    env = plan_launch(["--nnodes", "2", *options, str(SCRIPT)], environ={SHARE_STORE_ENV: "0"}).env_updates
    assert env[STATIC_RENDEZVOUS_ENV] == static
