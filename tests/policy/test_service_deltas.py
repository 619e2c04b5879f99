"""Deltas on a live service (``kvpool_policy._deltas``): a real ``PolicyService`` (its store
client on a real ``mooncake_master``) at the largest doorkeeper filter (4 MiB), an engine's
real ``PolicyClient`` over CURVE sending records: between whole snapshots the service sends
deltas a few KB long, and the engine's filter equals the service's own once its records are
in; a viewer's subscriber sees the sizes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from policy_harness import RunningService
from test_service_live import wait_for

from kvpool_agent.auth import local_fleet_keys
from kvpool_connector.keys import ParallelLayout, shard_prefix
from kvpool_connector.policy_client import PolicyClient
from kvpool_connector.policy_wire import AdmissionSnapshot, PolicyLayout
from kvpool_policy.policy import DOORKEEPER_MAX_MIB
from kvpool_replay import LocalMooncakeMaster

CHUNK_BYTES = 64 << 10
LAYOUT = PolicyLayout("dddddddddddd", [shard_prefix("deltas", "dddddddddddd",
                                                    ParallelLayout())])


def _prompt(doc: int, n: int = 16) -> list[str]:
    return [hashlib.sha256(f"{doc}-{i}".encode()).hexdigest()[:32] for i in range(n)]


@pytest.fixture
def running(mooncake_master: LocalMooncakeMaster, tmp_path: Path) -> Iterator[RunningService]:
    # 256 GiB of 64 KiB chunks: the largest filter once a record sizes it.
    r = RunningService(mooncake_master, local_fleet_keys(tmp_path / "keys"),
                       capacity_bytes=256 << 30)
    try:
        yield r
    finally:
        r.close()


def test_an_engine_follows_the_filter_through_deltas(running: RunningService) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    running.keys["viewer"].client("viewer").apply(sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(running.snapshots_at)
    engine = PolicyClient(running.address, running.keys["agent"].client("agent"), "eng-d",
                          LAYOUT, CHUNK_BYTES)
    counters = running.service.core.counters
    try:
        wait_for(lambda: engine.records_connected, 30, "the engine connected")
        sizes: list[tuple[int, int, int]] = []  # (base, bits, bytes) the viewer got

        def drain() -> None:
            while sub.poll(0):
                data = sub.recv()
                msg = msgspec.msgpack.decode(data, type=AdmissionSnapshot)
                sizes.append((msg.base, msg.bits, len(data)))

        for doc in range(40):  # 40 prompts of 16 chunks, over several publications
            engine.admit(_prompt(doc))
            if doc % 10 == 9:
                seen = counters.snapshots
                wait_for(lambda s=seen: counters.snapshots >= s + 2, 30, "two publications")
            drain()
        wait_for(lambda: counters.records == engine.sent == 40, 30, "every record applied")
        policy = running.service.core.policy
        dk = policy.doorkeeper_snapshot()
        assert dk is not None and len(dk[1]) > (DOORKEEPER_MAX_MIB << 20) - 16

        def same() -> bool:
            snap = engine.snapshot
            return snap is not None and (snap.bits, snap.bloom) == dk

        # The records are in: the next publication carries the last of their bits.
        wait_for(same, 10, "the engine's filter equal to the service's")
        drain()
        assert engine.deltas_missed == 0
        deltas = [n for base, _, n in sizes if base]
        wholes = [n for base, bits, n in sizes if not base and bits]  # with a filter
        assert deltas and wholes and counters.snapshot_deltas >= len(deltas)
        # A delta: the words 16 new chunks (4 probes each) set at most, 12 bytes a word.
        assert max(deltas) <= 10 * 16 * 4 * 12 + 200 < min(wholes) // 100
    finally:
        engine.close()
        sub.close(0)
        ctx.term()


@pytest.fixture
def fast(mooncake_master: LocalMooncakeMaster, tmp_path: Path) -> Iterator[RunningService]:
    # Periodic publications every 0.1 s, as often as ones for new subscribers: a subscription
    # is often taken in a turn whose publication is due as periodic.
    r = RunningService(mooncake_master, local_fleet_keys(tmp_path / "keys"),
                       capacity_bytes=256 << 30, snapshot_every_s=0.1)
    try:
        yield r
    finally:
        r.close()


def test_every_new_subscriber_gets_a_whole_snapshot_at_once(fast: RunningService) -> None:
    """40 subscribers in turn, records flowing (deltas between whole snapshots): each one has
    a whole snapshot, with the filter, within 3 messages. (libzmq delivers to a subscriber as
    soon as its subscription reaches the socket, before the service's loop takes it: a delta
    published in between comes first, and ``SnapshotReader`` saves every chunk on it.) An
    attacker's churn once saw subscribers wait ~20 deltas (10 s) for their first whole one: a
    subscription taken in the turn a periodic publication was due got a delta; the schedule's
    rule is checked exactly in ``test_service_first_snapshot.py``."""
    engine = PolicyClient(fast.address, fast.keys["agent"].client("agent"), "eng-w", LAYOUT,
                          CHUNK_BYTES)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    counters = fast.service.core.counters
    try:
        wait_for(lambda: engine.records_connected, 30, "the engine connected")
        engine.admit(_prompt(999, 4))
        wait_for(lambda: counters.records == 1, 30, "the filter sized by a record")
        before_whole = []
        for i in range(40):
            engine.admit(_prompt(1_000 + i, 4))
            # Two publications first: deltas go out between the subscriptions.
            s0 = counters.snapshots
            wait_for(lambda s0=s0: counters.snapshots >= s0 + 2, 30, "two publications")
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            role = "viewer" if i % 2 else "operator"
            fast.keys[role].client(role).apply(sub)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(fast.snapshots_at)
            deltas = 0
            while True:
                assert sub.poll(30_000), "no snapshot for a new subscriber"
                msg = msgspec.msgpack.decode(sub.recv(), type=AdmissionSnapshot)
                if not msg.base:
                    assert msg.bits > 0
                    break
                deltas += 1
            before_whole.append(deltas)
            sub.close(0)
        assert counters.snapshot_deltas > 0  # deltas did go out meanwhile
        assert max(before_whole) <= 3, before_whole
    finally:
        engine.close()
        ctx.term()
