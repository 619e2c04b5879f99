"""The hub's access window (``kvpool_agent._access_window``): the live reuse ceiling and the
what-if curve over compact chunk ids equal the replay's reference over the full hashes of the
same trace slice; the window is bounded and counts what it cut; the agent's queue of accesses
and the wire keep their bounds."""

from __future__ import annotations

import msgspec
import pytest
from agent_testlib import make_source

from kvpool_agent._access_window import FLEET, AccessWindow, Ceiling
from kvpool_agent._aggregate import ACCESS_QUEUE_CHUNKS, SAVE_QUEUE_CHUNKS, Aggregator
from kvpool_agent._reuse_service import pool_capacity_tokens
from kvpool_agent.protocol import (
    MAX_ACCESS_CHUNKS,
    MAX_COUNT,
    MAX_CURVE_POINTS,
    MAX_ID_CHARS,
    MAX_REPORT_ACCESSES,
    MAX_REPORT_SAVES,
    MAX_REUSE_MODELS,
    MAX_SPLIT_ENGINES,
    PROTOCOL_VERSION,
    REPORT_ACCESS_CHUNKS,
    Access,
    EngineState,
    ModelReuse,
    PoolStats,
    ProtocolError,
    Report,
    ReuseView,
    WhatIfPoint,
    chunk_id,
    decode,
    encode,
)
from kvpool_agent.reporter import Lookup, Saved
from kvpool_agent.reuse import CURVE_FACTORS
from kvpool_connector.keys import chunk_hashes
from kvpool_replay import (
    belady_hits,
    default_trace_path,
    load_trace,
    lru_hits,
    prefix_ceiling,
    request_tokens,
)

CHUNK = 512


@pytest.fixture(scope="module")
def conversation() -> list[tuple[int, list[str]]]:
    reqs = load_trace(default_trace_path("conversation_trace.jsonl"), limit=200)
    return [(r.input_length, chunk_hashes(request_tokens(r), CHUNK)) for r in reqs]


def test_ceiling_and_whatif_equal_the_trace_reference(
        conversation: list[tuple[int, list[str]]]) -> None:
    window = AccessWindow()
    for tokens, hashes in conversation:
        window.add("llama", CHUNK, tokens, [chunk_id(h) for h in hashes])
    acc = window.snapshot()
    ref = prefix_ceiling(conversation, CHUNK)
    assert ref.hit_tokens > 0
    got = AccessWindow.ceiling(acc)
    assert got["llama"] == got[FLEET] == Ceiling(ref.input_tokens, ref.hit_tokens)
    # The what-if at a pool of a quarter of the slice's distinct chunks: exact LRU and MIN.
    pool = len({h for _, hs in conversation for h in hs}) // 4 * CHUNK
    points = AccessWindow.whatif(acc, "llama", pool)
    assert [p.capacity_tokens for p in points] == [int(pool * f) for f in CURVE_FACTORS]
    one = points[CURVE_FACTORS.index(1.0)]
    assert one.lru_hit_rate == lru_hits(conversation, CHUNK, pool).hit_rate < ref.hit_rate
    assert one.min_hit_rate == belady_hits(conversation, CHUNK, pool).hit_rate
    assert points[-1].lru_hit_rate == ref.hit_rate  # 8x a quarter holds every chunk
    assert AccessWindow.whatif(acc, "other-model", pool) == []


def test_models_are_separate_pools_and_the_fleet_is_their_sum() -> None:
    window = AccessWindow()
    for model in ("a", "b"):
        window.add(model, 4, 9, [1, 2])
        window.add(model, 4, 9, [1, 2])  # hits both chunks: 8 tokens
    window.add("b", 16, 33, [1, 2])  # another chunk size: another pool, a miss
    got = AccessWindow.ceiling(window.snapshot())
    assert got == {"a": Ceiling(18, 8), "b": Ceiling(51, 8), FLEET: Ceiling(69, 16)}
    assert got[FLEET].hit_rate == pytest.approx(16 / 69)
    assert Ceiling(0, 0).hit_rate == 0.0


