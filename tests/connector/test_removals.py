"""The remover side of issue 39 item 4 (``kvpool_connector._removals``): a key seen under a
reader's lease is removed no sooner than the transport's transfer timeout after it was last
seen so; by hand on a clock of the test's own, then connector eviction and unpin against a
real ``mooncake_master`` whose lease ends long before that grace."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvpool_agent.vocabulary import ErrorCode
from kvpool_connector._removals import (
    MAX_LEASED_REMOVES,
    NOT_READY_RETRY_S,
    LeasedKeys,
    grace_s_of,
    remove_later,
)
from kvpool_connector.backends.mooncake import (
    TRANSFER_TIMEOUT_MS,
    MooncakeBackend,
    MooncakeConfig,
)
from kvpool_connector.keys import chunk_hashes
from kvpool_connector.pins import Pins
from kvpool_replay import LocalMooncakeMaster

LEASED, NOT_READY, GONE = (ErrorCode.OBJECT_HAS_LEASE, ErrorCode.REPLICA_IS_NOT_READY,
                           ErrorCode.OBJECT_NOT_FOUND)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_default_grace_is_mooncakes_transfer_timeout() -> None:
    """60 s: ``timeout_milliseconds = 60 * 1000`` in Mooncake's transfer_task.cpp."""
    assert TRANSFER_TIMEOUT_MS == 60_000
    assert LeasedKeys().grace_s == 60.0
    cfg = MooncakeConfig(master_server_address="127.0.0.1:1")
    assert cfg.transfer_timeout_ms == 60_000
    assert MooncakeConfig(master_server_address="127.0.0.1:1",
                          transfer_timeout_ms=5_000).transfer_timeout_ms == 5_000
    assert grace_s_of(1_500) == 1.5 and grace_s_of(-1) == 0.0


def test_a_key_seen_leased_waits_the_grace_from_its_last_refusal() -> None:
    clock = Clock()
    w = LeasedKeys(grace_s=60.0, clock=clock)
    todo = w.batch(["a", "b", "c", "d"], [], None)
    assert todo == ["a", "b", "c", "d"]
    assert w.settle(todo, [LEASED, 0, GONE, ErrorCode.INTERNAL_ERROR]) == (1, 1)
    assert len(w) == 1
    # The lease of "a" ended long ago; its reader may still copy it until 60 s after.
    clock.now += 59.9
    assert w.batch([], [], None) == []
    # Evicted again meanwhile (the scheduler's LRU lost it twice): it still waits.
    assert w.batch(["a", "e"], [], None) == ["e"]
    clock.now += 0.1
    assert w.batch([], [], None) == ["a"]
    # Refused again: the grace starts over from this refusal.
    w.settle(["a"], [LEASED])
    clock.now += 30
    assert w.batch([], [], None) == []
    clock.now += 30
    assert w.batch([], [], None) == ["a"]


def test_keep_pins_and_running_puts() -> None:
    clock = Clock()
    w = LeasedKeys(grace_s=60.0, clock=clock)
    w.settle(["back", "pinned", "putting"], [LEASED, LEASED, NOT_READY])
    # A running put (-703) is no reader: tried again after a short pause, not the grace.
    clock.now += NOT_READY_RETRY_S
    assert w.batch([], ["back"], lambda: frozenset({"pinned"})) == ["putting"]
    clock.now += 60
    # "back" was taken back by the scheduler: never removed; "pinned" a pin holds.
    assert w.batch([], [], lambda: frozenset({"pinned"})) == []
    assert len(w) == 0


def test_the_waiting_list_is_bounded() -> None:
    w = LeasedKeys(grace_s=60.0, clock=Clock())
    keys = [f"k{i}" for i in range(MAX_LEASED_REMOVES + 5)]
    w.settle(keys, [LEASED] * len(keys))
    assert len(w) == MAX_LEASED_REMOVES


def test_remove_later_tries_a_grace_after_each_refusal() -> None:
    """The timer path (unpin): refused twice, removed at the third try, each try at least a
    grace after the one before; a key still leased at the last allowed try is left."""
    calls: list[tuple[float, list[str]]] = []
    done = threading.Event()

    def remove(keys: list[str]) -> list[int]:
        calls.append((time.monotonic(), list(keys)))
        if len(calls) < 3:
            return [LEASED if k == "hot" else 0 for k in keys]
        done.set()
        return [0] * len(keys)

    start = time.monotonic()
    assert remove_later(remove, ["hot", "cold"], 0.2, "test") is not None
    assert done.wait(30)
    assert [keys for _, keys in calls] == [["hot", "cold"], ["hot"], ["hot"]]
    times = [start] + [t for t, _ in calls]
    assert all(b - a >= 0.2 for a, b in itertools.pairwise(times))
    assert remove_later(remove, [], 0.2, "test") is None

    tries: list[int] = []
    last = threading.Event()

    def always_leased(keys: list[str]) -> list[int]:
        tries.append(len(keys))
        if len(tries) == 2:
            last.set()
        return [LEASED] * len(keys)

    remove_later(always_leased, ["k"], 0.05, "test", rounds=2)
    assert last.wait(30)
    # No third try: wait past when one would have run.
    time.sleep(0.3)
    assert tries == [1, 1]


