"""Alert rules over what agents report (``kvpool_agent.protocol.EngineState``).

Each rule turns one condition an operator must act on into an :class:`Alert` with a severity
(``warning`` or ``critical``) and a hint saying what usually fixes it. Hints for backend errors
come from ``kvpool_agent.vocabulary.HINTS`` so the console, the logs and the docs say the same
thing. One alert per cause: a pool's alerts are raised once per pool (named by its master),
listing the engines that see it; an engine that failed to start gets only ``start_failed``.
The rules mirror the deployment rules ``kvpool-config validate`` checks before start-up
(kv_role per instance role, one backend for the fleet, ``default_kv_lease_ttl`` above transfer
times, usage under ``eviction_high_watermark_ratio``), applied to what the fleet actually does.

Counter rules (failed loads, lookup errors, backend errors) fire on counters since agent start;
:class:`AlertTracker` keeps them active only while the counter grew within ``window_ms``, so an
old failure does not stay red for ever in the TUI, while a one-shot ``status`` (no history) sees
every non-zero counter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Literal

import msgspec

from kvpool_agent.protocol import EngineState, PoolStats, Source
from kvpool_agent.vocabulary import HINTS, INSTANCE_ROLE_OF, KV_ROLE_FOR

__all__ = [
    "DEFAULT_STUCK_AFTER_MS",
    "SEVERITY_RANK",
    "WATERMARK_MARGIN",
    "Alert",
    "AlertTracker",
    "Severity",
    "evaluate",
    "pool_name",
]

Severity = Literal["warning", "critical"]

SEVERITY_RANK: dict[str, int] = {"warning": 1, "critical": 2}
"""Order of severities for ``--fail-on``: an alert counts when its rank is >= the chosen one."""


_CRITICAL_USAGE = 0.98
"""Pool usage fraction at which new saves start failing with NO_AVAILABLE_HANDLE."""

WATERMARK_MARGIN = 0.05
"""Hysteresis of ``pool_watermark``: raised above the ratio, cleared only below the ratio minus
this (usage swings a few percent around the ratio while eviction works: no flapping)."""

DEFAULT_STUCK_AFTER_MS = 10_000.0
"""A transfer in flight longer than this is stuck, when the pool's lease TTL
(``default_kv_lease_ttl``) is unknown; with it, the TTL is the threshold: a load still running
after its lease expired fails anyway, and Mooncake's transfer timeouts are below it when the
deployment follows ``kvpool-config validate`` (the TTL must exceed them)."""

_TOPOLOGY_MIN_LOOKUPS = 20
"""Lookups a consumer makes before "0% hits while producers save" is a finding, not chance."""


class Alert(msgspec.Struct, frozen=True, kw_only=True):
    """One active alert.

    ``rule`` is a stable id (``pool_watermark``, ``failed_after_hit``, ``lease_ttl``,
    ``lookup_errors``, ``backend_errors``, ``backend_mismatch``, ``kv_role_mismatch``,
    ``role_topology``, ``pool_unhealthy``, ``stale``, ``start_failed``, ``stuck_transfer``,
    ``namespace_split``); ``subject`` the engine id (the pool name for pool rules, the model
    name(s) for ``namespace_split``); ``key`` = ``f"{rule}:{subject}"`` identifies the alert
    across refreshes.
    """

    key: str
    rule: str
    severity: Severity
    subject: str
    message: str
    hint: str
    ts_ms: float


def _alert(rule: str, severity: Severity, subject: str, message: str, hint: str,
           ts_ms: float) -> Alert:
    return Alert(key=f"{rule}:{subject}", rule=rule, severity=severity, subject=subject,
                 message=message, hint=hint, ts_ms=ts_ms)


def _by_engine(states: Mapping[str, EngineState]) -> dict[str, list[EngineState]]:
    out: dict[str, list[EngineState]] = {}
    for st in states.values():
        out.setdefault(st.source.engine_id, []).append(st)
    return out


def pool_name(st: EngineState) -> str:
    """Which pool an agent reports: its backend at its master's address when known (the same
    pool for every engine, also when the master is down and reports no segments), else at its
    segments, else the engine's own."""
    p = st.pool
    backend = p.backend if p is not None else st.source.backend
    if st.source.master:
        return f"{backend}@{st.source.master}"
    if p is not None and p.segments:
        return f"{backend}:" + ",".join(sorted(s.name for s in p.segments))
    return f"{backend}:{st.source.engine_id}"


