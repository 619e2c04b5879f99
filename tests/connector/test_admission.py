"""Save admission (``kvpool_connector.admission``): the adaptive policy's decisions against a
plain reference model, its bounds, the config key, and a P/D hand-over through a real pool with
``admission: adaptive`` on both engines."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from chunk_testlib import chained, lru_insert
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvpool_connector.admission import AdaptiveAdmission, AdmitAll, admission_for
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import ParallelLayout
from kvpool_connector.lookup import LookupClient, LookupServer
from kvpool_connector.scheduler import KVPoolScheduler
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster


class _Reference:
    """The adaptive policy as its docstring states it, with lists and sets only (exact
    doorkeeper, no sampling)."""

    def __init__(self, cap: int, half_life: int) -> None:
        self.cap, self.decay = cap, 0.5 ** (1.0 / half_life)
        self.all: list[str] = []
        self.door: list[str] = []
        self.seen: set[str] = set()
        self.s_all = self.s_door = 0.0

    @staticmethod
    def _leading(hashes: Sequence[str], present: Sequence[str] | set[str]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in present:
            n += 1
        return n

    def _insert(self, lru: list[str], hashes: Sequence[str], admitted: int) -> None:
        lru_insert(lru, hashes, admitted)
        del lru[: max(0, len(lru) - self.cap)]

    def admit(self, hashes: Sequence[str]) -> tuple[int, bool]:
        self.s_all = self.s_all * self.decay + self._leading(hashes, self.all)
        self.s_door = self.s_door * self.decay + self._leading(hashes, self.door)
        door = self.s_door > self.s_all
        seen = self._leading(hashes, self.seen)
        self._insert(self.all, hashes, len(hashes))
        self._insert(self.door, hashes, seen)
        self.seen.update(hashes)
        return (seen if door else len(hashes)), door


_streams = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1,
                    max_size=60)


@settings(max_examples=150, deadline=None)
@given(_streams, st.integers(1, 8), st.sampled_from([1, 3, 50]))
def test_adaptive_decides_as_the_reference_model(prompts: list[list[int]], cap: int,
                                                 half_life: int) -> None:
    policy = AdaptiveAdmission(cap, half_life=half_life)
    ref = _Reference(cap, half_life)
    for ids in prompts:
        hashes = chained(ids)
        want, door = ref.admit(hashes)
        assert policy.admit(hashes) == want
        assert policy.doorkeeper_active == door
    assert sum(policy.decisions.values()) == len(prompts)


def _doorkeeper_wins(policy: AdaptiveAdmission) -> None:
    """A hot 2-chunk prompt between one-off 3-chunk prompts, a pool of 3 chunks: under *all*
    every one-off flushes the hot prompt; the doorkeeper never saves a one-off."""
    for i in range(20):
        policy.admit(chained([0, 1]))
        policy.admit(chained([100 + i, 1, 2]))
    assert policy.doorkeeper_active


def test_doorkeeper_skips_what_was_never_asked_for_and_all_wins_a_big_pool() -> None:
    small = AdaptiveAdmission(3)
    _doorkeeper_wins(small)
    assert small.admit(chained([999, 1, 2])) == 0  # never asked for: not saved
    assert small.admit(chained([0, 1, 7])) == 2  # the hot chunks were asked for before
    assert small.decisions["doorkeeper"] > 0
    # A pool that holds everything: the doorkeeper only loses second uses, *all* rules.
    big = AdaptiveAdmission(1000)
    for i in range(20):
        big.admit(chained([0, 1]))
        assert big.admit(chained([100 + i, 1, 2])) == 3
    assert not big.doorkeeper_active


def test_doorkeeper_forgets_after_two_generations() -> None:
    policy = AdaptiveAdmission(3)  # doorkeeper generations of 4096 chunks (its minimum)
    _doorkeeper_wins(policy)
    first = chained([5000])
    policy.admit(first)
    for i in range(4096):
        policy.admit(chained([10_000 + i]))
    assert policy.admit(first) == 1  # in the previous generation: still known
    for i in range(2 * 4096):
        policy.admit(chained([20_000 + i]))
    assert policy.doorkeeper_active
    assert policy.admit(chained([5000])) == 0


def test_ghosts_sample_a_big_pool_within_their_bound() -> None:
    policy = AdaptiveAdmission(1_000_000, max_ghost_keys=1000)
    for i in range(3000):
        policy.admit(chained([i, 1, 2, 3]))
    sizes = (len(policy._all.keys), len(policy._door.keys))
    assert 0 < sizes[0] <= 1000 and sizes[1] <= 1000
    # ~1000/1e6 of 12,000 distinct chunks are sampled.
    assert sizes[0] < 200


def test_config_needs_pool_tokens_for_adaptive_and_producers_admit_all() -> None:
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.admission_pool_tokens: "):
        KVPoolConfig.from_dicts({"admission": "adaptive"}, kv_role="kv_both", block_size=16,
                                model="m")
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.admission"):
        KVPoolConfig.from_dicts({"admission": "lru"}, kv_role="kv_both", block_size=16,
                                model="m")
    cfg = KVPoolConfig.from_dicts({"admission": "adaptive", "admission_pool_tokens": 4096},
                                  kv_role="kv_both", block_size=16, model="m")
    policy = admission_for(cfg.admission, cfg.kv_role, cfg.admission_pool_tokens, 16)
    assert isinstance(policy, AdaptiveAdmission)
    assert isinstance(admission_for("adaptive", "kv_producer", 4096, 16), AdmitAll)
    assert isinstance(admission_for("all", "kv_both", None, 16), AdmitAll)


# P/D hand-over through a real pool.

BLOCK = 16
_ALIVE: list[object] = []
"""Caches and workers stay allocated: a Mooncake client refuses memory overlapping a range it
registered before, and a freed tensor's range is reused."""


