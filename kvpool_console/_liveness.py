"""Is a silent engine's process still there? Asked for engines on the console's own host.

The console tells "hung" (the pid runs, with the start time the agent reported, but sends
nothing) from "gone" (no such process, a zombie, or the pid now names another process) when it
can look: on this host, in its own pid namespace. For other hosts it cannot, and says so
(``None``); SSH triage (``kvpool-console triage``) looks there. For an engine in another pid
namespace (a container on the host's network reports this host, and a pid of its container)
neither looks: the pid names an unrelated process here (``same_pid_namespace``, the one rule
of both).
"""

from __future__ import annotations

import psutil

from kvpool_agent.process_facts import pid_namespace, start_ticks
from kvpool_agent.protocol import Source
from kvpool_console._this_host import is_this_host

__all__ = ["OTHER_PID_NAMESPACE", "local_process_alive", "same_pid_namespace"]

OTHER_PID_NAMESPACE = "the engine runs in another pid namespace: run triage inside its container"
"""What is said instead of a verdict of a pid reported from another pid namespace."""


def same_pid_namespace(reported: int, here: int) -> bool:
    """Whether a pid an agent reported from pid namespace ``reported`` names a process of a
    checker in namespace ``here`` (inodes of ``/proc/self/ns/pid``, ``Source.pid_ns``). 0 on
    either side is unknown (an agent before the field, a host where it could not be read): the
    same, as before the field."""
    return not reported or not here or reported == here


def local_process_alive(src: Source) -> bool | None:
    """``True``: ``src.pid`` runs on this host and is the process that reported (the start
    ticks it reported match); ``False``: it is gone (no such pid, a zombie, or a pid that now
    names another process); ``None``: another host (``is_this_host``), another pid namespace
    (``same_pid_namespace``), no pid reported, or no start ticks to prove the running pid is
    the reporter (an agent key could name any pid, pid 1 say, and make a dead engine read
    "hung": helper 76)."""
    if src.pid <= 0 or not is_this_host(src.host) \
            or not same_pid_namespace(src.pid_ns, pid_namespace()):
        return None
    try:
        if psutil.Process(src.pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return None
    if not src.start_ticks:
        return None
    return start_ticks(src.pid) == src.start_ticks
