"""What an agent records of its pool's store (``_store_watch``, driven through the real
``Aggregator`` with a frozen clock): a ``store_stalled`` window while its transfers are stuck
and nothing ends well (a frozen ``mooncake_client``), none for slow transfers that keep ending
(a lease TTL below the load time), a ``pool_no_segments`` window while the master holds no
memory any more, the segments it dropped with their keys and bytes (``PoolStats.losses``), the
loads those windows explain (``max_unpaused_load_ms``, ``paused_after_hit``) and their place on
the wire (bounded, and skipped unread by receivers before them)."""

from __future__ import annotations

from typing import Literal

import msgspec
import pytest
from agent_testlib import FROZEN_MS, frozen_aggregator

from kvpool_agent._aggregate import RECENT_ERRORS, Aggregator
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    RECENT_PAUSES,
    EngineState,
    PauseWindow,
    PoolStats,
    ProtocolError,
    Report,
    SegmentUsage,
    Source,
    decode,
    encode,
)
from kvpool_agent.reporter import TransferFinished, TransferStarted

T = FROZEN_MS
"""Frozen wall clock (epoch ms); the monotonic clock of these tests starts at 0 ms."""
TTL_MS = 3_000
MIB = 1 << 20


def _agg() -> Aggregator:
    agg: Aggregator = frozen_aggregator(TTL_MS)
    return agg


def _ticks(agg: Aggregator, from_ms: float, until_ms: float) -> None:
    """The agent loop ticking every 50 ms from ``T + from_ms`` to ``T + until_ms``."""
    m = from_ms
    while m <= until_ms:
        agg.tick(m, T + m)
        m += 50.0


def _start(agg: Aggregator, req: str, at_ms: float, kind: str = "load") -> None:
    agg.apply([TransferStarted(T + at_ms, req, kind, 4, 4096, 0,  # type: ignore[arg-type]
                               T + at_ms + TTL_MS if kind == "load" else None)])


def _end(agg: Aggregator, req: str, at_ms: float, *, ok: bool = True, kind: str = "load",
         error: str = "LEASE_EXPIRED", after_hit: bool = True) -> None:
    agg.apply([TransferFinished(T + at_ms, req, kind, ok,  # type: ignore[arg-type]
                                4096 if ok else 0, None if ok else error, 0 if ok else 4,
                                not ok and after_hit, False)])


def _reading(agg: Aggregator, at_ms: float, *segments: tuple[str, int, int],
             keys: int = 0, backend: str = "mooncake") -> None:
    """A healthy reading of the master at ``T + at_ms``: ``segments`` (name, used, total)."""
    agg.set_pool(PoolStats(backend=backend, keys=keys, healthy=True, lease_ttl_ms=TTL_MS,
                           used_bytes=sum(u for _, u, _ in segments),
                           total_bytes=sum(t for _, _, t in segments),
                           segments=[SegmentUsage(name=n, used_bytes=u, total_bytes=t)
                                     for n, u, t in segments]), T + at_ms)


def test_a_frozen_store_is_a_window_from_the_stuck_load_to_the_first_answer() -> None:
    agg = _agg()
    _start(agg, "r1", 100)  # looked up at T + 100: lease until T + 3.1 s
    _start(agg, "s1", 200, "save")
    _ticks(agg, 50, 2_500)
    assert agg.state(T + 2_500).store_pauses == []  # under the 2.5 s floor: not yet stuck
    _ticks(agg, 2_550, 3_200)
    (w,) = agg.state(T + 3_200).store_pauses
    assert (w.kind, w.start_ms, w.end_ms) == ("store_stalled", T + 100, None)
    # Stopped 8 s; resumed, the load fails (its lease ran out meanwhile), the save ends well.
    _ticks(agg, 3_250, 8_000)
    _end(agg, "r1", 8_100, ok=False)
    _end(agg, "s1", 8_150, ok=True, kind="save")
    _ticks(agg, 8_200, 9_000)
    st = agg.state(T + 9_000)
    (w,) = st.store_pauses
    assert w.kind == "store_stalled" and w.start_ms == T + 100
    assert w.end_ms is not None and T + 8_150 <= w.end_ms <= T + 8_750
    assert (w.loads, w.failed_after_hit) == (1, 1)
    # The load's lease ran out in the stall: the stall's, not the TTL's.
    assert st.transfers.paused_after_hit == {"LEASE_EXPIRED": 1}
    assert st.pauses == []  # the process itself never stopped


