"""The stateless alert rules: :func:`evaluate` turns one fleet sample into alerts (pool rules
once per pool, then per engine). What needs memory across samples (pauses, eviction episodes,
failovers, counter retirement) is :class:`~kvpool_console.alerts.model.AlertModel`'s."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping

import msgspec

from kvpool_agent.protocol import (
    EngineState,
    ErrorRecord,
    PoolStats,
    Source,
)
from kvpool_agent.vocabulary import HINTS, INSTANCE_ROLE_OF, KV_ROLE_FOR
from kvpool_console.alerts.adapters import adapter_alerts
from kvpool_console.alerts.alert import (
    AFTER_HIT,
    Alert,
    Severity,
    alert_order,
    engines_text,
    fmt_ms,
    make_alert,
    pool_name,
)
from kvpool_console.alerts.pauses import cleared, store_explained, store_pause_text
from kvpool_console.alerts.policy import policy_alerts
from kvpool_console.alerts.segments import no_segments_hint, segment_alerts
from kvpool_console.alerts.settings import AlertSettings
from kvpool_console.alerts.silence import silence_alert
from kvpool_console.alerts.stalls import outlived, stalled_pools, stuck_alerts
from kvpool_console.alerts.versions import version_alerts

__all__ = ["evaluate"]

_CRITICAL_USAGE = 0.98
"""Pool usage fraction at which new saves start failing with NO_AVAILABLE_HANDLE."""

_TOPOLOGY_MIN_LOOKUPS = 20
"""Lookups a consumer makes before "0% hits while producers save" is a finding, not chance."""


def _by_engine(states: Mapping[str, EngineState]) -> dict[str, list[EngineState]]:
    out: dict[str, list[EngineState]] = {}
    for st in states.values():
        out.setdefault(st.source.engine_id, []).append(st)
    return out


_DISK_HINT = (
    "Mooncake's file_per_key offload ignores MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES (it fills "
    "90% of its filesystem): use bucket_storage_backend with MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_"
    "SIZE and _MAX_PHYSICAL_BYTES at the limit (kvpool-config checks it; docs: pool memory)")


def _pool_alerts(states: Mapping[str, EngineState], now_ms: float, *,
                 watermark_ratio: float | None, watermark_margin: float,
                 active: Collection[str]) -> list[Alert]:
    # Every agent of a fleet reports the same shared pool: one alert per pool, naming the
    # engines that see it, not one per agent or engine.
    pools: dict[str, EngineState] = {}
    engines: dict[str, set[str]] = {}
    unhealthy: dict[str, set[str]] = {}
    for st in states.values():
        p = st.pool
        if p is None:
            continue
        name = pool_name(st)
        engines.setdefault(name, set()).add(st.source.engine_id)
        if p.healthy is False:
            unhealthy.setdefault(name, set()).add(st.source.engine_id)
        prev = pools.get(name)
        if prev is None or st.ts_ms > prev.ts_ms:
            pools[name] = st
    out: list[Alert] = []
    for name, st in sorted(pools.items()):
        p = st.pool
        assert p is not None
        seen_by = f"engines {engines_text(engines[name])}"
        if p.total_bytes > 0:
            frac = p.used_bytes / p.total_bytes
            ratio = watermark_ratio if watermark_ratio is not None else p.high_watermark
            key = f"pool_watermark:{name}"
            # Hysteresis: raised above the ratio, held until usage drops below ratio - margin.
            # A pool that evicted has been over its watermark: the one-shot holds it as the
            # TUI (which saw it raised) does.
            held = key in active or p.evicted_keys > 0
            if frac > ratio or (held and frac > ratio - watermark_margin):
                sev: Severity = "critical" if frac >= _CRITICAL_USAGE else "warning"
                where = (f"over eviction_high_watermark_ratio {ratio:.2f}" if frac > ratio
                         else f"back under eviction_high_watermark_ratio {ratio:.2f}, alert "
                         f"clears below {ratio - watermark_margin:.2f}")
                out.append(make_alert(
                    "pool_watermark", sev, name,
                    f"pool {frac:.0%} used, {where} ({p.used_bytes}/{p.total_bytes} B; "
                    f"{seen_by})",
                    "eviction is running; if hit rate drops, add segment memory "
                    "(global_segment_size) or more segments", now_ms))
        if p.disk_total_bytes and p.disk_used_bytes > p.disk_total_bytes:
            out.append(make_alert(
                "disk_over_limit", "warning", name,
                f"the SSD tier holds {p.disk_used_bytes} B, over its "
                f"{p.disk_total_bytes} B limit ({seen_by})", _DISK_HINT, now_ms))
        out.extend(_master_alerts(name, p, seen_by, now_ms))
        if name in unhealthy:
            sick = [s for s in states.values() if s.pool is not None and s.pool.healthy is False
                    and pool_name(s) == name]
            detail = max(sick, key=lambda s: s.ts_ms).pool.health_detail  # type: ignore[union-attr]
            out.append(make_alert("pool_unhealthy", "critical", name,
                                  f"pool health check failed: {detail or 'unhealthy'} "
                                  f"(seen by engines {engines_text(unhealthy[name])})",
                                  HINTS["RPC_FAIL"], now_ms))
    return out


_ELECTION_HINT = (
    "a failover takes about 10 s (the dead leader's etcd lease expiring, then the new leader's "
    "5 s warm-up); if it lasts, check etcd (--etcd_endpoints) and that a standby "
    "mooncake_master runs with --enable_ha")


def _master_alerts(name: str, p: PoolStats, seen_by: str, now_ms: float) -> list[Alert]:
    """``no_leader`` when no master of an HA pool serves; ``master_behind`` for each master
    that does not answer or has not seen the serving leader's election (an older
    ``view_version`` or another leader), read from the masters' ``/health``."""
    if not p.masters:
        return []
    leaders = [m for m in p.masters if m.serving]
    if not leaders:
        states = ", ".join(f"{m.admin_url} {m.role or 'unreachable'}"
                           f"{'/' + m.ha_state if m.ha_state else ''}" for m in p.masters)
        return [make_alert("no_leader", "critical", name,
                           f"no master of the HA pool leads and serves ({states}; {seen_by}): "
                           "lookups and saves fail until one does", _ELECTION_HINT, now_ms)]
    lead = leaders[0]
    out = []
    for m in p.masters:
        if m.serving:
            continue
        if not m.reachable:
            why = f"does not answer /health ({m.error or 'no answer'})"
            hint = ("restart it with --enable_ha --enable_oplog and the pool's "
                    "--etcd_endpoints: until then the pool has no standby for this master")
        elif m.view_version < lead.view_version or m.leader_address != lead.leader_address:
            why = (f"has seen election view {m.view_version} (leader "
                   f"{m.leader_address or 'none'}), the leader view {lead.view_version} "
                   f"({lead.leader_address})")
            hint = ("it does not follow the current leader: check its --etcd_endpoints and "
                    "its connection to etcd; restart it if it stays behind")
        else:
            continue
        out.append(make_alert("master_behind", "warning", f"{name} {m.admin_url}",
                              f"master {m.admin_url} of pool {name} {why}", hint, now_ms))
    return out


