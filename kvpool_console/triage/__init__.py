"""Triage: when an engine's agent goes silent, look at its host.

``triage_engine`` connects to each host of an engine with the operator's SSH setup
(``asyncssh``; host keys always checked), or, for a host that is this machine, runs locally as
the console's user (``_local``); it runs a fixed allow-list of read-only checks
(``_commands``) in parallel, each bounded in time, and returns a ``TriageReport`` with the
console's diagnosis: hung or gone, killed by the OOM killer, port held by pid N (name).
``kvpool-console triage`` is in ``triage.cli``; the detail screen's panel in ``triage.panel``.
"""

from kvpool_console.triage._diagnose import diagnose, exit_status
from kvpool_console.triage._model import Finding, HostReport, ProcessCheck, TriageReport
from kvpool_console.triage._plan import PlanError, plan_engine
from kvpool_console.triage._render import render
from kvpool_console.triage._run import CHECK_TIMEOUT_S, check_host, triage_engine

__all__ = [
    "CHECK_TIMEOUT_S",
    "Finding",
    "HostReport",
    "PlanError",
    "ProcessCheck",
    "TriageReport",
    "check_host",
    "diagnose",
    "exit_status",
    "plan_engine",
    "render",
    "triage_engine",
]