@pytest.fixture(scope="module")
def backend(mooncake_master: LocalMooncakeMaster) -> Iterator[MooncakeBackend]:
    b = MooncakeBackend(MooncakeConfig.load({"mooncake": {
        "master_server_address": mooncake_master.address, "global_segment_size": "32MB",
        "local_buffer_size": "4MB"}}))
    yield b
    b.close()


class _Engine:
    """Scheduler + lookup server + worker of one engine (as in test_scheduler)."""

    def __init__(self, backend: MooncakeBackend, model: str, port: int, role: str,
                 **extra: object) -> None:
        self.config = KVPoolConfig.from_dicts(
            {"lookup_rpc_port": port, "admission": "adaptive", "admission_pool_tokens": 3 * BLOCK,
             **extra}, kv_role=role, block_size=BLOCK, model=model)
        # As the connector sets it on TP rank 0 / PP rank 0 of an engine that saves.
        self.worker = KVPoolWorker(self.config, ParallelLayout(), model, backend,
                                   evicts=self.config.eviction == "connector")
        kv = {"layers.0": torch.zeros(8, 1, BLOCK, 8)}
        self.worker.register_kv_caches(kv)
        _ALIVE.append((kv, self.worker))
        self.server = LookupServer(self.worker.lookup_chunks, lookup_rpc_port=port)
        self.sched = KVPoolScheduler(self.config, LookupClient(lookup_rpc_port=port,
                                                               timeout_ms=3000),
                                     lookup_async=False)

    def run_prefill(self, rid: str, prompt: list[int]) -> tuple[int, int]:
        """Schedule ``prompt`` whole in one step and run its saves; the saved chunk range."""
        req = Request(rid, prompt, SamplingParams(max_tokens=1), None)
        hit, _ = self.sched.get_num_new_matched_tokens(req, 0)
        blocks = list(range(len(prompt) // BLOCK + 1))
        self.sched.update_state_after_alloc(
            req, KVCacheBlocks(([KVCacheBlock(i) for i in blocks],)), hit)
        new = NewRequestData.from_request(req, (blocks,))
        meta = self.sched.build_connector_meta(SchedulerOutput(
            scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={rid: len(prompt) - hit}, total_num_scheduled_tokens=len(prompt),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
            free_encoder_mm_hashes=[]))
        self.worker.start_load_kv(meta)
        for layer in self.worker.kv.layers if self.worker.kv else []:
            self.worker.save_kv_layer(layer.name, None)
        self.worker.wait_for_save(meta)
        assert self.worker.drain_saves(10)
        saves = [(m.save_from_chunk, m.save_to_chunk) for m in meta.requests]
        return saves[0] if saves else (0, 0)

    def close(self) -> None:
        self.sched.close()
        self.server.close()
        self.worker.shutdown()


@pytest.fixture(autouse=True)
def _runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_RUNTIME_DIR", str(tmp_path))


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 3 for i in range(n)]


def test_pd_handover_finds_every_chunk_prefill_saved(backend: MooncakeBackend) -> None:
    model = f"test/admission-{uuid.uuid4().hex[:8]}"
    prefill = _Engine(backend, model, 7311, "kv_producer")
    decode = _Engine(backend, model, 7312, "kv_consumer", consumer_is_to_load=True)
    mixed = _Engine(backend, f"{model}-mixed", 7313, "kv_both")
    try:
        assert isinstance(prefill.sched.admission, AdmitAll)
        assert isinstance(mixed.sched.admission, AdaptiveAdmission)
        _doorkeeper_wins(mixed.sched.admission)
        prompt = _prompt(5 * BLOCK + 3, 1)  # 5 whole chunks, never seen before
        # A kv_both engine in the doorkeeper's regime skips a prompt nobody asked for before.
        assert mixed.run_prefill("m1", prompt) == (0, 0)
        # The producer saves it whole for its decode engine, which finds all 5 chunks.
        assert prefill.run_prefill("p1", prompt) == (0, 5)
        req = Request("d1", prompt, SamplingParams(max_tokens=1), None)
        assert decode.sched.get_num_new_matched_tokens(req, 0) == (5 * BLOCK, False)
    finally:
        for e in (prefill, decode, mixed):
            e.close()


def test_pd_producer_with_connector_eviction_keeps_its_latest_hand_overs(
        backend: MooncakeBackend) -> None:
    """``eviction: connector`` on a prefill engine whose share holds two hand-overs: the third
    removes the oldest from the pool (its decode engine finds nothing of it and recomputes),
    the two latest stay whole."""
    model = f"test/pd-evict-{uuid.uuid4().hex[:8]}"
    prefill = _Engine(backend, model, 7314, "kv_producer", eviction="connector",
                      admission_pool_tokens=10 * BLOCK)
    decode = _Engine(backend, model, 7315, "kv_consumer", consumer_is_to_load=True)
    try:
        assert decode.sched.eviction is None and not decode.worker.evicts  # it saves nothing
        prompts = [_prompt(5 * BLOCK + 3, seed) for seed in (11, 12, 13)]
        for i, prompt in enumerate(prompts):
            assert prefill.run_prefill(f"p{i}", prompt) == (0, 5)
        assert prefill.worker.counters.evicted_keys == 5
        found = [decode.sched.get_num_new_matched_tokens(
            Request(f"d{i}", prompt, SamplingParams(max_tokens=1), None), 0)[0]
            for i, prompt in enumerate(prompts)]
        assert found == [0, 5 * BLOCK, 5 * BLOCK]
    finally:
        for e in (prefill, decode):
            e.close()


@pytest.mark.parametrize(("extra", "field"), [
    ({}, "policy_service"),
    ({"policy_service": "10.0.0.5:5600"}, "policy_service"),
    ({"policy_service": "tcp://h:5600", "eviction": "connector",
      "admission_pool_tokens": 100_000}, "eviction"),
])
def test_admission_service_names_what_it_needs(extra: dict[str, object], field: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_AGENT_KEYS", "/etc/kvpool/agent")
    with pytest.raises(ValueError, match=rf"^kv_connector_extra_config\.{field}: [^\n]+$"):
        KVPoolConfig.from_dicts({"admission": "service", **extra}, kv_role="kv_both",
                                block_size=16, model="m")


def test_admission_service_needs_the_agent_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_AGENT_KEYS", raising=False)
    with pytest.raises(ValueError, match=r"agent_keys"):
        KVPoolConfig.from_dicts({"admission": "service", "policy_service": "tcp://h:5600"},
                                kv_role="kv_both", block_size=16, model="m")
    cfg = KVPoolConfig.from_dicts({"admission": "service", "policy_service": "tcp://h:5600",
                                   "agent_keys": "/k"}, kv_role="kv_both", block_size=16,
                                  model="m")
    # Until the workers' handshake makes the PolicyClient, every chunk is saved.
    assert admission_for(cfg.admission, cfg.kv_role, None, 16).admit(["a" * 32] * 3) == 3
