"""Miss reasons on a live pool (issue 41): a real mooncake_master, a separate mooncake store
process over TCP, real connector workers saving through it and a real ``KVPoolScheduler`` looking
up through a ``LookupServer``, their agents reporting to a real hub over CURVE. Injected faults
land under the right reason of the hub's saved-chunk memory: chunks removed between their save
and the lookup (a flush) are ``evicted``, chunks another layout digest of the model saved are
``other_digest``, chunks an earlier lookup asked for that nobody saved (a tiny save budget
skipped the save) are ``never_saved``, chunks nobody asked for before ``first_use``;
``status --json`` and the hub's ``/metrics`` show the split and still add up to the prompt
tokens."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from agent_testlib import make_source, wait_until
from prometheus_client.parser import text_string_to_metric_families
from vllm import SamplingParams
from vllm.v1.request import Request

from kvpool_agent import AGENT_KEYS_ENV, AgentHandle, FleetHub, KeyPaths, start_agent
from kvpool_agent._misses import split_not_in_pool
from kvpool_agent._saved_chunks import EVICTED
from kvpool_agent.auth import Role
from kvpool_agent.protocol import chunk_id
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes
from kvpool_connector.lookup import LookupClient, LookupServer
from kvpool_connector.metadata import KVPoolConnectorMetadata, ReqMeta
from kvpool_connector.scheduler import KVPoolScheduler
from kvpool_connector.worker import KVPoolWorker
from kvpool_console.cli import main as console_main
from kvpool_replay import LocalMooncakeMaster, LocalPoolStore, free_port

BLOCK = 16
PROMPT = 100
"""Tokens a prompt has: 6 whole chunks of 16 claimable (never the last token), a 4-token tail."""
CLAIMABLE = (PROMPT - 1) // BLOCK * BLOCK

_ALIVE: list[object] = []
"""Registered caches stay allocated: a Mooncake client refuses memory overlapping a range it
registered before, and a freed tensor's range is reused."""


@pytest.fixture
def split_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetHub]:
    kp = fleet_keys["hub"]
    monkeypatch.setenv(AGENT_KEYS_ENV, str(fleet_keys["agent"].root))
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(fleet_keys["viewer"].root))
    monkeypatch.setenv("KVPOOL_RUNTIME_DIR", str(tmp_path))
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  snapshot_interval_s=0.5, reuse_refresh_s=0.1, metrics_port=free_port()) as h:
        yield h


@pytest.fixture(scope="module")
def agent_master() -> Iterator[LocalMooncakeMaster]:
    """A master of the module's own (overrides the session's): its store stops with the module,
    and a stopped store's segment stays listed for the master's ``client_ttl`` (Mooncake's
    default 10 s), where puts fail TRANSFER_FAIL (-800); the next module on the session's
    master met it on three test workers."""
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=10_000) as master:
        yield master


@pytest.fixture(scope="module")
def store_client(agent_master: LocalMooncakeMaster) -> Iterator[MooncakeBackend]:
    """A store process holding the pool's memory, and a client contributing none (the
    engines' side of a pool with a separate store)."""
    with LocalPoolStore(agent_master, 64 << 20):
        b = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": agent_master.address, "global_segment_size": "0",
            "local_buffer_size": "4MB", "master_admin_url": agent_master.admin_url}}))
        yield b
        b.close()


