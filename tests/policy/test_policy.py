"""``kvpool_policy.PoolPolicy`` against a reference model (hypothesis): the same decisions, the
capacity never exceeded, saves and removals consistent with what the pool holds, pinned chunks
never removed."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_policy import AccessRecord, PoolPolicy
from kvpool_policy.policy import PolicyKey

DIGESTS = ("aaaaaaaaaaaa", "bbbbbbbbbbbb")


def chunk_hash(doc: int, i: int) -> str:
    """Chunk ``i`` of document ``doc``: 32 hex digits, chained in the sense that requests of one
    document share their leading chunks."""
    return hashlib.md5(f"{doc}:{i}".encode()).hexdigest()


class ReferenceLRU:
    """The obvious model of ``PoolPolicy(admission="all", eviction="lru")``: a list, least
    recently used first, touched and filled last chunk to first; pinned chunks kept apart."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: list[PolicyKey] = []
        self.size: dict[PolicyKey, int] = {}
        self.pins: set[PolicyKey] = set()

    def used(self) -> int:
        return sum(self.size.values())

    def record(self, rec: AccessRecord) -> tuple[int, set[PolicyKey], set[PolicyKey]]:
        keys = [(rec.digest, h) for h in rec.hashes]
        hits = next((i for i, k in enumerate(keys) if k not in self.size), len(keys))
        before = set(self.size)
        admitted = rec.wants
        for i in reversed(range(len(keys))):
            k = keys[i]
            if k in self.size:
                if k in self.order:
                    self.order.remove(k)
                    self.order.append(k)
            elif i < admitted:
                pinned = sum(self.size[p] for p in self.pins if p in self.size)
                if rec.chunk_bytes > self.capacity - pinned:
                    admitted = i
                    continue
                while self.used() + rec.chunk_bytes > self.capacity:
                    del self.size[self.order.pop(0)]
                self.size[k] = rec.chunk_bytes
                if k not in self.pins:
                    self.order.append(k)
        for i, k in enumerate(keys):  # chunks kept past a refusal are dropped again
            if i >= admitted and k in self.size and k not in before:
                del self.size[k]
                if k in self.order:
                    self.order.remove(k)
        after = set(self.size)
        return hits, after - before, before - after

    def pin(self, keys: list[PolicyKey]) -> None:
        for k in keys:
            if k in self.pins:
                continue
            self.pins.add(k)
            if k in self.order:
                self.order.remove(k)

    def unpin(self, keys: list[PolicyKey]) -> None:
        for k in keys:
            self.pins.discard(k)
            if k in self.size and k not in self.order:
                self.order.append(k)


record_st = st.builds(
    lambda digest, doc, length, size, wants: (digest, doc, length, size, wants),
    st.sampled_from(DIGESTS), st.integers(0, 5), st.integers(0, 8), st.sampled_from([1, 2, 3]),
    st.integers(0, 8))
op_st = st.one_of(
    st.tuples(st.just("record"), record_st),
    st.tuples(st.just("pin"), st.tuples(st.sampled_from(DIGESTS), st.integers(0, 5),
                                        st.integers(1, 4))),
    st.tuples(st.just("unpin"), st.tuples(st.sampled_from(DIGESTS), st.integers(0, 5),
                                          st.integers(1, 4))),
)


def _record(args: tuple[str, int, int, int, int]) -> AccessRecord:
    digest, doc, length, size, wants = args
    return AccessRecord(digest, tuple(chunk_hash(doc, i) for i in range(length)), size,
                        min(wants, length))


