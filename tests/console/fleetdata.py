"""Deterministic fleet states built from the wire schema, for view-model and snapshot tests."""

from __future__ import annotations

from kvpool_agent.protocol import (
    EngineState,
    ErrorRecord,
    LookupStats,
    ModelReuse,
    PoolStats,
    ReuseView,
    SegmentUsage,
    Source,
    Transfer,
    TransferStats,
    WhatIfPoint,
)

NOW_MS = 1_780_000_000_000.0
"""Frozen wall clock of every fixture (epoch ms)."""

GB = 1 << 30


def pool(used: int = 6 * GB, total: int = 10 * GB, *, keys: int = 1234, ttl: int = 11_000,
         healthy: bool | None = True) -> PoolStats:
    return PoolStats(backend="mooncake", keys=keys, used_bytes=used, total_bytes=total,
                     evicted_keys=17, evicted_bytes=17 * 2 * 1024 * 1024, high_watermark=0.9,
                     lease_ttl_ms=ttl, healthy=healthy, health_detail="" if healthy else "RPC_FAIL",
                     disk_keys=40, disk_used_bytes=80 << 20, disk_total_bytes=1 << 30,
                     memory_hits=120, disk_hits=30, memory_hit_bytes=120 << 21,
                     disk_hit_bytes=30 << 21,
                     segments=[SegmentUsage(name="127.0.0.1:15001", used_bytes=used // 2,
                                            total_bytes=total // 2),
                               SegmentUsage(name="127.0.0.1:15002", used_bytes=used - used // 2,
                                            total_bytes=total - total // 2)])


def engine(engine_id: str, *, role: str = "prefill", kv_role: str | None = None, tp: int = 2,
           backend: str = "mooncake", prompt: int = 10_000, hits: int = 4_000,
           hit_1m: float = 0.5, loads: int = 1, load_errors: int = 0, failed_after_hit: int = 0,
           errors: dict[str, int] | None = None, max_load_ms: float = 120.0,
           lookup_errors: int = 0, age_ms: float = 300.0, pool_stats: PoolStats | None = None,
           model: str = "tiny-llama", misses: dict[str, int] | None = None,
           versions: dict[str, str] | None = None) -> dict[str, EngineState]:
    """One engine: a scheduler agent (lookups) and ``tp`` worker agents (transfers);
    ``misses``: its scheduler's miss tokens by reason (``prompt - hits`` of them);
    ``versions``: what every agent runs (``Source.versions``)."""
    kv = kv_role or {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": "kv_both"}[role]
    ts = NOW_MS - age_ms
    pool_stats = pool_stats if pool_stats is not None else pool()

    def src(agent: str, prole: str, rank: int = 0) -> Source:
        return Source(agent_id=f"{engine_id}/{agent}", engine_id=engine_id,
                      instance_role=role,  # type: ignore[arg-type]
                      kv_role=kv,  # type: ignore[arg-type]
                      process_role=prole, tp_rank=rank,  # type: ignore[arg-type]
                      pid=1000 + rank, host="node1", backend=backend, model=model,
                      versions=dict(versions or {}))

    out = {f"{engine_id}/scheduler": EngineState(
        source=src("scheduler", "scheduler"), started_ms=NOW_MS - 3_600_000, ts_ms=ts,
        lookup=LookupStats(lookups=100, lookup_errors=lookup_errors, prompt_tokens=prompt,
                           local_tokens=0, loaded_tokens=hits,
                           hit_rate=hits / prompt if prompt else 0.0, hit_rate_1m=hit_1m,
                           latency_ms_p50=0.8, latency_ms_p99=3.0,
                           miss_tokens=dict(misses or {})),
        pool=pool_stats,
        recent_errors=[ErrorRecord(ts_ms=ts - 2000, where="lookup", name="RPC_FAIL",
                                   message="master unreachable", code=-900)]
        if lookup_errors else [])}
    for r in range(tp):
        errs = dict(errors or {})
        out[f"{engine_id}/dp0.tp{r}.pp0"] = EngineState(
            source=src(f"dp0.tp{r}.pp0", "worker", r), started_ms=NOW_MS - 3_600_000, ts_ms=ts,
            transfers=TransferStats(loads_finished=50, loads_failed=load_errors,
                                    saves_finished=80, loaded_bytes=50 << 20,
                                    saved_bytes=80 << 20, load_bytes_per_s=2 << 20,
                                    save_bytes_per_s=1 << 20,
                                    failed_after_hit=failed_after_hit, max_load_ms=max_load_ms,
                                    errors_by_name=errs),
            in_flight=[Transfer(req_id=f"req-{engine_id}-{i}", kind="load", blocks=4,
                                bytes=8 << 20, started_ms=NOW_MS - 400, layers_done=12,
                                layers_total=32, lease_expires_ms=NOW_MS + 4_200)
                       for i in range(loads)],
            pool=pool_stats,
            recent_errors=[ErrorRecord(ts_ms=ts - 1000, where="load", name=n,
                                       message=f"{n} on block 3", code=-707)
                           for n in errs])
    return out


MISSES = {
    "prefill-0": {"not_in_pool": 30_000, "tail": 9_000, "not_loaded": 3_000},
    "prefill-1": {"not_in_pool": 24_000, "load_failed": 3_000, "tail": 3_000},
    "prefill-2": {"MULTIMODAL": 4_000, "not_in_pool": 2_000, "tail": 1_000},
}
"""``sample_fleet(misses=True)``'s miss tokens by engine: each adds up to prompt - hits."""


VERSIONS = {"kvpool": "0.1.0", "mooncake": "0.3.13", "protocol": "2", "vllm": "0.32.0"}
"""``sample_fleet(versions=True)``'s versions (the stale prefill-2 runs Mooncake 0.3.7)."""


def sample_fleet(*, misses: bool = False, versions: bool = False) -> dict[str, EngineState]:
    """Five engines: healthy P and D, one with failed loads after hits and a short lease TTL,
    one with the wrong kv_role and another backend, one stale; ``misses``: the prefill
    engines' schedulers report ``MISSES``; ``versions``: every agent reports ``VERSIONS``
    but prefill-2's, on an older Mooncake client."""
    m = MISSES if misses else {}
    v = VERSIONS if versions else None
    fleet: dict[str, EngineState] = {}
    fleet |= engine("prefill-0", role="prefill", prompt=120_000, hits=78_000, hit_1m=0.7,
                    misses=m.get("prefill-0"), versions=v)
    fleet |= engine("decode-0", role="decode", prompt=0, hits=0, hit_1m=0.0, loads=2,
                    versions=v)
    fleet |= engine("prefill-1", role="prefill", prompt=50_000, hits=20_000, hit_1m=0.4,
                    load_errors=3, failed_after_hit=3, errors={"LEASE_EXPIRED": 3},
                    max_load_ms=12_500.0, misses=m.get("prefill-1"), versions=v)
    fleet |= engine("decode-1", role="decode", kv_role="kv_producer", backend="memcache",
                    prompt=0, hits=0, hit_1m=0.0, loads=0, versions=v)
    fleet |= engine("prefill-2", role="prefill", prompt=8_000, hits=1_000, hit_1m=0.1,
                    age_ms=9_000, loads=0, misses=m.get("prefill-2"),
                    versions={**VERSIONS, "mooncake": "0.3.7"} if versions else None)
    return fleet


def sample_reuse() -> ReuseView:
    """The hub's reuse figures for ``sample_fleet(misses=True)``: tiny-llama's ceiling 68%
    over its 178,000 window tokens, its what-if at 0.25x..8x of 400,000 tokens, and the
    not_in_pool split of prefill-0 (2,000 tokens left unsplit) and prefill-1."""
    cap = 400_000
    curve = [(0.25, 0.21, 0.30), (0.5, 0.33, 0.44), (1.0, 0.45, 0.55), (2.0, 0.56, 0.63),
             (4.0, 0.64, 0.67), (8.0, 0.68, 0.68)]
    return ReuseView(
        ts_ms=NOW_MS - 2_000, accesses=5_200, chunks=180_000, prompt_tokens=178_000,
        ceiling_tokens=121_040,
        models=[ModelReuse(model="tiny-llama", chunk_size=256, prompt_tokens=178_000,
                           ceiling_tokens=121_040, pool_capacity_tokens=cap,
                           whatif_ms=NOW_MS - 30_000,
                           whatif=[WhatIfPoint(capacity_tokens=int(cap * f), lru_hit_rate=lru,
                                               min_hit_rate=mn) for f, lru, mn in curve])],
        not_in_pool={"prefill-0": {"evicted": 18_000, "never_saved": 10_000},
                     "prefill-1": {"other_digest": 16_000, "first_use": 5_000,
                                   "never_saved": 3_000}})
