"""Which hosts to visit and what to look for there, from an engine's agent reports.

Every value that will reach a remote command (pid, start time, port, path, master address)
is checked here against a strict pattern; a value that does not match is refused, listed in
the report, and never sent. Host names go only to the SSH library, also after a check.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool_agent.protocol import EngineState

__all__ = ["HostPlan", "PlanError", "ProcPlan", "plan_engine", "safe_host", "safe_path"]

_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})")
"""RFC 1123 host names (and IPv4 literals); no leading ``-``, so never read as an option."""

_PATH = re.compile(r"/[A-Za-z0-9._+@,=/-]{0,4095}")
"""Absolute paths of plain characters: no spaces, quotes, ``$``, backquotes or newlines."""

_PID_MAX = 4_194_304
"""``PID_MAX_LIMIT`` on 64-bit Linux (include/linux/threads.h)."""


class PlanError(ValueError):
    """The engine is unknown or none of its agents said where it runs."""


def safe_host(host: str) -> bool:
    """A host name or IP literal triage will hand to SSH. IPv6 scope ids (``fe80::1%eth0``)
    are refused: their ``%`` part is free text to ``ipaddress``, and nothing starting with
    ``-`` could ever be read as an ssh option."""
    if _HOSTNAME.fullmatch(host):
        return True
    if "%" in host or host.startswith("-"):
        return False
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


_DEVICE_TREES = ("/dev", "/proc", "/sys")
"""Where paths name devices and kernel interfaces, not log files: reading ``/dev/zero`` or
``/proc/kmsg`` never ends."""


def safe_path(path: str) -> bool:
    """An absolute path of the characters in ``_PATH``, without ``..`` or ``.`` components,
    empty components, or a place under ``/dev``, ``/proc`` or ``/sys``."""
    if not _PATH.fullmatch(path):
        return False
    parts = path.split("/")[1:]
    if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        return False
    return not any(path == d or path.startswith(d + "/") for d in _DEVICE_TREES)


def _safe_master(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return safe_host(host) and port.isdigit() and 0 < int(port) < 65536


@dataclass(frozen=True)
class ProcPlan:
    """One engine process: ``pid``, its reported start (0: not reported, or ``disputed``: its
    agents reported different starts), its agents and the pid namespace ``pid`` is counted in
    (``Source.pid_ns``; 0: not reported)."""

    pid: int
    start_ticks: int
    agents: tuple[str, ...]
    pid_ns: int = 0
    disputed: bool = False


def merged_start(a: int, b: int, disputed: bool) -> tuple[int, bool]:
    """The start ticks of one process that agents reported as ``a`` and ``b`` (0: not
    reported), and whether they are disputed: two different starts mean one agent is forged
    or stale, and then none is used (0), as the stale alert judges a process only when its
    agents agree (``kvpool_console._liveness``); a forged start would otherwise make a live
    engine's pid look reused (gone)."""
    if disputed or (a and b and a != b):
        return 0, True
    return max(a, b), False


@dataclass
class HostPlan:
    """What to check on ``host``; ``refused`` says which reported values were not sent."""

    host: str
    procs: list[ProcPlan] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    sockets: list[str] = field(default_factory=list)
    master: str = ""
    refused: list[str] = field(default_factory=list)


def plan_engine(engine_id: str, states: Mapping[str, EngineState]) -> list[HostPlan]:
    """Group ``engine_id``'s agents by host and process (agents of one process share a pid
    and its pid namespace).

    Raises:
        PlanError: no agent of ``engine_id`` in ``states``, or none reported a usable host
            and pid (the message says which).
    """
    mine = sorted((s.source for s in states.values() if s.source.engine_id == engine_id),
                  key=lambda s: s.agent_id)
    if not mine:
        known = sorted({s.source.engine_id for s in states.values()})
        raise PlanError(f"unknown engine {engine_id!r}; known: {', '.join(known) or 'none'}")
    plans: dict[str, HostPlan] = {}
    skipped: list[str] = []
    procs: dict[tuple[str, int, int], list[str]] = {}
    starts: dict[tuple[str, int, int], tuple[int, bool]] = {}
    for src in mine:
        if not src.host or not 0 < src.pid <= _PID_MAX:
            skipped.append(f"agent {src.agent_id} reported no host or pid")
            continue
        if not safe_host(src.host):
            skipped.append(f"agent {src.agent_id}: host {src.host!r} refused (not a host name)")
            continue
        plan = plans.setdefault(src.host, HostPlan(host=src.host))
        key = (src.host, src.pid, src.pid_ns)
        procs.setdefault(key, []).append(src.agent_id)
        starts[key] = merged_start(src.start_ticks, *starts.get(key, (0, False)))
        _add_values(plan, src.agent_id, src.log_path, src.ports, src.sockets, src.master)
    if not plans:
        raise PlanError(f"engine {engine_id!r}: " + "; ".join(skipped))
    for (host, pid, pid_ns), agents in procs.items():
        start, disputed = starts[(host, pid, pid_ns)]
        plans[host].procs.append(ProcPlan(pid, start, tuple(agents), pid_ns, disputed))
    for plan in plans.values():
        plan.refused[:0] = skipped
    return list(plans.values())


def _add_values(plan: HostPlan, agent: str, log: str, ports: tuple[int, ...],
                sockets: tuple[str, ...], master: str) -> None:
    if log and log not in plan.logs:
        if safe_path(log):
            plan.logs.append(log)
        else:
            plan.refused.append(f"{agent}: log path {log!r} refused (not an absolute path of "
                                "plain characters outside /dev, /proc and /sys)")
    for port in ports:
        if 0 < port < 65536 and port not in plan.ports:
            plan.ports.append(port)
    for path in sockets:
        if path in plan.sockets:
            continue
        if safe_path(path):
            plan.sockets.append(path)
        else:
            plan.refused.append(f"{agent}: socket path {path!r} refused")
    if master and not plan.master:
        if _safe_master(master):
            plan.master = master
        else:
            plan.refused.append(f"{agent}: master address {master!r} refused (not host:port)")
