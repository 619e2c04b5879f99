"""A triage report as Rich ``Text``, for ``kvpool-console triage`` and the detail screen.

Everything that came from a host (log lines, process names, tool output, error messages) is
appended as plain text with ``Text.append``, which never interprets markup.
"""

from __future__ import annotations

from rich.text import Text

from kvpool_console.model import fmt_bytes
from kvpool_console.triage._model import HostReport, TriageReport

__all__ = ["render"]

_STYLE = {"critical": "bold red", "warning": "yellow", "info": "green"}


def render(report: TriageReport, *, log_lines: int = 40) -> Text:
    """The diagnosis first, then per host: processes, ports, memory, NPU, master, log tail
    (its last ``log_lines`` lines)."""
    t = Text()
    t.append(f"triage of engine {report.engine_id}", style="bold")
    t.append(" (agents reporting)\n" if report.reporting else " (agents silent)\n")
    for f in report.diagnosis:
        t.append(f"  {f.severity.upper():8} ", style=_STYLE[f.severity])
        t.append(f.text + "\n")
    for host in report.hosts:
        if not host.ssh_error:
            _host(t, host, log_lines)
    return t


def _host(t: Text, h: HostReport, log_lines: int) -> None:
    t.append(f"\nhost {h.host}", style="bold")
    t.append(f" via {h.target}, {h.elapsed_ms:.0f} ms\n")
    for p in h.processes:
        t.append(f"  process {p.pid} ({', '.join(p.agents)}): {p.state}")
        if p.letter:
            t.append(f" [{p.letter}] {p.name} ppid {p.ppid} start {p.start_ticks}")
        if p.start_ticks and p.reported_start_ticks not in (0, p.start_ticks):
            t.append(f" (reported start {p.reported_start_ticks})")
        t.append("\n")
        if p.exit or p.exit_source:
            t.append(f"    exit: {p.exit or '-'} ({p.exit_source})\n")
        if p.kernel_log:
            t.append(f"    kernel log: {p.kernel_log}\n")
        for line in p.kernel_lines:
            t.append(f"    | {line}\n", style="dim")
        if p.error:
            t.append(f"    error: {p.error}\n", style="red")
    if h.ports is not None:
        if h.ports.error:
            t.append(f"  ports: {h.ports.error}\n", style="red")
        else:
            t.append(f"  ports ({h.ports.method}): engine listens on "
                     f"{', '.join(h.ports.engine_listens) or 'nothing'}\n")
            for item in h.ports.items:
                holders = ", ".join(f"{x.pid or '?'} ({x.name or '?'})" for x in item.holders)
                t.append(f"    {item.label}: {holders or 'nothing listens'}\n")
    if h.memory is not None:
        m = h.memory
        t.append("  memory: " + (m.error or f"{fmt_bytes(m.available_bytes)} available of "
                 f"{fmt_bytes(m.total_bytes)}, swap {fmt_bytes(m.swap_free_bytes)} free of "
                 f"{fmt_bytes(m.swap_total_bytes)}") + "\n")
    if h.accel is not None:
        a = h.accel
        t.append("  npu: " + (a.error or a.note or "npu-smi / hccn_tool output below") + "\n")
        for line in [*a.npu_smi, *a.hccn]:
            t.append(f"    | {line}\n", style="dim")
    t.append("  master: " + ("not reported by the agents" if h.master is None else
                             f"{h.master.address} {h.master.detail}") + "\n")
    for log in h.logs:
        t.append(f"  log {log.path}" + (f": {log.error}\n" if log.error else "\n"))
        for line in log.lines[-log_lines:]:
            t.append(f"    | {line}\n", style="dim")
