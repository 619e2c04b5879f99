"""Reading the output of the allow-listed commands (``_commands``) into result structs.

Formats: ``/proc/<pid>/stat``, ``/proc/meminfo``, ``/proc/net/{tcp,tcp6,unix}`` from proc(5);
``ss`` from iproute2's ss(8) (``users:(("name",pid=N,fd=M))``); the OOM killer's lines from
the kernel's ``mm/oom_kill.c`` (``Killed process N (name)``, ``oom-kill:...,pid=N,...``).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterable
from typing import NamedTuple

from kvpool_console.triage._model import Holder, MemoryCheck, PortHolding

__all__ = [
    "Listener",
    "Stat",
    "describe_wait_status",
    "holdings",
    "kernel_evidence",
    "parse_meminfo",
    "parse_proc_sockets",
    "parse_ss",
    "parse_stat",
    "sections",
]

Listener = tuple[str, str, Holder]
"""``("tcp", "8000", holder)`` or ``("unix", "/path", holder)``."""


def sections(text: str, marker: str) -> list[tuple[str, list[str]]]:
    """Split ``text`` at lines ``"<marker> <title>"``: ``[(title, lines), ...]``; lines before
    the first marker are dropped."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(marker + " "):
            out.append((line[len(marker) + 1:], []))
        elif out:
            out[-1][1].append(line)
    return out


class Stat(NamedTuple):
    """The fields of one ``/proc/<pid>/stat`` line triage uses (proc(5) numbering): ``name``
    (2, comm), ``letter`` (3, state), ``ppid`` (4), ``start_ticks`` (22), ``exit_code`` (52,
    a waitpid(2) status; None on kernels before 3.5)."""

    name: str
    letter: str
    ppid: int
    start_ticks: int
    exit_code: int | None


def parse_stat(text: str) -> Stat:
    """Parse one ``/proc/<pid>/stat``.

    Raises:
        ValueError: not a stat line.
    """
    head, sep, rest = text.strip().rpartition(")")
    if not sep or "(" not in head:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    name = head.split("(", 1)[1]
    fields = rest.split()
    # fields[0] is field 3 (state); field N is fields[N - 3].
    exit_code = int(fields[49]) if len(fields) > 49 else None
    return Stat(name, fields[0], int(fields[1]), int(fields[19]), exit_code)


