"""An engine's silence verdict: the one rule the ``stale`` alert, the fleet table's State column
(``EngineRow.state``), ``status`` (text and ``--json``), the totals and triage name a silent
engine by.

An engine is silent once its newest report is older than the stale threshold
(``AlertSettings.stale_after_ms``, the wire contract's ``STALE_AFTER_MS``: three missed
heartbeats). Then:

- **hung** (critical): its process runs on this host, proven by the start time its agent
  reported, and sends nothing (stopped, SIGSTOP or a debugger, or stuck);
- **gone** (critical): its process is not running (no such pid, a zombie, a pid now naming
  another process);
- else, when the console cannot look (another host, another pid namespace, processes that
  disagree): **stale** (warning) until the down threshold, then **down** (critical).

``kvpool-console triage ENGINE`` says the same of what it finds on the engine's host: a process
stopped or alive while its agents are silent is hung, one that is not running gone, both
critical (:data:`VERDICT_SEVERITY`). The alert is the verdict's one owner on the console: the
row reads it from the alert (``Alert.verdict``) instead of judging again, so a process that
dies between two looks cannot read "hung" in one view and "gone" in another.
"""

from __future__ import annotations

from typing import Literal

from kvpool_agent.protocol import Source
from kvpool_console.alerts.alert import Alert, Severity, fmt_ms, make_alert

__all__ = ["VERDICT_SEVERITY", "Verdict", "silence_alert", "silence_verdict"]

Verdict = Literal["hung", "gone", "down", "stale"]
"""What a silent engine is (module docstring); ``EngineRow.state`` shows it upper-cased."""

VERDICT_SEVERITY: dict[Verdict, Severity] = {
    "hung": "critical", "gone": "critical", "down": "critical", "stale": "warning"}
"""The severity of each verdict: every view (the alert, the State column's style, triage's
finding) gives a verdict this one."""


def silence_verdict(age_ms: float, alive: bool | None, *, stale_after_ms: float,
                    down_after_ms: float) -> Verdict | None:
    """The verdict on an engine whose newest report is ``age_ms`` old: ``None`` while it
    reports (``age_ms <= stale_after_ms``); else ``hung`` when its process is alive
    (``alive`` True), ``gone`` when it is not (False), and when that is not known (None)
    ``down`` past ``down_after_ms``, else ``stale``."""
    if age_ms <= stale_after_ms:
        return None
    if alive is not None:
        return "hung" if alive else "gone"
    return "down" if age_ms > down_after_ms else "stale"


def silence_alert(engine_id: str, head: Source, alive: bool | None, age_ms: float,
                  now_ms: float, *, stale_after_ms: float, down_after_ms: float
                  ) -> Alert | None:
    """The ``stale`` alert of a silent engine (``None`` while it reports): its verdict
    (:func:`silence_verdict`) in ``Alert.verdict``, as the first word of the message and in
    the severity; ``head`` is the process the verdict names, ``alive`` the liveness of the
    engine's processes on this host (``rules._liveness``: agreed by all, else None)."""
    verdict = silence_verdict(age_ms, alive, stale_after_ms=stale_after_ms,
                              down_after_ms=down_after_ms)
    if verdict is None:
        return None
    where = f"pid {head.pid} on {head.host or '?'}"
    if verdict == "hung":
        message = f"hung: {where} is alive but sent no report for {fmt_ms(age_ms)}"
        hint = ("the process is stopped or stuck (SIGSTOP, a debugger, a blocked thread): "
                f"`kvpool-console triage {engine_id}` shows its state and log (`kill -CONT` "
                "resumes a stopped one); restart it if it does not recover")
    elif verdict == "gone":
        message = f"gone: {where} is not running; last report {fmt_ms(age_ms)} ago"
        hint = ("the engine exited or was killed: read its log (`kvpool-console triage "
                f"{engine_id}`), restart it, or `kvpool-console forget {engine_id}` after a "
                "scale-down")
    elif verdict == "down":
        message = f"down: no report for {fmt_ms(age_ms)}"
        hint = ("the engine is hung or gone, or its agent cannot reach the hub: "
                f"`kvpool-console triage {engine_id}` tells which on its host; check "
                "agent_address / KVPOOL_AGENT_ADDRESS")
    else:
        message = f"stale: no report for {fmt_ms(age_ms)}"
        hint = "engine busy, hung or unreachable; its numbers are out of date"
    return make_alert("stale", VERDICT_SEVERITY[verdict], engine_id, message, hint, now_ms,
                      verdict=verdict)
