"""Run the allow-listed checks on every host of an engine, in parallel, each bounded in time.

A host that is this machine (``is_this_host``: the console's one rule for it) is checked
locally, as the console's own user (``_local``), unless SSH is forced; any other host over one
SSH connection (``_ssh``). Either way the checks are the same commands, run separately, at most
``_CHANNELS`` at a time (sshd's ``MaxSessions`` is 10 by default). Hosts are checked
concurrently. A check that fails or times out is reported in its own ``error`` field and the
others still complete.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvpool_agent.protocol import EngineState
from kvpool_console._liveness import same_pid_namespace
from kvpool_console._this_host import is_this_host
from kvpool_console.triage import _commands as C
from kvpool_console.triage import _local
from kvpool_console.triage._diagnose import diagnose, transport_facts
from kvpool_console.triage._model import (
    AccelCheck,
    HostReport,
    LogTail,
    MasterCheck,
    MemoryCheck,
    PortsCheck,
    ProcessCheck,
    TriageReport,
)
from kvpool_console.triage._parse import (
    describe_wait_status,
    holdings,
    kernel_evidence,
    parse_meminfo,
    parse_proc_sockets,
    parse_ss,
    parse_stat,
    sections,
)
from kvpool_console.triage._plan import HostPlan, ProcPlan, merged_start, plan_engine

__all__ = ["CHECK_TIMEOUT_S", "check_host", "triage_engine"]

CHECK_TIMEOUT_S = 5.0
"""Upper bound of each remote command, seconds."""

_CHANNELS = 4

MAX_HOSTS = 64
"""Hosts one triage checks at most; the rest are listed as not checked. Hosts come from agent
reports (up to 1,024 agents an engine): without a bound one forged engine made a triage open
as many SSH logins, or run as many sets of local checks."""

MAX_LOGS = 8
"""Log files one host's check reads at most (each agent may report its own)."""

Outcome = tuple[int | None, str, str] | str
"""(exit status, stdout, stderr), or the error text when the command did not complete."""

Attempt = Callable[..., Awaitable[Outcome]]
"""``attempt(script, *args)``: one check on the host, bounded in time."""


async def triage_engine(engine_id: str, states: Mapping[str, EngineState], *,
                        reporting: bool, ssh_config: str | None = None,
                        timeout_s: float = CHECK_TIMEOUT_S, ssh: bool = False) -> TriageReport:
    """Run the checks on every host of ``engine_id``: locally on this machine, else over SSH.

    Args:
        engine_id: the engine, as its agents report it.
        states: the fleet (agent id -> last EngineState), e.g. ``FleetSource.fleet()[0]``.
        reporting: whether the engine's agents still report (not stale): tells "hung" from a
            process that is merely busy.
        ssh_config: an ssh config file instead of ``~/.ssh/config``.
        timeout_s: bound of each command, seconds.
        ssh: log in over SSH to a host that is this machine too.

    Raises:
        PlanError: unknown engine, or no agent reported a usable host and pid.
    """
    plans = _bounded(plan_engine(engine_id, states), ssh=ssh)
    hosts = await asyncio.gather(*(check_host(p, ssh_config=ssh_config, timeout_s=timeout_s,
                                              ssh=ssh)
                                   for p in plans))
    report = TriageReport(engine_id=engine_id, ts_ms=time.time() * 1e3, reporting=reporting,
                          hosts=list(hosts))
    report.transport_failures, report.transport_error = transport_facts(engine_id, states)
    report.diagnosis = diagnose(report)
    return report