def _lookup_hint(group: list[EngineState]) -> str:
    # A lookup waits on the pool: when the pool's health check fails, that is the cause, not
    # the lookup socket.
    if any(s.pool is not None and s.pool.healthy is False for s in group):
        return "the pool is unhealthy (see pool_unhealthy): " + HINTS["RPC_FAIL"]
    last = [e for s in group for e in s.recent_errors if e.where == "lookup"]
    if last and last[-1].message.startswith("no reply from the lookup server"):
        return ("worker rank 0 did not answer the lookup: check that it runs and is not "
                "stalled (`kvpool-console health`), then that scheduler and worker use the "
                "same lookup_rpc_port")
    return HINTS["LOOKUP"]


def _role_alerts(engine_id: str, group: list[EngineState], producers_saving: Mapping[str, set[str]],
                 now_ms: float) -> list[Alert]:
    out: list[Alert] = []
    for s in group:
        want = KV_ROLE_FOR.get(s.source.instance_role)
        if want is not None and s.source.kv_role != want:
            by = (f" (role declared by {s.source.role_source})" if s.source.role_source else "")
            out.append(make_alert(
                "kv_role_mismatch", "critical", engine_id,
                f"{s.source.instance_role} instance{by} runs kv_role {s.source.kv_role}",
                f"set kv_role to {want} for {s.source.instance_role} instances (or correct the "
                "declared role if the instance really is "
                f"{INSTANCE_ROLE_OF[s.source.kv_role]})", now_ms))
            break
    head = group[0].source
    loads = saves = saved = lookups = prompt = hits = 0
    for s in group:  # one pass: this runs for every engine on every console refresh
        t, lk = s.transfers, s.lookup
        loads += t.loads_finished + t.loads_failed
        saves += t.saves_finished + t.saves_failed + t.saves_skipped
        saved += t.saves_finished
        lookups += lk.lookups
        prompt += lk.prompt_tokens
        hits += lk.loaded_tokens
    # A kv_producer loads too (a prompt the pool holds whole needs no save); the rule is
    # for a prefill that runs as a loader.
    if head.instance_role == "prefill" and head.kv_role != "kv_producer" and loads and not saves:
        out.append(make_alert(
            "role_topology", "warning", engine_id,
            f"prefill instance loaded {loads} times and never saved",
            "a prefill instance saves for its decode instances: check its kv_role "
            "(kv_producer) and its declared role", now_ms))
    elif head.instance_role == "decode" and saved and not loads:
        out.append(make_alert(
            "role_topology", "warning", engine_id,
            f"decode instance saved {saved} times and never loaded",
            "a decode instance loads what prefill saved: use kv_role kv_consumer with "
            "consumer_is_to_load, and consumer_is_to_put only if it should save", now_ms))
    others = producers_saving.get(head.model, set()) - {engine_id}
    if (head.kv_role == "kv_consumer" and lookups >= _TOPOLOGY_MIN_LOOKUPS and prompt
            and not hits and others):
        out.append(make_alert(
            "role_topology", "warning", engine_id,
            f"0% pool hits over {lookups} lookups while producers of {head.model} save "
            f"({engines_text(others)})",
            "their keys never meet: compare the key namespaces (model name, layout digest, "
            "chunk_size, block_size) of this engine and the producers in `kvpool-console "
            "status`", now_ms))
    return out