def _prefix(args: tuple[str, int, int]) -> list[PolicyKey]:
    digest, doc, length = args
    return [(digest, chunk_hash(doc, i)) for i in range(length)]


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 24), ops=st.lists(op_st, max_size=60))
def test_leaf_first_lru_matches_the_reference(capacity: int, ops: list) -> None:
    policy = PoolPolicy(capacity, eviction="lru", admission="all")
    ref = ReferenceLRU(capacity)
    for kind, args in ops:
        if kind == "pin":
            policy.pin(_prefix(args))
            ref.pin(_prefix(args))
            continue
        if kind == "unpin":
            policy.unpin(_prefix(args))
            ref.unpin(_prefix(args))
            continue
        rec = _record(args)
        d = policy.record(rec)
        hits, saved, removed = ref.record(rec)
        assert d.hits == hits
        assert set(d.saves) == saved
        assert set(d.removals) == removed
        assert policy.used_bytes == ref.used() <= capacity
        assert {k for k in ref.size if k in policy} == set(ref.size)
        assert len(policy) == len(ref.size)


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 24), ops=st.lists(op_st, max_size=80))
def test_invariants_hold_for_every_policy(eviction: str, capacity: int, ops: list) -> None:
    """Adaptive admission and either eviction: the pool's bytes never exceed the capacity,
    saves and removals are exactly what changed, admitted chunks form a prefix within what the
    engine wants, and a pinned chunk is never removed."""
    policy = PoolPolicy(capacity, eviction=eviction, admission="adaptive")  # type: ignore[arg-type]
    resident: dict[PolicyKey, None] = {}
    pins: set[PolicyKey] = set()
    for kind, args in ops:
        if kind in ("pin", "unpin"):
            keys = _prefix(args)
            (policy.pin if kind == "pin" else policy.unpin)(keys)
            pins = pins | set(keys) if kind == "pin" else pins - set(keys)
            continue
        rec = _record(args)
        keys = [(rec.digest, h) for h in rec.hashes]
        d = policy.record(rec)
        assert d.hits == next((i for i, k in enumerate(keys) if k not in resident), len(keys))
        assert 0 <= d.admitted <= rec.wants
        assert set(d.saves) <= set(keys[:d.admitted])
        assert not set(d.saves) & set(resident)
        assert set(d.removals) <= set(resident)
        assert not set(d.removals) & pins
        for k in d.removals:
            del resident[k]
        resident.update(dict.fromkeys(d.saves))
        assert set(resident) == {k for k in resident if k in policy}
        assert len(policy) == len(resident)
        assert policy.used_bytes <= capacity
        # Every admitted chunk that fitted is resident (none lost between save and removal).
        assert all(k in policy for k in d.saves)


def test_a_chunk_pinned_before_it_is_saved_is_never_evicted() -> None:
    policy = PoolPolicy(4, admission="all")
    hot = (DIGESTS[0], chunk_hash(0, 0))
    policy.pin([hot])
    policy.record(AccessRecord(DIGESTS[0], (chunk_hash(0, 0),), 1, 1))
    for doc in range(1, 20):
        d = policy.record(_record((DIGESTS[0], doc, 3, 1, 3)))
        assert hot not in d.removals
    assert hot in policy
    policy.unpin([hot])
    policy.record(_record((DIGESTS[0], 99, 4, 1, 4)))
    assert hot not in policy


def test_the_prefix_head_outlives_its_tail() -> None:
    """Leaf first: a full pool evicts the last chunks of the oldest prompt, not its first."""
    policy = PoolPolicy(4, admission="all")
    policy.record(_record((DIGESTS[0], 0, 3, 1, 3)))
    d = policy.record(_record((DIGESTS[0], 1, 2, 1, 2)))
    assert d.removals == [(DIGESTS[0], chunk_hash(0, 2))]
    assert (DIGESTS[0], chunk_hash(0, 0)) in policy


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        PoolPolicy(0)
    with pytest.raises(ValueError):
        PoolPolicy(10, eviction="fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PoolPolicy(10).record(AccessRecord(DIGESTS[0], (chunk_hash(0, 0),), 0, 1))
    with pytest.raises(ValueError):
        PoolPolicy(10).record(AccessRecord(DIGESTS[0], (chunk_hash(0, 0),), 1, -1))
    # An engine that wants more chunks than its prompt has gets its prompt.
    d = PoolPolicy(10, admission="all").record(AccessRecord(DIGESTS[0], (chunk_hash(0, 0),), 1, 5))
    assert d.admitted == 1
