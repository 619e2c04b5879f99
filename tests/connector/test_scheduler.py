"""KVPoolScheduler with vLLM's own Request/KVCacheBlocks/SchedulerOutput objects, asking a real
LookupServer (real ZMQ IPC) backed by a real KVPoolWorker and a real mooncake_master."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvpool_agent._aggregate import Aggregator
from kvpool_agent.protocol import EngineState, Source
from kvpool_agent.reporter import Loaded, Lookup, ReportedError, Reporter
from kvpool_connector import _prefix_match as prefix_match_module
from kvpool_connector._requests import Phase
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.fingerprint import adapter_identity
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes
from kvpool_connector.lookup import LookupClient, LookupServer
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadOutcomes
from kvpool_connector.scheduler import KVPoolScheduler, request_extra
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster

BLOCK = 16

_ALIVE: list[object] = []
"""Registered caches (and each worker's scratch buffer) stay allocated: a Mooncake client
refuses memory overlapping a range it registered before, and a freed tensor's range is
reused."""


@pytest.fixture(autouse=True)
def _runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_RUNTIME_DIR", str(tmp_path))


@pytest.fixture(scope="module")
def backend(mooncake_master: LocalMooncakeMaster) -> Iterator[MooncakeBackend]:
    b = MooncakeBackend(MooncakeConfig.load({"mooncake": {
        "master_server_address": mooncake_master.address, "global_segment_size": "32MB",
        "local_buffer_size": "4MB"}}))
    yield b
    b.close()


class Engine:
    """Scheduler + lookup server + worker of one engine, like vLLM wires them."""

    def __init__(self, backend: MooncakeBackend, port: int, role: str = "kv_both",
                 timeout_ms: int = 3000, lookup_async: bool = False, **extra: Any) -> None:
        self.model = f"test/sched-{uuid.uuid4().hex[:8]}"
        self.config = KVPoolConfig.from_dicts({"lookup_rpc_port": port, **extra}, kv_role=role,
                                              block_size=BLOCK, model=self.model)
        self.backend = backend
        self.worker = KVPoolWorker(self.config, ParallelLayout(), self.model, backend)
        # The keys' layout digest comes from the registered caches (vLLM's CPU layout).
        kv = {"layers.0": torch.zeros(8, 1, BLOCK, 8)}
        self.worker.register_kv_caches(kv)
        _ALIVE.append((kv, self.worker))
        self.server = LookupServer(self.worker.lookup_chunks, lookup_rpc_port=port)
        self.reporter = Reporter()
        client = LookupClient(lookup_rpc_port=port, timeout_ms=timeout_ms)
        # Synchronous: these tests check what one ask answers (test_async_lookup: the same
        # answers from the lookup thread).
        self.sched = KVPoolScheduler(self.config, client, self.reporter,
                                     lookup_async=lookup_async)

    def store(self, prompt: list[int], chunks: int, extra: bytes = b"") -> None:
        """Put the first ``chunks`` chunk keys of ``prompt`` into the pool."""
        for h in chunk_hashes(prompt, self.config.chunk_size, extra)[:chunks]:
            key = str(PoolKey(self.config.model, self.worker.layout_digest, ParallelLayout(), h))
            assert self.backend.store.put(key, b"kv") == 0

    def close(self) -> None:
        self.sched.close()
        self.server.close()
        self.worker.shutdown()


@pytest.fixture
def engine(backend: MooncakeBackend) -> Iterator[Engine]:
    e = Engine(backend, 7201)
    yield e
    e.close()


def _request(rid: str, prompt: list[int], **kw: Any) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), None, **kw)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 3 for i in range(n)]


def _blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def _output(new: list[NewRequestData], num_scheduled: dict[str, int],
            cached: CachedRequestData | None = None) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def _cached(rid: str, new_blocks: list[int], computed: int) -> CachedRequestData:
    return CachedRequestData(req_ids=[rid], resumed_req_ids=set(), new_token_ids=[[]],
                             all_token_ids={}, new_block_ids=[(new_blocks,)],
                             num_computed_tokens=[computed], num_output_tokens=[0])


def test_matched_tokens_are_whole_chunks_and_never_the_last_token(engine: Engine) -> None:
    prompt = _prompt(70, 1)  # 4 whole chunks of 16 + 6 tokens
    engine.store(prompt, 3)
    assert engine.sched.get_num_new_matched_tokens(_request("r1", prompt), 0) == (48, False)
    # vLLM already holds 16 tokens locally: only the rest is claimed.
    assert engine.sched.get_num_new_matched_tokens(_request("r2", prompt), 16) == (32, False)
    # Local hit covers everything the pool has: nothing, and no load recorded.
    assert engine.sched.get_num_new_matched_tokens(_request("r3", prompt), 48) == (0, False)

    exact = _prompt(64, 2)  # exactly 4 chunks, all in the pool
    engine.store(exact, 4)
    # The last chunk holds the last prompt token, which vLLM must compute: 3 chunks only.
    assert engine.sched.get_num_new_matched_tokens(_request("r4", exact), 0) == (48, False)
    short = _prompt(16, 3)
    engine.store(short, 1)
    assert engine.sched.get_num_new_matched_tokens(_request("r5", short), 0) == (0, False)

    # Nothing beyond the local hit to look up: no lookup, but the prompt still counts.
    assert engine.sched.get_num_new_matched_tokens(_request("r6", prompt), 64) == (0, False)

    events = [e for e in engine.reporter.drain() if isinstance(e, Lookup)]
    assert [(e.req_id, e.prompt_tokens, e.local_tokens, e.pool_tokens, e.error, e.skipped)
            for e in events] == [
        ("r1", 70, 0, 48, None, None), ("r2", 70, 16, 32, None, None),
        ("r3", 70, 48, 0, None, None), ("r4", 64, 0, 48, None, None),
        ("r5", 16, 0, 0, None, "SHORT_PROMPT"), ("r6", 70, 64, 0, None, "LOCAL_CACHE"),
    ]
    assert all(e.latency_ms > 0 for e in events if e.skipped is None)
    # Lookups made carry the hashes asked about (the claimable whole chunks) for the hub's
    # reuse window; skipped ones none.
    assert [(e.chunk_size, len(e.chunks or [])) for e in events] == [
        (16, 4), (16, 4), (16, 4), (16, 3), (0, 0), (0, 0)]
    assert events[0].chunks == events[1].chunks
    # The agent attributes every prompt token: r1-r3 miss one whole chunk and a 6-token tail
    # each, r4 its last chunk (tail), r5 is short, r6 all local but its tail; found: 128.
    agg = Aggregator(Source(agent_id="e/scheduler", engine_id="e", instance_role="mixed",
                            kv_role="kv_both", process_role="scheduler"))
    agg.apply(events)
    assert agg.state(1.0).lookup.miss_tokens == {"not_in_pool": 48, "tail": 56,
                                                 "not_loaded": 128}
    # An offer is not a hit: nothing was loaded yet.
    c = engine.sched.counters
    assert (c.lookups, c.lookup_skipped, c.loaded_tokens) == (4, 2, 0)
    assert (c.prompt_tokens, c.local_tokens) == (70 * 4 + 64 + 16, 16 + 48 + 64)
    assert c.skip_reasons == {"SHORT_PROMPT": 1, "LOCAL_CACHE": 1}


def test_load_then_saves_through_chunked_prefill(engine: Engine) -> None:
    prompt = _prompt(100, 4)  # 6 whole chunks
    engine.store(prompt, 2)
    req = _request("a", prompt)
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (32, False)
    rec = engine.sched._requests["a"]  # the one record of the request, through its phases
    assert rec.phase is Phase.ASKED and rec.offered is not None and rec.asked is not None
    blocks = list(range(10, 17))
    engine.sched.update_state_after_alloc(req, _blocks(blocks), 32)
    assert rec.phase is Phase.LOAD_CONFIRMED and rec.offered is None and rec.asked is None
    assert rec.confirmed is not None and rec.confirmed.block_ids == blocks
    # Accepting is not loading: the hit is counted when the workers' outcome comes back.
    assert not [e for e in engine.reporter.drain() if isinstance(e, Loaded)]

    # Step 1: vLLM computes tokens 32..64 (chunked prefill, budget 32).
    new = NewRequestData.from_request(req, (blocks[:4],))
    new.num_computed_tokens = 32
    meta = engine.sched.build_connector_meta(_output([new], {"a": 32}))
    assert isinstance(meta, KVPoolConnectorMetadata)
    (m,) = meta.requests
    assert m.block_ids == blocks[:4]
    assert m.chunk_hashes == chunk_hashes(prompt, 16)
    assert m.load is not None and m.load.can_load
    assert (m.load.vllm_cached_tokens, m.load.kvpool_cached_tokens) == (0, 32)
    assert m.load.lease_expires_ms is None  # lease_ttl_ms not configured
    # Chunks 0-1 came from the pool; 2-3 are complete after this step and get saved.
    assert (m.save_from_chunk, m.save_to_chunk, m.is_last_save) == (2, 4, False)
    assert rec.phase is Phase.RUNNING and rec.confirmed is None and rec.saving
    assert rec.running is not None and rec.running.saved_chunks == 4
    # The step's output carries the workers' outcome (merged by vLLM: the least per request).
    outcome = LoadOutcomes({"a": (32, 32)}).aggregate(LoadOutcomes({"a": (32, 16)}))
    engine.sched.loads_outcome(outcome, ())
    engine.sched.loads_outcome(outcome, ())  # never counted twice
    loaded = [e for e in engine.reporter.drain() if isinstance(e, Loaded)]
    assert [(e.req_id, e.tokens, e.failed_tokens) for e in loaded] == [("a", 16, 16)]
    c = engine.sched.counters
    assert (c.loaded_tokens, c.load_failed_tokens) == (16, 16)

    # Step 2: the rest of the prompt; the load is not repeated.
    meta = engine.sched.build_connector_meta(_output([], {"a": 36}, _cached("a", blocks[4:], 64)))
    (m,) = meta.requests
    assert m.load is None and m.block_ids == blocks
    assert (m.save_from_chunk, m.save_to_chunk, m.is_last_save) == (4, 6, True)

    # Decode steps save nothing more.
    meta = engine.sched.build_connector_meta(_output([], {"a": 1}, _cached("a", [], 100)))
    assert meta.requests == []
    # A save was scheduled: vLLM must keep the blocks until the worker reports it.
    assert engine.sched.request_finished(req, blocks) == (True, None)
    assert "a" not in engine.sched._requests and engine.sched.saves_outstanding == 1


def test_request_without_saves_frees_blocks_at_once(backend: MooncakeBackend) -> None:
    consumer = Engine(backend, 7202, role="kv_consumer", consumer_is_to_load=True)
    try:
        prompt = _prompt(40, 5)
        consumer.store(prompt, 2)
        req = _request("c", prompt)
        assert consumer.sched.get_num_new_matched_tokens(req, 0) == (32, False)
        consumer.sched.update_state_after_alloc(req, _blocks([1, 2, 3]), 32)
        new = NewRequestData.from_request(req, ([1, 2, 3],))
        new.num_computed_tokens = 32
        (m,) = consumer.sched.build_connector_meta(_output([new], {"c": 8})).requests
        assert m.load is not None and m.save_to_chunk == m.save_from_chunk
        assert consumer.sched.request_finished(req, [1, 2, 3]) == (False, None)
    finally:
        consumer.close()


@pytest.mark.parametrize(
    ("role", "extra", "loads", "saves"),
    [
        ("kv_producer", {}, True, True),
        ("kv_consumer", {}, False, False),
        ("kv_consumer", {"consumer_is_to_load": True}, True, False),
        ("kv_consumer", {"consumer_is_to_load": True, "consumer_is_to_put": True}, True, True),
        ("kv_both", {}, True, True),
    ],
)
def test_kv_role_decides_loading_and_saving(
    backend: MooncakeBackend, role: str, extra: dict[str, bool], loads: bool, saves: bool
) -> None:
    e = Engine(backend, 7203, role=role, **extra)
    try:
        prompt = _prompt(50, 6)  # 3 whole chunks
        e.store(prompt, 1)
        req = _request("k", prompt)
        matched, _ = e.sched.get_num_new_matched_tokens(req, 0)
        assert matched == (16 if loads else 0)
        e.sched.update_state_after_alloc(req, _blocks([0, 1, 2, 3]), matched)
        new = NewRequestData.from_request(req, ([0, 1, 2, 3],))
        new.num_computed_tokens = matched
        meta = e.sched.build_connector_meta(_output([new], {"k": 50 - matched}))
        saved = sum(m.save_to_chunk - m.save_from_chunk for m in meta.requests)
        assert saved == ((2 if loads else 3) if saves else 0)
        assert e.sched.request_finished(req, [0, 1, 2, 3]) == (saves, None)
    finally:
        e.close()


def test_async_load_is_sent_before_the_request_runs(backend: MooncakeBackend) -> None:
    e = Engine(backend, 7204, load_async=True)
    try:
        prompt = _prompt(60, 7)
        e.store(prompt, 3)
        req = _request("x", prompt)
        assert e.sched.get_num_new_matched_tokens(req, 0) == (48, True)
        e.sched.update_state_after_alloc(req, _blocks([5, 6, 7]), 48)
        # The request waits for its KV: not scheduled, but its load goes out this step.
        (m,) = e.sched.build_connector_meta(_output([], {})).requests
        assert m.req_id == "x" and m.block_ids == [5, 6, 7] and m.load is not None
        assert m.save_to_chunk == m.save_from_chunk
        # Each worker's outcome comes in its own step; the load counts once every rank is
        # done (finished_recving), with what the least successful rank loaded.
        e.sched.loads_outcome(LoadOutcomes({"x": (48, 48)}), ())
        assert e.sched.counters.loaded_tokens == 0
        e.sched.loads_outcome(LoadOutcomes({"x": (48, 32)}), {"x"})
        # The worker's finished_recving reaches the scheduler (update_connector_output); vLLM's
        # second call after the load completed carries 0 external tokens.
        e.sched.loads_finished({"x"})
        assert (e.sched.counters.loaded_tokens, e.sched.counters.load_failed_tokens) == (32, 16)
        e.sched.update_state_after_alloc(req, _blocks([5, 6, 7, 8]), 0)
        new = NewRequestData.from_request(req, ([5, 6, 7, 8],))
        new.num_computed_tokens = 48
        # Not loaded again, and its 3 chunks are in the pool already: nothing to do.
        assert e.sched.build_connector_meta(_output([new], {"x": 12})).requests == []
        assert e.sched.request_finished(req, [5, 6, 7, 8]) == (False, None)
    finally:
        e.close()


def test_abort_during_async_load_keeps_blocks_until_the_load_ends(
    backend: MooncakeBackend,
) -> None:
    """A request aborted while its async load writes into its blocks must not free them:
    vLLM frees a finished request's blocks when the load's finished_recving arrives."""
    e = Engine(backend, 7205, load_async=True)
    try:
        for rid, seed in (("aborted", 8), ("done", 9)):
            prompt = _prompt(60, seed)
            e.store(prompt, 3)
            req = _request(rid, prompt)
            assert e.sched.get_num_new_matched_tokens(req, 0) == (48, True)
            e.sched.update_state_after_alloc(req, _blocks([1, 2, 3]), 48)
            (m,) = e.sched.build_connector_meta(_output([], {})).requests
            assert m.req_id == rid and m.load is not None
            if rid == "aborted":
                assert e.sched.request_finished(req, [1, 2, 3]) == (True, None)
            else:
                # Load ended (finished_recving), then the request is aborted before it ran.
                e.sched.loads_finished({rid})
                assert e.sched.request_finished(req, [1, 2, 3]) == (False, None)
    finally:
        e.close()


def test_lease_expiry_estimated_from_lease_ttl(backend: MooncakeBackend) -> None:
    e = Engine(backend, 7206, lease_ttl_ms=5000)
    try:
        prompt = _prompt(40, 10)
        e.store(prompt, 2)
        req = _request("l", prompt)
        before = time.time() * 1e3
        assert e.sched.get_num_new_matched_tokens(req, 0) == (32, False)
        e.sched.update_state_after_alloc(req, _blocks([0, 1, 2]), 32)
        new = NewRequestData.from_request(req, ([0, 1, 2],))
        (m,) = e.sched.build_connector_meta(_output([new], {"l": 8})).requests
        assert m.load is not None and m.load.lease_expires_ms is not None
        assert before + 5000 <= m.load.lease_expires_ms <= time.time() * 1e3 + 5000
    finally:
        e.close()


def test_cache_salt_and_lora_separate_keys(engine: Engine) -> None:
    prompt = _prompt(40, 8)
    salted = _request("s", prompt, cache_salt="tenant-a")
    engine.store(prompt, 2, extra=request_extra(salted))
    assert engine.sched.get_num_new_matched_tokens(salted, 0) == (32, False)
    # Same tokens, no salt or another salt: different keys, no hit.
    assert engine.sched.get_num_new_matched_tokens(_request("n", prompt), 0) == (0, False)
    other = _request("o", prompt, cache_salt="tenant-b")
    assert engine.sched.get_num_new_matched_tokens(other, 0) == (0, False)
    assert request_extra(salted) != request_extra(other) != b""
    # The scheduler's hash cache never lends one salt's hashes to another: each of the three
    # was hashed in full, and a second request of tenant-a reuses tenant-a's.
    cache = engine.sched.hash_cache
    assert (cache.reused_chunks, cache.hashed_chunks) == (0, 6)
    again = _request("s2", prompt, cache_salt="tenant-a")
    assert engine.sched.get_num_new_matched_tokens(again, 0) == (32, False)
    assert (cache.reused_chunks, cache.hashed_chunks) == (2, 6)


def test_a_lora_name_holding_a_salt_does_not_share_a_salted_requests_keys(
    engine: Engine,
) -> None:
    """Adapter ``L`` with salt ``S`` stores a prefix; an adapter named ``L\\x00salt=S`` (a
    runtime-loaded adapter's name is the client's choice) without a salt asks for the same
    tokens: other keys, no hit (the old ``lora=..\\x00salt=..`` join gave both one key)."""
    prompt = _prompt(40, 9)
    victim = _request("v", prompt, lora_request=LoRARequest("L", 1, "/a"), cache_salt="S")
    engine.store(prompt, 2, extra=request_extra(victim))
    assert engine.sched.get_num_new_matched_tokens(victim, 0) == (32, False)
    forged = _request("f", prompt, lora_request=LoRARequest("L\x00salt=S", 2, "/b"))
    assert engine.sched.get_num_new_matched_tokens(forged, 0) == (0, False)
    assert request_extra(forged) != request_extra(victim)
    assert request_extra(_request("n", prompt)) == b""  # unsalted, no adapter: keys unchanged


def test_next_conversation_turn_hashes_only_its_new_chunks(engine: Engine) -> None:
    turn1 = _prompt(50, 11)  # 3 whole chunks
    turn2 = [*turn1[:48], *_prompt(60, 12)]  # the same 3 chunks, then 3 more (+12 tokens)
    engine.store(turn2, 5)
    assert engine.sched.get_num_new_matched_tokens(_request("t1", turn1), 0) == (48, False)
    assert engine.sched.get_num_new_matched_tokens(_request("t2", turn2), 0) == (80, False)
    cache = engine.sched.hash_cache
    assert (cache.reused_chunks, cache.hashed_chunks) == (3, 6)
    # The saves of turn 2 use the same keys a fresh hash gives.
    assert engine.sched._requests["t2"].hashes == chunk_hashes(turn2, BLOCK)


def test_store_failure_is_reported_not_a_silent_miss(
    fresh_mooncake_master: LocalMooncakeMaster,
) -> None:
    b = MooncakeBackend(MooncakeConfig.load({"mooncake": {
        "master_server_address": fresh_mooncake_master.address, "global_segment_size": "16MB",
        "local_buffer_size": "4MB"}}))
    # The client waits longer than the store's own RPC retries to a dead master, so the
    # store's failure (not the client's timeout) is what this test sees, even on a busy host.
    e = Engine(b, 7205, timeout_ms=30_000)
    try:
        prompt = _prompt(40, 9)
        e.store(prompt, 2)
        assert e.sched.get_num_new_matched_tokens(_request("ok", prompt), 0) == (32, False)
        fresh_mooncake_master.kill()
        # The scheduler goes on without the pool (0 tokens) but the error is counted, logged
        # and reported with its name.
        assert e.sched.get_num_new_matched_tokens(_request("dead", prompt), 0) == (0, False)
        assert e.sched.counters.lookup_errors == 1
        assert e.server.errors == 1
        lookups = [ev for ev in e.reporter.drain() if isinstance(ev, Lookup)]
        assert lookups[0].error is None
        assert lookups[1].req_id == "dead" and lookups[1].pool_tokens == 0
        assert lookups[1].error is not None and "lookup failed" in lookups[1].error
    finally:
        e.close()
        b.close()


def test_preempted_request_resumes_with_new_blocks(engine: Engine) -> None:
    prompt = _prompt(80, 11)  # 5 whole chunks
    req = _request("p", prompt)
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    engine.sched.update_state_after_alloc(req, _blocks([0, 1]), 0)
    new = NewRequestData.from_request(req, ([0, 1],))
    (m,) = engine.sched.build_connector_meta(_output([new], {"p": 32})).requests
    assert (m.save_from_chunk, m.save_to_chunk) == (0, 2)
    # Preempted: the workers are told, so in-flight saves finish before blocks are reused.
    out = _output([], {})
    out.preempted_req_ids = {"p"}
    assert engine.sched.build_connector_meta(out).preempted == {"p"}
    # Resumed with a whole new block table; saving continues after the chunks already saved.
    resumed = _cached("p", [7, 8, 9, 10, 11], 32)
    resumed.resumed_req_ids = {"p"}
    (m,) = engine.sched.build_connector_meta(_output([], {"p": 48}, resumed)).requests
    assert m.block_ids == [7, 8, 9, 10, 11]
    assert (m.save_from_chunk, m.save_to_chunk, m.is_last_save) == (2, 5, True)


def test_waiting_request_is_looked_up_once(engine: Engine) -> None:
    """vLLM asks again on every step while a request waits for free blocks: one lookup."""
    prompt = _prompt(70, 12)
    engine.store(prompt, 3)
    req = _request("w", prompt)
    for _ in range(5):
        assert engine.sched.get_num_new_matched_tokens(req, 0) == (48, False)
    c = engine.sched.counters
    assert (c.lookups, c.lookup_cached, c.prompt_tokens) == (1, 4, 70)
    assert len([e for e in engine.reporter.drain() if isinstance(e, Lookup)]) == 1
    # A different local hit is a new question.
    assert engine.sched.get_num_new_matched_tokens(req, 16) == (32, False)
    assert c.lookups == 2
    # Allocated: the waiting period is over, the cached answer still loads what it said...
    engine.sched.update_state_after_alloc(req, _blocks([0, 1, 2, 3, 4]), 32)
    new = NewRequestData.from_request(req, ([0, 1, 2, 3, 4],))
    new.num_computed_tokens = 48
    (m,) = engine.sched.build_connector_meta(_output([new], {"w": 22})).requests
    assert m.load is not None and (m.load.vllm_cached_tokens, m.load.kvpool_cached_tokens) == (
        16, 48)
    # ...and a later ask (after a preemption) looks up again.
    assert engine.sched.get_num_new_matched_tokens(req, 16) == (32, False)
    assert c.lookups == 3


def test_breaker_skips_lookups_after_repeated_failures(
    fresh_mooncake_master: LocalMooncakeMaster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    b = MooncakeBackend(MooncakeConfig.load({"mooncake": {
        "master_server_address": fresh_mooncake_master.address, "global_segment_size": "16MB",
        "local_buffer_size": "4MB"}}))
    # Open for a minute: however slow the machine, the skips below fall inside the open period;
    # the scheduler's clock is moved past it afterwards instead of sleeping.
    e = Engine(b, 7207, lookup_breaker_failures=2, lookup_breaker_open_ms=60_000)
    try:
        prompt = _prompt(40, 13)
        e.store(prompt, 2)
        fresh_mooncake_master.kill()
        for i in range(2):
            assert e.sched.get_num_new_matched_tokens(_request(f"f{i}", prompt), 0) == (0, False)
        # A query may time out on the client before the dying store answers the server (a
        # Mooncake client retries a dead master for seconds per call).
        deadline = time.monotonic() + 60
        while e.server.errors < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.server.errors == 2
        # Open: the pool is not asked, the skip is counted with its reason.
        for i in range(3):
            assert e.sched.get_num_new_matched_tokens(_request(f"s{i}", prompt), 0) == (0, False)
        c = e.sched.counters
        assert (e.server.errors, c.lookup_errors, c.lookup_skipped) == (2, 2, 3)
        assert c.skip_reasons == {"BREAKER_OPEN": 3}
        events = e.reporter.drain()
        assert [ev.skipped for ev in events if isinstance(ev, Lookup)] == [
            None, None, "BREAKER_OPEN", "BREAKER_OPEN", "BREAKER_OPEN"]
        (err,) = [ev for ev in events if isinstance(ev, ReportedError)]
        assert err.name == "LOOKUP_BREAKER_OPEN" and "60000 ms" in err.message
        # After the open period one lookup is tried again (and fails: open again).
        later = time.monotonic() + 61
        monkeypatch.setattr(prefix_match_module, "time",
                            SimpleNamespace(monotonic=lambda: later, time=time.time,
                                            perf_counter=time.perf_counter))
        assert e.sched.get_num_new_matched_tokens(_request("t", prompt), 0) == (0, False)
        assert (c.lookups, c.lookup_errors, c.lookup_skipped) == (3, 3, 3)
    finally:
        e.close()
        b.close()


def test_multimodal_request_skips_the_pool(engine: Engine) -> None:
    """Placeholder tokens are the same for every image: a request with media neither loads
    another request's KV nor saves its own under its tokens' keys."""
    prompt = _prompt(70, 14)
    engine.store(prompt, 3)
    image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-1",
                                  mm_position=PlaceholderRange(offset=4, length=20),
                                  mm_hash="img-1")
    req = _request("mm", prompt, mm_features=[image])
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    c = engine.sched.counters
    assert (c.lookups, c.lookup_skipped, c.skip_reasons) == (0, 1, {"MULTIMODAL": 1})
    (ev,) = [e for e in engine.reporter.drain() if isinstance(e, Lookup)]
    assert ev.skipped == "MULTIMODAL"
    engine.sched.update_state_after_alloc(req, _blocks([0, 1, 2, 3, 4]), 0)
    new = NewRequestData.from_request(req, ([0, 1, 2, 3, 4],))
    assert engine.sched.build_connector_meta(_output([new], {"mm": 70})).requests == []
    assert engine.sched.request_finished(req, [0, 1, 2, 3, 4]) == (False, None)


def _adapter(root: Path, seed: int) -> str:
    """A LoRA adapter directory on k_proj/v_proj (PEFT's file names), weights from ``seed``."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps(
        {"r": 4, "lora_alpha": 8, "target_modules": ["k_proj", "v_proj"]}))
    rng = np.random.default_rng(seed)
    save_file({f"base_model.model.layers.0.self_attn.{m}.lora_{ab}.weight":
               rng.standard_normal((4, 64), dtype=np.float32)
               for m in ("k_proj", "v_proj") for ab in "AB"},
              str(root / "adapter_model.safetensors"))
    return str(root)


