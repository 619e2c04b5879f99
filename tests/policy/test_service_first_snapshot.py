"""A new snapshot subscriber of the policy service gets its first snapshot at once, not with the
next periodic publication (0.51 s measured before), and subscription churn cannot make the
service publish in a loop.

The live test runs a real ``PolicyService`` (its store client on a real ``mooncake_master``)
over real CURVE sockets with the longest periodic interval ``--snapshot-every-ms`` takes (a
minute): every snapshot after the service's first is one a subscription triggered, so each
subscriber's first snapshot is known by its version. ``SnapshotSchedule``'s rate bound is
checked on a clock of the test's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from policy_harness import RunningService
from test_service_live import wait_for

from kvpool_agent.auth import ClientKeys, local_fleet_keys
from kvpool_connector.policy_wire import AdmissionSnapshot
from kvpool_policy.service import (
    SNAPSHOT_EVERY_MS_RANGE,
    SUBSCRIBED_EVERY_S,
    SnapshotSchedule,
)
from kvpool_replay import LocalMooncakeMaster

EVERY_S = SNAPSHOT_EVERY_MS_RANGE[1] / 1e3
"""The periodic interval of the live test's service (s): none comes while the test runs."""

CAP = 1
"""The live test's ``max_subscribers_per_key`` (a viewer or operator key)."""


@pytest.fixture
def running(mooncake_master: LocalMooncakeMaster, tmp_path: Path) -> Iterator[RunningService]:
    r = RunningService(mooncake_master, local_fleet_keys(tmp_path / "keys"),
                       max_subscribers_per_key=CAP, snapshot_every_s=EVERY_S)
    try:
        yield r
    finally:
        r.close()


def _subscriber(ctx: zmq.Context[zmq.Socket[bytes]], at: str,
                keys: ClientKeys) -> zmq.Socket[bytes]:
    s: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    s.linger = 0
    keys.apply(s)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(at)
    return s


def _versions(sock: zmq.Socket[bytes]) -> list[int]:
    """The versions of the snapshots ``sock`` holds now (read and dropped)."""
    out = []
    while sock.poll(0):
        out.append(msgspec.msgpack.decode(sock.recv(), type=AdmissionSnapshot).version)
    return out


def test_a_new_subscriber_gets_a_snapshot_at_once_and_a_refused_one_triggers_none(
    running: RunningService,
) -> None:
    """The service's first snapshot (version 1) goes out at its start; a viewer's subscriber
    then gets version 2, published for it; 3 more subscribers of the viewer key, past its cap,
    are refused and trigger no publication: an operator's subscriber after them gets version 3,
    the next one, which the viewer's held subscriber gets too."""
    c = running.service.core.counters
    wait_for(lambda: c.snapshots == 1, 30, "the service's first snapshot")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        viewer = running.keys["viewer"].client("viewer")
        held = _subscriber(ctx, running.snapshots_at, viewer)
        got: list[int] = []
        wait_for(lambda: got.extend(_versions(held)) or got, 30, "the viewer's first snapshot")
        assert got == [2]
        assert (c.snapshots, c.snapshots_on_subscription) == (2, 1)

        refused = [_subscriber(ctx, running.snapshots_at, viewer) for _ in range(3)]
        wait_for(lambda: c.subscribers_over_cap == 3, 30, "3 subscribers refused")
        operator = _subscriber(ctx, running.snapshots_at,
                               running.keys["operator"].client("operator"))
        seen: list[int] = []
        wait_for(lambda: seen.extend(_versions(operator)) or seen, 30,
                 "the operator's first snapshot")
        assert seen == [3]
        assert (c.snapshots, c.snapshots_on_subscription) == (3, 2)
        assert _versions(held) == [3]
        assert [_versions(s) for s in refused] == [[], [], []]
        assert c.over_cap_by_key == {"viewer/viewer": 3}
        assert c.errors == 0
    finally:
        ctx.destroy(linger=0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_subscription_churn_is_published_at_most_once_every_tenth_of_a_second() -> None:
    """A subscription every turn of 30 ms for 3 s (the test's clock): the periodic snapshots
    stay (the first turn at or past 0.5 s from the last: every 17 turns), those for
    subscribers come ``SUBSCRIBED_EVERY_S`` apart at least (every 4 turns, 0.12 s, counted
    again from each periodic one, which serves the subscriptions before it), and no
    subscription waits longer than that and one turn."""
    clock = _Clock()
    schedule = SnapshotSchedule(0.5, clock)
    step = 0.03
    turns: dict[str, list[int]] = {"periodic": [], "subscribed": []}
    waiting_since: float | None = None
    longest_wait = 0.0
    for k in range(101):
        clock.now = k * step
        if k:  # the first turn, at the start, before any subscriber
            schedule.subscribed = True
            waiting_since = clock.now if waiting_since is None else waiting_since
        why = schedule.due(flipped=False)
        if why is not None:
            turns[why].append(k)
            if waiting_since is not None:
                longest_wait = max(longest_wait, clock.now - waiting_since)
            waiting_since = None
    assert turns["periodic"] == [0, 17, 34, 51, 68, 85]
    assert turns["subscribed"] == [p + d for p in turns["periodic"] for d in (1, 5, 9, 13)
                                   if p + d <= 100]
    early = [k * step for k in turns["subscribed"]]
    assert min(b - a for a, b in itertools.pairwise(early)) >= SUBSCRIBED_EVERY_S
    assert longest_wait <= SUBSCRIBED_EVERY_S + step
    # The last two turns' subscriptions wait for the next (0.06 s after turn 98's).
    assert schedule.subscribed and schedule.due(flipped=False) is None


def test_a_flip_publishes_at_once_and_serves_a_waiting_subscription() -> None:
    clock = _Clock()
    schedule = SnapshotSchedule(0.5, clock)
    assert schedule.due(flipped=False) == "periodic" and not schedule.serves_subscription
    clock.now = 0.01
    schedule.subscribed = True
    assert schedule.due(flipped=False) == "subscribed" and schedule.serves_subscription
    clock.now = 0.02
    schedule.subscribed = True
    assert schedule.due(flipped=False) is None  # 10 ms after the last one for subscribers
    # The flip's publication serves the waiting subscription: it must go out whole.
    assert schedule.due(flipped=True) == "periodic" and schedule.serves_subscription
    assert not schedule.subscribed
    clock.now = 0.2
    assert schedule.due(flipped=False) is None  # nothing waits, the interval not passed
    # A subscription taken in the turn the periodic one is due: served by it, whole.
    clock.now = 0.6
    schedule.subscribed = True
    assert schedule.due(flipped=False) == "periodic" and schedule.serves_subscription
    clock.now = 1.2
    assert schedule.due(flipped=False) == "periodic" and not schedule.serves_subscription
