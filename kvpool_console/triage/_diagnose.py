"""The console's diagnosis from a triage report: hung or gone, OOM-killed, port held by whom.

Rules, in the order the findings are listed (critical first):

- a process in state ``T``/``t``: **hung** (stopped); alive while its agents are silent:
  **hung**; a zombie, a missing pid or a pid now naming another process: **gone** (both with
  the severity the console's stale alert gives the same verdict, ``alerts.silence``), with the
  exit status when the kernel kept it; a pid its agents reported from another pid namespace
  than the check's (``kvpool_console._liveness.same_pid_namespace``): neither, one line saying
  where to run triage instead;
- the kernel log names the pid in an OOM kill: **killed by the OOM killer**;
- one of the engine's ports or sockets is listened on by a process that is not the engine:
  **port held by pid N (name)** (information only for an engine in another pid namespace:
  its own pids there are not the ones seen here);
- the pool's master does not accept a TCP connection from the engine's host;
- the engine's transfers failed in the transport (its agents counted Mooncake's transfer or RPC
  errors, ``TRANSFER_FAIL``, ``RPC_FAIL``... (``kvpool_console._transport``), or its
  log has Mooncake's transport lines, ``TRANSPORT_LOG_MARKS``): a **transport failure**, named as
  one and with what to change (issue 38: a store that answers but whose transfer engine cannot
  move the bytes is not a stopped store);
- less than ``LOW_MEMORY`` of the host's memory is available.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from kvpool_agent.protocol import EngineState
from kvpool_console._liveness import OTHER_PID_NAMESPACE
from kvpool_console._transport import (
    TRANSPORT_HINT,
    failures_text,
    is_transport_error,
    transport_failures,
    transport_hint,
)
from kvpool_console.alerts.silence import VERDICT_SEVERITY
from kvpool_console.triage._model import Finding, HostReport, ProcessCheck, TriageReport

__all__ = ["LOW_MEMORY", "TRANSPORT_LOG_MARKS", "diagnose", "exit_status", "transport_facts"]

TRANSPORT_LOG_MARKS = ("Failed to complete transfers after", "TCP lane queue-full rejection",
                       "TRANSFER_FAIL")
"""Mooncake's log lines of a failed transport (``transfer_task.cpp``'s timeout, the TCP
transport's refusal of a full lane, the error's name)."""


def transport_facts(engine_id: str, states: Mapping[str, EngineState]) -> tuple[dict[str, int],
                                                                               str]:
    """The engine's failed transfers by transport error name and the newest such error's
    message, from its agents' last reports."""
    mine = [s for s in states.values() if s.source.engine_id == engine_id]
    errors = [e for s in mine for e in s.recent_errors if is_transport_error(e.name)]
    last = max(errors, key=lambda e: e.ts_ms, default=None)
    return transport_failures(mine), (f"{last.name}: {last.message}" if last else "")

LOW_MEMORY = 0.05
"""``MemAvailable / MemTotal`` below this is reported as low memory."""

_RANK = {"critical": 0, "warning": 1, "info": 2}


def diagnose(report: TriageReport) -> list[Finding]:
    """Findings for ``report``, most severe first."""
    out: list[Finding] = []
    for host in report.hosts:
        if host.ssh_error:
            out.append(Finding(kind="ssh", severity="critical", text=host.ssh_error))
        for note in host.refused:
            out.append(Finding(kind="note", severity="warning", text=f"{host.host}: {note}"))
        if host.ssh_error:
            continue
        for proc in host.processes:
            out.extend(_process(proc, host.host, report.reporting))
        out.extend(_ports(host))
        m = host.master
        if m is not None and m.reachable is False:
            out.append(Finding(kind="master", severity="critical",
                               text=f"pool master {m.address} unreachable from {host.host}: "
                                    f"{m.detail}"))
        out.extend(_transport_log(host))
        mem = host.memory
        if mem is not None and mem.total_bytes and \
                mem.available_bytes < LOW_MEMORY * mem.total_bytes:
            out.append(Finding(kind="memory", severity="warning",
                               text=f"{host.host}: memory low, {mem.available_bytes >> 20} MiB "
                                    f"available of {mem.total_bytes >> 20} MiB"))
    out.extend(_transport(report))
    return sorted(out, key=lambda f: _RANK[f.severity])