def _bounded(plans: list[HostPlan], *, ssh: bool) -> list[HostPlan]:
    """``plans`` with every host that is this machine merged into one (unless ``ssh``: then
    each is its own login), at most ``MAX_HOSTS`` hosts and ``MAX_LOGS`` logs a host; what is
    left out is listed in the first plan's ``refused``."""
    here = [] if ssh else [p for p in plans if is_this_host(p.host)]
    if len(here) > 1:
        plans = [_merge(here) if p is here[0] else p for p in plans if p not in here[1:]]
    for p in plans:
        if len(p.logs) > MAX_LOGS:
            p.refused.append(f"{len(p.logs) - MAX_LOGS} more log paths not read (at most "
                             f"{MAX_LOGS} a host): {', '.join(p.logs[MAX_LOGS:MAX_LOGS + 3])}...")
            del p.logs[MAX_LOGS:]
    if len(plans) > MAX_HOSTS:
        plans[0].refused.append(
            f"{len(plans) - MAX_HOSTS} more hosts not checked (at most {MAX_HOSTS} a triage): "
            f"{', '.join(p.host for p in plans[MAX_HOSTS:MAX_HOSTS + 3])}...")
        del plans[MAX_HOSTS:]
    return plans


def _merge(here: list[HostPlan]) -> HostPlan:
    """One plan for every spelling of this host (``localhost``, ``127.0.0.2``, the host
    name...): the same machine, checked once, named as its first agent named it."""
    merged = HostPlan(host=here[0].host)
    procs: dict[tuple[int, int], ProcPlan] = {}
    for plan in here:
        for proc in plan.procs:
            old = procs.get((proc.pid, proc.pid_ns))
            if old is not None:
                start, disputed = merged_start(old.start_ticks, proc.start_ticks,
                                               old.disputed or proc.disputed)
                proc = ProcPlan(proc.pid, start, old.agents + proc.agents, proc.pid_ns,
                                disputed)
            procs[(proc.pid, proc.pid_ns)] = proc
        _extend(merged.logs, plan.logs)
        _extend(merged.ports, plan.ports)
        _extend(merged.sockets, plan.sockets)
        _extend(merged.refused, plan.refused)
        merged.master = merged.master or plan.master
    merged.procs = list(procs.values())
    merged.refused.append(f"{', '.join(p.host for p in here[1:4])}"
                          f"{'...' if len(here) > 4 else ''} name this host as well: checked "
                          f"once, as {here[0].host}")
    return merged


def _extend(into: list[Any], values: list[Any]) -> None:
    into.extend(v for v in values if v not in into)


async def check_host(plan: HostPlan, *, ssh_config: str | None = None,
                     timeout_s: float = CHECK_TIMEOUT_S, ssh: bool = False) -> HostReport:
    """Every check of ``plan`` on its host, each bounded to ``timeout_s`` seconds: run
    locally when the host is this machine (``target`` ``"local"``) and ``ssh`` is False, else
    over SSH (``ssh_error`` set instead when the login fails)."""
    t0 = time.monotonic()
    gate = asyncio.Semaphore(_CHANNELS)
    if not ssh and is_this_host(plan.host):
        async def local(script: str, *args: str | int) -> Outcome:
            async with gate:
                return await _local.run(C.argv(script, *args, timeout_s=timeout_s), timeout_s)

        return await _checks(plan, local, _local.TARGET, t0, python=sys.executable)
    # asyncssh (and cryptography) load only when a triage runs, not with every console command.
    from kvpool_console.triage._ssh import SSHAccessError, connect, run

    try:
        conn, target = await connect(plan.host, config=ssh_config)
    except SSHAccessError as e:
        return HostReport(host=plan.host, ssh_error=str(e), refused=plan.refused)

    async def remote(script: str, *args: str | int) -> Outcome:
        async with gate:
            return await run(conn, C.command(script, *args, timeout_s=timeout_s), timeout_s)

    async with conn:
        report = await _checks(plan, remote, target, t0, python="python3")
    return report


