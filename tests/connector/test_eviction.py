"""``eviction: connector`` (issue 24): the scheduler's exact LRU against a reference and the
replay's own exact LRU, its removals against a real ``mooncake_master`` (leases respected), and
the config's one-line errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from chunk_testlib import chained, lru_insert
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_agent.reporter import NullReporter
from kvpool_connector._transfers import SaveQueue, WorkerCounters
from kvpool_connector.admission import AdaptiveAdmission
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.eviction import ConnectorEviction, watermark_conflict
from kvpool_connector.keys import chunk_hashes
from kvpool_replay import LocalMooncakeMaster, default_trace_path, load_trace, lru_hits
from kvpool_replay import request_tokens as trace_tokens

MB = 1 << 20


def _reference(cap: int, hashes: Sequence[str], admitted: int, lru: list[str]) -> list[str]:
    """The module docstring's rule on a plain list, least recent first."""
    lru_insert(lru, hashes, admitted)
    out = []
    while len(lru) > cap and lru[0] not in hashes:
        out.append(lru.pop(0))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=7),
                          st.integers(0, 7)), min_size=1, max_size=50),
       st.integers(1, 9))
def test_evicts_what_the_reference_lru_evicts(requests: list[tuple[list[int], int]],
                                              cap: int) -> None:
    ev, ref = ConnectorEviction(cap), []
    removed = 0
    for ids, admitted in requests:
        hashes = chained(ids)
        ev.record(hashes, admitted)
        got, keep = ev.take()
        assert got == _reference(cap, hashes, admitted, ref)
        # A chunk evicted before and inserted again: its waiting removal is dropped.
        assert set(keep) <= set(hashes[:admitted])
        assert list(ev._lru) == ref
        removed += len(got)
        # Over the capacity only with the current request's own chunks.
        assert len(ev) <= max(cap, len(set(hashes)))
    assert ev.evicted == removed


def test_holds_what_the_replays_exact_lru_holds_on_a_trace_slice() -> None:
    """Leading chunks the connector's LRU holds, request by request, are the hits of
    ``kvpool_replay.lru_hits`` with the same admission (the *model* column of
    docs/benchmarks.md), on 400 synthetic requests in a 300k-token pool."""
    chunk, cap = 512, 300_000
    reqs = load_trace(str(default_trace_path("synthetic_trace.jsonl")), limit=400)
    items = [(r.input_length, chunk_hashes(trace_tokens(r), chunk)) for r in reqs]
    want = lru_hits(items, chunk, cap, AdaptiveAdmission(cap // chunk))
    ev, policy = ConnectorEviction(cap // chunk), AdaptiveAdmission(cap // chunk)
    hits = []
    for n, hashes in items:
        claimable = min(len(hashes), (n - 1) // chunk)  # a hit leaves the last token to compute
        lead = 0
        while lead < claimable and hashes[lead] in ev:
            lead += 1
        hits.append(lead * chunk)
        ev.record(hashes, policy.admit(hashes))
        ev.take()
    assert hits == want.per_request
    assert want.evicted_chunks == ev.evicted > 0


def test_a_chunk_taken_back_is_not_removed() -> None:
    """Two requests of one step: the second takes back what the first evicted, which is then
    never sent; taken back in a later step, its earlier removal is dropped (``keep``)."""
    a, b, c = chained([1]), chained([2]), chained([3])
    ev = ConnectorEviction(1)
    ev.record(a, 1)
    assert ev.take() == ([], [])
    ev.record(b, 1)  # evicts a ...
    ev.record(a, 1)  # ... taken back in the same step (evicts b)
    assert ev.take() == (b, [])
    ev.record(b, 1)  # b was sent for removal a step ago: keep it
    assert ev.take() == (a, b)
    ev.record(c, 0)  # not admitted: nothing changes
    assert ev.take() == ([], []) and b[0] in ev and ev.evicted == 2


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity_chunks must be >= 1, got 0"):
        ConnectorEviction(0)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.admission_pool_tokens: "
                                         r"eviction 'connector' needs"):
        KVPoolConfig.from_dicts({"eviction": "connector"}, kv_role="kv_both", block_size=16,
                                model="m")
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.eviction: 'connector' "
                                         r"removes keys with Mooncake's batch_remove; backend "
                                         r"'yuanrong' has none"):
        KVPoolConfig.from_dicts({"eviction": "connector", "admission_pool_tokens": 4096,
                                 "backend": "yuanrong"}, kv_role="kv_both", block_size=16,
                                model="m")
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.eviction"):
        KVPoolConfig.from_dicts({"eviction": "lru"}, kv_role="kv_both", block_size=16,
                                model="m")
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.admission_pool_tokens: "
                                         r"100 tokens hold no whole chunk of 256"):
        KVPoolConfig.from_dicts({"eviction": "connector", "admission_pool_tokens": 100,
                                 "chunk_size": 256}, kv_role="kv_both", block_size=16,
                                model="m")
    cfg = KVPoolConfig.from_dicts({"eviction": "connector", "admission_pool_tokens": 4096},
                                  kv_role="kv_both", block_size=16, model="m")
    assert (cfg.eviction, cfg.admission, cfg.admission_pool_tokens) == ("connector", "all", 4096)
    assert KVPoolConfig.from_dicts({}, kv_role="kv_both", block_size=16,
                                   model="m").eviction == "pool"


def test_warns_when_the_masters_watermark_would_evict_first() -> None:
    # 300k tokens at 512 per chunk: 585 chunks of 32 KiB = 19,169,280 bytes.
    pool = 19_200_000
    assert watermark_conflict(300_000, 512, 32_768, pool, 1.0) is None
    assert watermark_conflict(300_000, 512, 32_768, 0, 0.9) is None  # pool size unknown
    assert watermark_conflict(300_000, 512, 32_768, pool, 0.9) == (
        "eviction 'connector' keeps 300,000 tokens (19,169,280 bytes), above the master's "
        "watermark (0.9 of 19,200,000 bytes): Mooncake evicts first, in its own order; start "
        "mooncake_master with --eviction_high_watermark_ratio=1.0 (and set it in the Mooncake "
        "config) or lower admission_pool_tokens to 269,824")
    # The suggested capacity fits under the watermark.
    assert watermark_conflict(269_824, 512, 32_768, pool, 0.9) is None


@pytest.fixture(scope="module")
def leased_pool() -> Iterator[tuple[MooncakeBackend, torch.Tensor]]:
    """A master of its own whose leases end after 3 s, and a client with a buffer whose
    transfer timeout (the wait after a refused remove, ``_removals``) is 4 s."""
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=3000) as master:
        b = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": master.address, "global_segment_size": "16MB",
            "local_buffer_size": "4MB", "default_kv_lease_ttl": 3000,
            "transfer_timeout_ms": 4000}}))
        buf = torch.randint(0, 256, (MB,), dtype=torch.uint8)
        b.register_buffer(buf.data_ptr(), buf.numel())
        try:
            yield b, buf
        finally:
            b.close()