def _in_flight_ttl(engine_id: str, group: list[EngineState], ttl: int,
                   last_seen_ms: Mapping[str, float], now_ms: float, out: list[Alert],
                   stalled: frozenset[str]) -> None:
    """A load still in flight past the lease TTL is ``lease_ttl`` (critical) as soon as it
    passes it: the first alert of a TTL below the load time, before the load fails and long
    before a stuck transfer's floor (``STUCK_FLOOR_MS``). Replaces the warning of the same
    engine; a critical one from ended loads already says it. Not on a pool whose store
    stalled (``stalled``, ``stalls.stalled_pools``: a save stuck, or an agent's open
    ``store_stalled`` window): its store stopped answering, and ``stuck_transfer`` names
    it."""
    as_of = {s.source.agent_id: min(now_ms, last_seen_ms.get(s.source.agent_id, s.ts_ms))
             for s in group}
    late = [(as_of[s.source.agent_id] - t.started_ms, t, s) for s in group
            if s.source.master not in stalled
            for t in s.in_flight if outlived(t, s, as_of[s.source.agent_id], ttl)]
    if not late or any(a.rule == "lease_ttl" and a.severity == "critical" for a in out):
        return
    out[:] = [a for a in out if a.rule != "lease_ttl"]
    age, t, s = max(late, key=lambda x: x[0])
    more = f"; {len(late) - 1} more loads past it" if len(late) > 1 else ""
    out.append(make_alert(
        "lease_ttl", "critical", engine_id,
        f"load of {t.req_id} on {s.source.agent_id} in flight {fmt_ms(age)} >= lease TTL "
        f"{fmt_ms(ttl)} (default_kv_lease_ttl): its lease ran out before it ended{more}",
        HINTS["LEASE_EXPIRED"], now_ms))


def _retired(group: list[EngineState], cutoff_ms: float,
             match: Callable[[ErrorRecord], bool]) -> bool:
    """True when the agents recorded errors ``match`` selects and the newest is older than
    ``cutoff_ms``; False also when none is recorded (nothing says how old the counter is)."""
    newest = max((e.ts_ms for s in group for e in s.recent_errors if match(e)), default=None)
    return newest is not None and newest < cutoff_ms