def test_window_keeps_the_newest_chunks_and_cuts_long_prompts() -> None:
    window = AccessWindow(max_chunks=10)
    for i in range(5):
        window.add("m", 4, 17, [10 * i + k for k in range(4)])
    # 20 chunks added, 10 kept: the last access's 4 plus the 4 before it; a third would pass.
    assert (window.chunks, len(window), window.added) == (8, 2, 5)
    assert [a.chunks[0] for a in window.snapshot()] == [30, 40]
    window.add("m", 4, 10**6, list(range(MAX_ACCESS_CHUNKS + 5)))
    assert window.truncated == 1
    # One access longer than the window is kept alone (a window never drops its newest).
    assert (window.chunks, len(window)) == (MAX_ACCESS_CHUNKS, 1)
    with pytest.raises(ValueError):
        AccessWindow(max_chunks=0)


def test_chunk_id_is_the_hash_prefix() -> None:
    assert chunk_id("00000000000000ff" + "0" * 16) == 255
    assert chunk_id("f" * 32) == 2**64 - 1
    with pytest.raises(ValueError):
        chunk_id("abc")


def _lookup(agg: Aggregator, chunks: list[str] | None, chunk_size: int = 4) -> None:
    agg.apply([Lookup(1.0, "r", 4 * len(chunks or []) + 1, 0, 0, 0.1, None, None,
                      chunk_size, chunks)])


def test_agent_queues_accesses_within_its_budgets() -> None:
    agg = Aggregator(make_source("e", role="scheduler"))
    h = "0123456789abcdef" * 2
    # Two lookups of 10,000 chunks (each cut to MAX_ACCESS_CHUNKS) and one of 3.
    _lookup(agg, [h] * 10_000)
    _lookup(agg, [h] * 10_000)
    _lookup(agg, [h] * 3)
    _lookup(agg, None)  # no hashes: no access, not a drop
    _lookup(agg, ["not-a-hash"])  # counted as a drop, never sent
    assert agg.lookup.accesses_dropped == 1
    got = agg.take_accesses()
    assert [len(a.chunks) for a in got] == [MAX_ACCESS_CHUNKS, MAX_ACCESS_CHUNKS, 3]
    # Looked up at 1.0 ms, nothing local nor found: every chunk is past ``served``.
    assert got[2] == Access(tokens=13, chunk_size=4, chunks=[chunk_id(h)] * 3, ts_ms=1.0,
                            served=0)
    assert agg.take_accesses() == []
    # The queue holds ACCESS_QUEUE_CHUNKS ids: past them lookups are dropped and counted; one
    # report takes at most REPORT_ACCESS_CHUNKS of them.
    fits = ACCESS_QUEUE_CHUNKS // MAX_ACCESS_CHUNKS
    for _ in range(fits + 2):
        _lookup(agg, [h] * MAX_ACCESS_CHUNKS)
    assert agg.lookup.accesses_dropped == 1 + 2
    first = agg.take_accesses()
    assert sum(len(a.chunks) for a in first) == REPORT_ACCESS_CHUNKS
    assert len(first) + len(agg.take_accesses()) + len(agg.take_accesses()) + len(
        agg.take_accesses()) + len(agg.take_accesses()) == fits


def test_a_report_past_the_wire_bounds_is_refused() -> None:
    st = Aggregator(make_source("e", role="scheduler")).state(1.0)

    def report(accesses: list[Access]) -> bytes:
        return encode(Report(v=PROTOCOL_VERSION, seq=1, kind="delta", state=st,
                             accesses=accesses))

    ok = Access(tokens=9, chunk_size=4, chunks=[2**64 - 1, 0])
    assert isinstance(msg := decode(report([ok])), Report) and msg.accesses == [ok]
    for bad in ([Access(tokens=9, chunk_size=4, chunks=[0] * (MAX_ACCESS_CHUNKS + 1))],
                [ok] * (MAX_REPORT_ACCESSES + 1),
                [Access(tokens=9, chunk_size=0, chunks=[1])]):
        with pytest.raises(ProtocolError):
            decode(report(bad))