def test_one_lora_name_over_two_adapters_never_shares(engine: Engine, tmp_path: Path) -> None:
    """The name ``sql`` is pointed at a new adapter: a request through it never reads the KV
    the old adapter made, and the scheduler's hash cache lends it none of the old hashes."""
    prompt = _prompt(40, 16)
    v1, v2 = _adapter(tmp_path / "sql-v1", 1), _adapter(tmp_path / "sql-v2", 2)
    old = _request("old", prompt, lora_request=LoRARequest("sql", 1, v1))
    engine.store(prompt, 2, extra=request_extra(old))
    assert engine.sched.get_num_new_matched_tokens(old, 0) == (32, False)
    new = _request("new", prompt, lora_request=LoRARequest("sql", 1, v2))
    assert engine.sched.get_num_new_matched_tokens(new, 0) == (0, False)
    assert request_extra(new) != request_extra(old)
    assert engine.sched.hash_cache.reused_chunks == 0


def test_one_adapter_under_two_names_shares(engine: Engine, tmp_path: Path) -> None:
    prompt = _prompt(40, 17)
    path = _adapter(tmp_path / "shared", 3)
    copy = tmp_path / "copy-of-shared"
    import shutil

    shutil.copytree(path, copy)
    a = _request("a", prompt, lora_request=LoRARequest("tenant-a-sql", 1, path))
    engine.store(prompt, 2, extra=request_extra(a))
    b = _request("b", prompt, lora_request=LoRARequest("tenant-b-sql", 7, str(copy)))
    assert request_extra(b) == request_extra(a) != b""
    assert engine.sched.get_num_new_matched_tokens(b, 0) == (32, False)
    # Without the adapter the same tokens are another prefix.
    assert engine.sched.get_num_new_matched_tokens(_request("n", prompt), 0) == (0, False)


