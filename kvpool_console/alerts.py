"""Alert rules over what agents report (``kvpool_agent.protocol.EngineState``).

Each rule turns one condition an operator must act on into an :class:`Alert` with a severity
(``warning`` or ``critical``) and a hint saying what usually fixes it. Hints for backend errors
come from ``kvpool_connector.errors.HINTS`` so the console, the logs and the docs say the same
thing. The rules mirror the deployment rules ``kvpool-config validate`` checks before start-up
(kv_role per instance role, one backend for the fleet, ``default_kv_lease_ttl`` above transfer
times, usage under ``eviction_high_watermark_ratio``), applied to what the fleet actually does.

Counter rules (failed loads, lookup errors, backend errors) fire on counters since agent start;
:class:`AlertTracker` keeps them active only while the counter grew within ``window_ms``, so an
old failure does not stay red for ever in the TUI, while a one-shot ``status`` (no history) sees
every non-zero counter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Literal

import msgspec

from kvpool_agent.protocol import EngineState
from kvpool_agent.vocabulary import HINTS, KV_ROLE_FOR

__all__ = [
    "SEVERITY_RANK",
    "Alert",
    "AlertTracker",
    "Severity",
    "evaluate",
]

Severity = Literal["warning", "critical"]

SEVERITY_RANK: dict[str, int] = {"warning": 1, "critical": 2}
"""Order of severities for ``--fail-on``: an alert counts when its rank is >= the chosen one."""


_CRITICAL_USAGE = 0.98
"""Pool usage fraction at which new saves start failing with NO_AVAILABLE_HANDLE."""


class Alert(msgspec.Struct, frozen=True, kw_only=True):
    """One active alert.

    ``rule`` is a stable id (``pool_watermark``, ``failed_after_hit``, ``lease_ttl``,
    ``lookup_errors``, ``backend_errors``, ``backend_mismatch``, ``kv_role_mismatch``,
    ``pool_unhealthy``, ``stale``); ``subject`` the engine id (or pool name for pool rules);
    ``key`` = ``f"{rule}:{subject}"`` identifies the alert across refreshes.
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


def _pool_alerts(states: Mapping[str, EngineState], now_ms: float) -> list[Alert]:
    # Every agent of a fleet reports the same shared pool; one alert per pool, not per agent.
    pools: dict[str, EngineState] = {}
    for st in states.values():
        p = st.pool
        if p is None:
            continue
        name = f"{p.backend}:" + ",".join(sorted(s.name for s in p.segments)) if p.segments \
            else f"{p.backend}:{st.source.engine_id}"
        prev = pools.get(name)
        if prev is None or st.ts_ms > prev.ts_ms:
            pools[name] = st
    out: list[Alert] = []
    for name, st in sorted(pools.items()):
        p = st.pool
        assert p is not None
        if p.total_bytes > 0:
            frac = p.used_bytes / p.total_bytes
            if frac > p.high_watermark:
                sev: Severity = "critical" if frac >= _CRITICAL_USAGE else "warning"
                out.append(_alert(
                    "pool_watermark", sev, name,
                    f"pool {frac:.0%} used, over eviction_high_watermark_ratio "
                    f"{p.high_watermark:.2f} ({p.used_bytes}/{p.total_bytes} B)",
                    "eviction is running; if hit rate drops, add segment memory "
                    "(global_segment_size) or more segments", now_ms))
        if p.healthy is False:
            out.append(_alert("pool_unhealthy", "critical", name,
                              f"pool health check failed: {p.health_detail or 'unhealthy'}",
                              HINTS["RPC_FAIL"], now_ms))
    return out


