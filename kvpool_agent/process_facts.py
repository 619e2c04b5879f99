"""Facts about the reporting process that let an operator find it on its host afterwards.

``kvpool-console triage`` logs in to an engine's host over SSH when its agent goes silent and
looks for the process these facts name: its pid, the pid namespace it is counted in, and its
start time (``/proc/<pid>/stat``), its log file, and the ports and sockets it holds. They are
reported once, in ``Source``, because a process that is hung or gone can no longer say them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from typing import Any

import psutil

__all__ = ["ENGINE_LOG_ENV", "log_path", "pid_namespace", "process_facts", "start_ticks"]

ENGINE_LOG_ENV = "KVPOOL_ENGINE_LOG"
"""Environment variable naming the engine's log file when its output does not go to a file
directly (e.g. ``... | tee engine.log``)."""


def start_ticks(pid: int | None = None) -> int:
    """Start time of ``pid`` (default: this process) in clock ticks after boot, field 22 of
    ``/proc/<pid>/stat`` (proc(5)); 0 where there is no ``/proc`` (not Linux)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0
    # Field 2 (comm) is in parentheses and may contain spaces: count fields after the last ')'.
    return int(raw.rsplit(b")", 1)[1].split()[19])


def pid_namespace() -> int:
    """This process's pid namespace: the inode number of ``/proc/self/ns/pid`` (namespaces(7),
    Linux 3.8+; the number ``readlink`` shows as ``pid:[N]``); 0 where there is none to read
    (not Linux, no ``/proc``)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def log_path() -> str:
    """This process's log file: ``$KVPOOL_ENGINE_LOG`` when set to an absolute path, else the
    regular file stderr or stdout is written to; ``""`` when neither (a terminal, a pipe)."""
    named = os.environ.get(ENGINE_LOG_ENV, "")
    if os.path.isabs(named):
        return named
    for fd in (2, 1):
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return ""


def _listening_ports() -> tuple[int, ...]:
    try:
        conns = psutil.Process().net_connections(kind="inet")
    except (psutil.Error, OSError):
        return ()
    return tuple(sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}))


def process_facts(*, ports: Iterable[int] = (), sockets: Iterable[str] = (),
                  master: str = "") -> dict[str, Any]:
    """The ``Source`` fields triage needs, for this process: ``start_ticks``, ``pid_ns``,
    ``log_path``, ``ports`` (``ports`` given plus every TCP port this process listens on now),
    ``sockets`` and ``master`` (``host:port`` of the pool's master) as given.

    Use as ``Source(..., **process_facts(sockets=[...], master=...))``. Never raises.
    """
    return {"start_ticks": start_ticks(), "pid_ns": pid_namespace(), "log_path": log_path(),
            "ports": tuple(sorted({*ports, *_listening_ports()})),
            "sockets": tuple(sockets), "master": master}
