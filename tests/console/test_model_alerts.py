"""View model and alert rules on fleet states built from the wire schema (no sockets)."""

from __future__ import annotations

import pytest
from fleetdata import GB, NOW_MS, engine, pool, sample_fleet

from kvpool_agent.protocol import PROTOCOL_VERSION, CommandReply, FlushResult
from kvpool_console.alerts import AlertTracker, evaluate
from kvpool_console.model import (
    FleetModel,
    build_view,
    fmt_bytes,
    fmt_lease,
    select_rows,
    sum_flush,
)


def _rules(alerts: list) -> set[tuple[str, str, str]]:
    return {(a.rule, a.severity, a.subject) for a in alerts}


def test_engine_rows_merge_scheduler_and_workers() -> None:
    fleet = engine("p0", tp=4, prompt=10_000, hits=4_000, hit_1m=0.5, loads=3, load_errors=2)
    view = build_view(fleet, {}, NOW_MS)
    (row,) = view.engines
    assert row.engine_id == "p0" and row.role == "prefill" and row.kv_role == "kv_producer"
    assert row.workers == 4 and row.ranks == "dp0 tp0-3 pp0" and len(row.agents) == 5
    assert row.agents[0].process_role == "scheduler"
    assert [a.ranks for a in row.agents[1:]] == [f"dp0.tp{r}.pp0" for r in range(4)]
    assert row.lookup_tokens == 10_000 and row.hit_tokens == 4_000 and row.hit_rate == 0.4
    assert row.hit_rate_1m == 0.5
    # The same 3 requests load on every TP rank: counted once per request.
    assert row.loads_in_flight == 3
    assert row.load_errors == 4 * 2
    assert row.segment_used_bytes == 6 * GB and row.segment_total_bytes == 10 * GB
    assert row.high_watermark == 0.9 and row.lease_ttl_ms == 11_000
    assert row.next_lease_expiry_ms == NOW_MS + 4_200
    assert row.age_ms == 300.0 and not row.stale and not row.down
    assert view.totals.engines == 1 and view.totals.agents == 5
    assert view.pools[0].reported_by == 5 and view.pools[0].keys == 1234


def test_staleness_from_last_seen() -> None:
    fleet = engine("a", age_ms=0) | engine("b", age_ms=0) | engine("c", age_ms=0)
    seen = {k: NOW_MS - (6_000 if s.source.engine_id == "b" else
                         40_000 if s.source.engine_id == "c" else 100)
            for k, s in fleet.items()}
    view = build_view(fleet, seen, NOW_MS)
    by = {r.engine_id: r for r in view.engines}
    assert (by["a"].stale, by["a"].down) == (False, False)
    assert (by["b"].stale, by["b"].down) == (True, False)
    assert (by["c"].stale, by["c"].down) == (True, True)
    assert view.totals.stale == 1 and view.totals.down == 1
    alerts = evaluate(fleet, seen, NOW_MS)
    assert ("stale", "warning", "b") in _rules(alerts)
    assert ("stale", "critical", "c") in _rules(alerts)
    assert not any(a.subject == "a" for a in alerts)


def test_every_alert_rule_fires_with_hint() -> None:
    alerts = evaluate(sample_fleet(), {}, NOW_MS)
    rules = _rules(alerts)
    assert rules == {
        ("backend_mismatch", "critical", "decode-1"),
        ("kv_role_mismatch", "critical", "decode-1"),
        ("lease_ttl", "critical", "prefill-1"),
        ("failed_after_hit", "warning", "prefill-1"),
        ("stale", "warning", "prefill-2"),
    }
    by = {a.rule: a for a in alerts}
    assert "default_kv_lease_ttl" in by["lease_ttl"].hint
    assert "12500 ms >= lease TTL 11000 ms" in by["lease_ttl"].message
    assert by["failed_after_hit"].hint.startswith("load started after the lookup's lease")
    assert "LEASE_EXPIRED 6" in by["failed_after_hit"].message
    assert "set kv_role to kv_consumer" in by["kv_role_mismatch"].hint
    assert "memcache differs from the fleet's mooncake" in by["backend_mismatch"].message
    # Critical first.
    assert [a.severity for a in alerts][:3] == ["critical"] * 3