def _engine_alerts(engine_id: str, group: list[EngineState], majority_backend: str | None,
                   now_ms: float) -> list[Alert]:
    out: list[Alert] = []
    failed_after_hit = sum(s.transfers.failed_after_hit for s in group)
    loads_total = sum(s.transfers.loads_finished + s.transfers.loads_failed for s in group)
    errors: Counter[str] = Counter()
    for s in group:
        errors.update(s.transfers.errors_by_name)
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
    max_load = max((s.transfers.max_load_ms for s in group), default=0.0)
    ttls = [s.pool.lease_ttl_ms for s in group if s.pool is not None and s.pool.lease_ttl_ms > 0]
    if ttls and max_load > 0:
        ttl = min(ttls)
        if max_load >= ttl:
            out.append(_alert("lease_ttl", "critical", engine_id,
                              f"slowest load {max_load:.0f} ms >= lease TTL {ttl} ms "
                              "(default_kv_lease_ttl)", HINTS["LEASE_EXPIRED"], now_ms))
        elif max_load >= 0.8 * ttl:
            out.append(_alert("lease_ttl", "warning", engine_id,
                              f"slowest load {max_load:.0f} ms is within 20% of lease TTL "
                              f"{ttl} ms (default_kv_lease_ttl)", HINTS["LEASE_EXPIRED"], now_ms))
    lookups = sum(s.lookup.lookups for s in group)
    lookup_errors = sum(s.lookup.lookup_errors for s in group)
    if lookup_errors:
        sev = "critical" if lookups and lookup_errors * 2 >= lookups else "warning"
        last = [e for s in group for e in s.recent_errors if e.where == "lookup"]
        detail = f"; last: {last[-1].name}: {last[-1].message}" if last else ""
        out.append(_alert("lookup_errors", sev, engine_id,
                          f"{lookup_errors} of {lookups} lookups failed{detail}",
                          HINTS["LOOKUP"], now_ms))
    other = {n: c for n, c in errors.items()
             if n not in ("LEASE_EXPIRED", "OBJECT_NOT_FOUND") or not failed_after_hit}
    skipped = sum(s.transfers.saves_skipped for s in group)
    if skipped and "NO_AVAILABLE_HANDLE" not in other:
        other["NO_AVAILABLE_HANDLE"] = skipped
    if other:
        top = max(other, key=lambda n: other[n])
        listing = ", ".join(f"{n} {c}" for n, c in sorted(other.items(), key=lambda kv: -kv[1]))
        out.append(_alert("backend_errors", "warning", engine_id, f"backend errors: {listing}",
                          HINTS.get(top, "see the engine's log for the backend message"), now_ms))
    backends = {s.source.backend for s in group if s.source.backend}
    if majority_backend is not None and backends and backends != {majority_backend}:
        out.append(_alert(
            "backend_mismatch", "critical", engine_id,
            f"backend {'/'.join(sorted(backends))} differs from the fleet's {majority_backend}",
            "every engine of one pool must use the same backend "
            "(kv_connector_extra_config.backend = kv_cache_store_config.backend)", now_ms))
    for s in group:
        want = KV_ROLE_FOR.get(s.source.instance_role)
        if want is not None and s.source.kv_role != want:
            out.append(_alert(
                "kv_role_mismatch", "critical", engine_id,
                f"{s.source.instance_role} instance runs kv_role {s.source.kv_role}",
                f"set kv_role to {want} for {s.source.instance_role} instances", now_ms))
            break
    return out


def evaluate(
    states: Mapping[str, EngineState],
    last_seen_ms: Mapping[str, float],
    now_ms: float,
    *,
    stale_after_ms: float = 5_000.0,
    down_after_ms: float = 30_000.0,
) -> list[Alert]:
    """Every alert the current fleet state raises, pool alerts first, then per engine.

    Args:
        states: agent id -> latest EngineState (as ``FleetClient.fleet()`` holds it).
        last_seen_ms: agent id -> hub receive time of its last report (epoch ms); an agent
            missing here is aged by its own ``EngineState.ts_ms``.
        now_ms: current wall clock, epoch ms (tests pass a frozen value).
        stale_after_ms: silence after which an engine is ``stale`` (warning).
        down_after_ms: silence after which it is ``down`` (critical).

    Returns:
        Alerts sorted by severity (critical first) then key.
    """
    out = _pool_alerts(states, now_ms)
    groups = _by_engine(states)
    counts = Counter(s.source.backend for s in states.values() if s.source.backend)
    majority: str | None = None
    if counts:
        ranked = counts.most_common()
        # With a tie there is no "rest of the fleet" to differ from.
        if len(ranked) == 1 or ranked[0][1] > ranked[1][1]:
            majority = ranked[0][0]
    for engine_id in sorted(groups):
        group = groups[engine_id]
        out.extend(_engine_alerts(engine_id, group, majority, now_ms))
        seen = max(last_seen_ms.get(s.source.agent_id, s.ts_ms) for s in group)
        age = now_ms - seen
        if age > down_after_ms:
            out.append(_alert("stale", "critical", engine_id,
                              f"down: no report for {age / 1e3:.0f} s",
                              "engine process or its agent is gone; check the engine and "
                              "agent_address / KVPOOL_AGENT_ADDRESS", now_ms))
        elif age > stale_after_ms:
            out.append(_alert("stale", "warning", engine_id,
                              f"stale: no report for {age / 1e3:.1f} s",
                              "engine busy, hung or unreachable; its numbers are out of date",
                              now_ms))
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
