"""View model and alert rules on fleet states built from the wire schema (no sockets)."""

from __future__ import annotations

import pytest
from fleetdata import GB, NOW_MS, engine, pool, sample_fleet

from kvpool_agent.protocol import PROTOCOL_VERSION, CommandReply, FlushResult
from kvpool_console.alerts import AlertSettings, AlertTracker, evaluate
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
    assert row.prompt_tokens == 10_000 and row.loaded_tokens == 4_000 and row.hit_rate == 0.4
    assert row.hit_rate_1m == 0.5
    # The same 3 requests load on every TP rank: counted once per request.
    assert row.loads_in_flight == 3
    assert row.loads_failed == 4 * 2
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
    assert "slowest load 12.5 s >= lease TTL 11.0 s" in by["lease_ttl"].message
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


def test_request_level_token_split() -> None:
    """Prompt tokens split into local + loaded + recomputed, per engine and over the fleet;
    the local hit rate is local / prompt (the README's "Pool hit rate")."""
    fleet = {**engine("p0", prompt=10_000, hits=4_000), **engine("p1", prompt=2_000, hits=0)}
    sched = fleet["p0/scheduler"].lookup
    sched.local_tokens = 3_000
    view = build_view(fleet, {}, NOW_MS)
    p0, p1 = view.engines
    assert (p0.local_tokens, p0.loaded_tokens, p0.recomputed_tokens) == (3_000, 4_000, 3_000)
    assert p0.local_hit_rate == 0.3 and p0.hit_rate == 0.4
    assert (p1.local_tokens, p1.recomputed_tokens, p1.local_hit_rate) == (0, 2_000, 0.0)
    t = view.totals
    assert (t.local_tokens, t.loaded_tokens, t.recomputed_tokens) == (3_000, 4_000, 5_000)
    assert t.local_hit_rate == pytest.approx(3_000 / 12_000)
    assert t.local_tokens + t.loaded_tokens + t.recomputed_tokens == t.prompt_tokens


def test_pool_alerts_once_per_pool_with_engines_and_hysteresis() -> None:
    import msgspec

    def on_master(fleet: dict, used: float, healthy: bool | None = True,
                  evicted: int = 0) -> dict:
        # The master is down: no segments, every engine reports the same master address.
        p = pool(used=int(used * GB), total=10 * GB, healthy=healthy)
        p.segments = [] if healthy is False else p.segments
        p.evicted_keys = evicted
        return {k: msgspec.structs.replace(
            s, source=msgspec.structs.replace(s.source, master="127.0.0.1:50051"), pool=p)
            for k, s in fleet.items()}

    fleet = engine("a") | engine("b") | engine("c") | engine("d")
    down = evaluate(on_master(fleet, 5, healthy=False), {}, NOW_MS)
    sick = [a for a in down if a.rule == "pool_unhealthy"]
    assert len(sick) == 1 and sick[0].subject == "mooncake@127.0.0.1:50051"
    assert sick[0].message == ("pool health check failed: RPC_FAIL "
                               "(seen by engines a, b, c, d)")
    # Watermark 0.90, margin 0.05: raised above 0.90, kept down to 0.85, cleared below.
    tracker = AlertTracker()

    def marks(used: float, **kw: float) -> list[str]:
        states = on_master(fleet, used)
        got = tracker.update(evaluate(states, dict.fromkeys(states, NOW_MS), NOW_MS,
                                      AlertSettings(**kw), active=tracker.active_keys), NOW_MS)
        return [a.message for a in got if a.rule == "pool_watermark"]

    assert marks(8.8) == []
    (msg,) = marks(9.2)
    assert msg == ("pool 92% used, over eviction_high_watermark_ratio 0.90 "
                   "(9878424780/10737418240 B; engines a, b, c, d)")
    # Held by the margin: the message says so, and where it clears.
    assert marks(8.6) == [
        "pool 86% used, back under eviction_high_watermark_ratio 0.90, alert clears below "
        "0.85 (9234179686/10737418240 B; engines a, b, c, d)"]
    assert marks(8.4) == []
    assert marks(8.8) == []
    # Both are the console's settings.
    assert len(marks(8.8, watermark_ratio=0.8, watermark_margin=0.1)) == 1
    assert len(marks(7.1, watermark_ratio=0.8, watermark_margin=0.1)) == 1
    assert marks(6.9, watermark_ratio=0.8, watermark_margin=0.1) == []
    # A pool that evicted has been over its watermark: held inside the margin without history,
    # as a one-shot `status` evaluates it.
    held = on_master(fleet, 8.6, evicted=5)
    assert [a.message for a in evaluate(held, {}, NOW_MS) if a.rule == "pool_watermark"] == [
        "pool 86% used, back under eviction_high_watermark_ratio 0.90, alert clears below "
        "0.85 (9234179686/10737418240 B; engines a, b, c, d)"]
    assert not [a for a in evaluate(on_master(fleet, 8.4, evicted=5), {}, NOW_MS)
                if a.rule == "pool_watermark"]


