"""The policy service's decisions (``kvpool_policy.service.PolicyCore``) against the reference
model (hypothesis): record batches of several engines, with malformed records mixed in, leave
exactly the chunks the reference LRU holds; malformed and over-budget records are counted and
change nothing; a restarted service adopts the pool's chunks as least recently used."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policy import ReferenceLRU, chunk_hash

from kvpool_connector.keys import ParallelLayout, shard_prefix
from kvpool_connector.policy_wire import WIRE_VERSION, PolicyLayout, PolicyRecord, RecordBatch
from kvpool_policy import AccessRecord, PoolPolicy
from kvpool_policy.policy import AdmissionKind
from kvpool_policy.service import PolicyCore, pool_chunks

DIGEST = "aaaaaaaaaaaa"
LAYOUT = PolicyLayout(DIGEST, [shard_prefix("m", DIGEST, ParallelLayout(tp_rank=r))
                               for r in range(2)])
CHUNK = 100


def _batch(records: list[PolicyRecord], engine: str = "e0", seq: int = 0,
           layout: PolicyLayout = LAYOUT) -> RecordBatch:
    return RecordBatch(WIRE_VERSION, engine, seq, 0, [layout], records)


requests = st.lists(
    st.tuples(st.integers(0, 1),  # engine
              st.integers(0, 6),  # document
              st.integers(1, 5),  # chunks
              st.booleans()),  # malformed (a hash that is not hex)
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(requests, st.integers(1, 12))
def test_batches_leave_what_the_reference_lru_holds(reqs: list[tuple[int, int, int, bool]],
                                                    capacity_chunks: int) -> None:
    core = PolicyCore(PoolPolicy(capacity_chunks * CHUNK, admission="all"), None,
                      max_chunk_bytes=CHUNK)
    ref = ReferenceLRU(capacity_chunks * CHUNK)
    good = bad = 0
    seqs = [0, 0]
    for engine, doc, n, malformed in reqs:
        hashes = [chunk_hash(doc, i) for i in range(n)]
        if malformed:
            hashes[-1] = "not-a-hash"
            bad += 1
        else:
            ref.record(AccessRecord(DIGEST, tuple(hashes), CHUNK, n))
            good += 1
        core.apply(_batch([PolicyRecord(DIGEST, hashes, CHUNK, n)], f"e{engine}",
                          seqs[engine]), f"key{engine}")
        seqs[engine] += 1
    assert {k for k in ref.size} == {(DIGEST, chunk_hash(d, i)) for d in range(7)
                                     for i in range(5) if (DIGEST, chunk_hash(d, i)) in core.policy}
    assert core.policy.used_bytes == ref.used() <= capacity_chunks * CHUNK
    assert (core.counters.records, core.counters.malformed) == (good, bad)
    assert core.counters.lost_batches == 0


def test_a_layout_naming_keys_outside_its_digest_is_dropped_whole() -> None:
    core = PolicyCore(PoolPolicy(10 * CHUNK), None)
    forged = PolicyLayout(DIGEST, ["kvpool-pins@m@aaaaaaaaaaaa@"])
    other = PolicyLayout(DIGEST, [shard_prefix("m", "bbbbbbbbbbbb", ParallelLayout())])
    for lay in (forged, other):
        core.apply(_batch([PolicyRecord(DIGEST, [chunk_hash(0, 0)], CHUNK, 1)], layout=lay), "k")
    assert core.counters.malformed == 2 and core.counters.records == 0
    assert len(core.policy) == 0


def test_over_budget_records_are_dropped_and_counted_per_key() -> None:
    now = [0.0]
    core = PolicyCore(PoolPolicy(1000 * CHUNK), None, budget=6, clock=lambda: now[0])
    recs = [PolicyRecord(DIGEST, [chunk_hash(d, 0)], CHUNK, 1) for d in range(10)]
    # 10 hashes and the layout's first declaration (2 keys a chunk): a bucket of 2 x 6
    core.apply(_batch(recs), "greedy")
    core.apply(_batch(recs[:1], seq=1), "greedy")  # bucket empty
    core.apply(_batch(recs[:1], engine="e1"), "modest")  # another key's budget is its own
    assert (core.counters.records, core.counters.over_budget) == (11, 1)
    now[0] = 1.0  # six more a second later (the known layout costs nothing again)
    core.apply(_batch(recs[:6], seq=2), "greedy")
    assert core.counters.records == 17


def test_sender_drops_and_lost_batches_are_counted() -> None:
    core = PolicyCore(PoolPolicy(1000 * CHUNK), None)
    rec = [PolicyRecord(DIGEST, [chunk_hash(0, 0)], CHUNK, 1)]
    core.apply(RecordBatch(WIRE_VERSION, "e0", 0, 3, [LAYOUT], rec), "k")
    core.apply(RecordBatch(WIRE_VERSION, "e0", 4, 7, [LAYOUT], rec), "k")  # 3 batches lost
    assert (core.counters.sender_dropped, core.counters.lost_batches) == (7, 3)


def test_a_restarted_service_adopts_the_pool_chunks_least_recent_first() -> None:
    old = [chunk_hash(9, i) for i in range(4)]
    listing = [f"{p}{h}" for h in old for p in LAYOUT.prefixes] + ["kvpool-pins@m@x", "other"]
    found = pool_chunks(listing)
    assert found == {DIGEST: old}
    core = PolicyCore(PoolPolicy(5 * CHUNK, admission="all"), None, found=found,
                      max_chunk_bytes=CHUNK)
    new = [chunk_hash(1, i) for i in range(2)]
    core.apply(_batch([PolicyRecord(DIGEST, new, CHUNK, 2)]), "k")
    # 4 found + 2 new in 5 chunks: the first found chunk is the one evicted.
    assert [(DIGEST, h) in core.policy for h in old] == [False, True, True, True]
    assert all((DIGEST, h) in core.policy for h in new)
    assert core.policy.used_bytes == 5 * CHUNK


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 5), st.integers(0, 5)),
                min_size=1, max_size=60), st.integers(1, 12))
def test_the_live_policy_holds_what_the_engines_saved(reqs: list[tuple[int, int, int]],
                                                      capacity_chunks: int) -> None:
    """The service's policy (``engines_decide``: engines admit from its snapshot) inserts the
    chunks a record says were saved, whatever its own admission would say: the pool's content,
    as the reference LRU of the same saves holds it."""
    core = PolicyCore(PoolPolicy(capacity_chunks * CHUNK, engines_decide=True), None,
                      max_chunk_bytes=CHUNK)
    ref = ReferenceLRU(capacity_chunks * CHUNK)
    for doc, n, saved in reqs:
        hashes = [chunk_hash(doc, i) for i in range(n)]
        ref.record(AccessRecord(DIGEST, tuple(hashes), CHUNK, min(saved, n)))
        core.apply(_batch([PolicyRecord(DIGEST, hashes, CHUNK, saved)]), "k")
    universe = {(DIGEST, chunk_hash(d, i)) for d in range(7) for i in range(5)}
    assert set(ref.size) == {k for k in universe if k in core.policy}
    assert core.policy.used_bytes == ref.used()


@pytest.mark.parametrize("admission", ["adaptive", "all"])
def test_admission_all_never_publishes_a_doorkeeper(admission: AdmissionKind) -> None:
    """``kvpool-policy serve --admission all`` (bench_fleet's live LRU): a workload on which the
    pool-wide doorkeeper takes over (a hot set of half the pool, each round followed by a scan
    of twice the pool) leaves its snapshots admitting everything."""
    core = PolicyCore(PoolPolicy(8 * CHUNK, engines_decide=True, admission=admission), None,
                      max_chunk_bytes=CHUNK)
    seq = 0
    for rnd in range(40):
        docs = [*range(4), *range(100 + 16 * rnd, 116 + 16 * rnd)]
        for doc in docs:
            core.apply(_batch([PolicyRecord(DIGEST, [chunk_hash(doc, 0)], CHUNK, 1)], seq=seq),
                       "key0")
            seq += 1
    snap = core.snapshot("service", 1)
    assert core.counters.records == seq
    if admission == "adaptive":
        assert snap.doorkeeper and snap.bits > 0 and any(snap.bloom)
    else:
        assert not snap.doorkeeper and (snap.bits, snap.bloom) == (0, b"")
