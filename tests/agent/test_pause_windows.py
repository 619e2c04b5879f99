"""Pause windows an agent records itself (``Aggregator.tick`` and ``set_pool``, driven with a
frozen clock, never a sleep): a stall of its own process and a span of failing pool health
checks, the loads that waited in them (``max_unpaused_load_ms``, ``paused_after_hit``) and
their place in the wire schema (bounded, validated, optional for older peers)."""

from __future__ import annotations

import msgspec
import pytest
from agent_testlib import FROZEN_MS, frozen_aggregator

from kvpool_agent._aggregate import STALL_MS, Aggregator
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    RECENT_PAUSES,
    EngineState,
    PauseWindow,
    PoolStats,
    ProtocolError,
    Report,
    decode,
    encode,
)
from kvpool_agent.reporter import TransferFinished, TransferStarted

T = FROZEN_MS
"""Frozen wall clock (epoch ms); the monotonic clock of these tests starts at 0 ms."""
TTL_MS = 3_000


def _agg() -> Aggregator:
    agg: Aggregator = frozen_aggregator(TTL_MS)
    return agg


def _load(agg: Aggregator, req: str, start: float, end: float, *, ok: bool = True,
          lease_expires_ms: float | None = None) -> None:
    """A load of ``req`` from ``start`` to ``end`` (epoch ms); a failure is LEASE_EXPIRED after
    a positive lookup."""
    agg.apply([TransferStarted(start, req, "load", 4, 4096, 0, lease_expires_ms)])
    agg.apply([TransferFinished(end, req, "load", ok, 4096 if ok else 0,
                                None if ok else "LEASE_EXPIRED", 0 if ok else 4, not ok,
                                False)])


def _ticks(agg: Aggregator, mono_ms: float, wall_ms: float, until_mono_ms: float) -> None:
    """The agent loop ticking every 50 ms from ``mono_ms`` (= ``wall_ms``) to ``until_mono_ms``."""
    m = mono_ms
    while m <= until_mono_ms:
        agg.tick(m, wall_ms + (m - mono_ms))
        m += 50.0


def test_a_stall_of_the_process_is_a_window_and_ticks_on_time_are_none() -> None:
    agg = _agg()
    _ticks(agg, 50.0, T + 50, 10_000.0)
    # A loop late by just under the threshold (a loaded host) is no stall.
    agg.tick(10_000.0 + STALL_MS, T + 10_000 + STALL_MS)
    assert agg.state(T + 12_000).pauses == []
    # SIGSTOP for 8 s: the first tick after SIGCONT closes an 8 s window ending now.
    agg.tick(20_000.0 + STALL_MS, T + 20_000 + STALL_MS)
    (w,) = agg.state(T + 22_000).pauses
    assert (w.kind, w.start_ms, w.end_ms) == (
        "process_stalled", T + 12_000, T + 20_000 + STALL_MS)
    assert (w.loads, w.failed_after_hit, w.max_load_ms) == (0, 0, 0.0)


def test_a_wall_clock_step_is_no_stall() -> None:
    agg = _agg()
    agg.tick(50.0, T + 3_600_000)  # NTP stepped the wall clock an hour on
    agg.tick(100.0, T - 3_600_000)
    assert agg.state(T).pauses == []


def test_a_load_that_waited_in_a_stall_counts_without_the_stall() -> None:
    agg = _agg()
    _load(agg, "before", T + 10, T + 40)  # ended before the stall: not in the window
    agg.apply([TransferStarted(T + 30, "slow", "load", 4, 4096, 0, None)])
    agg.tick(50.0, T + 50)
    agg.tick(8_050.0, T + 8_050)  # stopped from T + 50 to T + 8050
    agg.apply([TransferFinished(T + 8_090, "slow", "load", True, 4096, None, 0, False,
                                False)])
    st = agg.state(T + 8_100)
    (w,) = st.pauses
    assert (w.loads, w.max_load_ms, w.failed_after_hit) == (1, 8_060.0, 0)
    # 8060 ms of which 8000 stopped: 60 ms are what the lease TTL had to cover.
    assert st.transfers.max_load_ms == 8_060.0
    assert st.transfers.max_unpaused_load_ms == 60.0


def test_a_lease_that_ran_out_only_because_of_the_stall_is_the_stalls() -> None:
    agg = _agg()
    # Looked up at T (lease until T + 3 s), stopped from T + 50 for 8 s, failed after.
    agg.apply([TransferStarted(T + 20, "r1", "load", 4, 4096, 0, T + TTL_MS)])
    agg.tick(8_050.0, T + 8_050)
    agg.apply([TransferFinished(T + 8_200, "r1", "load", False, 0, "LEASE_EXPIRED", 4, True,
                                False)])
    # Looked up at T + 8.2 s and took 3.1 s with no pause: the TTL's, not the stall's.
    _ticks(agg, 8_100.0, T + 8_100, 12_000.0)
    _load(agg, "r2", T + 8_250, T + 11_300, ok=False, lease_expires_ms=T + 8_200 + TTL_MS)
    st = agg.state(T + 12_000)
    assert st.transfers.failed_after_hit == 2
    assert st.transfers.errors_by_name == {"LEASE_EXPIRED": 2}
    assert st.transfers.paused_after_hit == {"LEASE_EXPIRED": 1}
    (w,) = st.pauses
    assert (w.loads, w.failed_after_hit) == (1, 1)