def test_the_adapters_an_engine_keyed_reach_its_state_by_content(engine: Engine,
                                                                 tmp_path: Path) -> None:
    """Issue 39 item 5: each adapter a scheduler keys a prompt under reaches the agent's
    ``LookupStats.adapters`` (name -> content identity, the latest per name) and the wire."""
    prompt = _prompt(40, 19)
    v1, v2 = _adapter(tmp_path / "v1", 4), _adapter(tmp_path / "v2", 5)
    for rid, name, path in (("a", "sql", v1), ("b", "chat", v1), ("c", "sql", v2)):
        req = _request(rid, prompt, lora_request=LoRARequest(name, 1, path))
        assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert engine.sched.get_num_new_matched_tokens(_request("n", prompt), 0) == (0, False)
    agg = Aggregator(Source(agent_id="e/scheduler", engine_id="e", instance_role="mixed",
                            kv_role="kv_both", process_role="scheduler"))
    agg.apply(engine.reporter.drain())
    one, two = adapter_identity("sql", v1), adapter_identity("sql", v2)
    assert one.startswith("lora:") and two.startswith("lora:") and one != two
    state = agg.state(1.0)
    assert state.lookup.adapters == {"sql": two, "chat": one}
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=EngineState)
    assert wire.lookup.adapters == {"sql": two, "chat": one}