def test_pool_lookup_and_backend_error_rules() -> None:
    full = pool(used=int(9.5 * GB), total=10 * GB)
    fleet = engine("e", pool_stats=full, lookup_errors=60, errors={"NO_AVAILABLE_HANDLE": 4})
    alerts = evaluate(fleet, {}, NOW_MS)
    by = {a.rule: a for a in alerts}
    assert by["pool_watermark"].severity == "warning"
    assert "95% used, over eviction_high_watermark_ratio 0.90" in by["pool_watermark"].message
    assert by["lookup_errors"].severity == "critical"  # 60 of 100 lookups failed
    assert "60 of 100 lookups failed; last: RPC_FAIL" in by["lookup_errors"].message
    assert by["backend_errors"].message == "backend errors: NO_AVAILABLE_HANDLE 8"
    assert "global_segment_size" in by["backend_errors"].hint
    # One pool alert although 3 agents report the same pool.
    assert sum(a.rule == "pool_watermark" for a in alerts) == 1
    crit = evaluate(engine("e", pool_stats=pool(used=int(9.9 * GB), total=10 * GB,
                                                healthy=False)), {}, NOW_MS)
    assert {(a.rule, a.severity) for a in crit} == {("pool_watermark", "critical"),
                                                    ("pool_unhealthy", "critical")}


def test_lease_ttl_warning_band() -> None:
    alerts = evaluate(engine("e", max_load_ms=9_000.0), {}, NOW_MS)
    assert _rules(alerts) == {("lease_ttl", "warning", "e")}
    assert evaluate(engine("e", max_load_ms=8_000.0), {}, NOW_MS) == []


def test_counter_alerts_retire_when_counters_stop() -> None:
    tracker = AlertTracker(window_ms=10_000)

    def step(fleet: dict, t: float) -> list[str]:
        seen = dict.fromkeys(fleet, t)  # reporting all along: never stale
        return [a.rule for a in tracker.update(evaluate(fleet, seen, t), t)]

    fleet = engine("e", lookup_errors=1, loads=0)
    assert step(fleet, NOW_MS) == ["lookup_errors"]
    assert [a.rule for a in tracker.new] == ["lookup_errors"]
    assert step(fleet, NOW_MS + 5_000) == ["lookup_errors"] and tracker.new == []
    assert step(fleet, NOW_MS + 11_000) == []
    assert step(engine("e", lookup_errors=2, loads=0), NOW_MS + 12_000) == ["lookup_errors"]


def test_filter_sort_and_faults_only() -> None:
    fleet = sample_fleet()
    view = build_view(fleet, {}, NOW_MS, alerts=evaluate(fleet, {}, NOW_MS))
    rows = view.engines
    assert [r.engine_id for r in select_rows(rows, sort="hit", reverse=True)][:3] == [
        "prefill-0", "prefill-1", "prefill-2"]
    assert [r.engine_id for r in select_rows(rows, text="DECODE")] == ["decode-0", "decode-1"]
    assert [r.engine_id for r in select_rows(rows, text="memcache")] == ["decode-1"]
    assert [r.engine_id for r in select_rows(rows, text="dp0.tp1")] == [
        "decode-0", "decode-1", "prefill-0", "prefill-1", "prefill-2"]
    assert [r.engine_id for r in select_rows(rows, faults_only=True)] == [
        "decode-1", "prefill-1", "prefill-2"]
    assert select_rows(rows, sort="errors", reverse=True)[0].engine_id == "prefill-1"
    with pytest.raises(ValueError, match="sort: 'bogus' is not one of engine"):
        select_rows(rows, sort="bogus")


def test_history_and_formatting() -> None:
    model = FleetModel(history=3)
    for i in range(5):
        model.sample(engine("e", hit_1m=i / 10, age_ms=0), {}, NOW_MS + i)
    assert list(model.hit_history["e"]) == [0.2, 0.3, 0.4]
    assert list(model.throughput_history["e"]) == [6 * (1 << 20)] * 3
    assert fmt_bytes(1536) == "1.5K" and fmt_bytes(512) == "512B" and fmt_bytes(3 * GB) == "3.0G"
    assert fmt_lease(None, NOW_MS) == "-" and fmt_lease(NOW_MS - 1, NOW_MS) == "EXPIRED"
    assert fmt_lease(NOW_MS + 4_200, NOW_MS) == "4.2s"


def _reply(agent: str, flush: FlushResult | None = None, error: str | None = None
           ) -> CommandReply:
    return CommandReply(v=PROTOCOL_VERSION, seq=1, request_id="r", agent_id=agent,
                        ok=error is None, error=error, flush=flush)


def test_sum_flush_adds_results_and_lists_errors() -> None:
    total, errors = sum_flush([
        _reply("a", FlushResult(dry_run=False, keys=5, bytes=500, removed_keys=4,
                                skipped_leased=1)),
        _reply("b", FlushResult(dry_run=True, keys=2, bytes=20)),
        _reply("c", error="timeout after 5000 ms"),
        _reply("d"),
    ])
    assert total == FlushResult(dry_run=False, keys=7, bytes=520, removed_keys=4,
                                skipped_leased=1)
    assert errors == ["c: timeout after 5000 ms", "d: no flush result"]
    assert sum_flush([_reply("c", error="unauthorised")]) == (None, ["c: unauthorised"])
