"""A triage report as Rich ``Text``, for ``kvpool-console triage`` and the detail screen.

Everything that came from a host (log lines, process names, tool output, error messages) is
appended as plain text with ``Text.append``, which never interprets markup, and with its
control characters made visible (``ESC`` shows as ``\\x1b``), so remote output cannot drive
the operator's terminal.
"""

from __future__ import annotations

from rich.text import Text

from kvpool_console._text import visible
from kvpool_console.model import fmt_bytes
from kvpool_console.triage._local import TARGET
from kvpool_console.triage._model import HostReport, TriageReport

__all__ = ["render"]

_STYLE = {"critical": "bold red", "warning": "yellow", "info": "green"}


def _add(t: Text, text: str, style: str = "") -> None:
    t.append(visible(text), style=style)


def render(report: TriageReport, *, log_lines: int = 40) -> Text:
    """The diagnosis first, then per host: processes, ports, memory, NPU, master, log tail
    (its last ``log_lines`` lines)."""
    t = Text()
    _add(t, f"triage of engine {report.engine_id}", style="bold")
    _add(t, " (agents reporting)\n" if report.reporting else " (agents silent)\n")
    for f in report.diagnosis:
        _add(t, f"  {f.severity.upper():8} ", style=_STYLE[f.severity])
        _add(t, f.text + "\n")
    for host in report.hosts:
        if not host.ssh_error:
            _host(t, host, log_lines)
    return t


def _host(t: Text, h: HostReport, log_lines: int) -> None:
    _add(t, f"\nhost {h.host}", style="bold")
    via = "checked locally, no SSH" if h.target == TARGET else f"via {h.target}"
    _add(t, f" {via}, {h.elapsed_ms:.0f} ms\n")
    for p in h.processes:
        _add(t, f"  process {p.pid} ({', '.join(p.agents)}): {p.state}")
        if p.letter:
            _add(t, f" [{p.letter}] {p.name} ppid {p.ppid} start {p.start_ticks}")
        if p.start_ticks and p.reported_start_ticks not in (0, p.start_ticks):
            _add(t, f" (reported start {p.reported_start_ticks})")
        if p.state == "other_namespace":
            _add(t, f" (its pid namespace pid:[{p.pid_ns}], this check's pid:[{h.pid_ns}])")
        _add(t, "\n")
        if p.exit or p.exit_source:
            _add(t, f"    exit: {p.exit or '-'} ({p.exit_source})\n")
        if p.kernel_log:
            _add(t, f"    kernel log: {p.kernel_log}\n")
        for line in p.kernel_lines:
            _add(t, f"    | {line}\n", style="dim")
        if p.error:
            _add(t, f"    error: {p.error}\n", style="red")
    if h.ports is not None:
        if h.ports.error:
            _add(t, f"  ports: {h.ports.error}\n", style="red")
        else:
            _add(t, f"  ports ({h.ports.method}): engine listens on "
                     f"{', '.join(h.ports.engine_listens) or 'nothing'}\n")
            for item in h.ports.items:
                holders = ", ".join(f"{x.pid or '?'} ({x.name or '?'})" for x in item.holders)
                _add(t, f"    {item.label}: {holders or 'nothing listens'}\n")
    if h.memory is not None:
        m = h.memory
        _add(t, "  memory: " + (m.error or f"{fmt_bytes(m.available_bytes)} available of "
                 f"{fmt_bytes(m.total_bytes)}, swap {fmt_bytes(m.swap_free_bytes)} free of "
                 f"{fmt_bytes(m.swap_total_bytes)}") + "\n")
    if h.accel is not None:
        a = h.accel
        _add(t, "  npu: " + (a.error or a.note or "npu-smi / hccn_tool output below") + "\n")
        for line in [*a.npu_smi, *a.hccn]:
            _add(t, f"    | {line}\n", style="dim")
    _add(t, "  master: " + ("not reported by the agents" if h.master is None else
                             f"{h.master.address} {h.master.detail}") + "\n")
    for log in h.logs:
        _add(t, f"  log {log.path}" + (f": {log.error}\n" if log.error else "\n"))
        for line in log.lines[-log_lines:]:
            _add(t, f"    | {line}\n", style="dim")