def test_removes_wait_for_a_readers_lease(leased_pool: tuple[MooncakeBackend, torch.Tensor]
                                          ) -> None:
    """A key under a lease is not removed by force: it is removed with a later batch once
    the transfer timeout passed since the refusal (the lease ended before), unless the
    scheduler took its chunk back; a key never stored is no failure."""
    b, buf = leased_pool
    keys = ["ev-a", "ev-b", "ev-back", "ev-other"]
    assert b.batch_put_from(keys, [[buf.data_ptr()]] * 4, [[4096]] * 4) == [0] * 4
    counters = WorkerCounters()
    q = SaveQueue(b, NullReporter(), counters, threading.Lock(), blocks_per_chunk=1)
    try:
        assert b.batch_exists(keys) == [1, 1, 1, 1]  # a reader's lookup: leases on all four
        q.remove(["ev-a", "ev-b", "ev-back", "ev-never-stored"]).result()
        refused = time.monotonic()
        # Read before the lease of 3 s can end: the remove ran right after the lookup.
        assert (counters.evicted_keys, counters.evict_failed_keys) == (0, 0)
        q.remove([], keep=["ev-back"]).result()
        deadline = time.monotonic() + 60
        while counters.evicted_keys < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            q.remove([]).result()  # each batch takes the waiting ones again
        assert (counters.evicted_keys, counters.evict_failed_keys) == (2, 0)
        assert time.monotonic() - refused >= 4.0
        assert b.batch_exists(keys) == [0, 0, 1, 1]
    finally:
        q.shutdown()


def test_pinned_keys_are_never_removed(leased_pool: tuple[MooncakeBackend, torch.Tensor]
                                       ) -> None:
    b, buf = leased_pool
    keys = ["ev-pinned", "ev-loose"]
    assert b.batch_put_from(keys, [[buf.data_ptr()]] * 2, [[4096]] * 2) == [0, 0]
    counters = WorkerCounters()
    q = SaveQueue(b, NullReporter(), counters, threading.Lock(), blocks_per_chunk=1)
    try:
        q.remove(keys, pinned=lambda: frozenset({"ev-pinned"})).result()
        assert (counters.evicted_keys, counters.evict_failed_keys) == (1, 0)
        assert b.batch_exists(keys) == [1, 0]
    finally:
        q.shutdown()
