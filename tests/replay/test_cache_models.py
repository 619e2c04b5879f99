"""Offline cache models of the replay's reference (``_reference``): Belady's MIN and LRU under an
admission policy, checked by hand and against brute-force models."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_connector.admission import AdmitAll
from kvpool_replay import belady_hits, lru_hits, prefix_ceiling


def test_belady_keeps_what_is_used_next() -> None:
    # 4-token chunks, room for 2. After request 2 the cache must drop one of a, b, x:
    # LRU drops a (oldest), MIN drops x (never used again), so request 3 hits a and b.
    reqs = [(9, ["a", "b"]), (5, ["x"]), (9, ["a", "b"]), (9, ["a", "b"])]
    assert lru_hits(reqs, 4, capacity_tokens=8).per_request == [0, 0, 0, 8]
    opt = belady_hits(reqs, 4, capacity_tokens=8)
    assert opt.per_request == [0, 0, 8, 8]
    assert opt.evicted_chunks == 1
    assert belady_hits(reqs, 4, capacity_tokens=0).hit_tokens == 0


class _Counting(AdmitAll):
    """Admits all, remembering what it was asked."""

    def __init__(self, limit: int) -> None:
        self.asked: list[list[str]] = []
        self.limit = limit

    def admit(self, hashes: Sequence[str]) -> int:
        self.asked.append(list(hashes))
        return min(self.limit, len(hashes))


def test_lru_with_admission_inserts_only_admitted_chunks() -> None:
    reqs = [(13, ["a", "b", "c"]), (13, ["a", "b", "c"])]
    policy = _Counting(limit=1)
    r = lru_hits(reqs, 4, capacity_tokens=100, admission=policy)
    assert policy.asked == [["a", "b", "c"], ["a", "b", "c"]]
    assert r.per_request == [0, 4]  # only "a" was ever inserted
    assert lru_hits(reqs, 4, 100, admission=AdmitAll()).per_request == [0, 12]


def _brute_min(reqs: list[tuple[int, list[str]]], chunk: int, cap_chunks: int) -> list[int]:
    """MIN by scanning the future at every eviction; ties: the smallest hash goes first."""
    cache: set[str] = set()
    per = []
    for i, (n, hashes) in enumerate(reqs):
        hit = 0
        for h in hashes[: max(0, (n - 1) // chunk)]:
            if h not in cache:
                break
            hit += 1
        per.append(hit * chunk)
        cache.update(hashes)

        def next_use(h: str, i: int = i) -> int:
            return next((j for j in range(i + 1, len(reqs)) if h in reqs[j][1]), len(reqs))

        while len(cache) > cap_chunks:
            cache.remove(min(cache, key=lambda h: (-next_use(h), h)))
    return per


_prompts = st.lists(st.integers(0, 3), min_size=1, max_size=4).map(
    lambda ids: [":".join(map(str, ids[: k + 1])) for k in range(len(ids))])


@settings(max_examples=200, deadline=None)
@given(st.lists(_prompts, min_size=1, max_size=25), st.integers(0, 6))
def test_belady_matches_brute_force(prompts: list[list[str]], cap: int) -> None:
    reqs = [(4 * len(p) + 1, p) for p in prompts]
    assert belady_hits(reqs, 4, capacity_tokens=4 * cap).per_request == _brute_min(reqs, 4, cap)
    # Unbounded, MIN never evicts: the prefix-reuse ceiling.
    assert (belady_hits(reqs, 4, capacity_tokens=10**6).per_request
            == prefix_ceiling(reqs, 4).per_request)
