"""Same-host pipeline channels through shared memory: every byte arrives, in order, and nothing can wedge.

The ring is shrunk to a few KiB here so that chunking, wrapping and a full ring happen on every test.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from smp_compat.runtime import local_links
from smp_compat.runtime.local_links import LocalLink
from smp_compat.runtime.mailbox import Mailbox
from smp_compat.testing import run_ranks

pytestmark = pytest.mark.skipif(not local_links.enabled(), reason="shared-memory channels need Linux x86-64")

RING = 4096


@pytest.fixture
def small_ring(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(local_links, "RING_BYTES", RING)
    yield


def _link() -> tuple[LocalLink, LocalLink]:
    """Rank 0's sender end and rank 1's receiver end of one direction, both in this process."""
    sender_sock, receiver_sock = socket.socketpair()
    fd = os.memfd_create("smp-compat-test")
    os.ftruncate(fd, local_links._CONTROL_BYTES + local_links.RING_BYTES)
    return LocalLink(None, 1, sender_sock, os.dup(fd)), LocalLink(None, 0, receiver_sock, fd)


def _receive(link: LocalLink, deadline_s: float = 10.0) -> bytes:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        buf = link.receive_now()
        if buf is not None:
            data = bytes(buf.numpy())
            link.release()
            return data
        time.sleep(0.0005)
    raise AssertionError("no message within the deadline")


def _message(size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_messages_of_every_size_arrive_whole_and_in_order(small_ring: None) -> None:
    sender, receiver = _link()
    sizes = [1, 100, RING // 2 - 1, RING // 2, RING // 2 + 1, RING, 3 * RING + 17, 5, 2000, 2000, 2000, 7 * RING]
    messages = [_message(n, i) for i, n in enumerate(sizes)]
    thread = threading.Thread(target=lambda: [sender.send_async(m) for m in messages], daemon=True)
    thread.start()  # larger than the ring: the sender waits for space while we read
    for expected in messages:
        assert _receive(receiver) == bytes(expected.numpy())
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_drained_ring_starts_again_at_its_warm_start(small_ring: None) -> None:
    sender, receiver = _link()
    for i in range(50):
        sender.send_async(_message(300, i))
        assert _receive(receiver) == bytes(_message(300, i).numpy())
    assert sender.write_pos % RING <= 2 * 300  # not cycling over the whole ring (fresh pages, cold cache)


def test_after_a_warm_start_the_sender_does_not_wait_for_the_first_message_to_be_read(
    small_ring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the ring's skipped tail counted as unread, so a second message waited until the receiver (busy
    # computing, in a pipeline) had read the first: up to 9 ms per step on rank 0 of the timeline demo
    sender, receiver = _link()
    sender.send_async(_message(1000, 0))
    assert _receive(receiver) == bytes(_message(1000, 0).numpy())
    monkeypatch.setattr(sender, "_wait_for_space", lambda needed: pytest.fail("waited with the ring nearly empty"))
    for i in range(1, 4):  # the first goes to the warm start; all three fit in the ring unread
        sender.send_async(_message(1000, i))
    for i in range(1, 4):
        assert _receive(receiver) == bytes(_message(1000, i).numpy())


def test_two_ranks_sending_to_each_other_into_full_rings_both_finish(small_ring: None) -> None:
    # each side's stalled send reads what the other sent: without that both would wait for space forever
    a_to_b, b_from_a = _link()
    b_to_a, a_from_b = _link()
    sent = [_message(3 * RING, seed) for seed in range(4)]
    got: dict[str, list[bytes]] = {"a": [], "b": []}

    def drain(link: LocalLink, into: list[bytes]) -> None:
        while (buf := link.receive_now()) is not None:
            into.append(bytes(buf.numpy()))
            link.release()

    def rank(out: LocalLink, incoming: LocalLink, into: list[bytes]) -> None:
        out.on_stall = lambda: drain(incoming, into)
        for message in sent:
            out.send_async(message)
        while len(into) < len(sent):  # then keeps reading, as a rank's scheduler does
            drain(incoming, into)
            time.sleep(0.0005)

    threads = [threading.Thread(target=rank, args=(a_to_b, a_from_b, got["a"]), daemon=True),
               threading.Thread(target=rank, args=(b_to_a, b_from_a, got["b"]), daemon=True)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(thread.is_alive() for thread in threads), "the two sends wedged"
    expected = [bytes(m.numpy()) for m in sent]
    assert got["a"] == expected and got["b"] == expected


def test_a_peer_that_goes_away_is_an_error_at_once_not_a_wait(small_ring: None) -> None:
    sender, receiver = _link()
    sender.close()
    assert receiver.receive_now() is None  # a poll between hand-overs looks only at the shared counter
    readable, _, _ = select.select([receiver.sock], [], [], 5)  # the scheduler's wait sees end-of-file
    assert readable
    with pytest.raises(ConnectionError, match="closed by rank 0"):
        receiver.receive_now(readable=True)


def test_mailbox_wakes_for_a_message_handed_in_from_another_thread() -> None:
    box = Mailbox()
    with pytest.raises(queue.Empty):
        box.get(timeout=0.01)
    threading.Timer(0.05, box.put, args=("hello",)).start()
    start = time.monotonic()
    assert box.get(timeout=5) == "hello"
    assert time.monotonic() - start < 2
    box.close()
    box.put("after close")  # a late receiver thread at shutdown: ignored, not an error


def _channel_kinds() -> list[str]:
    import smp_compat as smp
    from models import lm_train_step, make_batches, make_model, place_blocks_by_stage

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    model = smp.DistributedModel(make_model())
    place_blocks_by_stage(smp, model)
    step = lm_train_step(smp)
    for x, y in make_batches(1, 4):
        step(model, x, y)
    transport = model.pipeline_engine.transport
    return [type(out.channel).__name__ for out in transport._outgoing.values()] + [
        type(channel).__name__ for channel in transport._incoming
    ]


def test_ranks_on_one_host_use_shared_memory_and_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_ranks(_channel_kinds, 2, timeout=60) == [["LocalLink", "LocalLink"]] * 2
    monkeypatch.setenv(local_links.ENV, "0")
    assert run_ranks(_channel_kinds, 2, timeout=60) == [["_Channel", "_Channel"]] * 2


@pytest.mark.parametrize("from_the_sender", [True, False])
def test_a_link_is_accepted_only_from_the_senders_process(from_the_sender: bool) -> None:
    # the listening name is visible to every local user, and what arrives on a link is unpickled
    listener = local_links._listen("test", 0, 1)
    assert listener is not None
    sender = local_links._connect("test", 0, 1)
    assert sender is not None
    expected_pid = os.getpid() if from_the_sender else os.getpid() + 1
    accepted = local_links._accept(listener, expected_pid)
    listener.close()
    assert (accepted is not None) == from_the_sender
    for sock, fd in filter(None, (sender, accepted)):
        sock.close()
        os.close(fd)
