"""A restarted attempt of an SMP v2 script (which makes its process group itself, env://) rendezvouses under
its attempt's prefix in torchrun's agent store, as ``smp.init`` does for v1 (issue 33). The restart itself,
end to end, is in tests/cli/test_restarts_soak.py (``-m soak``)."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from smp_compat.v2.restart_store import with_attempt_store

__all__: list[str] = []

_TIMEOUT = datetime.timedelta(seconds=10)


def _restarted(monkeypatch: pytest.MonkeyPatch, port: int, count: int = 1) -> None:
    for name, value in {"TORCHELASTIC_RESTART_COUNT": str(count), "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "WORLD_SIZE": "1", "RANK": "0"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)


def test_a_restarted_attempts_rendezvous_uses_its_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=_TIMEOUT)  # torchrun's agent's store
    _restarted(monkeypatch, agent.port, count=2)
    kwargs = with_attempt_store((), {"timeout": _TIMEOUT, "device_id": None})
    assert (kwargs["rank"], kwargs["world_size"], kwargs["timeout"], kwargs["device_id"]) == (0, 1, _TIMEOUT, None)
    kwargs["store"].set("rank0-address", "x")
    assert agent.check(["smp_compat/attempt2//rank0-address"]) and not agent.check(["rank0-address"])


def test_a_first_attempt_or_a_rendezvous_the_script_chose_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=_TIMEOUT)
    _restarted(monkeypatch, agent.port, count=0)
    assert with_attempt_store((), {"timeout": _TIMEOUT}) == {"timeout": _TIMEOUT}
    _restarted(monkeypatch, agent.port, count=1)
    for args, kwargs in [(("tcp://h:1",), {}), ((), {"init_method": "file:///tmp/x"}), ((), {"store": agent})]:
        assert with_attempt_store(args, kwargs) == kwargs
