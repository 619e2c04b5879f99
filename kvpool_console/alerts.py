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
they retire once the newest error they count (``EngineState.recent_errors``, stamped by the
agent) is older than ``COUNTER_WINDOW_MS``, which a one-shot ``status`` sees as well as the TUI.
:class:`AlertModel` is the one model both run: those rules, :class:`AlertTracker` (retirement of
counters without error records), the pauses it observed and those agents report in
``EngineState.pauses`` (a load that waited on a stopped master or engine is ``pause_wait``, not
TTL advice, also in a one-shot that did not watch the pause) and the pool's eviction rate
(``pool_evicting``). HA pools (``PoolStats.masters``): ``no_leader`` while no master serves,
``master_behind`` for a master that does not answer or follows an older election, and (the
model) ``pool_failover`` after the leader changed, with the time without one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from kvpool_agent.protocol import (
    EngineState,
    ErrorRecord,
    PoolStats,
    Source,
    Transfer,
    TransferStats,
)
from kvpool_agent.vocabulary import HINTS, INSTANCE_ROLE_OF, KV_ROLE_FOR

__all__ = [
    "COUNTER_WINDOW_MS",
    "SEVERITY_RANK",
    "STALE_AFTER_MS",
    "STUCK_FLOOR_MS",
    "STUCK_MULTIPLE",
    "WATERMARK_MARGIN",
    "Alert",
    "AlertModel",
    "AlertTracker",
    "Severity",
    "evaluate",
    "fmt_ms",
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

STUCK_FLOOR_MS = 2_500.0
"""A transfer is never ``stuck_transfer`` before this age (ms): below it, scheduling jitter of a
loaded host, not a stopped store. Low enough that a stopped store is named within 5 s."""

STUCK_MULTIPLE = 2.0
"""A transfer is stuck once in flight this many times longer than expected: its bytes over the
agent's recent rate for its kind (``TransferStats.load_bytes_per_s`` / ``save_bytes_per_s``).
That rate is throughput over 10 s, idle time included, so the expected time is already an upper
bound of what the link takes. Not the lease TTL: with a 50 ms ``default_kv_lease_ttl`` every
ordinary save outlives it."""

STALE_AFTER_MS = 3_000.0
"""Silence (ms) after which an engine is ``stale``: agents send a heartbeat every second, so
three missed ones are a fault, and a stopped engine is named within 5 s."""

COUNTER_WINDOW_MS = 60_000.0
"""A counter alert stays active this long (ms) after the newest error it counts."""

_AFTERMATH_MS = 10_000.0
"""After a pause ends, failures for this long (ms) are its aftermath: loads looked up before
the pause fail with LEASE_EXPIRED once it ends."""

_GAP_MS = 2_500.0
"""An engine whose reports stop this long (ms; heartbeats come every second) was paused."""

_AFTER_HIT = ("LEASE_EXPIRED", "OBJECT_NOT_FOUND")
"""Error names of a load that failed after a positive lookup (``failed_after_hit``)."""

_TOPOLOGY_MIN_LOOKUPS = 20
"""Lookups a consumer makes before "0% hits while producers save" is a finding, not chance."""


class Alert(msgspec.Struct, frozen=True, kw_only=True):
    """One active alert.

    ``rule`` is a stable id (``pool_watermark``, ``failed_after_hit``, ``lease_ttl``,
    ``lookup_errors``, ``backend_errors``, ``backend_mismatch``, ``kv_role_mismatch``,
    ``role_topology``, ``pool_unhealthy``, ``stale``, ``start_failed``, ``stuck_transfer``,
    ``namespace_split``, ``no_leader``, ``master_behind``; :class:`AlertModel` adds
    ``pause_wait``, ``pool_evicting`` and ``pool_failover``);
    ``subject`` the engine id (the pool name for pool rules, the model name(s) for
    ``namespace_split``); ``key`` = ``f"{rule}:{subject}"`` identifies the alert
    across refreshes.
    """

    key: str
    rule: str
    severity: Severity
    subject: str
    message: str
    hint: str
    ts_ms: float


def fmt_ms(ms: float) -> str:
    """A duration given in ms, for messages: ``"850 ms"`` below a second, ``"3.2 s"`` below
    a minute, else ``"2.5 min"``."""
    if ms < 1_000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1e3:.1f} s"
    return f"{ms / 6e4:.1f} min"


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
            # Hysteresis: raised above the ratio, held until usage drops below ratio - margin.
            # A pool that evicted has been over its watermark: the one-shot holds it as the
            # TUI (which saw it raised) does.
            held = key in active or p.evicted_keys > 0
            if frac > ratio or (held and frac > ratio - watermark_margin):
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
        out.extend(_master_alerts(name, p, seen_by, now_ms))
        if name in unhealthy:
            sick = [s for s in states.values() if s.pool is not None and s.pool.healthy is False
                    and pool_name(s) == name]
            detail = max(sick, key=lambda s: s.ts_ms).pool.health_detail  # type: ignore[union-attr]
            out.append(_alert("pool_unhealthy", "critical", name,
                              f"pool health check failed: {detail or 'unhealthy'} "
                              f"(seen by engines {_engines_text(unhealthy[name])})",
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
        return [_alert("no_leader", "critical", name,
                       f"no master of the HA pool leads and serves ({states}; {seen_by}): "
                       "lookups and saves fail until one does", _ELECTION_HINT, now_ms)]
    lead = leaders[0]
    out = []
    for m in p.masters:
        if m.serving:
            continue
        if not m.reachable:
            why = "does not answer /health"
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
        out.append(_alert("master_behind", "warning", f"{name} {m.admin_url}",
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
    # A kv_producer loads too (a prompt the pool holds whole needs no save); the rule is
    # for a prefill that runs as a loader.
    if head.instance_role == "prefill" and head.kv_role != "kv_producer" and loads and not saves:
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


def _stuck_limit(t: Transfer, tr: TransferStats, stuck_after_ms: float | None) -> tuple[float, str]:
    """How long ``t`` may be in flight (ms) before it is stuck, and why that long."""
    if stuck_after_ms is not None:
        return stuck_after_ms, "threshold"
    rate = tr.load_bytes_per_s if t.kind == "load" else tr.save_bytes_per_s
    if rate <= 0 or t.bytes <= 0:
        return STUCK_FLOOR_MS, "floor; no recent transfer rate"
    expected = t.bytes / rate * 1e3
    why = f"{fmt_ms(expected)} expected at {rate / 1e6:.1f} MB/s"
    if STUCK_MULTIPLE * expected > STUCK_FLOOR_MS:
        return STUCK_MULTIPLE * expected, f"{STUCK_MULTIPLE:g}x the {why}"
    return STUCK_FLOOR_MS, f"floor; {why}"


def _stuck_alerts(engine_id: str, group: list[EngineState], now_ms: float,
                  stuck_after_ms: float | None) -> list[Alert]:
    stuck: list[tuple[float, Transfer, EngineState, float, str]] = []
    for s in group:
        for t in s.in_flight:
            age = now_ms - t.started_ms
            # The limit is never below the floor: most transfers are skipped without it.
            if age > STUCK_FLOOR_MS or stuck_after_ms is not None:
                limit, why = _stuck_limit(t, s.transfers, stuck_after_ms)
                if age > limit:
                    stuck.append((age, t, s, limit, why))
    if not stuck:
        return []
    age, t, s, limit, why = max(stuck, key=lambda x: x[0])
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
    return [_alert(
        "stuck_transfer", "critical", engine_id,
        f"{t.kind} of {t.req_id} on {s.source.agent_id} in flight {fmt_ms(age)} "
        f"(> {fmt_ms(limit)}: {why}; {t.blocks} blocks{layers}){more}; likely owner: "
        f"{owner}", hint, now_ms)]


def _retired(group: list[EngineState], cutoff_ms: float,
             match: Callable[[ErrorRecord], bool]) -> bool:
    """True when the agents recorded errors ``match`` selects and the newest is older than
    ``cutoff_ms``; False also when none is recorded (nothing says how old the counter is)."""
    newest = max((e.ts_ms for s in group for e in s.recent_errors if match(e)), default=None)
    return newest is not None and newest < cutoff_ms


def _engine_alerts(engine_id: str, group: list[EngineState], majority_backend: str | None,
                   now_ms: float, window_ms: float) -> list[Alert]:
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
                                         and e.name in _AFTER_HIT):
        cause = max(_AFTER_HIT, key=lambda n: errors.get(n, 0))
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
                              f"slowest load {fmt_ms(max_load)} >= lease TTL {fmt_ms(ttl)} "
                              "(default_kv_lease_ttl)", HINTS["LEASE_EXPIRED"], now_ms))
        elif max_load >= 0.8 * ttl:
            out.append(_alert("lease_ttl", "warning", engine_id,
                              f"slowest load {fmt_ms(max_load)} is within 20% of lease TTL "
                              f"{fmt_ms(ttl)} (default_kv_lease_ttl)", HINTS["LEASE_EXPIRED"],
                              now_ms))
    if lookup_errors and not _retired(group, cutoff, lambda e: e.where == "lookup"):
        sev = "critical" if lookups and lookup_errors * 2 >= lookups else "warning"
        last = [e for s in group for e in s.recent_errors if e.where == "lookup"]
        detail = f"; last: {last[-1].name}: {last[-1].message}" if last else ""
        out.append(_alert("lookup_errors", sev, engine_id,
                          f"{lookup_errors} of {lookups} lookups failed{detail}",
                          _lookup_hint(group), now_ms))
    other = {n: c for n, c in errors.items() if n not in _AFTER_HIT or not failed_after_hit}
    if skipped and "NO_AVAILABLE_HANDLE" not in other:
        other["NO_AVAILABLE_HANDLE"] = skipped
    if other and not _retired(group, cutoff, lambda e: e.name in other):
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
                      f"hung: {where} is alive but sent no report for {fmt_ms(age)}",
                      "the process is stopped or stuck (SIGSTOP, a debugger, a blocked "
                      f"thread): `kvpool-console triage {engine_id}` shows its state and log; "
                      "restart it if it does not recover", now_ms)
    if state is False:
        return _alert("stale", "critical", engine_id,
                      f"gone: {where} is not running; last report {fmt_ms(age)} ago",
                      "the engine exited or was killed: read its log (`kvpool-console triage "
                      f"{engine_id}`), restart it, or `kvpool-console forget {engine_id}` after "
                      "a scale-down", now_ms)
    if age > down_after_ms:
        return _alert("stale", "critical", engine_id,
                      f"down: no report for {fmt_ms(age)}",
                      "the engine is hung or gone, or its agent cannot reach the hub: "
                      f"`kvpool-console triage {engine_id}` tells which on its host; check "
                      "agent_address / KVPOOL_AGENT_ADDRESS", now_ms)
    return _alert("stale", "warning", engine_id,
                  f"stale: no report for {fmt_ms(age)}",
                  "engine busy, hung or unreachable; its numbers are out of date", now_ms)


