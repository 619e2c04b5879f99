"""Deterministic fleet states built from the wire schema, for view-model and snapshot tests."""

from __future__ import annotations

from kvpool_agent.protocol import (
    EngineState,
    ErrorRecord,
    LookupStats,
    PoolStats,
    SegmentUsage,
    Source,
    Transfer,
    TransferStats,
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
           model: str = "tiny-llama") -> dict[str, EngineState]:
    """One engine: a scheduler agent (lookups) and ``tp`` worker agents (transfers)."""
    kv = kv_role or {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": "kv_both"}[role]
    ts = NOW_MS - age_ms
    pool_stats = pool_stats if pool_stats is not None else pool()

    def src(agent: str, prole: str, rank: int = 0) -> Source:
        return Source(agent_id=f"{engine_id}/{agent}", engine_id=engine_id,
                      instance_role=role,  # type: ignore[arg-type]
                      kv_role=kv,  # type: ignore[arg-type]
                      process_role=prole, tp_rank=rank,  # type: ignore[arg-type]
                      pid=1000 + rank, host="node1", backend=backend, model=model)

    out = {f"{engine_id}/scheduler": EngineState(
        source=src("scheduler", "scheduler"), started_ms=NOW_MS - 3_600_000, ts_ms=ts,
        lookup=LookupStats(lookups=100, lookup_errors=lookup_errors, prompt_tokens=prompt,
                           local_tokens=0, loaded_tokens=hits,
                           hit_rate=hits / prompt if prompt else 0.0, hit_rate_1m=hit_1m,
                           latency_ms_p50=0.8, latency_ms_p99=3.0),
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


def sample_fleet() -> dict[str, EngineState]:
    """Five engines: healthy P and D, one with failed loads after hits and a short lease TTL,
    one with the wrong kv_role and another backend, one stale."""
    fleet: dict[str, EngineState] = {}
    fleet |= engine("prefill-0", role="prefill", prompt=120_000, hits=78_000, hit_1m=0.7)
    fleet |= engine("decode-0", role="decode", prompt=0, hits=0, hit_1m=0.0, loads=2)
    fleet |= engine("prefill-1", role="prefill", prompt=50_000, hits=20_000, hit_1m=0.4,
                    load_errors=3, failed_after_hit=3, errors={"LEASE_EXPIRED": 3},
                    max_load_ms=12_500.0)
    fleet |= engine("decode-1", role="decode", kv_role="kv_producer", backend="memcache",
                    prompt=0, hits=0, hit_1m=0.0, loads=0)
    fleet |= engine("prefill-2", role="prefill", prompt=8_000, hits=1_000, hit_1m=0.1,
                    age_ms=9_000, loads=0)
    return fleet