def describe_wait_status(status: int) -> str:
    """``"exited with status 1"`` or ``"killed by signal 9 (SIGKILL)"`` for a waitpid(2)
    status word."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "unknown signal"
        core = ", core dumped" if os.WCOREDUMP(status) else ""
        return f"killed by signal {sig} ({name}{core})"
    return f"exited with status {os.WEXITSTATUS(status)}"


_OOM_KILLED = re.compile(r"Killed process (\d+) \(")
_OOM_KILL_EVENT = re.compile(r"oom-kill:.*[,:]pid=(\d+)[,\s]")
_CRASH = re.compile(r"\[(\d+)\]: (segfault|general protection|trap)")


_STAMP = re.compile(r"\[\s*(\d+(?:\.\d+)?)\]")
"""``[ 1234.567890]``: seconds after boot, as ``dmesg`` and ``journalctl -o short-monotonic``
print them."""


def kernel_evidence(lines: Iterable[str], pid: int, after_s: float | None = None
                    ) -> tuple[bool, str, list[str]]:
    """From kernel log ``lines``: (OOM-killed?, crash signal in words or ``""``, the lines
    naming ``pid``) for ``pid``. With ``after_s`` (the process's start, seconds after boot)
    lines stamped earlier are about an older process with the same pid and are skipped."""
    mine: list[str] = []
    oom = False
    crash = ""
    for line in lines:
        stamp = _STAMP.match(line)
        if after_s is not None and stamp is not None and float(stamp.group(1)) < after_s:
            continue
        hits = [m.group(1) for rx in (_OOM_KILLED, _OOM_KILL_EVENT) for m in rx.finditer(line)]
        c = _CRASH.search(line)
        if str(pid) in hits:
            oom = True
            mine.append(line)
        elif c is not None and int(c.group(1)) == pid:
            crash = "killed by signal 11 (SIGSEGV)" if c.group(2) == "segfault" else \
                f"crashed ({c.group(2)})"
            mine.append(line)
    return oom, crash, mine


def parse_meminfo(text: str) -> MemoryCheck:
    """``/proc/meminfo`` -> bytes (its values are kB)."""
    kb: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            kb[key.strip()] = int(parts[0])
    if "MemTotal" not in kb:
        return MemoryCheck(error="no MemTotal in /proc/meminfo")
    return MemoryCheck(total_bytes=kb["MemTotal"] * 1024,
                       available_bytes=kb.get("MemAvailable", kb.get("MemFree", 0)) * 1024,
                       swap_total_bytes=kb.get("SwapTotal", 0) * 1024,
                       swap_free_bytes=kb.get("SwapFree", 0) * 1024)


_SS_USER = re.compile(r'\("((?:[^"\\]|\\.)*)",pid=(\d+),fd=\d+\)')


def parse_ss(lines: Iterable[str]) -> list[Listener]:
    """``ss -H -l -n -p -t -x`` lines -> listeners. A socket whose process is not visible
    (another user's, without root) is listed with pid 0."""
    out: list[Listener] = []
    for line in lines:
        tok = line.split()
        if len(tok) < 5:
            continue
        if tok[0] == "tcp":
            where = ("tcp", tok[4].rpartition(":")[2])
        elif tok[0].startswith("u_"):
            where = ("unix", tok[4])
        else:
            continue
        users = _SS_USER.findall(line)
        for name, pid in users or [("", "0")]:
            out.append((*where, Holder(pid=int(pid), name=name)))
    return out


def parse_proc_sockets(net: list[str], fds: list[str], comm: list[str]) -> list[Listener]:
    """The ``/proc`` fallback of ``_commands.PORTS``: ``/proc/net/{tcp,tcp6,unix}`` lines, fd
    lines ``/proc/<pid>/fd socket:[<inode>]`` and comm lines ``/proc/<pid>/comm:<name>``."""
    names = {}
    for line in comm:
        path, _, name = line.partition(":")
        names[path.split("/")[2] if path.count("/") >= 3 else ""] = name
    owners: dict[str, list[int]] = {}
    for line in fds:
        d, _, link = line.partition(" ")
        if link.startswith("socket:[") and d.count("/") >= 3:
            owners.setdefault(link[8:-1], []).append(int(d.split("/")[2]))
    listening: list[tuple[str, str, str]] = []
    for line in net:
        tok = line.split()
        # tcp: sl local rem st ... inode(9); st 0A is LISTEN (include/net/tcp_states.h).
        if len(tok) >= 10 and tok[0].endswith(":") and tok[3] == "0A":
            listening.append(("tcp", str(int(tok[1].rpartition(":")[2], 16)), tok[9]))
        # unix: Num RefCount Protocol Flags Type St Inode Path; flag 0x10000 is __SO_ACCEPTCON.
        elif len(tok) >= 8 and tok[0].endswith(":") and int(tok[3], 16) & 0x10000:
            listening.append(("unix", tok[7], tok[6]))
    out: list[Listener] = []
    for kind, where, inode in listening:
        pids = sorted(set(owners.get(inode, []))) or [0]
        out.extend((kind, where, Holder(pid=p, name=names.get(str(p), ""))) for p in pids)
    return out


def holdings(listeners: list[Listener], ports: Iterable[int],
             sockets: Iterable[str]) -> list[PortHolding]:
    """One ``PortHolding`` per engine port and socket, with every process listening there."""
    items = [PortHolding(kind="tcp", port=p) for p in ports]
    items += [PortHolding(kind="unix", path=s) for s in sockets]
    for item in items:
        where = str(item.port) if item.kind == "tcp" else item.path
        seen = {h for kind, w, h in listeners if kind == item.kind and w == where}
        item.holders = sorted(seen, key=lambda h: (h.pid, h.name))
    return items