class _Engine:
    """One engine's worker (its layout digest from its cache's head size) and, when it looks
    up, its scheduler asking the worker through a real LookupServer; each process its agent."""

    def __init__(self, engine_id: str, model: str, backend: MooncakeBackend, hub_address: str,
                 head_size: int, *, schedules: bool, pool_admin_url: str | None = None,
                 **extra: Any) -> None:
        port = free_port()
        self.config = KVPoolConfig.from_dicts({"lookup_rpc_port": port, **extra},
                                              kv_role="kv_both", block_size=BLOCK, model=model)
        self.backend = backend
        # With the master's admin URL the worker's agent reports its pool (evictions).
        self.worker_agent = start_agent(make_source(engine_id, model=model),
                                        address=hub_address, pool_admin_url=pool_admin_url)
        self.agents: list[AgentHandle] = [self.worker_agent]
        self.worker = KVPoolWorker(self.config, ParallelLayout(), model, backend,
                                   self.worker_agent.reporter)
        kv = {"layers.0": torch.zeros(2 * PROMPT // BLOCK, 1, BLOCK, head_size)}
        self.worker.register_kv_caches(kv)
        _ALIVE.append((kv, self.worker))
        self.server: LookupServer | None = None
        self.sched: KVPoolScheduler | None = None
        if schedules:
            self.server = LookupServer(self.worker.lookup_chunks, lookup_rpc_port=port)
            sched_agent = start_agent(make_source(engine_id, role="scheduler", model=model),
                                      address=hub_address)
            self.agents.append(sched_agent)
            self.sched = KVPoolScheduler(self.config, LookupClient(lookup_rpc_port=port),
                                         sched_agent.reporter, lookup_async=False)

    def save(self, *prompts: list[int]) -> list[str]:
        """Save the prompts' claimable chunks through the worker's save path, in one step
        (one request each); the keys of the first."""
        n = CLAIMABLE // BLOCK
        hashes = [chunk_hashes(p, BLOCK)[:n] for p in prompts]
        meta = KVPoolConnectorMetadata(requests=[ReqMeta(
            req_id=f"s-{uuid.uuid4().hex[:8]}", block_ids=list(range(i * n, (i + 1) * n)),
            chunk_hashes=h, save_from_chunk=0, save_to_chunk=n, is_last_save=True)
            for i, h in enumerate(hashes)])
        self.worker.start_load_kv(meta)
        self.worker.save_kv_layer("layers.0", None)
        self.worker.wait_for_save(meta)
        assert self.worker.drain_saves(10)
        return [str(PoolKey(self.config.model, self.worker.layout_digest, ParallelLayout(), h))
                for h in hashes[0]]

    def lookup(self, rid: str, prompt: list[int]) -> int:
        assert self.sched is not None
        req = Request(rid, prompt, SamplingParams(max_tokens=4), None)
        found, _ = self.sched.get_num_new_matched_tokens(req, 0)
        assert isinstance(found, int)
        return found

    def close(self) -> None:
        if self.sched is not None:
            self.sched.close()
        if self.server is not None:
            self.server.close()
        self.worker.shutdown()
        for a in self.agents:
            a.stop()


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 3 for i in range(PROMPT)]


def test_injected_faults_land_under_their_reason(
        split_hub: FleetHub, hub_address: str, store_client: MooncakeBackend,
        capsys: pytest.CaptureFixture[str]) -> None:
    model = f"org/misses-{uuid.uuid4().hex[:8]}"
    a = _Engine("eng-a", model, store_client, hub_address, head_size=8, schedules=True)
    b = _Engine("eng-b", model, store_client, hub_address, head_size=16, schedules=False)
    # A save budget of one byte: with nothing in flight one request's save runs, the other
    # request of the same step is skipped (SAVE_BUDGET).
    c = _Engine("eng-c", model, store_client, hub_address, head_size=8, schedules=False,
                save_budget="1")
    try:
        assert a.worker.layout_digest != b.worker.layout_digest
        assert a.worker.layout_digest == c.worker.layout_digest
        flushed, other, fresh, kept = _prompt(1), _prompt(2), _prompt(3), _prompt(4)
        budget_ok, budget_skipped = _prompt(5), _prompt(6)
        keys = a.save(flushed)
        a.save(kept)
        b.save(other)
        c.save(budget_ok, budget_skipped)
        assert c.worker.counters.save_skipped_keys == CLAIMABLE // BLOCK
        # The hub remembers the saves (its memory's stamps are whole seconds of the report).
        last = chunk_hashes(other, BLOCK)[CLAIMABLE // BLOCK - 1]
        for digest, h in ((a.worker.layout_digest, chunk_hashes(flushed, BLOCK)[0]),
                          (b.worker.layout_digest, last)):
            wait_until(lambda d=digest, h=h: split_hub.reuse.saved.reason(  # type: ignore[misc]
                model, d, chunk_id(h), time.time() * 1e3) == EVICTED)
        # The fault: a flush between the save and the lookup removes the first prompt's keys.
        assert store_client.batch_remove(keys) == [0] * len(keys)
        # `fresh` twice: its first lookup is the first use, the second asks for chunks an
        # earlier lookup asked for and nobody saved.
        prompts = (flushed, other, fresh, kept, budget_ok, budget_skipped, fresh)
        assert [a.lookup(f"r{i}", p) for i, p in enumerate(prompts)] == [
            0, 0, 0, CLAIMABLE, CLAIMABLE, 0, 0]
        want = {"evicted": CLAIMABLE, "other_digest": CLAIMABLE, "first_use": 2 * CLAIMABLE,
                "never_saved": CLAIMABLE}
        wait_until(lambda: split_hub.reuse.not_in_pool().get("eng-a") == want)
        sched_id = "eng-a/scheduler"
        wait_until(lambda: split_hub.fleet()[sched_id][0].lookup.lookups == len(prompts))
        lk = split_hub.fleet()[sched_id][0].lookup
        tail = len(prompts) * (PROMPT - CLAIMABLE)
        assert lk.miss_tokens == {"not_in_pool": 5 * CLAIMABLE, "tail": tail,
                                  "not_loaded": 2 * CLAIMABLE}
        merged = split_not_in_pool(lk.miss_tokens, want)
        assert lk.prompt_tokens == len(prompts) * PROMPT == (
            lk.local_tokens + lk.loaded_tokens + sum(merged.values()))
        # The skipped save is in eng-c's worker report, by its reason.
        wait_until(lambda: split_hub.fleet()["eng-c/dp0.tp0.pp0"][0].transfers.errors_by_name
                   == {"SAVE_BUDGET": 1})
        # The console shows the split once the hub's view carries it.
        wait_until(lambda: (v := split_hub.reuse.view()) is not None
                   and v.not_in_pool.get("eng-a") == want)

        def row() -> dict[str, Any]:
            assert console_main(["status", "--json", "--hub", hub_address]) == 0
            doc = json.loads(capsys.readouterr().out)
            return next(e for e in doc["engines"] if e["engine_id"] == "eng-a")

        wait_until(lambda: row()["miss_tokens"] == {**want, "tail": tail,
                                                    "not_loaded": 2 * CLAIMABLE})
        # So does the hub's /metrics, one series per reason.
        assert split_hub.metrics is not None
        scraped = {
            s.labels["reason"]: s.value
            for fam in text_string_to_metric_families(httpx.get(split_hub.metrics.url).text)
            for s in fam.samples
            if s.name == "kvpool_miss_tokens_total" and s.labels["engine"] == "eng-a"}
        assert scraped == {**want, "tail": tail, "not_loaded": 2 * CLAIMABLE}
    finally:
        for e in (a, b, c):
            e.close()


SMALL_HEAD = 8_192
"""Head size of the small pool's engine: a chunk (one layer, 16 tokens, float32) is 512 KiB."""

SMALL_POOL = 16 << 20
"""The small pool's store (Mooncake's smallest segment): 32 of those chunks; its master evicts
past half of it."""


@pytest.fixture(scope="module")
def small_pool() -> Iterator[tuple[LocalMooncakeMaster, MooncakeBackend]]:
    """A pool too small for the traffic: a master evicting past half of a 16 MiB store (half
    its objects a round, leases of 100 ms), and a client contributing no memory."""
    with LocalMooncakeMaster(eviction_high_watermark_ratio=0.5, eviction_ratio=0.5,
                             default_kv_lease_ttl_ms=100) as master, \
            LocalPoolStore(master, SMALL_POOL):
        b = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": master.address, "global_segment_size": "0",
            "local_buffer_size": "4MB", "master_admin_url": master.admin_url,
            "transfer_timeout_ms": 1_000}}))
        yield master, b
        b.close()