def test_start_failure_topology_and_stuck_rules() -> None:
    import msgspec

    from kvpool_agent.protocol import StartFailure, Transfer

    fleet = engine("p0")
    w = fleet["p0/dp0.tp0.pp0"]
    w.start_failure = StartFailure(ts_ms=NOW_MS - 60_000, name="PortInUse",
                                   message="lookup socket held by engine x (pid 7)",
                                   hint="give each engine its own lookup_rpc_port")
    alerts = evaluate(fleet, {}, NOW_MS + 120_000)  # long silent: FAILED, not down
    assert [(a.rule, a.message, a.hint) for a in alerts] == [(
        "start_failed", "failed to start (p0/dp0.tp0.pp0): PortInUse: lookup socket held by "
        "engine x (pid 7)", "give each engine its own lookup_rpc_port")]
    view = build_view(fleet, {}, NOW_MS + 120_000, alerts=alerts)
    row = view.engines[0]
    assert row.state == "FAILED" and row.failed.startswith("PortInUse: lookup socket")
    from kvpool_console.cli import status_document

    (doc,) = status_document(view)["engines"]
    assert (doc["state"], doc["failed"], doc["failed_hint"]) == (
        "FAILED", "PortInUse: lookup socket held by engine x (pid 7)",
        "give each engine its own lookup_rpc_port")

    # A prefill that loads and never saves; a decode that saves and never loads.
    fleet = engine("p1", role="prefill", kv_role="kv_both") | engine("d1", role="decode")
    for k, s in fleet.items():
        if k.startswith("p1/"):
            s.transfers.saves_finished = 0
        else:
            s.transfers.loads_finished = 0
    by = {(a.rule, a.subject): a for a in evaluate(fleet, {}, NOW_MS)}
    assert by[("role_topology", "p1")].message == (
        "prefill instance loaded 100 times and never saved")
    assert by[("role_topology", "d1")].message == "decode instance saved 160 times and never loaded"
    assert ("kv_role_mismatch", "p1") in by
    # A kv_producer that loaded whole prompts from the pool and had nothing to save is fine.
    fleet = engine("p3", role="prefill")
    for s in fleet.values():
        s.transfers.saves_finished = 0
    assert not [a for a in evaluate(fleet, {}, NOW_MS) if a.rule == "role_topology"]

    # A consumer with many lookups and no hits while a producer of its model saves.
    fleet = engine("p2") | engine("d2", role="decode", hits=0)
    (a,) = [a for a in evaluate(fleet, {}, NOW_MS) if a.rule == "role_topology"]
    assert a.subject == "d2" and a.message == (
        "0% pool hits over 100 lookups while producers of tiny-llama save (p2)")
    assert "key namespaces" in a.hint

    # A save in flight 2x longer than its bytes take at the agent's save rate (1 MiB/s), and
    # past the floor, names the transfer, its age, the threshold and the owner.
    fleet = engine("s0", loads=0)
    fleet["s0/dp0.tp1.pp0"].in_flight = [Transfer(
        req_id="req-9", kind="save", blocks=3, bytes=256 << 10, started_ms=NOW_MS - 18_200)]
    (a,) = evaluate(fleet, {}, NOW_MS)
    assert a.rule == "stuck_transfer" and a.subject == "s0"
    assert a.message == (
        "save of req-9 on s0/dp0.tp1.pp0 in flight 18.2 s (> 2.5 s: floor; 250 ms expected at "
        "1.0 MB/s; 3 blocks); likely owner: the store process holding the segments "
        "(127.0.0.1:15001, 127.0.0.1:15002) or the master")
    assert evaluate(fleet, {}, NOW_MS, AlertSettings(stuck_after_ms=20_000)) == []
    # A big save is stuck only past 2x its expected 12 s.
    fleet["s0/dp0.tp1.pp0"].in_flight[0].bytes = 12 << 20
    assert evaluate(fleet, {}, NOW_MS) == []
    (a,) = evaluate(fleet, dict.fromkeys(fleet, NOW_MS + 6_000), NOW_MS + 6_000)
    assert "in flight 24.2 s (> 24.0 s: 2x the 12.0 s expected at 1.0 MB/s; 3 blocks)" in \
        a.message
    fleet = {k: msgspec.structs.replace(s, pool=pool(healthy=False)) for k, s in fleet.items()}
    stuck = [a for a in evaluate(fleet, dict.fromkeys(fleet, NOW_MS + 6_000), NOW_MS + 6_000)
             if a.rule == "stuck_transfer"]
    assert "likely owner: master the master (pool health check failing: RPC_FAIL)" in \
        stuck[0].message