def test_pool_capacity_is_the_watermark_over_a_chunks_keys() -> None:
    pool = PoolStats(backend="mooncake", keys=100, used_bytes=100 * 1_000,
                     total_bytes=1_000_000, high_watermark=0.8)

    def worker(engine: str, tp: int, model: str = "m", with_pool: bool = True) -> EngineState:
        return EngineState(source=make_source(engine, tp=tp, model=model), started_ms=0.0,
                           ts_ms=0.0, pool=pool if with_pool else None)

    # Two ranks: a chunk is 2 keys of 1,000 bytes; 800,000 bytes before eviction = 400 chunks.
    states = [worker("e1", 0), worker("e1", 1, with_pool=False), worker("e2", 0, "other"),
              EngineState(source=make_source("e1", role="scheduler", model="m"),
                          started_ms=0.0, ts_ms=0.0, pool=pool)]
    assert pool_capacity_tokens(states, "m", 16) == 400 * 16
    assert pool_capacity_tokens(states, "other", 16) == 800 * 16
    assert pool_capacity_tokens(states, "absent", 16) == 0
    assert pool_capacity_tokens([worker("e1", 0, with_pool=False)], "m", 16) == 0


def test_the_largest_reuse_view_fits_its_frame_share() -> None:
    point = WhatIfPoint(capacity_tokens=MAX_COUNT - 1, lru_hit_rate=0.123456789,
                        min_hit_rate=0.987654321)
    models = [ModelReuse(model="m" * MAX_ID_CHARS, chunk_size=MAX_COUNT - 1,
                         prompt_tokens=MAX_COUNT - 1, ceiling_tokens=MAX_COUNT - 1,
                         pool_capacity_tokens=MAX_COUNT - 1, whatif_ms=1.7e12,
                         whatif=[point] * MAX_CURVE_POINTS)] * MAX_REUSE_MODELS
    split = {f"e{i:03d}" + "x" * (MAX_ID_CHARS - 4): {
        "never_saved": MAX_COUNT - 1, "evicted": MAX_COUNT - 1, "other_digest": MAX_COUNT - 1}
        for i in range(MAX_SPLIT_ENGINES)}
    view = ReuseView(ts_ms=1.7e12, accesses=MAX_COUNT - 1, chunks=MAX_COUNT - 1,
                     prompt_tokens=MAX_COUNT - 1, ceiling_tokens=MAX_COUNT - 1, models=models,
                     not_in_pool=split)
    # The view's share of a snapshot's first frame (protocol.MAX_SPLIT_ENGINES).
    assert len(msgspec.msgpack.encode(view)) < 120 * 1024
    # One engine more is refused on the wire.
    view.not_in_pool["one-more"] = {"evicted": 1}
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(view), type=ReuseView)


def test_agent_queues_saved_chunks_within_its_budget() -> None:
    """A worker's saved chunk ids go to the hub in reports of at most MAX_REPORT_SAVES; past
    SAVE_QUEUE_CHUNKS queued, a save's chunks are dropped and counted (never sent)."""
    agg = Aggregator(make_source("e", role="worker"))
    h = "0123456789abcdef" * 2
    agg.apply([Saved(1.0, [h] * 3), Saved(1.0, ["not-a-hash"])])
    assert agg.transfers.saves_unreported == 1
    assert agg.take_saves() == [chunk_id(h)] * 3 and agg.take_saves() == []
    for _ in range(SAVE_QUEUE_CHUNKS // MAX_REPORT_SAVES + 1):
        agg.apply([Saved(1.0, [h] * MAX_REPORT_SAVES)])
    assert agg.transfers.saves_unreported == 1 + MAX_REPORT_SAVES
    assert [len(agg.take_saves()) for _ in range(5)] == [MAX_REPORT_SAVES] * 4 + [0]
