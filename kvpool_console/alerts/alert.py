"""One alert (:class:`Alert`), its severities and the names rules give pools and durations."""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import msgspec

# One owner of pool names: the hub's /metrics names pools alike (kvpool_agent.pool_readings).
from kvpool_agent.pool_readings import pool_name

__all__ = ["AFTER_HIT", "CAUSES_FIRST", "SEVERITY_RANK", "SEVERITY_STYLE", "Alert", "Severity",
           "alert_order", "engines_text", "fmt_ms", "make_alert", "pool_name"]

Severity = Literal["info", "warning", "critical"]
"""``info``: a state to know of that needs no action while it is expected (``model_versions``:
a rolling update, issue 39 item 5); it marks no engine's state."""

SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}
"""Order of severities for ``--fail-on``: an alert counts when its rank is >= the chosen one."""

SEVERITY_STYLE: dict[str, str] = {"info": "cyan", "warning": "yellow", "critical": "bold red"}
"""How an alert's severity label is drawn (``status``, the Events tab)."""

CAUSES_FIRST = frozenset({"lease_ttl", "pool_no_segments"})
"""Rules listed before the others of their severity: a lease TTL below the load time makes
the loads fail after their hit (``failed_after_hit``) and stay in flight; the TTL is what to
change (issue 38 item 4). A pool without memory (``pool_no_segments``) fails every save."""


AFTER_HIT = ("LEASE_EXPIRED", "OBJECT_NOT_FOUND")
"""Error names of a load that failed after a positive lookup (``failed_after_hit``)."""


class Alert(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One active alert.

    ``rule`` is a stable id (``pool_watermark``, ``failed_after_hit``, ``lease_ttl``,
    ``lookup_errors``, ``backend_errors``, ``backend_mismatch``, ``kv_role_mismatch``,
    ``role_topology``, ``pool_unhealthy``, ``pool_no_segments``, ``disk_over_limit``,
    ``stale``, ``start_failed``, ``stuck_transfer``, ``namespace_split``, ``model_versions``,
    ``version_skew``, ``unshared_identity``, ``no_leader``, ``master_behind``,
    ``policy_master``;
    :class:`AlertModel` adds ``pause_wait``, ``pool_evicting``, ``pool_failover`` and, from
    the hub's reuse figures, ``silent_miss``, subject the model name);
    ``subject`` the engine id (the pool name for pool rules, the model name(s) for
    ``namespace_split``, the model name or ``<model> lora <adapter name>`` for
    ``model_versions``); ``key`` = ``f"{rule}:{subject}"`` identifies the alert
    across refreshes; ``verdict`` is a ``stale`` alert's verdict on its silent engine
    (``hung``, ``gone``, ``down`` or ``stale``: :mod:`.silence`), which the engine's State
    (``EngineRow.state``) shows, and ``""`` (left out of ``status --json``) for every other
    rule.
    """

    key: str
    rule: str
    severity: Severity
    subject: str
    message: str
    hint: str
    ts_ms: float
    verdict: str = ""


def fmt_ms(ms: float) -> str:
    """A duration given in ms, for messages: ``"850 ms"`` below a second, ``"3.2 s"`` below
    a minute, else ``"2.5 min"``."""
    if ms < 1_000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1e3:.1f} s"
    return f"{ms / 6e4:.1f} min"


def make_alert(rule: str, severity: Severity, subject: str, message: str, hint: str,
               ts_ms: float, *, verdict: str = "") -> Alert:
    return Alert(key=f"{rule}:{subject}", rule=rule, severity=severity, subject=subject,
                 message=message, hint=hint, ts_ms=ts_ms, verdict=verdict)


def alert_order(alert: Alert) -> tuple[int, bool, str]:
    """Sort key of a list of alerts: critical first, a severity's causes (``CAUSES_FIRST``)
    before its other rules, then by key. The one order of ``evaluate``, the console's model
    and ``status``."""
    return -SEVERITY_RANK[alert.severity], alert.rule not in CAUSES_FIRST, alert.key


def engines_text(engines: Collection[str], limit: int = 8) -> str:
    """``engines`` sorted and comma-joined, past ``limit`` counted (``and N more``)."""
    names = sorted(engines)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more

