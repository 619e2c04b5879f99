"""Miss reasons (``kvpool_agent._misses``): every prompt token is local, a hit or a miss with
exactly one reason, by hand and for any sequence of lookups and load outcomes."""

from __future__ import annotations

from agent_testlib import make_source
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent._aggregate import Aggregator
from kvpool_agent._misses import MAX_REASONS, MissCounter, split_not_in_pool
from kvpool_agent._reuse_service import ReuseService
from kvpool_agent.protocol import REPORT_ACCESS_CHUNKS, Access, EngineState, Report, chunk_id
from kvpool_agent.reporter import Loaded, Lookup


def test_reasons_by_hand() -> None:
    m = MissCounter()
    # 100 tokens, chunk 16: 6 whole claimable chunks (96); 16 local, the pool holds 32 more.
    m.lookup(100, 16, 32, skipped=None, error=False, chunks=6, chunk_size=16)
    assert m.by_reason == {"not_in_pool": 96 - 16 - 32, "tail": 4}
    m.lookup(50, 10, 0, skipped="MULTIMODAL", error=False, chunks=None, chunk_size=0)
    m.lookup(15, 0, 0, skipped="SHORT_PROMPT", error=False, chunks=None, chunk_size=0)
    m.lookup(40, 0, 0, skipped=None, error=True, chunks=2, chunk_size=16)
    assert m.by_reason == {"not_in_pool": 48, "tail": 4 + 15, "MULTIMODAL": 40,
                           "lookup_error": 40}
    # Of the 32 found: 16 loaded, 8 failed, 8 without an outcome yet.
    assert m.snapshot(loaded=16, load_failed=8) == {**m.by_reason, "load_failed": 8,
                                                    "not_loaded": 8}


def test_reasons_are_bounded() -> None:
    m = MissCounter()
    for i in range(MAX_REASONS + 5):
        m.lookup(10, 0, 0, skipped=f"R{i}", error=False, chunks=None, chunk_size=0)
    assert len(m.by_reason) == MAX_REASONS + 1 and m.by_reason["other"] == 50


_lookup = st.tuples(
    st.integers(1, 5_000),  # prompt
    st.integers(0, 5_000),  # local (clamped below)
    st.integers(0, 5_000),  # found beyond local
    st.sampled_from([None, None, "MULTIMODAL", "LOCAL_CACHE", "BREAKER_OPEN"]),
    st.booleans(),  # error
    st.sampled_from([16, 256]),
    st.booleans(),  # chunks known
    st.floats(0, 1),  # share of found loaded
    st.floats(0, 1),  # share of the rest failed
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_lookup, min_size=1, max_size=30))
def test_prompt_is_local_plus_hits_plus_misses(lookups: list[tuple]) -> None:  # type: ignore[type-arg]
    agg = Aggregator(make_source("e", role="scheduler"))
    for i, (prompt, local, found, skipped, error, size, known, hit, fail) in enumerate(lookups):
        local = min(local, prompt - 1)
        claim = (prompt - 1) // size
        # As the scheduler reports: the pool's hit is whole chunks, beyond local.
        found = 0 if skipped or error else max(0, min(found, claim * size) - local)
        hashes = ["0" * 32] * claim if known and skipped is None else None
        agg.apply([Lookup(1.0, f"r{i}", prompt, local, found, 0.1,
                          "boom" if error and skipped is None else None, skipped, size,
                          hashes)])
        loaded = int(found * hit)
        failed = int((found - loaded) * fail)
        if loaded or failed:
            agg.apply([Loaded(2.0, f"r{i}", loaded, failed)])
    lk = agg.state(3.0).lookup
    assert lk.prompt_tokens == lk.local_tokens + lk.loaded_tokens + sum(lk.miss_tokens.values())
    assert all(n > 0 for n in lk.miss_tokens.values())


def test_split_by_hand() -> None:
    miss = {"not_in_pool": 100, "tail": 4}
    assert split_not_in_pool(miss, {"evicted": 60, "never_saved": 30}) == {
        "evicted": 60, "never_saved": 30, "not_in_pool": 10, "tail": 4}
    assert split_not_in_pool(miss, None) == miss
    # The hub ahead of the agent (its report in flight): scaled to the agent's 100.
    assert split_not_in_pool(miss, {"evicted": 150, "other_digest": 50}) == {
        "evicted": 75, "other_digest": 25, "tail": 4}
    assert split_not_in_pool({"tail": 4}, {"evicted": 3}) == {"tail": 4}


_DIGEST = "d" * 12


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(0, 600), st.integers(0, 600),
                          st.booleans()), min_size=1, max_size=20),
       st.sets(st.integers(0, 40)))