def test_slow_transfers_that_keep_ending_are_no_stall() -> None:
    agg = _agg()
    # Loads of 4 s each, one ending every 500 ms (r_j from T - 3.5 s + j * 0.5 s): each past
    # the 2.5 s floor, while the store keeps answering.
    _start(agg, "w", -600)
    _end(agg, "w", -100)
    for j in range(8):
        _start(agg, f"r{j}", -3_500 + j * 500)
    for k in range(24):
        at = 500 + k * 500
        _ticks(agg, at - 450, at)
        _end(agg, f"r{k}", at)
        _start(agg, f"r{k + 8}", at)
    st = agg.state(T + 12_000)
    assert st.store_pauses == []
    assert st.transfers.max_unpaused_load_ms == 4_000.0  # the lease_ttl rule sees it


def test_a_dead_store_is_no_segments_until_memory_is_back_and_its_segment_a_loss() -> None:
    agg = _agg()
    _reading(agg, 1_000, ("10.0.0.5:15001", 300 * MIB, 512 * MIB),
             ("10.0.0.6:15001", 100 * MIB, 512 * MIB), keys=4_000)
    # 10.0.0.6's store died: the master dropped its segment; memory is left.
    _reading(agg, 3_000, ("10.0.0.5:15001", 300 * MIB, 512 * MIB), keys=3_000)
    st = agg.state(T + 3_000)
    assert st.pool is not None and st.store_pauses == []
    (loss,) = st.pool.losses
    assert (loss.segment, loss.seen_ms, loss.ts_ms, loss.bytes) == (
        "10.0.0.6:15001", T + 1_000, T + 3_000, 100 * MIB)
    assert loss.keys == 1_000  # its share of the bytes of the 4,000 keys
    # Then the other: no memory at all, saves fail at once (NO_AVAILABLE_HANDLE).
    _reading(agg, 5_000, keys=0)
    _reading(agg, 7_000, keys=0)
    # A new store mounts.
    _reading(agg, 9_000, ("10.0.0.7:15001", 0, 512 * MIB))
    st = agg.state(T + 9_000)
    assert st.pool is not None
    assert [x.segment for x in st.pool.losses] == ["10.0.0.6:15001", "10.0.0.5:15001"]
    assert (st.pool.lost_keys, st.pool.lost_bytes) == (4_000, 400 * MIB)
    (w,) = st.store_pauses
    assert (w.kind, w.start_ms, w.end_ms, w.detail) == (
        "pool_no_segments", T + 3_000, T + 9_000, "10.0.0.5:15001")


def test_no_window_without_memory_ever_read_nor_for_other_backends() -> None:
    agg = _agg()
    _reading(agg, 1_000)  # a pool whose memory is not mounted yet: nothing was lost
    _reading(agg, 3_000)
    _reading(agg, 5_000, ("10.0.0.5:15001", 0, 512 * MIB))
    assert agg.state(T + 5_000).store_pauses == []
    other = _agg()
    _reading(other, 1_000, ("node", 10, 100), backend="yuanrong")
    _reading(other, 3_000, backend="yuanrong")
    st = other.state(T + 3_000)
    assert st.store_pauses == [] and st.pool is not None and st.pool.losses == []
    # An unhealthy reading says nothing of the segments (the master did not answer).
    agg.set_pool(PoolStats(backend="mooncake", healthy=False, health_detail="down"), T + 7_000)
    _reading(agg, 9_000, ("10.0.0.5:15001", 0, 512 * MIB))
    st = agg.state(T + 9_000)
    assert st.pool is not None and st.pool.losses == [] and st.store_pauses == []