def test_each_fault_is_the_top_reason_with_its_fix(
        split_hub: FleetHub, hub_address: str, store_client: MooncakeBackend,
        small_pool: tuple[LocalMooncakeMaster, MooncakeBackend],
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41's injected faults, each on an engine (and model) of its own that looks up only
    what the fault touched: within 10 s of its lookups ``status --json`` names the fault's
    reason as the engine's ``top_miss`` with the fix for that cause."""
    master, small_client = small_pool
    tag = uuid.uuid4().hex[:8]
    split = _Engine("split", f"org/split-{tag}", store_client, hub_address, head_size=8,
                    schedules=True)
    other = _Engine("split-other", f"org/split-{tag}", store_client, hub_address, head_size=16,
                    schedules=False)
    budget = _Engine("budget", f"org/budget-{tag}", store_client, hub_address, head_size=8,
                     schedules=True, save_budget="1")
    flush = _Engine("flush", f"org/flush-{tag}", store_client, hub_address, head_size=8,
                    schedules=True)
    small = _Engine("small", f"org/small-{tag}", small_client, hub_address,
                    head_size=SMALL_HEAD, schedules=True, pool_admin_url=master.admin_url)
    engines = (split, other, budget, flush, small)
    try:
        # Namespaces split: the other layout saved what `split` looks up.
        split_prompts = [_prompt(100 + i) for i in range(2)]
        other.save(*split_prompts)
        # A save budget of one byte: the second request of the step is skipped. Its prompt was
        # looked up once before (a first use), and twice after the skipped save.
        budget_prompts = [_prompt(200), _prompt(201)]
        assert budget.lookup("budget-first", budget_prompts[1]) == 0
        budget.save(*budget_prompts)
        assert budget.worker.counters.save_skipped_keys == CLAIMABLE // BLOCK
        # A flush during traffic: saved, then removed before the lookup.
        flush_prompts = [_prompt(300 + i) for i in range(2)]
        flushed = [k for p in flush_prompts for k in flush.save(p)]
        # Traffic past the small pool: 12 prompts of 6 chunks (36 MiB) into 16 MiB; the master
        # evicts the oldest at its watermark (no one removes anything).
        small_prompts = [_prompt(400 + i) for i in range(12)]
        small_keys = [small.save(p) for p in small_prompts]
        # The hub remembers every save before the lookups (its stamps are whole seconds).
        for e, p in ((other, split_prompts[-1]), (budget, budget_prompts[0]),
                     (flush, flush_prompts[-1]), (small, small_prompts[-1])):
            h = chunk_hashes(p, BLOCK)[CLAIMABLE // BLOCK - 1]
            wait_until(lambda e=e, h=h: split_hub.reuse.saved.reason(  # type: ignore[misc]
                e.config.model, e.worker.layout_digest, chunk_id(h), time.time() * 1e3)
                == EVICTED)
        assert store_client.batch_remove(flushed) == [0] * len(flushed)
        # The prompts the watermark took whole (their keys all gone); the master reports
        # the evictions.
        gone = [p for p, keys in zip(small_prompts, small_keys, strict=True)
                if not any(small_client.batch_exists(keys))]
        assert gone, "the master evicted no whole prompt"
        for i, p in enumerate(split_prompts):
            assert split.lookup(f"split-{i}", p) == 0
        for i in range(2):
            assert budget.lookup(f"budget-{i}", budget_prompts[1]) == 0
        for i, p in enumerate(flush_prompts):
            assert flush.lookup(f"flush-{i}", p) == 0
        for i, p in enumerate(gone):
            assert small.lookup(f"small-{i}", p) == 0
        looked_up = time.monotonic()

        def rows() -> dict[str, dict[str, Any]]:
            assert console_main(["status", "--json", "--hub", hub_address]) == 0
            doc = json.loads(capsys.readouterr().out)
            return {e["engine_id"]: e for e in doc["engines"]}

        want = {"split": "other_digest", "budget": "never_saved", "flush": "evicted",
                "small": "evicted"}
        seen: dict[str, dict[str, Any]] = {}

        tail = PROMPT - CLAIMABLE

        def named() -> bool:
            seen.update(rows())
            # Both lookups' reports in, not only the first's (a loaded CI run read the top
            # reason after one and counted half the tokens).
            return all(seen[e]["top_miss"] == r for e, r in want.items() if e in seen) \
                and want.keys() <= seen.keys() and seen["small"]["pool_evicted_keys"] > 0 \
                and seen["budget"]["miss_tokens"].get("never_saved") == 2 * CLAIMABLE \
                and seen["split"]["miss_tokens"] == {"other_digest": 2 * CLAIMABLE,
                                                     "tail": 2 * tail}
        wait_until(named, timeout_s=10)
        assert time.monotonic() - looked_up <= 10
        got = {e: (seen[e]["top_miss"], seen[e]["top_miss_fix"]) for e in want}
        evicted = seen["small"]["pool_evicted_keys"]
        assert got == {
            "split": ("other_digest", "another layout digest saved it: align model, dtype, "
                                      "layout"),
            "budget": ("never_saved", f"{CLAIMABLE // BLOCK} block saves skipped: raise "
                                     "save_budget, see breaker"),
            "flush": ("evicted", "saved, then removed (flush, unpin): see events, audit file"),
            "small": ("evicted", f"pool too small ({evicted} keys evicted): add memory; "
                                 "whatif 2x"),
        }
        # The tokens behind each: the fault's chunks, the rest the prompts' tails.
        assert seen["split"]["miss_tokens"] == {"other_digest": 2 * CLAIMABLE, "tail": 2 * tail}
        assert seen["budget"]["miss_tokens"] == {"first_use": CLAIMABLE,
                                                 "never_saved": 2 * CLAIMABLE, "tail": 3 * tail}
        assert seen["flush"]["miss_tokens"] == {"evicted": 2 * CLAIMABLE, "tail": 2 * tail}
        # A put the full pool refused (Mooncake: "insufficient space"; the chunk never saved,
        # never asked for before) reads first_use: at most the small engine's skipped and
        # failed saves; every other chunk of the prompts the watermark took reads evicted.
        small_miss = seen["small"]["miss_tokens"]
        assert "never_saved" not in small_miss
        never = small_miss.pop("first_use", 0)
        c = small.worker.counters
        assert never <= (c.save_skipped_keys + c.save_failed_keys) * BLOCK
        assert small_miss == {"evicted": len(gone) * CLAIMABLE - never,
                              "tail": len(gone) * tail}
    finally:
        for e in engines:
            e.close()