async def _checks(plan: HostPlan, attempt: Attempt, target: str, t0: float, *,
                  python: str) -> HostReport:
    """Run every check of ``plan`` through ``attempt`` and read their outputs; ``python``
    runs the log tail (``_commands.log_tail``)."""
    marker = f"@@kvpool-triage-{secrets.token_hex(8)}@@"
    pids = [p.pid for p in plan.procs]
    master_job = (asyncio.ensure_future(attempt(C.MASTER, *_host_port(plan.master)))
                  if plan.master else None)
    procs, klog, ports, mem, accel, *logs = await asyncio.gather(
        attempt(C.PROCESSES, marker, *pids),
        attempt(C.KERNEL_LOG, marker),
        attempt(C.PORTS, marker),
        attempt(C.MEMINFO),
        attempt(C.ACCEL, marker),
        *(attempt(*C.log_tail(path, python)) for path in plan.logs))
    master = await master_job if master_job is not None else None
    checks, pid_ns = _processes(plan.procs, procs, klog, marker)
    judged = {c.pid for c in checks if c.state != "other_namespace"}
    disputed = [f"pid {p.pid}: its agents ({', '.join(p.agents[:4])}) report different start "
                "times, so none is used to tell it from a later process (one agent is forged "
                "or stale)" for p in plan.procs if p.disputed]
    return HostReport(
        host=plan.host, target=target, refused=plan.refused + disputed, processes=checks,
        pid_ns=pid_ns,
        logs=[_log(path, out) for path, out in zip(plan.logs, logs, strict=True)],
        ports=_ports(plan, judged, ports, marker), memory=_memory(mem),
        accel=_accel(accel, marker), master=_master(plan.master, master),
        elapsed_ms=(time.monotonic() - t0) * 1e3)


