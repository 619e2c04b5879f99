"""Is a silent engine's process still there? Asked for engines on the console's own host.

The console tells "hung" (the pid runs, with the start time the agent reported, but sends
nothing) from "gone" (no such process, a zombie, or the pid now names another process) when it
can look: on this host. For other hosts it cannot, and says so (``None``); SSH triage
(``kvpool-console triage``) looks there.
"""

from __future__ import annotations

import psutil

from kvpool_agent.process_facts import start_ticks
from kvpool_agent.protocol import Source
from kvpool_console._this_host import is_this_host

__all__ = ["local_process_alive"]


def local_process_alive(src: Source) -> bool | None:
    """``True``: ``src.pid`` runs on this host and is the process that reported (the start
    ticks it reported match); ``False``: it is gone (no such pid, a zombie, or a pid that now
    names another process); ``None``: another host (``is_this_host``), no pid reported, or no
    start ticks to prove the running pid is the reporter (an agent key could name any pid,
    pid 1 say, and make a dead engine read "hung": helper 76)."""
    if src.pid <= 0 or not is_this_host(src.host):
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