def test_a_prompt_embeds_request_skips_the_pool(engine: Engine) -> None:
    """vLLM's ``--enable-prompt-embeds``: a request's token ids (none, or placeholders next to
    the embeddings) do not say what the model saw, so it never reads another prompt's KV and
    never saves its own under those ids: a named, counted skip."""
    prompt = _prompt(70, 18)
    engine.store(prompt, 3)
    embeds = torch.randn(70, 64)
    mixed = Request("pe", prompt, SamplingParams(max_tokens=4), None, prompt_embeds=embeds,
                    prompt_is_token_ids=[i < 4 for i in range(70)])
    only = Request("pe2", None, SamplingParams(max_tokens=4), None, prompt_embeds=embeds)
    for req in (mixed, only):
        assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    c = engine.sched.counters
    assert (c.lookups, c.lookup_skipped, c.skip_reasons) == (0, 2, {"PROMPT_EMBEDS": 2})
    assert [e.skipped for e in engine.reporter.drain() if isinstance(e, Lookup)] == [
        "PROMPT_EMBEDS", "PROMPT_EMBEDS"]
    engine.sched.update_state_after_alloc(mixed, _blocks([0, 1, 2, 3, 4]), 0)
    new = NewRequestData.from_request(mixed, ([0, 1, 2, 3, 4],))
    assert engine.sched.build_connector_meta(_output([new], {"pe": 70})).requests == []
    assert engine.sched.request_finished(mixed, [0, 1, 2, 3, 4]) == (False, None)
    # The same token ids without embeddings still find the stored prefix.
    assert engine.sched.get_num_new_matched_tokens(_request("t", prompt), 0) == (48, False)