# ---- against a real master ---------------------------------------------------------------

LEASE_MS = 300
GRACE_MS = 2_000
"""The master's lease ends long before the grace: only the grace keeps the key."""
VALUE = 4096


@pytest.fixture(scope="module")
def short_lease() -> Iterator[tuple[LocalMooncakeMaster, MooncakeBackend, torch.Tensor]]:
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=LEASE_MS) as m:
        b = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": m.address, "master_admin_url": m.admin_url,
            "global_segment_size": "16MB", "local_buffer_size": "4MB",
            "default_kv_lease_ttl": LEASE_MS, "transfer_timeout_ms": GRACE_MS}}))
        buf = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        b.register_buffer(buf.data_ptr(), buf.numel())
        try:
            yield m, b, buf
        finally:
            b.close()


def _present(b: MooncakeBackend, keys: list[str]) -> set[str]:
    """Keys the master holds, read from its admin port (no lease taken, unlike exists)."""
    return set(keys) & set(b._all_keys())


def _wait_gone(b: MooncakeBackend, keys: list[str], timeout_s: float) -> float:
    end = time.monotonic() + timeout_s
    while _present(b, keys):
        assert time.monotonic() < end, f"{keys} still in the pool after {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic()


def test_connector_eviction_waits_the_grace_after_a_seen_lease(
        short_lease: tuple[LocalMooncakeMaster, MooncakeBackend, torch.Tensor]) -> None:
    """A reader's lookup leases the keys; the eviction's remove is refused; the lease ends
    after 300 ms, yet the key stays until 2 s (the configured transfer timeout) after the
    refusal, then goes with a later batch. A key never leased goes at once."""
    from kvpool_agent.reporter import NullReporter
    from kvpool_connector._transfers import SaveQueue, WorkerCounters

    _, b, buf = short_lease
    keys = ["rm-read", "rm-free"]
    assert b.batch_put_from(keys, [[buf.data_ptr()]] * 2, [[VALUE]] * 2) == [0, 0]
    counters = WorkerCounters()
    q = SaveQueue(b, NullReporter(), counters, threading.Lock(), blocks_per_chunk=1)
    try:
        assert b.batch_exists(["rm-read"]) == [1]  # a reader: leased for 300 ms
        q.remove(keys).result()
        refused = time.monotonic()
        assert _present(b, keys) == {"rm-read"}
        assert counters.evicted_keys == 1
        while time.monotonic() < refused + GRACE_MS / 1e3 - 0.2:
            q.remove([]).result()  # later batches: the lease is over, the grace is not
            assert _present(b, ["rm-read"]) == {"rm-read"}
            time.sleep(0.05)
        end = time.monotonic() + 30
        while counters.evicted_keys < 2:
            assert time.monotonic() < end, "the waiting key was never removed"
            q.remove([]).result()
            time.sleep(0.05)
        assert time.monotonic() - refused >= GRACE_MS / 1e3
        assert not _present(b, keys) and counters.evict_failed_keys == 0
    finally:
        q.shutdown()


def _pins(b: MooncakeBackend, lease_wait_s: float) -> Pins:
    return Pins(b, lambda hs: [f"kvpool@rm-pins@{h}" for h in hs], 16, VALUE,
                lambda: b.stats().total_bytes, lease_wait_s=lease_wait_s)


@pytest.mark.parametrize("lease_wait_s", [0.0, 10.0])
def test_unpin_removes_a_leased_key_a_grace_after_the_refusal(
        lease_wait_s: float,
        short_lease: tuple[LocalMooncakeMaster, MooncakeBackend, torch.Tensor]) -> None:
    """Within ``lease_wait_s`` unpin waits the grace out itself (and counts the key);
    beyond it a timer removes it; either way not before the grace."""
    _, b, buf = short_lease
    pins = _pins(b, lease_wait_s)
    assert pins.grace_s == GRACE_MS / 1e3
    tokens = [int(lease_wait_s) * 1000 + i for i in range(32)]
    keys = [f"kvpool@rm-pins@{h}" for h in chunk_hashes(tokens, 16)]
    assert b.batch_put_from(keys, [[buf.data_ptr()]] * 2, [[VALUE]] * 2) == [0, 0]
    assert pins.pin("p", tokens).pinned_now == 2
    assert b.batch_exists(keys) == [1, 1]  # a reader leases both chunks
    start = time.monotonic()
    removed = pins.unpin("p")
    if lease_wait_s:
        assert removed == 2 and not _present(b, keys)
        gone = time.monotonic()
    else:
        assert removed == 0 and _present(b, keys) == set(keys)
        gone = _wait_gone(b, keys, 30)
    assert gone - start >= GRACE_MS / 1e3