def test_namespace_split_and_lookup_hint() -> None:
    import msgspec

    def described(fleet: dict, model: str, chunk: int) -> dict:
        layout = {"model": model, "dtype": "float16", "block_size": 16, "chunk_size": chunk}
        return {k: msgspec.structs.replace(s, source=msgspec.structs.replace(
            s.source, model=model, layout_digest=f"d{chunk}{model[-1]}", layout=layout))
            for k, s in fleet.items()}

    fleet = described(engine("a"), "m1", 256) | described(engine("b"), "m1", 512) | \
        described(engine("c"), "m1", 512)
    (a,) = [a for a in evaluate(fleet, {}, NOW_MS) if a.rule == "namespace_split"]
    assert a.subject == "m1" and a.message == (
        "engines of m1 use 2 key namespaces (d5121: b, c; d2561: a): no shared hits: "
        "chunk_size 512 vs 256")
    row = build_view(fleet, {}, NOW_MS).engines[0]
    assert row.namespace == "m1 @d2561 chunk 256 block 16"
    fleet = described(engine("a"), "m1", 512) | described(engine("b"), "m2", 512)
    (a,) = [a for a in evaluate(fleet, {}, NOW_MS) if a.rule == "namespace_split"]
    assert a.subject == "m1/m2" and "no shared hits: model m1 vs m2" in a.message
    assert "--served-model-name" in a.hint
    # Lookups failing while the pool is unhealthy: the pool is named, not the lookup port.
    sick = engine("e", lookup_errors=5, pool_stats=pool(healthy=False))
    (lk,) = [a for a in evaluate(sick, {}, NOW_MS) if a.rule == "lookup_errors"]
    assert lk.hint.startswith("the pool is unhealthy (see pool_unhealthy): master unreachable")


def test_namespace_split_says_why_an_engine_keeps_per_rank_values() -> None:
    import msgspec

    from kvpool_connector._heads import plan_shares

    why = plan_shares(8, 0, 2, dcp_size=2)
    assert isinstance(why, str)

    def described(fleet: dict, digest: str, **layout: str | int) -> dict:
        facts = {"model": "m", "dtype": "float16", "block_size": 16, **layout}
        return {k: msgspec.structs.replace(s, source=msgspec.structs.replace(
            s.source, model="m", layout_digest=digest, layout=facts))
            for k, s in fleet.items()}

    fleet = described(engine("a"), "d1", tp=1, kv_share="8x1h") | described(
        engine("b"), "d1", tp=1, kv_share="8x1h") | described(engine("c"), "d2", tp=2,
                                                              dcp=2, kv_share=why)
    (a,) = [a for a in evaluate(fleet, {}, NOW_MS) if a.rule == "namespace_split"]
    assert a.message.endswith(
        "no shared hits: dcp - vs 2; kv_share 8x1h vs per-rank: PCP 1 / DCP 2 split the "
        "tokens, not the heads; tp 1 vs 2")


def test_every_mooncake_error_has_a_fix_and_health_rows_show_checks() -> None:
    from kvpool_agent.protocol import HealthCheck, HealthResult
    from kvpool_agent.vocabulary import HINTS, ErrorCode
    from kvpool_console.model import health_rows

    assert all(len(HINTS[c.name]) > 30 for c in ErrorCode)
    reply = CommandReply(v=PROTOCOL_VERSION, seq=1, request_id="r", agent_id="e/dp0.tp0.pp0",
                         ok=False, health=HealthResult(checks=[
                             HealthCheck(name="master", ok=False, latency_ms=1.5,
                                         detail="master unreachable: connection refused"),
                             HealthCheck(name="probe_put", ok=False, latency_ms=3.0,
                                         detail="RPC_FAIL", code=-900)]))
    assert health_rows([reply, _reply("a", error="timeout after 5000 ms"), _reply("b")]) == [
        ("a", "reply", False, "", "timeout after 5000 ms"),
        ("b", "reply", False, "", "agent sent no health result"),
        ("e/dp0.tp0.pp0", "master", False, "1.5", "master unreachable: connection refused"),
        ("e/dp0.tp0.pp0", "probe_put", False, "3.0", "RPC_FAIL (code -900)"),
    ]