def _host_port(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def _failed(out: Outcome) -> str:
    """The error of an outcome that did not give stdout to parse, else ``""``."""
    if isinstance(out, str):
        return out
    status, _, err = out
    return f"exit status {status}: {err.strip()[:200]}" if status != 0 else ""


def _klog(out: Outcome, marker: str) -> tuple[str, list[str] | None]:
    """(which log was read or why none could be, its lines or None)."""
    if isinstance(out, str):
        return f"kernel log check failed: {out}", None
    parts = sections(out[1], marker)
    if not parts:
        return f"kernel log check failed: {_failed(out) or 'no output'}", None
    title, lines = parts[0]
    if title == "unreadable":
        return "unreadable: " + "; ".join(line.strip() for line in lines), None
    return title, lines


_PID_NS = re.compile(r"pid:\[(\d+)\]")
"""``readlink /proc/self/ns/pid``: ``pid:[4026531836]`` (namespaces(7))."""


def _processes(plans: list[ProcPlan], out: Outcome, klog_out: Outcome,
               marker: str) -> tuple[list[ProcessCheck], int]:
    """Each process's check, and the checking shell's pid namespace (0: unread)."""
    if isinstance(out, str) or not plans:
        return [ProcessCheck(pid=p.pid, agents=list(p.agents), state="unknown",
                             error=out if isinstance(out, str) else "no pid")
                for p in plans], 0
    stats: dict[int, str] = {}
    gone: set[int] = set()
    clk = 100
    pid_ns = 0
    hidden = False
    for title, lines in sections(out[1], marker):
        kind, _, arg = title.partition(" ")
        if kind == "clk" and arg.strip().isdigit():
            clk = int(arg)
        elif kind == "pidns" and (m := _PID_NS.fullmatch(arg.strip())):
            pid_ns = int(m.group(1))
        elif kind == "hidepid":
            hidden = True
        elif kind == "pid" and arg.isdigit():
            stats[int(arg)] = "\n".join(lines)
        elif kind == "gone" and arg.isdigit():
            gone.add(int(arg))
    source, klines = _klog(klog_out, marker)
    checks = [_process(p, stats.get(p.pid, ""), p.pid in gone, source, klines, clk)
              if same_pid_namespace(p.pid_ns, pid_ns) else
              # The pid names some process of this host's namespace, not the engine's.
              ProcessCheck(pid=p.pid, agents=list(p.agents), state="other_namespace",
                           reported_start_ticks=p.start_ticks, pid_ns=p.pid_ns)
              for p in plans]
    for c in checks:
        if hidden and c.state == "gone":
            # Under hidepid a live process of another user looks exactly like a gone one.
            c.state, c.error = "unknown", (
                "/proc hides other users' processes (mounted with hidepid): gone or hidden "
                "cannot be told apart; add the triage user to the proc mount's gid= group")
    return checks, pid_ns


def _process(plan: ProcPlan, stat: str, gone: bool, klog_source: str,
             klines: list[str] | None, clk: int) -> ProcessCheck:
    check = ProcessCheck(pid=plan.pid, agents=list(plan.agents), state="gone",
                         reported_start_ticks=plan.start_ticks, pid_ns=plan.pid_ns)
    if not gone:
        try:
            st = parse_stat(stat)
        except (ValueError, IndexError) as e:
            check.state, check.error = "unknown", str(e)
            return check
        check.letter, check.name, check.ppid = st.letter, st.name, st.ppid
        check.start_ticks = st.start_ticks
        if plan.start_ticks and st.start_ticks != plan.start_ticks:
            check.state = "reused"
        elif st.letter in ("T", "t"):
            check.state = "stopped"
            return check
        elif st.letter == "Z":
            check.state = "zombie"
            if st.exit_code is not None:
                check.exit = describe_wait_status(st.exit_code)
                check.exit_source = ("/proc/<pid>/stat of the zombie: the kernel keeps it "
                                     "until the parent reaps it")
        elif st.letter != "X":
            check.state = "running"
            return check
    # The process this engine ran is dead: what did the kernel log say about it?
    check.kernel_log = klog_source
    if klines is None:
        check.exit_source = check.exit_source or f"unknown: kernel log {klog_source}"
        return check
    after = plan.start_ticks / clk if plan.start_ticks else None
    oom, crash, mine = kernel_evidence(klines, plan.pid, after)
    check.oom_killed, check.kernel_lines = oom, mine
    if not check.exit and (oom or crash):
        check.exit = "killed by signal 9 (SIGKILL)" if oom else crash
        check.exit_source = f"kernel log ({klog_source})" + (": the OOM killer" if oom else "")
    if not check.exit:
        check.exit_source = ("unknown: reaped by its parent, and the kernel log names no OOM "
                             "kill or crash of this pid; its parent or service manager (e.g. "
                             "systemctl status) has the status")
    return check


def _log(path: str, out: Outcome) -> LogTail:
    if isinstance(out, str):
        return LogTail(path=path, error=out)
    status, stdout, stderr = out
    if status != 0:
        return LogTail(path=path, error=stderr.strip() or f"exit status {status}")
    return LogTail(path=path, lines=stdout.splitlines())


def _ports(plan: HostPlan, pids: set[int], out: Outcome, marker: str) -> PortsCheck:
    """The holders of ``plan``'s ports and sockets, and what ``pids`` (the engine's processes
    judged here) listen on."""
    if isinstance(out, str):
        return PortsCheck(error=out)
    parts = dict(sections(out[1], marker))
    if "ss" in parts:
        method, listeners = "ss", parse_ss(parts["ss"])
    elif "proc" in parts:
        method = "/proc"
        listeners = parse_proc_sockets(parts["proc"], parts.get("fds", []),
                                       parts.get("comm", []))
    else:
        return PortsCheck(error=_failed(out) or "no output")
    return PortsCheck(method=method, items=holdings(listeners, plan.ports, plan.sockets),
                      engine_listens=sorted({f"{k} {w}" for k, w, h in listeners
                                             if h.pid in pids}))


def _memory(out: Outcome) -> MemoryCheck:
    err = _failed(out)
    return MemoryCheck(error=err) if err or isinstance(out, str) else parse_meminfo(out[1])


def _accel(out: Outcome, marker: str) -> AccelCheck:
    if isinstance(out, str):
        return AccelCheck(error=out)
    parts = dict(sections(out[1], marker))
    if "absent" in parts:
        return AccelCheck(note="skipped: neither npu-smi nor hccn_tool is installed")
    return AccelCheck(present=True, npu_smi=parts.get("npu-smi", []),
                      hccn=parts.get("hccn_tool", []))


def _master(address: str, out: Outcome | None) -> MasterCheck | None:
    if not address or out is None:
        return None
    if isinstance(out, str):
        return MasterCheck(address=address, detail=out)
    line = out[1].strip()
    reachable = True if line.startswith("reachable") else (
        False if line.startswith("unreachable") else None)
    return MasterCheck(address=address, reachable=reachable, detail=line or _failed(out))