def _engines_text(engines: Collection[str], limit: int = 8) -> str:
    names = sorted(engines)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


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
        seen_by = f"engines {_engines_text(engines[name])}"
        if p.total_bytes > 0:
            frac = p.used_bytes / p.total_bytes
            ratio = watermark_ratio if watermark_ratio is not None else p.high_watermark
            key = f"pool_watermark:{name}"
            # Hysteresis: an active alert stays until usage drops below ratio - margin.
            if frac > ratio or (key in active and frac > ratio - watermark_margin):
                sev: Severity = "critical" if frac >= _CRITICAL_USAGE else "warning"
                where = (f"over eviction_high_watermark_ratio {ratio:.2f}" if frac > ratio
                         else f"back under eviction_high_watermark_ratio {ratio:.2f}, alert "
                         f"clears below {ratio - watermark_margin:.2f}")
                out.append(_alert(
                    "pool_watermark", sev, name,
                    f"pool {frac:.0%} used, {where} ({p.used_bytes}/{p.total_bytes} B; "
                    f"{seen_by})",
                    "eviction is running; if hit rate drops, add segment memory "
                    "(global_segment_size) or more segments", now_ms))
        if name in unhealthy:
            sick = [s for s in states.values() if s.pool is not None and s.pool.healthy is False
                    and pool_name(s) == name]
            detail = max(sick, key=lambda s: s.ts_ms).pool.health_detail  # type: ignore[union-attr]
            out.append(_alert("pool_unhealthy", "critical", name,
                              f"pool health check failed: {detail or 'unhealthy'} "
                              f"(seen by engines {_engines_text(unhealthy[name])})",
                              HINTS["RPC_FAIL"], now_ms))
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
            out.append(_alert(
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
        hits += lk.pool_hit_tokens
    if head.instance_role == "prefill" and loads and not saves:
        out.append(_alert(
            "role_topology", "warning", engine_id,
            f"prefill instance loaded {loads} times and never saved",
            "a prefill instance saves for its decode instances: check its kv_role "
            "(kv_producer) and its declared role", now_ms))
    elif head.instance_role == "decode" and saved and not loads:
        out.append(_alert(
            "role_topology", "warning", engine_id,
            f"decode instance saved {saved} times and never loaded",
            "a decode instance loads what prefill saved: use kv_role kv_consumer with "
            "consumer_is_to_load, and consumer_is_to_put only if it should save", now_ms))
    others = producers_saving.get(head.model, set()) - {engine_id}
    if (head.kv_role == "kv_consumer" and lookups >= _TOPOLOGY_MIN_LOOKUPS and prompt
            and not hits and others):
        out.append(_alert(
            "role_topology", "warning", engine_id,
            f"0% pool hits over {lookups} lookups while producers of {head.model} save "
            f"({_engines_text(others)})",
            "their keys never meet: compare the key namespaces (model name, layout digest, "
            "chunk_size, block_size) of this engine and the producers in `kvpool-console "
            "status`", now_ms))
    return out


def _stuck_alerts(engine_id: str, group: list[EngineState], now_ms: float,
                  stuck_after_ms: float | None) -> list[Alert]:
    ttls = [s.pool.lease_ttl_ms for s in group if s.pool is not None and s.pool.lease_ttl_ms > 0]
    limit = stuck_after_ms if stuck_after_ms is not None else (
        float(min(ttls)) if ttls else DEFAULT_STUCK_AFTER_MS)
    stuck = [(now_ms - t.started_ms, t, s) for s in group for t in s.in_flight
             if now_ms - t.started_ms > limit]
    if not stuck:
        return []
    age, t, s = max(stuck, key=lambda x: x[0])
    reqs = {(x[1].req_id, x[1].kind) for x in stuck}
    more = f"; {len(reqs) - 1} more stuck" if len(reqs) > 1 else ""
    layers = (f", layer {t.layers_done}/{t.layers_total}" if t.layers_total else "")
    pool: PoolStats | None = s.pool
    master = s.source.master or "the master"
    if pool is not None and pool.healthy is False:
        owner = f"master {master} (pool health check failing: {pool.health_detail or '?'})"
        hint = HINTS["RPC_FAIL"]
    else:
        segs = ", ".join(x.name for x in pool.segments) if pool is not None and pool.segments \
            else "the segments' hosts"
        owner = (f"the store process holding the segments ({segs}) or {master}"
                 if t.kind == "save" else
                 f"the segment owner(s) ({segs}) or the transfer engine of this worker")
        hint = ("check that the store process (mooncake_client or the engines contributing "
                "segments) runs and is not stopped, and the network to it; `kvpool-console "
                f"triage {engine_id}` shows the engine's host")
    limit_text = "lease TTL" if stuck_after_ms is None and ttls else "threshold"
    return [_alert(
        "stuck_transfer", "critical", engine_id,
        f"{t.kind} of {t.req_id} on {s.source.agent_id} in flight {age / 1e3:.1f} s "
        f"(> {limit / 1e3:.1f} s {limit_text}; {t.blocks} blocks{layers}){more}; likely owner: "
        f"{owner}", hint, now_ms)]


def _engine_alerts(engine_id: str, group: list[EngineState], majority_backend: str | None,
                   now_ms: float) -> list[Alert]:
    out: list[Alert] = []
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
    if failed_after_hit:
        cause = max(("LEASE_EXPIRED", "OBJECT_NOT_FOUND"), key=lambda n: errors.get(n, 0))
        sev: Severity = "critical" if loads_total and failed_after_hit * 2 >= loads_total \
            else "warning"
        out.append(_alert(
            "failed_after_hit", sev, engine_id,
            f"{failed_after_hit} loads failed after a positive lookup "
            f"(LEASE_EXPIRED {errors.get('LEASE_EXPIRED', 0)}, "
            f"OBJECT_NOT_FOUND {errors.get('OBJECT_NOT_FOUND', 0)})",
            HINTS[cause], now_ms))
    if ttl and max_load > 0:
        if max_load >= ttl:
            out.append(_alert("lease_ttl", "critical", engine_id,
                              f"slowest load {max_load:.0f} ms >= lease TTL {ttl} ms "
                              "(default_kv_lease_ttl)", HINTS["LEASE_EXPIRED"], now_ms))
        elif max_load >= 0.8 * ttl:
            out.append(_alert("lease_ttl", "warning", engine_id,
                              f"slowest load {max_load:.0f} ms is within 20% of lease TTL "
                              f"{ttl} ms (default_kv_lease_ttl)", HINTS["LEASE_EXPIRED"], now_ms))
    if lookup_errors:
        sev = "critical" if lookups and lookup_errors * 2 >= lookups else "warning"
        last = [e for s in group for e in s.recent_errors if e.where == "lookup"]
        detail = f"; last: {last[-1].name}: {last[-1].message}" if last else ""
        out.append(_alert("lookup_errors", sev, engine_id,
                          f"{lookup_errors} of {lookups} lookups failed{detail}",
                          _lookup_hint(group), now_ms))
    other = {n: c for n, c in errors.items()
             if n not in ("LEASE_EXPIRED", "OBJECT_NOT_FOUND") or not failed_after_hit}
    if skipped and "NO_AVAILABLE_HANDLE" not in other:
        other["NO_AVAILABLE_HANDLE"] = skipped
    if other:
        top = max(other, key=lambda n: other[n])
        listing = ", ".join(f"{n} {c}" for n, c in sorted(other.items(), key=lambda kv: -kv[1]))
        out.append(_alert("backend_errors", "warning", engine_id, f"backend errors: {listing}",
                          HINTS.get(top, "see the engine's log for the backend message"), now_ms))
    if majority_backend is not None and backends and backends != {majority_backend}:
        out.append(_alert(
            "backend_mismatch", "critical", engine_id,
            f"backend {'/'.join(sorted(backends))} differs from the fleet's {majority_backend}",
            "every engine of one pool must use the same backend "
            "(kv_connector_extra_config.backend = kv_cache_store_config.backend)", now_ms))
    return out


def _namespace_alerts(groups: Mapping[str, list[EngineState]], now_ms: float) -> list[Alert]:
    """Engines whose keys can never meet although they serve the same model: same model name
    but different layout digests, or the same layout under different model names."""
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
            parts.append(f"{digest}: {_engines_text(eids, 4)}")
            for k in sorted(set(base) | set(facts)):
                if base.get(k) != facts.get(k):
                    diffs.append(f"{k} {base.get(k, '-')} vs {facts.get(k, '-')}")
        why = "; ".join(dict.fromkeys(diffs)) or "layout digests differ"
        out.append(_alert(
            "namespace_split", "warning", model,
            f"engines of {model} use {len(digests)} key namespaces ({'; '.join(parts)}): "
            f"no shared hits: {why}",
            "engines share pool values only when model name and layout match: give them the "
            "same chunk_size, block_size, dtypes and parallel sizes", now_ms))
    by_layout: dict[str, dict[str, list[str]]] = {}
    for eid, (model, _, facts) in described.items():
        shape = msgspec.json.encode({k: v for k, v in facts.items() if k != "model"},
                                    order="sorted").decode()
        by_layout.setdefault(shape, {}).setdefault(model, []).append(eid)
    for models in by_layout.values():
        if len(models) < 2:
            continue
        names = sorted(models)
        listing = "; ".join(f"{m}: {_engines_text(models[m], 4)}" for m in names)
        out.append(_alert(
            "namespace_split", "warning", "/".join(names),
            f"the same layout under {len(names)} model names ({listing}): no shared hits: "
            f"model {' vs '.join(names)}",
            "keys start with the model name: serve the same weights under one model name "
            "(--served-model-name) on every engine that should share", now_ms))
    return out


def _silence_alert(engine_id: str, group: list[EngineState], age: float, now_ms: float,
                   stale_after_ms: float, down_after_ms: float,
                   alive: Callable[[Source], bool | None] | None) -> Alert | None:
    if age <= stale_after_ms:
        return None
    head = next((s.source for s in group if s.source.pid), group[0].source)
    state = alive(head) if alive is not None else None
    where = f"pid {head.pid} on {head.host or '?'}"
    if state is True:
        return _alert("stale", "critical" if age > down_after_ms else "warning", engine_id,
                      f"hung: {where} is alive but sent no report for {age / 1e3:.0f} s",
                      "the process is stopped or stuck (SIGSTOP, a debugger, a blocked "
                      f"thread): `kvpool-console triage {engine_id}` shows its state and log; "
                      "restart it if it does not recover", now_ms)
    if state is False:
        return _alert("stale", "critical", engine_id,
                      f"gone: {where} is not running; last report {age / 1e3:.0f} s ago",
                      "the engine exited or was killed: read its log (`kvpool-console triage "
                      f"{engine_id}`), restart it, or `kvpool-console forget {engine_id}` after "
                      "a scale-down", now_ms)
    if age > down_after_ms:
        return _alert("stale", "critical", engine_id,
                      f"down: no report for {age / 1e3:.0f} s",
                      "the engine is hung or gone, or its agent cannot reach the hub: "
                      f"`kvpool-console triage {engine_id}` tells which on its host; check "
                      "agent_address / KVPOOL_AGENT_ADDRESS", now_ms)
    return _alert("stale", "warning", engine_id,
                  f"stale: no report for {age / 1e3:.1f} s",
                  "engine busy, hung or unreachable; its numbers are out of date", now_ms)


def evaluate(
    states: Mapping[str, EngineState],
    last_seen_ms: Mapping[str, float],
    now_ms: float,
    *,
    stale_after_ms: float = 5_000.0,
    down_after_ms: float = 30_000.0,
    watermark_ratio: float | None = None,
    watermark_margin: float = WATERMARK_MARGIN,
    stuck_after_ms: float | None = None,
    active: Collection[str] = (),
    alive: Callable[[Source], bool | None] | None = None,
) -> list[Alert]:
    """Every alert the current fleet state raises, pool alerts first, then per engine.

    Args:
        states: agent id -> latest EngineState (as ``FleetClient.fleet()`` holds it).
        last_seen_ms: agent id -> hub receive time of its last report (epoch ms); an agent
            missing here is aged by its own ``EngineState.ts_ms``.
        now_ms: current wall clock, epoch ms (tests pass a frozen value).
        stale_after_ms: silence after which an engine is ``stale`` (warning).
        down_after_ms: silence after which it is ``down`` (critical).
        watermark_ratio: usage fraction above which ``pool_watermark`` is raised; ``None``:
            the pool's own ``eviction_high_watermark_ratio``.
        watermark_margin: an active ``pool_watermark`` clears only below ratio - margin.
        stuck_after_ms: age (ms) after which an in-flight load or save is ``stuck_transfer``;
            ``None``: the pool's lease TTL, else ``DEFAULT_STUCK_AFTER_MS``.
        active: keys of the alerts active before this call (``AlertTracker.active_keys``), for
            hysteresis; empty for a one-shot evaluation.
        alive: tells whether a silent engine's process still runs (``True``: hung, ``False``:
            gone, ``None``: cannot tell, e.g. another host); ``None``: never asked.

    Returns:
        Alerts sorted by severity (critical first) then key. An engine that reported a start
        failure gets ``start_failed`` (with its error and fix) and no silence alert.
    """
    out = _pool_alerts(states, now_ms, watermark_ratio=watermark_ratio,
                       watermark_margin=watermark_margin, active=active)
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
    for engine_id in sorted(groups):
        group = groups[engine_id]
        failures = [s for s in group if s.start_failure is not None]
        if failures:
            f = max(failures, key=lambda s: s.start_failure.ts_ms)  # type: ignore[union-attr]
            sf = f.start_failure
            assert sf is not None
            out.append(_alert("start_failed", "critical", engine_id,
                              f"failed to start ({f.source.agent_id}): {sf.name}: {sf.message}",
                              sf.hint or "see the engine's log", now_ms))
            continue
        out.extend(_engine_alerts(engine_id, group, majority, now_ms))
        out.extend(_role_alerts(engine_id, group, saving, now_ms))
        seen = max(last_seen_ms.get(s.source.agent_id, s.ts_ms) for s in group)
        silence = _silence_alert(engine_id, group, now_ms - seen, now_ms, stale_after_ms,
                                 down_after_ms, alive)
        if silence is not None:
            out.append(silence)
        else:
            # A silent engine's in-flight list is as old as its last report.
            out.extend(_stuck_alerts(engine_id, group, now_ms, stuck_after_ms))
    out.sort(key=lambda a: (-SEVERITY_RANK[a.severity], a.key))
    return out


_COUNTER_RULES = frozenset({"failed_after_hit", "lookup_errors", "backend_errors"})


class AlertTracker:
    """Keeps counter alerts active only while their counters keep growing.

    ``update`` takes the alerts of one :func:`evaluate` call plus a fingerprint of each
    counter-rule alert (its message, which embeds the counts); a counter alert whose message
    did not change for ``window_ms`` is retired. Other alerts pass through. ``new`` holds the
    alerts that became active (or changed severity) in the last update, for the events log.

    Args:
        window_ms: how long a counter alert stays active after its counters last grew.
    """

    def __init__(self, window_ms: float = 60_000.0) -> None:
        self.window_ms = window_ms
        self._changed_at: dict[str, tuple[str, float]] = {}
        self._active: dict[str, Alert] = {}
        self.new: list[Alert] = []

    def update(self, alerts: list[Alert], now_ms: float) -> list[Alert]:
        """Filter ``alerts`` (from :func:`evaluate` at ``now_ms``); returns the active ones."""
        keep: list[Alert] = []
        for a in alerts:
            if a.rule in _COUNTER_RULES:
                prev = self._changed_at.get(a.key)
                if prev is None or prev[0] != a.message:
                    self._changed_at[a.key] = (a.message, now_ms)
                elif now_ms - prev[1] > self.window_ms:
                    continue
            keep.append(a)
        active = {a.key: a for a in keep}
        self.new = [a for k, a in active.items()
                    if k not in self._active or self._active[k].severity != a.severity]
        self._active = active
        return keep

    @property
    def active_keys(self) -> frozenset[str]:
        """Keys of the alerts active after the last ``update`` (``evaluate(active=...)``)."""
        return frozenset(self._active)