def _engine_alerts(engine_id: str, group: list[EngineState], majority_backend: str | None,
                   now_ms: float, window_ms: float,
                   last_seen_ms: Mapping[str, float], stalled: frozenset[str]) -> list[Alert]:
    out: list[Alert] = []
    cutoff = now_ms - window_ms
    # One pass over the agents (this runs for every engine on every console refresh).
    failed_after_hit = loads_total = lookups = lookup_errors = skipped = 0
    max_load = 0.0
    ttl = 0
    errors: dict[str, int] = {}
    backends: set[str] = set()
    for s in group:
        tr, lk = s.transfers, s.lookup
        failed_after_hit += tr.failed_after_hit
        loads_total += tr.loads_finished + tr.loads_failed
        skipped += tr.saves_skipped
        max_load = max(max_load, tr.max_load_ms)
        for n, c in tr.errors_by_name.items():
            errors[n] = errors.get(n, 0) + c
        lookups += lk.lookups
        lookup_errors += lk.lookup_errors
        if s.pool is not None and s.pool.lease_ttl_ms > 0:
            ttl = s.pool.lease_ttl_ms if not ttl else min(ttl, s.pool.lease_ttl_ms)
        if s.source.backend:
            backends.add(s.source.backend)
    if failed_after_hit and not _retired(group, cutoff, lambda e: e.where == "load"
                                         and e.name in AFTER_HIT):
        cause = max(AFTER_HIT, key=lambda n: errors.get(n, 0))
        sev: Severity = "critical" if loads_total and failed_after_hit * 2 >= loads_total \
            else "warning"
        out.append(make_alert(
            "failed_after_hit", sev, engine_id,
            f"{failed_after_hit} loads failed after a positive lookup "
            f"(LEASE_EXPIRED {errors.get('LEASE_EXPIRED', 0)}, "
            f"OBJECT_NOT_FOUND {errors.get('OBJECT_NOT_FOUND', 0)})",
            HINTS[cause], now_ms))
    if ttl and max_load > 0:
        if max_load >= ttl:
            out.append(make_alert("lease_ttl", "critical", engine_id,
                                  f"slowest load {fmt_ms(max_load)} >= lease TTL {fmt_ms(ttl)} "
                                  "(default_kv_lease_ttl)", HINTS["LEASE_EXPIRED"], now_ms))
        elif max_load >= 0.8 * ttl:
            out.append(make_alert("lease_ttl", "warning", engine_id,
                                  f"slowest load {fmt_ms(max_load)} is within 20% of lease TTL "
                                  f"{fmt_ms(ttl)} (default_kv_lease_ttl)", HINTS["LEASE_EXPIRED"],
                                  now_ms))
    _in_flight_ttl(engine_id, group, ttl, last_seen_ms, now_ms, out, stalled)
    if lookup_errors and not _retired(group, cutoff, lambda e: e.where == "lookup"):
        sev = "critical" if lookups and lookup_errors * 2 >= lookups else "warning"
        last = [e for s in group for e in s.recent_errors if e.where == "lookup"]
        detail = f"; last: {last[-1].name}: {last[-1].message}" if last else ""
        out.append(make_alert("lookup_errors", sev, engine_id,
                              f"{lookup_errors} of {lookups} lookups failed{detail}",
                              _lookup_hint(group), now_ms))
    other = {n: c for n, c in errors.items() if n not in AFTER_HIT or not failed_after_hit}
    if skipped and "NO_AVAILABLE_HANDLE" not in other:
        other["NO_AVAILABLE_HANDLE"] = skipped
    # Errors of a store pause (a frozen or dead store: timeouts, NO_AVAILABLE_HANDLE, values
    # lost with their segment) are its: they clear once it has, else they keep its fix.
    store = store_explained(group, other)
    other = {n: c for n, c in other.items() if n not in store or not cleared(store[n][0], now_ms)}
    if other and not _retired(group, cutoff, lambda e: e.name in other):
        top = max(other, key=lambda n: other[n])
        listing = ", ".join(f"{n} {c}" for n, c in sorted(other.items(), key=lambda kv: -kv[1]))
        if all(n in store for n in other):
            w, st = max((store[n] for n in other), key=lambda x: x[0].start_ms)
            what, hint = store_pause_text(w, st)
            listing += f" while {what}"
        else:
            hint = no_segments_hint(group, other) or HINTS.get(
                top, "see the engine's log for the backend message")
        out.append(make_alert("backend_errors", "warning", engine_id,
                              f"backend errors: {listing}", hint, now_ms))
    if majority_backend is not None and backends and backends != {majority_backend}:
        out.append(make_alert(
            "backend_mismatch", "critical", engine_id,
            f"backend {'/'.join(sorted(backends))} differs from the fleet's {majority_backend}",
            "every engine of one pool must use the same backend "
            "(kv_connector_extra_config.backend = kv_cache_store_config.backend)", now_ms))
    return out


FINGERPRINT_FACT = "fingerprint"
"""The layout fact naming the weights' identity (``kvpool_connector.fingerprint``):
``<source>:<hex>``."""

UNSHARED = "unshared"
"""The fingerprint source of an engine whose weights have no content identity: it shares with
no other engine (``kvpool_connector.fingerprint.FingerprintSource``)."""


