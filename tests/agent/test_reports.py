"""Real saves and loads against a real mooncake_master, reported through a real agent and hub:
the numbers a console receives are checked, not just that a message arrived."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import msgspec
from agent_testlib import make_source

from kvpool_agent import FleetClient, FleetHub, start_agent
from kvpool_agent._versions import package_versions
from kvpool_agent.protocol import EngineState
from kvpool_agent.vocabulary import error_name
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, model_pattern
from kvpool_connector.operations import BackendOperations
from kvpool_replay import LocalMooncakeMaster

BLOCK = 16 * 1024  # bytes per key (one chunk of all layers)
CHUNK = 256  # tokens per chunk
DIGEST = "0123456789ab"  # layout digest of the keys written by hand


def _wait_state(
    client: FleetClient, agent_id: str, pred: Any, timeout_s: float = 5.0
) -> EngineState:
    deadline = time.monotonic() + timeout_s
    while True:
        entry = client.fleet().get(agent_id)
        if entry is not None and pred(entry.state):
            return entry.state
        assert time.monotonic() < deadline, f"state never matched: {entry}"
        client.updates(100)


def test_real_saves_and_loads_are_reported_with_exact_numbers(
    hub: FleetHub,
    hub_address: str,
    mooncake_backend: Any,
    pool_buffer: Any,
    agent_master: LocalMooncakeMaster,
    model: str,
) -> None:
    backend = mooncake_backend
    src = make_source("eng-a", model=model)
    handle = start_agent(
        src,
        address=hub_address,
        operations=BackendOperations(backend, src, key_scope=(model, DIGEST, (ParallelLayout(),))),
        pool_admin_url=agent_master.admin_url,
        lease_ttl_ms=agent_master.default_kv_lease_ttl_ms,
    )
    rep = handle.reporter
    base = ctypes.addressof(pool_buffer)
    tokens = list(range(4 * CHUNK))
    keys = [str(PoolKey(model, DIGEST, ParallelLayout(), h)) for h in chunk_hashes(tokens, CHUNK)]
    try:
        # Save 4 chunks the way the worker does: started -> batch_put_from -> finished.
        rep.transfer_started("req-save", "save", 4, 4 * BLOCK)
        codes = backend.batch_put_from(keys, [[base + i * BLOCK] for i in range(4)], [[BLOCK]] * 4)
        assert codes == [0, 0, 0, 0]
        rep.transfer_finished("req-save", "save", ok=True, nbytes=4 * BLOCK)

        # A lookup of a 6-chunk prompt: the pool holds 4 leading chunks (real batch_exists).
        prompt = tokens + list(range(10_000, 10_000 + 2 * CHUNK))
        lk_keys = [str(PoolKey(model, DIGEST, ParallelLayout(), h))
                   for h in chunk_hashes(prompt, CHUNK)]
        t0 = time.perf_counter()
        present = backend.batch_exists(lk_keys)
        latency = (time.perf_counter() - t0) * 1e3
        hit = 0
        for p in present:
            if p != 1:
                break
            hit += 1
        assert hit == 4
        rep.lookup("req-load", len(prompt), 0, hit * CHUNK, latency)

        # Load the 4 chunks into the second half of the buffer: real bytes, compared.
        rep.transfer_started("req-load", "load", 4, 4 * BLOCK)
        got = backend.batch_get_into(
            keys, [[base + (4 + i) * BLOCK] for i in range(4)], [[BLOCK]] * 4
        )
        assert got == [BLOCK] * 4
        assert ctypes.string_at(base, 4 * BLOCK) == ctypes.string_at(base + 4 * BLOCK, 4 * BLOCK)
        rep.loaded("req-load", hit * CHUNK)
        rep.transfer_finished("req-load", "load", ok=True, nbytes=4 * BLOCK)

        # A load after a positive lookup of a key that is gone: the real store answers -704.
        missing = str(PoolKey(model, DIGEST, ParallelLayout(), "f" * 32))
        rep.lookup("req-gone", CHUNK * 2, CHUNK, CHUNK, 0.5)
        rep.transfer_started("req-gone", "load", 1, BLOCK)
        (code,) = backend.batch_get_into([missing], [[base]], [[BLOCK]])
        assert code < 0
        rep.transfer_finished(
            "req-gone", "load", ok=False, nbytes=0, error_name=error_name(code),
            failed_blocks=1, after_hit=True,
        )
        rep.loaded("req-gone", 0, CHUNK)  # the scheduler's count: nothing of it loaded
        # A lookup the store could not answer.
        rep.lookup("req-err", 512, 0, 0, 2.0, error="RPC_FAIL: master unreachable")
        # Lookups not made: counted apart, by reason, never as lookups; their prompts count
        # (recomputed), as the failed lookup's does.
        rep.lookup("req-mm", 300, 0, 0, 0.0, skipped="MULTIMODAL")
        rep.lookup("req-open", 300, 0, 0, 0.0, skipped="BREAKER_OPEN")

        with FleetClient(hub_address) as client:
            st = _wait_state(
                client,
                src.agent_id,
                lambda s: s.lookup.lookups == 3 and s.lookup.lookup_skipped == 2
                and s.transfers.loads_failed == 1
                and s.pool is not None
                and s.pool.keys >= 4,
            )
        lk = st.lookup
        prompts = len(prompt) + 2 * CHUNK + 512 + 300 + 300
        assert lk.prompt_tokens == prompts
        assert lk.local_tokens == CHUNK
        # A hit is what was loaded; the failed load's tokens are counted apart.
        assert lk.loaded_tokens == 4 * CHUNK
        assert lk.load_failed_tokens == CHUNK
        assert abs(lk.hit_rate - 4 * CHUNK / prompts) < 1e-9
        assert abs(lk.hit_rate_1m - lk.hit_rate) < 1e-9
        assert lk.lookup_errors == 1
        assert lk.lookup_skipped == 2
        assert lk.skipped_by_reason == {"MULTIMODAL": 1, "BREAKER_OPEN": 1}
        assert 0 < lk.latency_ms_p50 <= lk.latency_ms_p99
        tr = st.transfers
        assert (tr.saves_finished, tr.saved_bytes) == (1, 4 * BLOCK)
        assert (tr.loads_finished, tr.loads_failed, tr.loaded_bytes) == (1, 1, 4 * BLOCK)
        assert tr.errors_by_name == {"OBJECT_NOT_FOUND": 1}
        assert tr.failed_after_hit == 1
        assert tr.load_bytes_per_s == 4 * BLOCK / 10
        assert st.in_flight == []
        names = [(e.where, e.name) for e in st.recent_errors]
        assert ("load", "OBJECT_NOT_FOUND") in names and ("lookup", "LOOKUP") in names
        # Pool stats come from the master's /metrics: our 4 keys of 16 KiB are in it.
        assert st.pool is not None and st.pool.healthy is True
        assert st.pool.used_bytes >= 4 * BLOCK and st.pool.total_bytes >= 64 << 20
        assert st.pool.lease_ttl_ms == agent_master.default_kv_lease_ttl_ms
        assert any(seg.total_bytes == 64 << 20 for seg in st.pool.segments)
        # Process stats from psutil.
        assert st.process.rss_bytes > 10 << 20 and st.process.threads > 1
        # The agent adds the versions it runs (issue 41: version skew) to its source.
        assert st.source == msgspec.structs.replace(src, versions=package_versions())
        assert st.source.versions["protocol"] == "2" and st.source.versions["kvpool"]
    finally:
        backend.remove_by_scope(model_pattern(model), dry_run=False, force=True)
        handle.stop()


def test_in_flight_layerwise_progress_and_lease_expiry(hub: FleetHub, hub_address: str) -> None:
    src = make_source("eng-b")
    handle = start_agent(src, address=hub_address, lease_ttl_ms=5_000)
    rep = handle.reporter
    try:
        t_lookup = time.time() * 1e3
        rep.lookup("r1", 1024, 0, 768, 1.0)
        t_lookup_end = time.time() * 1e3
        rep.transfer_started("r1", "load", 3, 3 * BLOCK, layers_total=32)
        rep.transfer_progress("r1", "load", 12)
        rep.transfer_started("r2", "save", 2, 2 * BLOCK, lease_expires_ms=123.0)
        with FleetClient(hub_address) as client:
            st = _wait_state(client, src.agent_id, lambda s: len(s.in_flight) == 2)
        by_req = {t.req_id: t for t in st.in_flight}
        load = by_req["r1"]
        assert (load.kind, load.blocks, load.bytes) == ("load", 3, 3 * BLOCK)
        assert (load.layers_done, load.layers_total) == (12, 32)
        # The lease of r1 runs from its lookup plus default_kv_lease_ttl.
        assert load.lease_expires_ms is not None
        assert t_lookup + 5_000 <= load.lease_expires_ms <= t_lookup_end + 5_000
        assert by_req["r2"].lease_expires_ms == 123.0
        rep.transfer_finished("r1", "load", ok=False, error_name=None, timed_out=True)
        st = handle.state()
        assert st.transfers.loads_timed_out == 1 and st.transfers.loads_failed == 1
        assert st.transfers.errors_by_name == {"TIMEOUT": 1}
        assert [t.req_id for t in st.in_flight] == ["r2"]
        # It lasted the timeout, not the pool's time: not the "slowest load".
        assert st.transfers.max_load_ms == 0.0
    finally:
        handle.stop()


def test_start_failure_reaches_the_hub_before_the_agent_stops(
        hub: FleetHub, hub_address: str) -> None:
    src = make_source("eng-f")
    handle = start_agent(src, address=hub_address)
    # Reported at once after start: the report waits for the hub connection.
    assert handle.report_start_failure("PortInUse", "lookup socket held by engine x (pid 7)",
                                       "give each engine its own lookup_rpc_port") is True
    assert not handle.enabled
    deadline = time.monotonic() + 10
    while (src.agent_id not in hub.fleet() or hub.fleet()[src.agent_id][0].start_failure is None
           ) and time.monotonic() < deadline:
        time.sleep(0.02)
    st = hub.fleet()[src.agent_id][0]
    assert st.start_failure is not None
    assert (st.start_failure.name, st.start_failure.message, st.start_failure.hint) == (
        "PortInUse", "lookup socket held by engine x (pid 7)",
        "give each engine its own lookup_rpc_port")
    # Without a hub there is nobody to tell: False, and it returns.
    lone = start_agent(make_source("eng-g"), address=None)
    assert lone.report_start_failure("X", "y", "z", timeout_s=0.1) is False


# Module-lifetime KV caches: memory registered with the Mooncake client must never be freed
# while the client lives (a new registration overlapping it would fail).
_ALIVE: list[object] = []


def test_kvpool_worker_saves_and_loads_are_reported(
    hub: FleetHub, hub_address: str, mooncake_backend: Any, model: str
) -> None:
    import torch

    from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadSpec, ReqMeta
    from kvpool_connector.worker import KVPoolWorker

    class _Settings:
        block_size = 16
        chunk_size = 32
        use_layerwise = False
        load_async = False
        layerwise_timeout_ms = 2_000
        save_budget_bytes = 64 << 20
        hash_algo = "sha256"
        checksum = False

    def caches() -> dict[str, torch.Tensor]:
        # vLLM's CPU layout: (num_blocks, kv_heads, block_size, 2 * head_size), 2 layers.
        kv = {f"layers.{i}": torch.zeros(16, 2, 16, 16, dtype=torch.float32) for i in range(2)}
        _ALIVE.append(kv)
        return kv

    src_kv, dst_kv = caches(), caches()
    for t in src_kv.values():
        t.uniform_()
    sources = {name: make_source(name, model=model) for name in ("eng-save", "eng-load")}
    agents = {
        name: start_agent(
            src,
            address=hub_address,
            operations=BackendOperations(mooncake_backend, src),
        )
        for name, src in sources.items()
    }
    workers = {}
    for name, kv in (("eng-save", src_kv), ("eng-load", dst_kv)):
        w = KVPoolWorker(
            _Settings(), ParallelLayout(), model, mooncake_backend,  # type: ignore[arg-type]
            agents[name].reporter,
        )
        w.register_kv_caches(kv)  # type: ignore[arg-type]
        _ALIVE.append(w)
        workers[name] = w
    try:
        hashes = chunk_hashes(list(range(69)), 32)  # 2 whole chunks = 4 blocks
        saver, loader = workers["eng-save"], workers["eng-load"]
        meta = KVPoolConnectorMetadata(requests=[ReqMeta(
            req_id="s1", block_ids=[0, 1, 2, 3], chunk_hashes=hashes, save_from_chunk=0,
            save_to_chunk=2, is_last_save=True)])
        saver.start_load_kv(meta)
        saver.wait_for_save(meta)
        assert saver.drain_saves(10)
        assert loader.lookup_chunks(hashes) == 2
        agents["eng-load"].reporter.lookup("l1", 69, 0, 64, 0.4)
        loader.start_load_kv(KVPoolConnectorMetadata(requests=[ReqMeta(
            req_id="l1", block_ids=[4, 5, 6, 7], chunk_hashes=hashes,
            load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=64, can_load=True))]))
        assert loader.get_block_ids_with_load_errors() == set()
        assert torch.equal(src_kv["layers.1"][0:4], dst_kv["layers.1"][4:8])
        # A load of chunks the lookup claimed but the pool does not hold: -704, recompute.
        gone = chunk_hashes(list(range(1000, 1069)), 32)
        loader.start_load_kv(KVPoolConnectorMetadata(requests=[ReqMeta(
            req_id="l2", block_ids=[8, 9, 10, 11], chunk_hashes=gone,
            load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=64, can_load=True))]))
        assert loader.get_block_ids_with_load_errors() == {8, 9, 10, 11}
        # The workers' outcomes go to the scheduler, which reports each load once.
        outcomes = loader.build_connector_worker_meta()
        assert outcomes is not None and outcomes.outcomes == {"l1": (64, 64), "l2": (64, 0)}
        for rid, (accepted, got) in outcomes.outcomes.items():
            agents["eng-load"].reporter.loaded(rid, got, accepted - got)

        block_bytes = 2 * 2 * 16 * 16 * 4  # both layers of one block
        with FleetClient(hub_address) as client:
            saved = _wait_state(client, "eng-save/dp0.tp0.pp0",
                                lambda s: s.transfers.saves_finished == 1)
            loaded = _wait_state(client, "eng-load/dp0.tp0.pp0",
                                 lambda s: s.transfers.loads_failed == 1)
        assert saved.transfers.saved_bytes == 4 * block_bytes
        assert saved.in_flight == [] and saved.transfers.saves_failed == 0
        tr = loaded.transfers
        assert (tr.loads_finished, tr.loads_failed, tr.failed_after_hit) == (1, 1, 1)
        assert tr.errors_by_name == {"OBJECT_NOT_FOUND": 1}
        assert tr.loaded_bytes >= 4 * block_bytes
        assert loaded.lookup.loaded_tokens == 64 and loaded.lookup.hit_rate == 64 / 69
        assert loaded.lookup.load_failed_tokens == 64
        (err,) = [e for e in loaded.recent_errors if e.req_id == "l2"]
        assert err.name == "OBJECT_NOT_FOUND" and "after a positive lookup" in err.message
        # Each worker reported the layout digest of its keys and what it hashes: one layout.
        assert saver.layout_facts is not None
        assert saved.source.layout_digest == loaded.source.layout_digest == saver.layout_digest
        assert saved.source.layout == loaded.source.layout == saver.layout_facts.as_dict()
        assert saved.source.layout["cache"] == "2x float32(B,2,16,16)/(*,256,16,1)"
        assert (saved.source.layout["block_size"], saved.source.layout["chunk_size"]) == (16, 32)
    finally:
        for w in workers.values():
            w.shutdown()
        for h in agents.values():
            h.stop()
        mooncake_backend.remove_by_scope(model_pattern(model), dry_run=False, force=True)