def test_hub_split_keeps_every_token(lookups: list[tuple[int, int, int, bool]],
                                     saved: set[int]) -> None:
    """Lookups through a scheduler's aggregator, its report through the hub's service, some
    chunks saved by a worker before: the split sums to the agent's ``not_in_pool`` exactly
    (every access reached the hub), so prompt = local + loaded + split misses."""
    sched = Aggregator(make_source("e", role="scheduler", model="m"))
    size = 16
    hashes = [f"{i:032x}" for i in range(41)]
    for i, (prompt, local, found, error) in enumerate(lookups):
        local = min(local, prompt - 1) // size * size
        claim = (prompt - 1) // size
        found = 0 if error else max(0, min(found, claim * size) - local) // size * size
        sched.apply([Lookup(5_000.0, f"r{i}", prompt, local, found, 0.1,
                            "boom" if error else None, None, size, hashes[:claim])])
        if found:
            sched.apply([Loaded(5_000.0, f"r{i}", found)])
    svc = ReuseService()
    worker = make_source("e", role="worker", model="m", layout_digest=_DIGEST)
    svc.split(Report(v=2, seq=1, kind="delta", state=EngineState(
        source=worker, started_ms=0.0, ts_ms=1_000.0),
        saves=[chunk_id(hashes[c]) for c in sorted(saved)]))
    st_ = sched.state(6_000.0)
    svc.split(Report(v=2, seq=1, kind="delta", state=st_, accesses=sched.take_accesses()))
    lk = st_.lookup
    split = svc.not_in_pool().get("e", {})
    assert sum(split.values()) == lk.miss_tokens.get("not_in_pool", 0)
    assert set(split) <= {"evicted", "never_saved", "first_use"}
    merged = split_not_in_pool(lk.miss_tokens, split)
    assert "not_in_pool" not in merged
    assert lk.prompt_tokens == lk.local_tokens + lk.loaded_tokens + sum(merged.values())


def _report(src: object, *, started_ms: float = 0.0, ts_ms: float = 10_000.0,
            **kw: object) -> Report:
    return Report(v=2, seq=1, kind="delta", state=EngineState(
        source=src, started_ms=started_ms, ts_ms=ts_ms), **kw)  # type: ignore[arg-type]


def test_service_split_by_hand() -> None:
    """Per engine: chunks past ``served`` by the memory's reason, in tokens (a partial last
    chunk counts its tokens); a chunk an earlier lookup asked for and no one saved is
    ``never_saved``, one never asked for ``first_use``; an engine whose digest no worker
    reported is not split; a scheduler restart restarts its counts."""
    svc = ReuseService()
    a_w = make_source("a", model="m", layout_digest="a" * 12)
    b_w = make_source("b", model="m", layout_digest="b" * 12)
    svc.split(_report(a_w, saves=[1, 2]))
    svc.split(_report(b_w, saves=[3]))
    # Prompt of 70 tokens, chunk 16, 4 chunks asked about (64 tokens), 16 held locally.
    look = Access(tokens=70, chunk_size=16, chunks=[1, 3, 4, 2], ts_ms=20_000.0, served=16)
    svc.split(_report(make_source("a", role="scheduler", model="m"), accesses=[look]))
    assert svc.not_in_pool() == {"a": {"other_digest": 16, "first_use": 16, "evicted": 16}}
    # A lookup before the saves' report (10 s) and the first lookup (20 s) finds none of them
    # saved nor asked for.
    early = Access(tokens=70, chunk_size=16, chunks=[1, 3], ts_ms=9_000.0, served=0)
    svc.split(_report(make_source("a", role="scheduler", model="m"), accesses=[early]))
    assert svc.not_in_pool()["a"] == {"other_digest": 16, "first_use": 48, "evicted": 16}
    # Chunk 4 was asked for at 20 s and never saved: at 30 s it is never_saved, and so is
    # chunk 1 for another engine of the layout (asked at 9 s: the earliest ask is kept);
    # chunk 5, asked by nobody, is a first use.
    again = Access(tokens=48, chunk_size=16, chunks=[4, 5], ts_ms=30_000.0, served=0)
    svc.split(_report(make_source("a", role="scheduler", model="m"), accesses=[again]))
    assert svc.not_in_pool()["a"] == {"other_digest": 16, "first_use": 64, "evicted": 16,
                                      "never_saved": 16}
    svc.split(_report(make_source("a2", model="m", layout_digest="a" * 12)))
    svc.split(_report(make_source("a2", role="scheduler", model="m"), accesses=[
        Access(tokens=16, chunk_size=16, chunks=[1], ts_ms=9_500.0, served=0)]))
    assert svc.not_in_pool()["a2"] == {"never_saved": 16}
    # Unknown engine digest: nothing split.
    svc.split(_report(make_source("c", role="scheduler", model="m"), accesses=[look]))
    assert "c" not in svc.not_in_pool()
    # The scheduler restarted: its agent's counters and the split start again.
    svc.split(_report(make_source("a", role="scheduler", model="m"), started_ms=5.0,
                      accesses=[Access(tokens=40, chunk_size=16, chunks=[2, 9], served=0)]))
    assert svc.not_in_pool()["a"] == {"evicted": 16, "first_use": 16}


def test_a_report_past_the_agents_chunk_budget_is_split_only_up_to_it() -> None:
    """An agent sends at most ``REPORT_ACCESS_CHUNKS`` chunk ids a report; a forged one of more
    (2M one-byte ids held the hub's socket thread 1-3 s) has only its accesses within that
    split and remembered as asked, the rest left ``not_in_pool`` and counted."""
    svc = ReuseService()
    svc.split(_report(make_source("a", model="m", layout_digest="a" * 12)))
    per = 2_048  # MAX_ACCESS_CHUNKS
    accesses = [Access(tokens=16 * per, chunk_size=16, chunks=list(range(i * per, (i + 1) * per)),
                       ts_ms=20_000.0, served=0) for i in range(REPORT_ACCESS_CHUNKS // per + 3)]
    svc.split(_report(make_source("a", role="scheduler", model="m"), accesses=accesses))
    assert svc.not_in_pool()["a"] == {"first_use": 16 * REPORT_ACCESS_CHUNKS}
    assert svc.unsplit_accesses == 3
    # The split ones were remembered as asked, the others not.
    assert svc.saved.asked == REPORT_ACCESS_CHUNKS
    assert svc.saved.reasons("m", "a" * 12, [0, REPORT_ACCESS_CHUNKS], 30_000.0) == [
        "never_saved", "first_use"]