def _namespace_alerts(groups: Mapping[str, list[EngineState]], now_ms: float) -> list[Alert]:
    """Engines whose keys can never meet although they serve the same model: same model name
    but different layout digests (``model_versions`` when only the weights' fingerprint
    differs: a rolling update), or the same layout under different model names; and engines
    with no content identity, which share with nobody (``unshared_identity``)."""
    # engine id -> (model, digest, layout facts) from its first worker that described its keys
    described: dict[str, tuple[str, str, dict[str, str | int]]] = {}
    for eid, group in groups.items():
        for s in group:
            if s.source.layout_digest and s.start_failure is None:
                described[eid] = (s.source.model, s.source.layout_digest, dict(s.source.layout))
                break
    out: list[Alert] = []
    by_model: dict[str, dict[str, list[str]]] = {}
    for eid, (model, digest, _) in described.items():
        by_model.setdefault(model, {}).setdefault(digest, []).append(eid)
    for model, digests in sorted(by_model.items()):
        if len(digests) < 2:
            continue
        ordered = sorted(digests.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        base = described[ordered[0][1][0]][2]
        diffs: list[str] = []
        parts: list[str] = []
        for digest, eids in ordered:
            facts = described[eids[0]][2]
            parts.append(f"{digest}: {engines_text(eids, 4)}")
            for k in sorted(set(base) | set(facts)):
                if base.get(k) != facts.get(k):
                    diffs.append(f"{k} {base.get(k, '-')} vs {facts.get(k, '-')}")
        if diffs and all(d.startswith(f"{FINGERPRINT_FACT} ") for d in diffs):
            # Only the weights differ: a rolling update (or a node left on old weights).
            versions = "; ".join(
                f"{described[eids[0]][2].get(FINGERPRINT_FACT, '-')}: {engines_text(eids, 4)}"
                for _, eids in ordered)
            out.append(make_alert(
                "model_versions", "info", model,
                f"engines of {model} run on {len(digests)} versions of its weights "
                f"({versions}): engines of different versions never share",
                "expected while a rolling update of the weights runs; once it is over every "
                "engine should report one fingerprint: restart the engines still on the old "
                "weights (`kvpool-config fingerprint MODEL_DIR` prints a checkpoint's)",
                now_ms))
            continue
        why = "; ".join(dict.fromkeys(diffs)) or "layout digests differ"
        out.append(make_alert(
            "namespace_split", "warning", model,
            f"engines of {model} use {len(digests)} key namespaces ({'; '.join(parts)}): "
            f"no shared hits: {why}",
            "engines share pool values only when model name and layout match: give them the "
            "same chunk_size, block_size, dtypes and parallel sizes", now_ms))
    for eid, (model, _, facts) in sorted(described.items()):
        if str(facts.get(FINGERPRINT_FACT, "")).startswith(f"{UNSHARED}:"):
            out.append(make_alert(
                "unshared_identity", "warning", eid,
                f"{eid} ({model}) shares with no other engine: its weights could not be "
                "fingerprinted by content (not a local safetensors directory) and no "
                "model_fingerprint is set",
                "set model_fingerprint in kv_connector_extra_config to the same value on "
                "every engine that loads these weights, or load them from a local safetensors "
                "directory", now_ms))
    by_layout: dict[str, dict[str, list[str]]] = {}
    for eid, (model, _, facts) in described.items():
        shape = msgspec.json.encode({k: v for k, v in facts.items() if k != "model"},
                                    order="sorted").decode()
        by_layout.setdefault(shape, {}).setdefault(model, []).append(eid)
    for models in by_layout.values():
        if len(models) < 2:
            continue
        names = sorted(models)
        listing = "; ".join(f"{m}: {engines_text(models[m], 4)}" for m in names)
        out.append(make_alert(
            "namespace_split", "warning", "/".join(names),
            f"the same layout under {len(names)} model names ({listing}): no shared hits: "
            f"model {' vs '.join(names)}",
            "keys start with the model name: serve the same weights under one model name "
            "(--served-model-name) on every engine that should share", now_ms))
    return out


def _liveness(group: list[EngineState], cfg: AlertSettings) -> tuple[Source, bool | None]:
    """The engine's process that the verdict names, and the verdict: ``True`` (hung) or
    ``False`` (gone) only when every process of the engine ``cfg.alive`` can judge agrees
    (an agent key adding one forged agent to a real engine could otherwise name a live pid
    and turn "gone" into "hung", or the reverse); ``None``: none can be judged, or they
    disagree (the stale/down alert then says what is known)."""
    head = next((s.source for s in group if s.source.pid), group[0].source)
    if cfg.alive is None:
        return head, None
    seen: dict[tuple[str, int, int, int], Source] = {}
    for s in group:
        if s.source.pid:
            src = s.source
            seen.setdefault((src.host, src.pid, src.pid_ns, src.start_ticks), src)
    judged = [(src, v) for src in seen.values() if (v := cfg.alive(src)) is not None]
    verdicts = {v for _, v in judged}
    if len(verdicts) != 1:
        return head, None
    return judged[0][0], verdicts.pop()


def _silence_alert(engine_id: str, group: list[EngineState], age: float, now_ms: float,
                   cfg: AlertSettings) -> Alert | None:
    if age <= cfg.stale_after_ms:
        return None
    head, alive = _liveness(group, cfg)
    return silence_alert(engine_id, head, alive, age, now_ms, stale_after_ms=cfg.stale_after_ms,
                         down_after_ms=cfg.down_after_ms)


def evaluate(
    states: Mapping[str, EngineState],
    last_seen_ms: Mapping[str, float],
    now_ms: float,
    settings: AlertSettings | None = None,
    *,
    active: Collection[str] = (),
) -> list[Alert]:
    """Every alert the current fleet state raises, pool alerts first, then per engine.

    Args:
        states: agent id -> latest EngineState (as ``FleetClient.fleet()`` holds it).
        last_seen_ms: agent id -> hub receive time of its last report (epoch ms); an agent
            missing here is aged by its own ``EngineState.ts_ms``.
        now_ms: current wall clock, epoch ms (tests pass a frozen value).
        settings: the thresholds (``AlertSettings()``'s defaults when ``None``).
        active: keys of the alerts active before this call (``AlertTracker.active_keys``), for
            hysteresis; empty for a one-shot evaluation.

    Returns:
        Alerts sorted by severity (critical first) then key. An engine that reported a start
        failure gets ``start_failed`` (with its error and fix) and no silence alert.
    """
    cfg = settings if settings is not None else AlertSettings()
    out = _pool_alerts(states, now_ms, watermark_ratio=cfg.watermark_ratio,
                       watermark_margin=cfg.watermark_margin, active=active)
    out.extend(segment_alerts(states, now_ms, last_seen_ms))
    groups = _by_engine(states)
    counts = Counter(s.source.backend for s in states.values() if s.source.backend)
    majority: str | None = None
    if counts:
        ranked = counts.most_common()
        # With a tie there is no "rest of the fleet" to differ from.
        if len(ranked) == 1 or ranked[0][1] > ranked[1][1]:
            majority = ranked[0][0]
    saving: dict[str, set[str]] = {}
    for st in states.values():
        if st.source.kv_role != "kv_consumer" and st.transfers.saves_finished:
            saving.setdefault(st.source.model, set()).add(st.source.engine_id)
    out.extend(_namespace_alerts(groups, now_ms))
    out.extend(adapter_alerts(groups, now_ms))
    out.extend(version_alerts(groups, now_ms))
    out.extend(policy_alerts(groups, last_seen_ms, now_ms, cfg.stale_after_ms))
    stalled = stalled_pools(states, last_seen_ms, now_ms, cfg.stuck_after_ms)
    for engine_id in sorted(groups):
        group = groups[engine_id]
        failures = [s for s in group if s.start_failure is not None]
        if failures:
            f = max(failures, key=lambda s: s.start_failure.ts_ms)  # type: ignore[union-attr]
            sf = f.start_failure
            assert sf is not None
            out.append(make_alert("start_failed", "critical", engine_id,
                                  f"failed to start ({f.source.agent_id}): {sf.name}: {sf.message}",
                                  sf.hint or "see the engine's log", now_ms))
            continue
        out.extend(_engine_alerts(engine_id, group, majority, now_ms, cfg.window_ms,
                                  last_seen_ms, stalled))
        out.extend(_role_alerts(engine_id, group, saving, now_ms))
        seen = max(last_seen_ms.get(s.source.agent_id, s.ts_ms) for s in group)
        silence = _silence_alert(engine_id, group, now_ms - seen, now_ms, cfg)
        if silence is not None:
            out.append(silence)
        else:
            # A silent engine's in-flight list is as old as its last report.
            out.extend(stuck_alerts(engine_id, group, now_ms, cfg.stuck_after_ms, stalled))
    out.sort(key=alert_order)
    return out