def test_agent_rows_on_request_and_totals_kept_for_engines_without_reports() -> None:
    import msgspec

    fleet = sample_fleet()
    alerts = evaluate(fleet, {}, NOW_MS)
    full = build_view(fleet, {}, NOW_MS, alerts=alerts)
    lean = build_view(fleet, {}, NOW_MS, alerts=alerts, agent_rows_for={"decode-1"})
    for f, lr in zip(full.engines, lean.engines, strict=True):
        assert lr.agent_ids == [a.agent_id for a in f.agents]
        assert lr.agents == (f.agents if f.engine_id == "decode-1" else [])
        assert msgspec.structs.replace(lr, agents=f.agents) == f
    assert lean.totals == full.totals and lean.pools == full.pools
    # The filter still finds an engine by one of its agents' ids.
    assert [r.engine_id for r in select_rows(lean.engines, text="decode-1/dp0.tp1")] == [
        "decode-1"]
    # FleetModel: an engine with no new report keeps its totals and is aged; one whose
    # worker reported is summed again; agent rows of any engine come from the last sample.
    model = FleetModel()
    model.sample(fleet, {}, NOW_MS, alerts, agent_rows_for=())
    later = dict(fleet)
    w = later["prefill-0/dp0.tp1.pp0"]
    later["prefill-0/dp0.tp1.pp0"] = msgspec.structs.replace(
        w, ts_ms=NOW_MS + 500, transfers=msgspec.structs.replace(
            w.transfers, loads_failed=w.transfers.loads_failed + 5))
    seen = {k: NOW_MS + 500 if k == "prefill-0/dp0.tp1.pp0" else s.ts_ms
            for k, s in later.items()}
    view = model.sample(later, seen, NOW_MS + 1_000, alerts, agent_rows_for=())
    fresh = build_view(later, seen, NOW_MS + 1_000, alerts=alerts, agent_rows_for=())
    assert view.engines == fresh.engines
    rows = {r.engine_id: r for r in view.engines}
    assert rows["prefill-0"].loads_failed == 5 and rows["prefill-0"].age_ms == 500.0
    assert rows["decode-0"].age_ms == 1_300.0
    assert model.agent_rows("prefill-0") == build_view(later, seen, NOW_MS + 1_000).engines[
        [r.engine_id for r in view.engines].index("prefill-0")].agents
    assert model.agent_rows("nope") == []


def test_weights_versions_and_an_unshared_identity_are_named() -> None:
    import msgspec

    def described(fleet: dict, digest: str, fingerprint: str) -> dict:
        facts = {"model": "m", "dtype": "bfloat16", "block_size": 16,
                 "fingerprint": fingerprint}
        return {k: msgspec.structs.replace(s, source=msgspec.structs.replace(
            s.source, model="m", layout_digest=digest, layout=facts))
            for k, s in fleet.items()}

    v1, v2 = "safetensors:" + "1" * 32, "safetensors:" + "2" * 32
    # A rolling update: two engines on v2, one still on v1; only the weights differ.
    fleet = described(engine("a"), "d1", v1) | described(engine("b"), "d2", v2) | described(
        engine("c"), "d2", v2)
    alerts = evaluate(fleet, {}, NOW_MS)
    assert not [a for a in alerts if a.rule == "namespace_split"]
    (a,) = [a for a in alerts if a.rule == "model_versions"]
    assert (a.subject, a.severity) == ("m", "info")  # a rolling update: no action yet
    assert a.message == (f"engines of m run on 2 versions of its weights ({v2}: b, c; {v1}: a): "
                         "engines of different versions never share")
    assert "rolling update" in a.hint and "kvpool-config fingerprint" in a.hint
    # Weights and another fact differ: a namespace split naming both, not a version.
    other = described(engine("a"), "d1", v1) | {
        k: msgspec.structs.replace(s, source=msgspec.structs.replace(
            s.source, layout={**s.source.layout, "block_size": 32}))
        for k, s in described(engine("b"), "d2", v2).items()}
    rules = {a.rule for a in evaluate(other, {}, NOW_MS)}
    assert "namespace_split" in rules and "model_versions" not in rules
    # An engine without a content identity shares with nobody: a warning naming the fix.
    lone = described(engine("x"), "d3", "unshared:" + "3" * 32) | described(engine("y"), "d1",
                                                                           v1)
    (u,) = [a for a in evaluate(lone, {}, NOW_MS) if a.rule == "unshared_identity"]
    assert u.subject == "x" and "model_fingerprint" in u.hint
    assert not [a for a in evaluate(fleet, {}, NOW_MS) if a.rule == "unshared_identity"]