def test_a_backend_without_prefill_over_context_loads_nothing_and_saves(engine: Engine) -> None:
    """vLLM's CPU_MLA computes a suffix over loaded context wrongly: the engine never looks up
    (a named, counted skip), and still saves what it computes from token 0."""
    sched = KVPoolScheduler(engine.config, engine.sched.lookup_client, engine.reporter,
                            no_context_prefill="CPU_MLA", lookup_async=False)
    prompt = _prompt(70, 15)
    engine.store(prompt, 3)
    req = _request("nc", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    c = sched.counters
    assert (c.lookups, c.lookup_skipped, c.skip_reasons) == (0, 1, {"NO_CONTEXT_PREFILL": 1})
    (ev,) = [e for e in engine.reporter.drain() if isinstance(e, Lookup)]
    assert ev.skipped == "NO_CONTEXT_PREFILL"
    sched.update_state_after_alloc(req, _blocks([0, 1, 2, 3, 4]), 0)
    new = NewRequestData.from_request(req, ([0, 1, 2, 3, 4],))
    (meta,) = sched.build_connector_meta(_output([new], {"nc": 70})).requests
    assert meta.load is None
    assert (meta.save_from_chunk, meta.save_to_chunk) == (0, 70 // engine.config.chunk_size)


class _Shrinking:
    """A token id whose ``__index__`` empties the list it is read from."""

    def __init__(self, ids: list[Any]) -> None:
        self.ids = ids

    def __index__(self) -> int:
        self.ids.clear()
        return 7


@pytest.mark.parametrize(("bad_id", "why"), [(-1, r"token id -1 at position 40 is outside"),
                                             (2**32, r"token id 4294967296 at position 40"),
                                             (2**64, r"at position 40 .*: at least 2\*\*63"),
                                             (1.5, r"'float' object cannot be interpreted"),
                                             ("shrinks", r"changed size while being packed")])
def test_token_ids_outside_uint32_run_without_the_pool(
        engine: Engine, bad_id: Any, why: str) -> None:
    """vLLM checks prompt token ids against the vocabulary only when it has a tokenizer
    (``skip_tokenizer_init`` skips the check) and with TP > 1 its embedding zeroes an id
    outside the vocabulary instead of failing: such a request runs. The connector must not end
    the engine with an exception from hashing it; no key can name its tokens, so it neither
    loads nor saves (recomputed), and the error is reported once with the request id."""
    prompt = _prompt(70, 15)
    engine.store(prompt, 3)
    bad = [*prompt[:40], bad_id, *prompt[41:]]
    if bad_id == "shrinks":  # an id whose __index__ empties the prompt it is read from
        bad[40] = _Shrinking(bad)
    req = _request("bad-ids", bad)
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    c = engine.sched.counters
    assert (c.lookups, c.lookup_skipped, c.skip_reasons) == (0, 1, {"BAD_TOKEN_IDS": 1})
    events = engine.reporter.drain()
    (err,) = [e for e in events if isinstance(e, ReportedError)]
    assert (err.name, err.req_id) == ("BAD_TOKEN_IDS", "bad-ids")
    assert re.search(r"request bad-ids's prompt cannot be keyed \(.*" + why, err.message)
    (ev,) = [e for e in events if isinstance(e, Lookup)]
    assert ev.skipped == "BAD_TOKEN_IDS"
    engine.sched.update_state_after_alloc(req, _blocks([0, 1, 2, 3, 4]), 0)
    new = NewRequestData.from_request(req, ([0, 1, 2, 3, 4],))
    assert engine.sched.build_connector_meta(_output([new], {"bad-ids": 70})).requests == []
    assert engine.sched.request_finished(req, [0, 1, 2, 3, 4]) == (False, None)
    assert [e for e in engine.reporter.drain() if isinstance(e, ReportedError)] == []
    # A short prompt with such an id (no lookup to make) is saved by no one either.
    short_ids = [5, bad_id, 6]
    if bad_id == "shrinks":
        short_ids[1] = _Shrinking(short_ids)
    short = _request("bad-short", short_ids)
    assert engine.sched.get_num_new_matched_tokens(short, 0) == (0, False)
    engine.sched.update_state_after_alloc(short, _blocks([5]), 0)
    new = NewRequestData.from_request(short, ([5],))
    assert engine.sched.build_connector_meta(_output([new], {"bad-short": 3})).requests == []
    # The engine goes on: the good prompt still loads what the pool holds.
    assert engine.sched.get_num_new_matched_tokens(_request("good", prompt), 0) == (48, False)


def test_trimmed_hit_is_loaded_up_to_the_cut(backend: MooncakeBackend) -> None:
    e = Engine(backend, 7208, chunk_size=2 * BLOCK)
    try:
        prompt = _prompt(100, 15)
        e.store(prompt, 3)
        req = _request("t", prompt)
        assert e.sched.get_num_new_matched_tokens(req, 0) == (96, False)
        # vLLM keeps 80 of the 96 tokens: the cut is inside chunk 2.
        e.sched.update_state_after_alloc(req, _blocks(list(range(7))), 80)
        new = NewRequestData.from_request(req, (list(range(7)),))
        new.num_computed_tokens = 80
        (m,) = e.sched.build_connector_meta(_output([new], {"t": 20})).requests
        assert m.load is not None
        assert (m.load.vllm_cached_tokens, m.load.kvpool_cached_tokens) == (0, 80)
    finally:
        e.close()


class _Tracked:
    """Records what the scheduler tells the KV-event joiner (``RequestEvents``)."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.released: list[str] = []

    def track(self, request: Request) -> None:
        self.live.add(request.request_id)

    def release(self, req_ids: Any) -> None:
        for rid in req_ids:
            self.live.discard(rid)
            self.released.append(rid)


def test_requests_are_kept_for_kv_events_until_their_saves_are_reported(engine: Engine) -> None:
    """With KV events on, a request that saved is kept (its block hashes) until its
    ``finished_sending``, one that did not is released when it finishes; finished requests'
    saves outstanding are counted for ``reset_cache``, and a reset forgets kept lookups."""
    tracked = _Tracked()
    engine.sched.events = tracked
    saver, idle = _request("s", _prompt(40, 9)), _request("i", _prompt(10, 9))
    for req, blocks in ((saver, [1, 2, 3]), (idle, [4])):
        assert engine.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        engine.sched.update_state_after_alloc(req, _blocks(blocks), 0)
    # The 10-token prompt has no whole chunk: nothing to save, nothing to announce.
    assert tracked.live == {"s"}
    new = NewRequestData.from_request(saver, ([1, 2, 3],))
    (m,) = engine.sched.build_connector_meta(_output([new], {"s": 40})).requests
    assert (m.save_from_chunk, m.save_to_chunk) == (0, 2)
    assert engine.sched.request_finished(saver, [1, 2, 3]) == (True, None)
    assert engine.sched.request_finished(idle, [4]) == (False, None)
    assert tracked.live == {"s"} and tracked.released == ["i"]
    assert engine.sched.saves_outstanding == 1
    engine.sched.saves_finished({"s"})
    assert engine.sched.saves_outstanding == 0
    # A waiting request's kept lookup is dropped by a reset: it is asked again.
    waiting = _request("w", _prompt(40, 10))
    engine.store(waiting.prompt_token_ids or [], 2)
    engine.sched.get_num_new_matched_tokens(waiting, 0)
    engine.sched.get_num_new_matched_tokens(waiting, 0)
    # (The 10-token prompt was never looked up: it has no whole chunk.)
    assert (engine.sched.counters.lookups, engine.sched.counters.lookup_cached) == (2, 1)
    engine.sched.forget_lookups()
    assert engine.sched.get_num_new_matched_tokens(waiting, 0) == (32, False)
    assert (engine.sched.counters.lookups, engine.sched.counters.lookup_cached) == (3, 1)


def _pd_request(rid: str, prompt: list[int], params: dict[str, Any]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1,
                                               extra_args={"kv_transfer_params": params}), None)


def test_pd_handover_prefill_promises_its_chunks_and_decode_waits_for_them(
        backend: MooncakeBackend) -> None:
    # The proxy's prefill request (vLLM's toy proxy marks it do_remote_decode) answers with
    # the tokens its saves write; the decode engine, given them, waits until the pool holds
    # them, then loads them all.
    prefill = Engine(backend, 7211)
    decode = Engine(backend, 7212, role="kv_consumer", consumer_is_to_load=True,
                    handover_wait_ms=60_000)
    try:
        prompt = _prompt(50, 21)  # 3 whole chunks
        req = _pd_request("p", prompt, {"do_remote_decode": True, "remote_engine_id": None})
        assert prefill.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        prefill.sched.update_state_after_alloc(req, _blocks([0, 1, 2, 3]), 0)
        new = NewRequestData.from_request(req, ([0, 1, 2, 3],))
        prefill.sched.build_connector_meta(_output([new], {"p": 50}))
        held, params = prefill.sched.request_finished(req, [0, 1, 2, 3])
        assert (held, params) == (True, {"kvpool_handover": {"tokens": 48}})

        # The prefill's saves land in the pool one by one (here written as the decode
        # engine's keys: each test engine has a model of its own).
        dreq = _pd_request("d", prompt, params)
        before = decode.sched.counters.lookups
        # Nothing saved yet: asked again later, not counted as a lookup.
        assert decode.sched.get_num_new_matched_tokens(dreq, 0) == (None, False)
        decode.store(prompt, 2)
        assert decode.sched.get_num_new_matched_tokens(dreq, 0) == (None, False)
        assert decode.sched.counters.lookups == before
        assert decode.sched.counters.handover_waits == 2
        decode.store(prompt, 3)
        # Asked again within RECHECK_MS: "later" without a lookup; then the whole hand-over.
        deadline = time.monotonic() + 30
        while (answer := decode.sched.get_num_new_matched_tokens(dreq, 0))[0] is None:
            assert time.monotonic() < deadline
        # The last prompt token is computed by decode: 3 chunks of 16 hold 48 < 50 tokens.
        assert answer == (48, False)
        assert decode.sched.counters.lookups == before + 1
        assert decode.sched.counters.handover_short == 0
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("params", [
    {"kvpool_handover": {"tokens": 10**9}}, {"kvpool_handover": {"tokens": "48"}},
    {"kvpool_handover": {"tokens": True}}, {"kvpool_handover": 48}, {"kvpool_handover": None},
    {"do_remote_decode": True},
])
def test_pd_handover_a_bad_promise_is_no_reason_to_wait(
        backend: MooncakeBackend, params: dict[str, Any]) -> None:
    # kv_transfer_params are the API caller's: a promise that is not an int within the
    # prompt makes nothing wait (and a prefill-side marker on a decode engine neither).
    decode = Engine(backend, 7213, role="kv_consumer", consumer_is_to_load=True,
                    handover_wait_ms=60_000)
    try:
        prompt = _prompt(50, 22)
        decode.store(prompt, 1)
        assert decode.sched.get_num_new_matched_tokens(
            _pd_request("b", prompt, params), 0) == (16, False)
        assert decode.sched.counters.handover_waits == 0
    finally:
        decode.close()


def test_pd_handover_runs_short_after_handover_wait_ms(backend: MooncakeBackend) -> None:
    decode = Engine(backend, 7214, role="kv_consumer", consumer_is_to_load=True,
                    handover_wait_ms=1)
    try:
        prompt = _prompt(50, 23)
        decode.store(prompt, 1)
        req = _pd_request("s", prompt, {"kvpool_handover": {"tokens": 48}})
        answer = decode.sched.get_num_new_matched_tokens(req, 0)
        while answer[0] is None:  # waits at most handover_wait_ms (1 ms) of its own clock
            answer = decode.sched.get_num_new_matched_tokens(req, 0)
        assert answer == (16, False)
        assert decode.sched.counters.handover_short == 1
    finally:
        decode.close()


def test_no_handover_params_without_the_proxys_marker(engine: Engine) -> None:
    prompt = _prompt(50, 24)
    req = _pd_request("n", prompt, {"do_remote_decode": False})
    engine.sched.get_num_new_matched_tokens(req, 0)
    engine.sched.update_state_after_alloc(req, _blocks([0, 1, 2, 3]), 0)
    engine.sched.build_connector_meta(_output([NewRequestData.from_request(req, ([0, 1, 2, 3],))],
                                              {"n": 50}))
    assert engine.sched.request_finished(req, [0, 1, 2, 3]) == (True, None)


def test_a_load_of_a_request_finished_in_its_step_is_counted(engine: Engine) -> None:
    # A P/D prefill's request computes one token: vLLM finishes it (request_finished) before
    # it hands over that step's connector output, which carries the load's outcome.
    prompt = _prompt(50, 25)
    engine.store(prompt, 2)
    req = Request("one", prompt, SamplingParams(max_tokens=1), None)
    assert engine.sched.get_num_new_matched_tokens(req, 0) == (32, False)
    engine.sched.update_state_after_alloc(req, _blocks([0, 1, 2, 3]), 32)
    new = NewRequestData.from_request(req, ([0, 1, 2, 3],))
    new.num_computed_tokens = 32
    engine.sched.build_connector_meta(_output([new], {"one": 18}))
    engine.sched.request_finished(req, [0, 1, 2, 3])
    engine.sched.loads_outcome(LoadOutcomes({"one": (32, 32)}), ())
    assert engine.sched.counters.loaded_tokens == 32
    loaded = [e for e in engine.reporter.drain() if isinstance(e, Loaded)]
    assert [(e.req_id, e.tokens) for e in loaded] == [("one", 32)]


def test_handover_waits_are_bounded_in_time_rate_and_number() -> None:
    from kvpool_connector.handover import MAX_WAITING, RECHECK_MS, HandoverWaits

    w = HandoverWaits(1_000)
    assert w.keep_waiting("a", 0, 64, now=100.0)
    assert w.ask_later("a", now=100.0 + RECHECK_MS / 2e3)  # no lookup before RECHECK_MS
    assert not w.ask_later("a", now=100.0 + 2 * RECHECK_MS / 1e3)
    assert w.keep_waiting("a", 32, 64, now=100.5)
    assert not w.keep_waiting("a", 32, 64, now=101.0)  # handover_wait_ms is up
    assert not w.ask_later("a", now=101.001)  # forgotten: nothing more to wait for
    assert not w.keep_waiting("b", 64, 64, now=100.0)  # all there
    for i in range(MAX_WAITING):
        assert w.keep_waiting(f"r{i}", 0, 64, now=200.0)
    assert not w.keep_waiting("one-too-many", 0, 64, now=200.0)
    w.forget("r0")
    assert w.keep_waiting("one-too-many", 0, 64, now=200.0)
    assert not HandoverWaits(0).keep_waiting("c", 0, 64, now=1.0)