def test_store_windows_are_bounded_and_skipped_by_receivers_before_them() -> None:
    agg = _agg()
    st = agg.state(T)
    windows = [PauseWindow(kind="store_stalled", start_ms=T + i, end_ms=T + i + 1)
               for i in range(RECENT_PAUSES)]
    full = msgspec.structs.replace(st, store_pauses=windows)
    got = decode(encode(Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot", state=full)))
    assert isinstance(got, Report) and got.state.store_pauses == windows
    with pytest.raises(ProtocolError):
        decode(encode(Report(v=PROTOCOL_VERSION, seq=2, kind="delta", state=msgspec.structs
                             .replace(st, store_pauses=[*windows, windows[0]]))))

    # A receiver before the field (PauseWindow without the store kinds, EngineState without
    # store_pauses) decodes the report: the field is skipped unread.
    old_window = msgspec.defstruct("PauseWindow", [
        ("kind", Literal["process_stalled", "pool_unhealthy"]), ("start_ms", float)],
        kw_only=True)
    old_state = msgspec.defstruct("EngineState", [
        ("source", Source), ("ts_ms", float), ("pauses", list[old_window])],  # type: ignore
        kw_only=True)
    prev = msgspec.msgpack.decode(msgspec.msgpack.encode(full), type=old_state)
    assert prev.ts_ms == full.ts_ms  # type: ignore[attr-defined]
    # An agent before the fields sends none: they decode as nothing recorded.
    old = msgspec.to_builtins(st)
    old.pop("store_pauses")
    back = msgspec.msgpack.Decoder(EngineState).decode(msgspec.msgpack.encode(old))
    assert back.store_pauses == []


def test_a_dead_stores_refused_transfers_are_in_its_window() -> None:
    """A killed store: its transfers fail at once (TRANSFER_FAIL) while its segment lingers
    in the master for client_ttl; the window starts at the first failure after the last
    transfer that ended well, and counts them."""
    agg = _agg()
    _reading(agg, 1_000, ("10.0.0.5:15001", 100 * MIB, 512 * MIB), keys=500)
    _start(agg, "ok", 1_100, "save")
    _end(agg, "ok", 1_200, kind="save")
    for i, at in enumerate((1_500, 2_000, 2_500)):
        _start(agg, f"s{i}", at - 10, "save")
        _end(agg, f"s{i}", at, ok=False, kind="save", error="TRANSFER_FAIL", after_hit=False)
    _reading(agg, 3_000, ("10.0.0.5:15001", 100 * MIB, 512 * MIB), keys=500)  # lingering
    _reading(agg, 5_000, keys=0)  # dropped
    (w,) = agg.state(T + 5_000).store_pauses
    assert (w.kind, w.start_ms, w.end_ms) == ("pool_no_segments", T + 1_500, None)
    assert w.errors == {"TRANSFER_FAIL": 3}


def test_a_dead_stores_window_counts_failures_a_flood_pushed_out_of_the_records() -> None:
    """The same, with more failures after the first TRANSFER_FAIL than the agent keeps records
    of (``RECENT_ERRORS``: saves refused at once, NO_AVAILABLE_HANDLE, while the segment
    lingers): the window still counts all of them, so the console can put every one on the
    store (a CI run under load read the 4 TRANSFER_FAIL as the transport's)."""
    agg = _agg()
    _reading(agg, 1_000, ("10.0.0.5:15001", 100 * MIB, 512 * MIB), keys=500)
    _start(agg, "ok", 1_100, "save")
    _end(agg, "ok", 1_200, kind="save")
    for i in range(4):
        _start(agg, f"t{i}", 1_490 + i, "save")
        _end(agg, f"t{i}", 1_500 + i, ok=False, kind="save", error="TRANSFER_FAIL",
             after_hit=False)
    flood = RECENT_ERRORS + 10
    for i in range(flood):
        _start(agg, f"n{i}", 2_000 + i, "save")
        _end(agg, f"n{i}", 2_001 + i, ok=False, kind="save", error="NO_AVAILABLE_HANDLE",
             after_hit=False)
    assert not [e for e in agg.recent_errors if e.name == "TRANSFER_FAIL"]  # pushed out
    _reading(agg, 3_000, ("10.0.0.5:15001", 100 * MIB, 512 * MIB), keys=500)  # lingering
    _reading(agg, 5_000, keys=0)  # dropped
    (w,) = agg.state(T + 5_000).store_pauses
    assert (w.kind, w.start_ms) == ("pool_no_segments", T + 1_500)
    assert w.errors == {"TRANSFER_FAIL": 4, "NO_AVAILABLE_HANDLE": flood}
