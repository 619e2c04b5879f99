"""Who steers the saves of engines configured for the pool-wide policy service (``admission:
service``, issue 40 item 1): each one's scheduler reports it (``EngineState.policy``), and the
``policy_master`` warning names the pools whose engines have the master in charge because the
service has been silent past their stale time (every chunk saved, the master's watermark
evicting: a working pool, not the policy configured)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvpool_agent.protocol import EngineState, PolicySteering
from kvpool_console.alerts.alert import Alert, engines_text, fmt_ms, make_alert, pool_name

__all__ = ["POLICY_HINT", "engine_policy", "policy_alerts", "policy_text", "service_removed",
           "steering_summary"]

POLICY_HINT = ("start or check the policy service: `kvpool-policy serve` beside the master "
               "(`kvpool-policy status --listen ADDRESS --keys DIR` shows whether it "
               "publishes), and the engines' `policy_service` address; see docs/policy.md")
"""The fix ``policy_master`` gives."""


def engine_policy(group: Iterable[EngineState]) -> PolicySteering | None:
    """An engine's newest ``PolicySteering`` (its scheduler reports it), ``None`` for an engine
    not configured for the service (or whose agents predate the field)."""
    newest: PolicySteering | None = None
    for s in group:
        if s.policy is not None and (newest is None or s.policy.ts_ms > newest.ts_ms):
            newest = s.policy
    return newest


def policy_text(p: PolicySteering) -> str:
    """``policy: service`` or ``policy: master (service silent 12.0 s)`` (``records not
    connected`` while snapshots still arrive)."""
    if p.in_charge == "service":
        return "policy: service"
    why = (f"service silent {fmt_ms(p.silent_ms)}" if p.silent_ms >= p.stale_ms or
           p.records_connected else "records not connected")
    return f"policy: master ({why})"


def service_removed(engines: Iterable[tuple[str, int]]) -> int:
    """Keys the policy services removed since they started, over ``(service address, keys its
    last snapshot said)`` of the engines configured for one: each service's largest count
    (engines hear it at different times), summed over services."""
    most: dict[str, int] = {}
    for service, n in engines:
        if service:
            most[service] = max(most.get(service, 0), n)
    return sum(most.values())


def steering_summary(engines: Iterable[tuple[str, str, str]], removed: int = 0
                     ) -> tuple[str, bool]:
    """``policy: the service steers N engine(s) (e1, e2), removed K keys; the master steers M:
    e3 (service silent 12.0 s); silent 1: e4 (last said service)`` over ``(engine id, who,
    policy_text)`` of the engines configured for the service (who: ``service``, ``master``,
    ``silent`` for an engine that stopped reporting, ``EngineRow.steered_by``, counted
    under neither: who steers it now is not known; ``""``: not configured, left out) and the
    keys the service removed (``service_removed``: the master's eviction count leaves them
    out), and whether the master steers any (the Pool tab shows it yellow). One line for the
    Pool tab and ``status``."""
    rows = list(engines)
    steered = [eid for eid, who, _ in rows if who == "service"]
    master = [(eid, text) for eid, who, text in rows if who == "master"]
    silent = [(eid, text) for eid, who, text in rows if who == "silent"]
    line = f"policy: the service steers {len(steered)} engine(s)"
    if steered:
        line += f" ({engines_text(steered, 4)})"
    if removed:
        line += f", removed {removed:,} keys"
    if master:
        shown = [f"{eid} {text.removeprefix('policy: master ')}" for eid, text in master[:4]]
        more = f" and {len(master) - 4} more" if len(master) > 4 else ""
        line += f"; the master steers {len(master)}: {', '.join(shown)}{more}"
    if silent:
        shown = [f"{eid} (last said {text.removeprefix('policy: ')})" for eid, text in silent[:4]]
        more = f" and {len(silent) - 4} more" if len(silent) > 4 else ""
        line += f"; silent {len(silent)}: {', '.join(shown)}{more}"
    return line, bool(master)


def policy_alerts(groups: Mapping[str, list[EngineState]], last_seen_ms: Mapping[str, float],
                  now_ms: float, stale_after_ms: float) -> list[Alert]:
    """``policy_master`` (warning), one per pool (subject its name): engines configured for
    the policy service whose scheduler has had the master in charge for at least its stale
    time (``PolicySteering.silent_ms >= stale_ms``). Engines silent past ``stale_after_ms``
    (ms) are left out: their report is old (``stale`` names them)."""
    by_pool: dict[str, tuple[list[str], set[str], float]] = {}
    for eid, group in groups.items():
        p = engine_policy(group)
        if p is None or p.in_charge != "master" or p.silent_ms < p.stale_ms:
            continue
        seen = max(last_seen_ms.get(s.source.agent_id, s.ts_ms) for s in group)
        if now_ms - seen > stale_after_ms:
            continue
        st = next((s for s in group if s.policy is not None), group[0])
        name = pool_name(st)
        engines, services, silent = by_pool.get(name, ([], set(), 0.0))
        engines.append(eid)
        services.add(p.service or "?")
        by_pool[name] = (engines, services, max(silent, p.silent_ms))
    return [make_alert(
        "policy_master", "warning", pool,
        f"the master is in charge of {len(engines)} engine(s) configured for the policy "
        f"service ({engines_text(engines)}): {', '.join(sorted(services))} silent "
        f"{fmt_ms(silent)}; every chunk is saved and the master's watermark evicts",
        POLICY_HINT, now_ms) for pool, (engines, services, silent) in sorted(by_pool.items())]