def _transport(report: TriageReport) -> list[Finding]:
    if not report.transport_failures:
        return []
    last = f" (last: {report.transport_error})" if report.transport_error else ""
    return [Finding(kind="transport", severity="critical",
                    text=f"transport failure: transfers failed with "
                         f"{failures_text(report.transport_failures)}{last}; fix: "
                         f"{transport_hint(report.transport_failures)}")]


def _transport_log(host: HostReport) -> list[Finding]:
    """Mooncake's transport lines in the engine's log tail, the newest one quoted."""
    lines = [ln for log in host.logs for ln in log.lines
             if any(m in ln for m in TRANSPORT_LOG_MARKS)]
    if not lines:
        return []
    return [Finding(kind="transport", severity="critical",
                    text=f"transport failure in the log on {host.host} ({len(lines)} lines, "
                         f"last: {lines[-1].strip()[:200]}); fix: {TRANSPORT_HINT}")]


def _process(p: ProcessCheck, host: str, reporting: bool) -> list[Finding]:
    who = f"pid {p.pid} ({p.name})" if p.name else f"pid {p.pid}"
    where = f"{who} on {host}"
    if p.state == "running":
        if reporting:
            return [Finding(kind="ok", severity="info",
                            text=f"running: {where}, state {p.letter}, reporting")]
        return [Finding(kind="hung", severity=VERDICT_SEVERITY["hung"],
                        text=f"hung: {where} is alive (state {p.letter}) but its agents "
                             "stopped reporting")]
    if p.state == "stopped":
        return [Finding(kind="hung", severity=VERDICT_SEVERITY["hung"],
                        text=f"hung: {where} is stopped (state {p.letter}: SIGSTOP or a "
                             f"debugger); kill -CONT {p.pid} resumes it")]
    if p.state == "unknown":
        return [Finding(kind="note", severity="warning",
                        text=f"{where}: process check failed: {p.error}")]
    if p.state == "other_namespace":
        return [Finding(kind="note", severity="warning",
                        text=f"{where} (pid namespace pid:[{p.pid_ns}]): "
                             f"{OTHER_PID_NAMESPACE}")]
    status = p.exit or f"exit status {p.exit_source}"
    if p.state == "zombie":
        text = f"gone: {where} {status}; its parent pid {p.ppid} has not reaped it"
    elif p.state == "reused":
        text = (f"gone: pid {p.pid} on {host} is now another process ({p.name}, started "
                f"later); {status}")
    else:
        text = f"gone: pid {p.pid} on {host} no longer exists; {status}"
    out = [Finding(kind="gone", severity=VERDICT_SEVERITY["gone"], text=text)]
    if p.oom_killed:
        out.append(Finding(kind="oom", severity="critical",
                           text=f"killed by the OOM killer: pid {p.pid} on {host} "
                                f"({p.kernel_log})"))
    return out


def _ports(host: HostReport) -> list[Finding]:
    if host.ports is None:
        return []
    if host.ports.error:
        return [Finding(kind="note", severity="warning",
                        text=f"{host.host}: port check failed: {host.ports.error}")]
    mine = {p.pid for p in host.processes if p.state != "other_namespace"}
    alive = any(p.state in ("running", "stopped") for p in host.processes)
    # Seen from outside its pid namespace, the engine's own pids are not the ones reported.
    elsewhere = any(p.state == "other_namespace" for p in host.processes)
    severity: Literal["critical", "warning", "info"] = (
        "info" if elsewhere else "warning" if alive else "critical")
    out: list[Finding] = []
    for item in host.ports.items:
        for h in item.holders:
            if h.pid in mine:
                continue
            holder = (f"pid {h.pid} ({h.name})" if h.pid else
                      "a process this user cannot see (need root for its pid)")
            out.append(Finding(kind="port", severity=severity,
                               text=f"{item.label} held by {holder} on {host.host}"
                                    + (" (the engine itself, from another pid namespace, or "
                                       "another process)" if elsewhere else "")))
        if not item.holders:
            out.append(Finding(kind="note", severity="info",
                               text=f"{item.label} on {host.host}: nothing listens"))
    return out


def exit_status(report: TriageReport) -> int:
    """``kvpool-console triage``'s exit status: 2 when a host could not be logged in to, 1
    when a finding is critical (hung, gone, OOM, port held from a dead engine, master
    unreachable), else 0."""
    if any(h.ssh_error for h in report.hosts):
        return 2
    return 1 if any(f.severity == "critical" for f in report.diagnosis) else 0
