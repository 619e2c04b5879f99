"""Miss reasons (``kvpool_agent._misses``): every prompt token is local, a hit or a miss with
exactly one reason, by hand and for any sequence of lookups and load outcomes."""

from __future__ import annotations

from agent_testlib import make_source
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent._aggregate import Aggregator
from kvpool_agent._misses import MAX_REASONS, MissCounter
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
