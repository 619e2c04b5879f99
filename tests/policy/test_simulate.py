"""The offline model's baselines (``kvpool_policy.simulate``) against ``kvpool_agent.reuse``."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent.reuse import lru_hits, prefix_ceiling
from kvpool_connector.admission import AdaptiveAdmission
from kvpool_policy import per_engine_hits, policy_hits, simulate_row
from kvpool_policy.simulate import SimRow

CHUNK = 4


def _accesses(reqs: list[tuple[int, int, int]]) -> list[tuple[int, list[str]]]:
    """``(document, chunks, extra tokens)`` -> ``(prompt tokens, chained chunk hashes)``:
    requests of one document share their leading chunks."""
    return [(length * CHUNK + extra,
             [hashlib.md5(f"{doc}:{i}".encode()).hexdigest() for i in range(length)])
            for doc, length, extra in reqs]


reqs_st = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6), st.integers(0, 3)),
                   max_size=120)


@settings(max_examples=150, deadline=None)
@given(reqs=reqs_st, chunks=st.integers(1, 30))
def test_one_engine_is_the_adaptive_lru_model(reqs: list, chunks: int) -> None:
    """N = 1 is docs/benchmarks.md's *model* column: ``lru_hits`` with ``AdaptiveAdmission``
    (prompts shorter than the capacity: ``ConnectorEviction`` keeps a longer one's chunks)."""
    acc = [a for a in _accesses(reqs) if len(a[1]) <= chunks]
    want = lru_hits(acc, CHUNK, chunks * CHUNK, AdaptiveAdmission(chunks))
    got = per_engine_hits(acc, CHUNK, chunks * CHUNK, 1)
    assert got.per_request == want.per_request
    assert got.hit_rate == want.hit_rate


@settings(max_examples=150, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(0, 40), st.just(1), st.integers(0, 3)),
                     max_size=150), chunks=st.integers(1, 20))
def test_policy_with_admission_all_is_lru_on_one_chunk_requests(reqs: list,
                                                                chunks: int) -> None:
    """With one chunk per request the leaf-first order is LRU's order: the pool-wide policy
    admitting everything is exactly ``lru_hits`` on the same input."""
    acc = _accesses(reqs)
    want = lru_hits(acc, CHUNK, chunks * CHUNK)
    got = policy_hits(acc, CHUNK, chunks * CHUNK, admission="all")
    assert got.per_request == want.per_request
    assert got.evicted_chunks == want.evicted_chunks


@settings(max_examples=100, deadline=None)
@given(reqs=reqs_st, engines=st.sampled_from([1, 2, 4, 8]))
def test_a_pool_that_holds_everything_hits_the_ceiling(reqs: list, engines: int) -> None:
    """No eviction: the policy admitting everything, and LRU, hit the prefix ceiling."""
    acc = _accesses(reqs)
    cap = (sum(len(h) for _, h in acc) + engines) * CHUNK
    ceiling = prefix_ceiling(acc, CHUNK).per_request
    assert policy_hits(acc, CHUNK, cap, engines, admission="all").per_request == ceiling
    assert lru_hits(acc, CHUNK, cap).per_request == ceiling


@settings(max_examples=60, deadline=None)
@given(reqs=reqs_st, engines=st.sampled_from([1, 2, 4, 8]), chunks=st.integers(8, 40))
def test_every_engine_count_stays_within_the_ceiling(reqs: list, engines: int,
                                                     chunks: int) -> None:
    acc = _accesses(reqs)
    ceiling = prefix_ceiling(acc, CHUNK).hit_tokens
    row = simulate_row(acc, CHUNK, chunks * CHUNK, engines)
    assert row.engines == engines
    for rate in (row.per_engine, row.lru, row.belady, row.policy):
        assert 0.0 <= rate * row_total(acc) <= ceiling + 1e-9


def row_total(acc: list[tuple[int, list[str]]]) -> int:
    return sum(n for n, _ in acc)


def test_gap_closed_and_ratios() -> None:
    row = SimRow(8, 1000, per_engine=0.05, lru=0.10, belady=0.30, policy=0.15)
    assert row.gap_closed == pytest.approx(0.25)
    assert row.x_lru == pytest.approx(1.5)
    assert row.per_engine_x_lru == pytest.approx(0.5)
    assert SimRow(1, 1000, 0.1, 0.2, 0.2, 0.2).gap_closed == 0.0


def test_too_small_a_pool_is_refused() -> None:
    with pytest.raises(ValueError):
        per_engine_hits([], CHUNK, CHUNK * 3, 4)
    with pytest.raises(ValueError):
        policy_hits([], 0, 100)


def test_a_prompt_one_engine_keeps_hot_survives_the_other_engines_traffic() -> None:
    """Two engines round-robin: engine 0 asks for the same 2-chunk prompt every time, engine 1
    sends a new 3-chunk prompt every time. In a pool of 8 chunks the pool-wide policy keeps the
    hot prompt: every repeat hits."""
    hot = [(2 * CHUNK + 1, [hashlib.md5(f"hot:{i}".encode()).hexdigest() for i in range(2)])]
    acc: list[tuple[int, list[str]]] = []
    for doc in range(40):
        acc += hot
        cold = [hashlib.md5(f"{doc}:{i}".encode()).hexdigest() for i in range(3)]
        acc.append((3 * CHUNK + 1, cold))
    pol = policy_hits(acc, CHUNK, 8 * CHUNK, 2).per_request
    assert pol[0::2] == [0] + [2 * CHUNK] * 39


def test_per_engine_removes_what_another_engine_uses_and_the_pool_policy_does_not() -> None:
    """A pool of 4 chunks, 2 engines (round-robin: even requests engine 0, odd engine 1).
    Engine 0 saves a prompt, engine 1 loads it, then engine 0's next prompt overflows its own
    LRU of 2 chunks, which removes the shared prompt from the pool: engine 1's repeat misses.
    The pool-wide policy of 4 chunks holds both prompts."""
    def doc(name: str) -> tuple[int, list[str]]:
        return (2 * CHUNK + 1, [hashlib.md5(f"{name}:{i}".encode()).hexdigest()
                                for i in range(2)])
    acc = [doc("shared"), doc("shared"), doc("a"), doc("shared")]
    per = per_engine_hits(acc, CHUNK, 4 * CHUNK, 2)
    pol = policy_hits(acc, CHUNK, 4 * CHUNK, 2)
    assert per.per_request == [0, 2 * CHUNK, 0, 0]
    assert per.evicted_chunks == 2
    assert pol.per_request == [0, 2 * CHUNK, 0, 2 * CHUNK]
    assert pol.evicted_chunks == 0


@settings(max_examples=60, deadline=None)
@given(reqs=reqs_st, engines=st.sampled_from([2, 4, 8]), chunks=st.integers(8, 40))
def test_snapshots_that_arrive_before_the_next_request_change_nothing(
        reqs: list, engines: int, chunks: int) -> None:
    """Engines deciding admission from replicas that see every other record before the next
    request (1 ms apart, 1 ms delay) decide as the one pool-wide admission does."""
    acc = _accesses(reqs)
    want = policy_hits(acc, CHUNK, chunks * CHUNK, engines)
    got = policy_hits(acc, CHUNK, chunks * CHUNK, engines, timestamps_ms=range(len(acc)),
                      delay_ms=1)
    assert got.per_request == want.per_request


def test_a_delay_needs_timestamps() -> None:
    acc = _accesses([(0, 2, 1)])
    with pytest.raises(ValueError, match="timestamps_ms"):
        policy_hits(acc, CHUNK, 8 * CHUNK, 2, delay_ms=1000)