def evaluate(
    states: Mapping[str, EngineState],
    last_seen_ms: Mapping[str, float],
    now_ms: float,
    *,
    stale_after_ms: float = STALE_AFTER_MS,
    down_after_ms: float = 30_000.0,
    watermark_ratio: float | None = None,
    watermark_margin: float = WATERMARK_MARGIN,
    stuck_after_ms: float | None = None,
    counter_window_ms: float = COUNTER_WINDOW_MS,
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
            ``None``: ``STUCK_MULTIPLE`` times what its bytes take at its agent's recent rate,
            at least ``STUCK_FLOOR_MS``.
        counter_window_ms: a counter alert retires once the newest error it counts is older.
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
        out.extend(_engine_alerts(engine_id, group, majority, now_ms, counter_window_ms))
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


_NOT_TTL = "; default_kv_lease_ttl is not the cause"


def _master_pause_hint() -> str:
    return HINTS["RPC_FAIL"] + "; the load waited on it (see pool_unhealthy)" + _NOT_TTL


def _engine_pause_hint(engine_id: str) -> str:
    return ("the engine process was stopped or stalled (SIGSTOP, a debugger, swapping) and its "
            f"load waited with it: `kvpool-console triage {engine_id}` if it recurs" + _NOT_TTL)


@dataclass
class _Pause:
    """A span (epoch ms) in which a pool's master failed its health check or an engine sent no
    report; ``end_ms`` is None while it lasts."""

    what: str
    hint: str
    start_ms: float
    end_ms: float | None = None

    def remembered(self, now_ms: float) -> bool:
        """Failures and its alert still belong to it (it lasts, or ended < aftermath ago)."""
        return self.end_ms is None or now_ms <= self.end_ms + _AFTERMATH_MS


@dataclass
class _Excuse:
    """What of one agent's counters a pause explains: subtracted before the rules run."""

    pause: _Pause
    failed_after_hit: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    max_load_seen: float | None = None
    """The slowest load that overlapped the pause (``TransferStats.max_load_ms``)..."""
    max_load_before: float = 0.0
    """...and the slowest before it, which the lease TTL rule sees while that is the max."""


@dataclass
class _Seen:
    """One agent's counters at the previous update (``ts_ms``), its hub receive time then
    (``seen_ms``), and its state then with what :meth:`_PauseLedger.adjust` made of it."""

    ts_ms: float
    seen_ms: float
    failed_after_hit: int
    errors: dict[str, int]
    max_load_ms: float
    state: EngineState
    adjusted: EngineState


def _agent_excused(tr: TransferStats) -> TransferStats:
    """``tr`` less what its agent's own pause windows explain (``max_unpaused_load_ms`` for
    ``max_load_ms``, ``paused_after_hit`` off ``failed_after_hit`` and ``errors_by_name``):
    ``tr`` itself when they take nothing off (and from an agent before those fields)."""
    if not tr.paused_after_hit and tr.max_unpaused_load_ms in (None, tr.max_load_ms):
        return tr
    paused = tr.paused_after_hit
    return msgspec.structs.replace(
        tr, failed_after_hit=max(0, tr.failed_after_hit - sum(paused.values())),
        errors_by_name={n: c - paused.get(n, 0) for n, c in tr.errors_by_name.items()
                        if c > paused.get(n, 0)},
        max_load_ms=tr.max_load_ms if tr.max_unpaused_load_ms is None
        else tr.max_unpaused_load_ms)


def _agent_pauses(st: EngineState, now_ms: float) -> list[tuple[_Pause, int, float]]:
    """``st``'s own remembered pause windows that explain TTL advice (a failed-after-hit load,
    or a load that waited in one for >= 80% of the lease TTL: what ``lease_ttl`` would have
    said): ``(pause, failed after hit, slowest load ms)``."""
    if not st.pauses:
        return []
    ttl = st.pool.lease_ttl_ms if st.pool is not None else 0
    eid = st.source.engine_id
    out = []
    for w in st.pauses:
        if not (w.failed_after_hit or (ttl and w.max_load_ms >= 0.8 * ttl)):
            continue
        if w.kind == "pool_unhealthy":
            pause = _Pause(f"master {st.source.master or pool_name(st)} failed its health check "
                           f"({w.detail or 'unhealthy'})", _master_pause_hint(), w.start_ms,
                           w.end_ms)
        else:
            pause = _Pause(f"process {st.source.agent_id} was stopped or stalled",
                           _engine_pause_hint(eid), w.start_ms, w.end_ms)
        if pause.remembered(now_ms):
            out.append((pause, w.failed_after_hit, w.max_load_ms))
    return out


class _PauseLedger:
    """Pauses the console observed, and the slow loads and failed-after-hit loads they explain.

    A pause of a pool: from the first update that sees an agent report its health check failing
    to the first that sees none. Of an engine: from its last report before a silence longer than
    ``_GAP_MS`` to the first after. A load whose span (its ``max_load_ms`` ending by this update)
    overlaps a pause of its pool or engine, and a ``failed_after_hit`` that grew during one or in
    its aftermath, are taken off the counters the rules see (so no TTL advice) and reported as
    ``pause_wait`` with the pause's hint until the pause is no longer remembered.
    """

    def __init__(self) -> None:
        self._pools: dict[str, _Pause] = {}
        self._engines: dict[str, _Pause] = {}
        self._past: list[tuple[str, _Pause]] = []
        self._seen: dict[str, _Seen] = {}
        self._excused: dict[str, _Excuse] = {}
        self._updated_ms: float | None = None

    def _open_close(self, states: Mapping[str, EngineState], last_seen_ms: Mapping[str, float],
                    now_ms: float) -> None:
        sick: dict[str, str] = {}
        masters: dict[str, str] = {}
        for st in states.values():
            if st.pool is not None:
                name = pool_name(st)
                masters[name] = st.source.master or name
                if st.pool.healthy is False:
                    sick[name] = st.pool.health_detail or "unhealthy"
        for name in set(self._pools) | set(sick):
            p = self._pools.get(name)
            if name in sick and p is None:
                self._pools[name] = _Pause(
                    f"master {masters[name]} failed its health check ({sick[name]})",
                    _master_pause_hint(), now_ms)
            elif name not in sick and p is not None:
                p.end_ms = now_ms
                self._past.append((name, self._pools.pop(name)))
        # One pass over the agents (this runs on every refresh of a 2,304-agent fleet):
        # each engine's newest receive time now and at the previous update.
        last: dict[str, float] = {}
        before: dict[str, float] = {}
        for a, st in states.items():
            eid = st.source.engine_id
            last[eid] = max(last.get(eid, 0.0), last_seen_ms.get(a, st.ts_ms))
            old = self._seen.get(a)
            if old is not None:
                before[eid] = max(before.get(eid, 0.0), old.seen_ms)
        # A jump of the receive time is a pause only if this model looked in between: else
        # it is the model's own gap (a slow refresh), not the engine's.
        looked = self._updated_ms is not None and now_ms - self._updated_ms <= _GAP_MS
        self._updated_ms = now_ms
        for eid, seen in last.items():
            p = self._engines.get(eid)
            prev = before.get(eid)
            jumped = looked and prev is not None and seen - prev > _GAP_MS
            if p is None and (now_ms - seen > _GAP_MS or jumped):
                p = self._engines[eid] = _Pause(
                    f"engine {eid} sent no report (stopped or stalled)",
                    _engine_pause_hint(eid), prev if jumped and prev is not None else seen)
            if p is not None and now_ms - seen <= _GAP_MS:
                p.end_ms = seen
                self._past.append((eid, self._engines.pop(eid)))
        self._past = [(k, p) for k, p in self._past if p.remembered(now_ms)]

    def _pause_of(self, st: EngineState, start_ms: float, end_ms: float) -> _Pause | None:
        """A pause of ``st``'s pool or engine overlapping ``[start_ms, end_ms]``, aftermath
        included."""
        keys = {st.source.engine_id, pool_name(st) if st.pool is not None else ""}
        spans = [p for k, p in [*self._pools.items(), *self._engines.items(), *self._past]
                 if k in keys]
        return next((p for p in spans if p.start_ms <= end_ms and (
            p.end_ms is None or start_ms <= p.end_ms + _AFTERMATH_MS)), None)

    def adjust(self, states: Mapping[str, EngineState], last_seen_ms: Mapping[str, float],
               now_ms: float) -> dict[str, EngineState]:
        """Record this update's pauses and what they explain; returns ``states`` with the
        explained counts taken off, first what the agents' own pause windows explain
        (``_agent_excused``), then what this ledger's pauses explain of the rest (the same
        objects for agents with nothing explained)."""
        self._open_close(states, last_seen_ms, now_ms)
        out = dict(states)
        for a, st in states.items():
            prev = self._seen.get(a)
            if prev is not None and prev.state is st:
                # No report since (FleetClient replaces a state per report): same counters.
                prev.ts_ms, prev.seen_ms = now_ms, last_seen_ms.get(a, st.ts_ms)
                out[a] = prev.adjusted
                continue
            tr = _agent_excused(st.transfers)
            base = st if tr is st.transfers else msgspec.structs.replace(st, transfers=tr)
            out[a] = base
            ex = self._excused.get(a)
            if prev is not None and (tr.failed_after_hit < prev.failed_after_hit
                                     or tr.max_load_ms < prev.max_load_ms):
                prev = ex = None  # the agent restarted: its counters began again
                self._excused.pop(a, None)
            if prev is not None:
                grew = tr.failed_after_hit - prev.failed_after_hit
                pause = self._pause_of(st, now_ms, now_ms) if grew > 0 else None
                if pause is not None:
                    ex = self._excused.setdefault(a, _Excuse(pause))
                    ex.pause = pause
                    ex.failed_after_hit += grew
                    for n in _AFTER_HIT:
                        ex.errors[n] += max(0, tr.errors_by_name.get(n, 0) - prev.errors.get(n, 0))
                if tr.max_load_ms > prev.max_load_ms:
                    pause = self._pause_of(st, prev.ts_ms - tr.max_load_ms, now_ms)
                    if pause is not None:
                        ex = self._excused.setdefault(a, _Excuse(pause))
                        ex.pause = pause
                        if ex.max_load_seen is None:
                            ex.max_load_before = prev.max_load_ms
                        ex.max_load_seen = tr.max_load_ms
            if ex is not None:
                errors = {n: c - ex.errors[n] for n, c in tr.errors_by_name.items()
                          if c - ex.errors[n] > 0}
                max_load = (ex.max_load_before if ex.max_load_seen == tr.max_load_ms
                            else tr.max_load_ms)
                out[a] = msgspec.structs.replace(base, transfers=msgspec.structs.replace(
                    tr, failed_after_hit=tr.failed_after_hit - ex.failed_after_hit,
                    errors_by_name=errors, max_load_ms=max_load))
            self._seen[a] = _Seen(now_ms, last_seen_ms.get(a, st.ts_ms), tr.failed_after_hit,
                                  dict(tr.errors_by_name), tr.max_load_ms, st, out[a])
        for a in set(self._seen) - set(states):
            del self._seen[a]
            self._excused.pop(a, None)
        return out

    def alerts(self, states: Mapping[str, EngineState], now_ms: float) -> list[Alert]:
        """One ``pause_wait`` per engine with explained loads whose pause is remembered: the
        pauses this ledger saw and those the engine's agents reported (``_agent_pauses``),
        named by the latest."""
        by_engine: dict[str, list[tuple[_Pause, int, float]]] = {}
        for a, ex in self._excused.items():
            st = states.get(a)
            if st is not None and ex.pause.remembered(now_ms):
                by_engine.setdefault(st.source.engine_id, []).append(
                    (ex.pause, ex.failed_after_hit, ex.max_load_seen or 0.0))
        for st in states.values():
            if st.pauses:
                by_engine.setdefault(st.source.engine_id, []).extend(_agent_pauses(st, now_ms))
        out = []
        for eid, exs in sorted(by_engine.items()):
            if not exs:
                continue
            pause = max((x[0] for x in exs), key=lambda p: p.start_ms)
            failed = sum(x[1] for x in exs)
            slowest = max(x[2] for x in exs)
            parts = ([f"{failed} loads failed after a positive lookup"] if failed else []) + (
                [f"slowest load {fmt_ms(slowest)}"] if slowest else [])
            span = (f"{fmt_ms(pause.end_ms - pause.start_ms)}" if pause.end_ms is not None
                    else "ongoing")
            out.append(_alert("pause_wait", "warning", eid,
                              f"{', '.join(parts)} while {pause.what} ({span})",
                              pause.hint, now_ms))
        return out


class AlertModel:
    """The alerts the TUI and the one-shot modes show: :func:`evaluate` on the fleet with
    what pauses explain taken off (``pause_wait``), :class:`AlertTracker`'s retirement, and
    ``pool_evicting`` while a pool's ``evicted_keys`` grew within ``window_ms``. Feed it every
    sample (:meth:`update`); a one-shot feeds the samples of its observation window, so it sees
    the evictions and the pauses it observed inside that window only, and the pauses agents
    recorded themselves (``EngineState.pauses``) whenever they were.

    Args:
        window_ms: counter alerts and ``pool_evicting`` retire this long after their last
            growth (ms).
        stale_after_ms, down_after_ms, watermark_ratio, watermark_margin, stuck_after_ms,
            alive: as :func:`evaluate`'s.
    """

    def __init__(self, *, window_ms: float = COUNTER_WINDOW_MS,
                 stale_after_ms: float = STALE_AFTER_MS, down_after_ms: float = 30_000.0,
                 watermark_ratio: float | None = None,
                 watermark_margin: float = WATERMARK_MARGIN,
                 stuck_after_ms: float | None = None,
                 alive: Callable[[Source], bool | None] | None = None) -> None:
        self.window_ms = window_ms
        self.stale_after_ms = stale_after_ms
        self.down_after_ms = down_after_ms
        self.watermark_ratio = watermark_ratio
        self.watermark_margin = watermark_margin
        self.stuck_after_ms = stuck_after_ms
        self.alive = alive
        self.tracker = AlertTracker(window_ms)
        self._pauses = _PauseLedger()
        # pool name -> (evicted keys, evicted bytes) at the previous update, and the growth
        # since the first update of the current eviction episode: (start ms, last growth
        # ms, keys, bytes).
        self._evicted: dict[str, tuple[int, int]] = {}
        self._evicting: dict[str, tuple[float, float, int, int]] = {}
        # HA pools: pool name -> the serving leader's address at the previous update, since
        # when none serves (ms), and the last failover (ms when a new leader served, old
        # leader, new leader, ms without a serving leader).
        self._leader: dict[str, str] = {}
        self._leaderless: dict[str, float] = {}
        self._failover: dict[str, tuple[float, str, str, float]] = {}

    def _failover_alerts(self, states: Mapping[str, EngineState], now_ms: float) -> list[Alert]:
        """``pool_failover`` for ``window_ms`` after an HA pool's leader changed: the old and
        new leader and how long no master served (from the first update without one)."""
        pools: dict[str, PoolStats] = {}
        for st in states.values():
            if st.pool is not None and st.pool.masters:
                pools[pool_name(st)] = st.pool
        out = []
        for name, p in sorted(pools.items()):
            serving = next((m.leader_address for m in p.masters if m.serving), None)
            prev = self._leader.get(name)
            if serving is None:
                self._leaderless.setdefault(name, now_ms)
            else:
                since = self._leaderless.pop(name, None)
                if prev is not None and serving != prev:
                    self._failover[name] = (now_ms, prev, serving,
                                            now_ms - since if since is not None else 0.0)
                self._leader[name] = serving
            fo = self._failover.get(name)
            if fo is None:
                continue
            if now_ms - fo[0] > self.window_ms:
                del self._failover[name]
                continue
            out.append(_alert(
                "pool_failover", "warning", name,
                f"failover: leader {fo[1]} -> {fo[2]} after {fmt_ms(fo[3])} without a serving "
                f"leader ({fmt_ms(now_ms - fo[0])} ago)",
                "lookups and saves failed meanwhile and were recomputed; restart the old "
                "master as a standby (see master_behind)", now_ms))
        return out

    def _eviction_alerts(self, states: Mapping[str, EngineState], now_ms: float) -> list[Alert]:
        pools: dict[str, PoolStats] = {}
        for st in states.values():
            if st.pool is not None:
                pools[pool_name(st)] = st.pool
        out = []
        for name, p in sorted(pools.items()):
            prev = self._evicted.get(name)
            self._evicted[name] = (p.evicted_keys, p.evicted_bytes)
            ep = self._evicting.get(name)
            if prev is not None and p.evicted_keys > prev[0]:
                start = ep[0] if ep is not None else now_ms
                keys = (ep[2] if ep is not None else 0) + p.evicted_keys - prev[0]
                nbytes = (ep[3] if ep is not None else 0) + max(0, p.evicted_bytes - prev[1])
                ep = self._evicting[name] = (start, now_ms, keys, nbytes)
            if ep is None:
                continue
            if now_ms - ep[1] > self.window_ms:
                del self._evicting[name]
                continue
            used = f"{p.used_bytes / p.total_bytes:.0%} used, " if p.total_bytes else ""
            out.append(_alert(
                "pool_evicting", "warning", name,
                f"pool evicting: {ep[2]} keys ({ep[3]} B) evicted since "
                f"{fmt_ms(now_ms - ep[0])} ago ({used}eviction_high_watermark_ratio "
                f"{p.high_watermark:.2f})",
                "usage reached the high watermark and the master drops the least recently "
                "used values: if the hit rate drops, add segment memory (global_segment_size) "
                "or more segments", now_ms))
        return out

    def update(self, states: Mapping[str, EngineState], last_seen_ms: Mapping[str, float],
               now_ms: float) -> list[Alert]:
        """The active alerts at ``now_ms`` (epoch ms), critical first; ``new`` holds those
        that became active or changed severity in this update."""
        adjusted = self._pauses.adjust(states, last_seen_ms, now_ms)
        alerts = evaluate(adjusted, last_seen_ms, now_ms, stale_after_ms=self.stale_after_ms,
                          down_after_ms=self.down_after_ms, watermark_ratio=self.watermark_ratio,
                          watermark_margin=self.watermark_margin,
                          stuck_after_ms=self.stuck_after_ms, counter_window_ms=self.window_ms,
                          active=self.tracker.active_keys, alive=self.alive)
        alerts += (self._pauses.alerts(states, now_ms) + self._eviction_alerts(states, now_ms)
                   + self._failover_alerts(states, now_ms))
        alerts.sort(key=lambda a: (-SEVERITY_RANK[a.severity], a.key))
        return self.tracker.update(alerts, now_ms)

    @property
    def new(self) -> list[Alert]:
        """Alerts that became active (or changed severity) in the last :meth:`update`."""
        return self.tracker.new