def test_a_lease_too_short_even_without_the_stall_is_not_the_stalls() -> None:
    agg = _agg()
    # A load just before sets the rate (410 B/s over 10 s): 4 KiB take 10 s, so r1 is slow,
    # not stuck (stuck past 2x that: no store_stalled window).
    _load(agg, "r0", T - 30, T - 10)
    # Looked up at T; 2.1 s stopped; failed at T + 9 s: 6.9 s unpaused > the 3 s TTL.
    agg.apply([TransferStarted(T + 20, "r1", "load", 4, 4096, 0, T + TTL_MS)])
    agg.tick(2_150.0, T + 2_150)
    _ticks(agg, 2_200.0, T + 2_200, 9_000.0)
    agg.apply([TransferFinished(T + 9_000, "r1", "load", False, 0, "LEASE_EXPIRED", 4, True,
                                False)])
    st = agg.state(T + 9_000)
    assert st.transfers.failed_after_hit == 1 and st.transfers.paused_after_hit == {}
    assert st.pauses[0].loads == 1 and st.pauses[0].failed_after_hit == 0
    assert st.store_pauses == []


def test_failing_health_checks_are_a_pool_window_from_the_last_passing_one() -> None:
    agg = _agg()

    def check(healthy: bool, at_ms: float) -> None:
        agg.set_pool(PoolStats(backend="mooncake", lease_ttl_ms=TTL_MS, healthy=healthy,
                               health_detail="" if healthy else "master admin unreachable"),
                     at_ms)

    check(True, T + 1_000)
    agg.apply([TransferStarted(T + 1_500, "w", "load", 4, 4096, 0, None)])
    check(False, T + 3_000)
    check(False, T + 5_000)  # still the same window
    (w,) = agg.state(T + 5_000).pauses
    assert (w.kind, w.start_ms, w.end_ms, w.detail) == (
        "pool_unhealthy", T + 1_000, None, "master admin unreachable")
    agg.apply([TransferFinished(T + 9_200, "w", "load", True, 4096, None, 0, False, False)])
    check(True, T + 9_500)
    agg.set_pool(PoolStats(backend="mooncake", healthy=None), T + 9_600)  # not checked: no-op
    (w,) = agg.state(T + 10_000).pauses
    assert (w.start_ms, w.end_ms, w.loads, w.max_load_ms) == (T + 1_000, T + 9_500, 1, 7_700.0)
    assert agg.state(T + 10_000).transfers.max_unpaused_load_ms == 0.0
    # Stats without a check time (a caller that does not time its checks) open no window.
    agg.set_pool(PoolStats(backend="mooncake", healthy=False))
    assert len(agg.state(T + 10_000).pauses) == 1


def test_overlapping_windows_count_their_time_once() -> None:
    agg = _agg()
    agg.set_pool(PoolStats(backend="mooncake", healthy=True), T)
    agg.apply([TransferStarted(T + 10, "w", "load", 4, 4096, 0, None)])
    agg.set_pool(PoolStats(backend="mooncake", healthy=False), T + 2_000)
    agg.tick(6_000.0, T + 6_000)  # a stall from T + 0 to T + 6 s inside the pool's window
    agg.set_pool(PoolStats(backend="mooncake", healthy=True), T + 8_000)
    agg.apply([TransferFinished(T + 9_010, "w", "load", True, 4096, None, 0, False, False)])
    st = agg.state(T + 9_100)
    assert [w.kind for w in st.pauses] == ["pool_unhealthy", "process_stalled"]
    assert [w.loads for w in st.pauses] == [1, 1]
    # 9000 ms from T + 10: 7990 ms in the union of the windows (T + 10 .. T + 8000).
    assert st.transfers.max_unpaused_load_ms == 1_010.0


def test_windows_are_bounded_and_validated_and_optional_on_the_wire() -> None:
    agg = _agg()
    for i in range(1, RECENT_PAUSES + 3):
        agg.tick(i * 10_000.0, T + i * 10_000)
    st = agg.state(T + 200_000)
    assert len(st.pauses) == RECENT_PAUSES
    assert st.pauses[-1].end_ms == T + (RECENT_PAUSES + 2) * 10_000
    got = decode(encode(Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot", state=st)))
    assert isinstance(got, Report) and got.state.pauses == st.pauses
    # A peer sending more windows, or a window out of range, is refused as a whole.
    for bad in (msgspec.structs.replace(st, pauses=st.pauses + st.pauses[:1]),
                msgspec.structs.replace(st, pauses=[PauseWindow(kind="process_stalled",
                                                                start_ms=-1.0)])):
        with pytest.raises(ProtocolError):
            decode(encode(Report(v=PROTOCOL_VERSION, seq=2, kind="delta", state=bad)))
    # An agent before these fields sends none of them: they decode as "not told".
    old = msgspec.to_builtins(st)
    del old["pauses"]
    del old["transfers"]["max_unpaused_load_ms"]
    del old["transfers"]["paused_after_hit"]
    prev = msgspec.msgpack.Decoder(EngineState).decode(msgspec.msgpack.encode(old))
    assert prev.pauses == [] and prev.transfers.max_unpaused_load_ms is None
    assert prev.transfers.paused_after_hit == {}
