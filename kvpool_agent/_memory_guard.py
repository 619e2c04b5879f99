"""The hub's memory limit, enforced where libzmq cannot bound a queue: past the limit the hub
drops the connections holding the most bytes it has not read since its RSS was calm
(``kvpool_agent._hub_connections``: a multipart message in the middle of its parts is its
senders' alone), or, when none holds enough, closes and binds again the console port (the
subscribers' send queues), and when a shed freed too little every port but the operator's
(``FleetHub._shed``), which frees everything libzmq holds for its connections.

Why: libzmq 4.3 hands no part of a multipart message to the hub before its last part has come
(a ROUTER polls nothing between parts), bounds each part only (``MAXMSGSIZE``) and counts whole
messages in its queues, so one message of many parts is held whole, outside every bound of
``kvpool_agent._hub_memory`` (issue 42: 512 parts of 1.99 MiB from a viewer grew the hub by
996 MiB). No socket option of libzmq bounds it, and the socket types without multipart
(``SERVER``) are drafts missing from pyzmq's build, so the hub watches its own RSS instead.

What it costs: the sender's connection drops (its socket reconnects by itself; its message is
lost). A rebuild of every port drops every connection but the operator's at once (agents and
consoles reconnect by themselves within libzmq's reconnect interval, 0.1 s; agents keep their
ids), commands in flight are answered with an error, replies on their way to consoles are
lost. The RSS may pass the limit by what arrives within one check (``CHECK_S``) and the libzmq
I/O thread's release of the dropped connections (``RELEASE_S`` at most). The operator port is
never rebuilt: only operator keys reach it.

A shed frees what libzmq holds, not the fleet's state: when the RSS is still over the limit
after one (an agent key's states, attack found in review: 95 rebuilds in 30 s), the next shed
waits until the RSS has grown by ``REGROW`` of the limit since, and is then a rebuild of every
port (``again``), so a message arriving later is still freed and the hub never drops everyone
over and over for memory a rebuild cannot free.

A shed of connections is judged once libzmq has closed them, not before (issue 42: every port
was rebuilt for the round-5 split flood beside two CPU burners): a dropped connection is freed
by libzmq's I/O thread, which first reads into the message it then discards what the kernel
still holds for it, and under load it takes its time. Measured (12 connections of 30 MiB each,
256 MiB limit, two ``yes`` on 2 cores): the last dropped connection closed 0.06 to 0.59 s after
the shed (16 runs); in 8 runs before this change it closed after ``COOLDOWN_S`` twice, the RSS
judged then was 28 and 38 MiB past the shed's (``REGROW``: 32 MiB), and in one it peaked at +37
MiB before falling to ~66 MiB as they closed. The +38 MiB made the next shed an escalation
(``again``), which rebuilds every port when the connections left weigh less than ``REGROW``. So
while the hub says a connection the last shed dropped is still open (``over(releasing=True)``:
its ports' monitors have not reported it closed) the RSS is read but not judged, for
``RELEASE_S`` after the shed at most; then the rules above apply. What it costs: a message
arriving meanwhile is shed ``RELEASE_S`` later at most, and the hub reads its RSS every
``CHECK_S`` meanwhile. glibc keeping freed memory is not the cause in ``kvpool-agent hub`` (it
serves blocks of 256 KiB and more by ``mmap``, ``_hub_memory.return_large_blocks_to_os``):
``malloc_trim(0)`` at those checks gave back 0-1 MiB (0.3-1 ms a call), so the guard does not
call it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["CHECK_S", "COOLDOWN_S", "REGROW", "RELEASE_S", "MemoryGuard", "rss_bytes"]

CHECK_S = 0.01
"""Seconds between two reads of the hub's RSS at most (a read costs ~10 us)."""
COOLDOWN_S = 0.25
"""Seconds after a shed before the RSS is checked again: libzmq frees the closed sockets'
queues on its own thread, and the RSS falls only then."""
RELEASE_S = 1.0
"""Seconds after a shed during which the RSS is not judged while a connection it dropped is
still open in libzmq (``over(releasing=True)``): the slowest release measured beside two CPU
burners took 0.59 s."""

REGROW = 1 / 8
"""Growth (a fraction of the limit) past the RSS of the last shed that allows the next one
while the RSS stays over the limit."""

_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set size (bytes), ``None`` where ``/proc`` is missing."""
    try:
        return int(_STATM.read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class MemoryGuard:
    """Says when the process's RSS is over ``limit_bytes`` (``None``: never).

    Args:
        limit_bytes: the RSS (bytes) past which the hub sheds its connections.
    """

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit_bytes = limit_bytes
        self._next = 0.0
        # The RSS when the last shed was decided, while the RSS stays over the limit.
        self._shed_at: int | None = None
        self._shed_t = 0.0
        self.futile = 0
        """Checks over the limit that did not shed: the last shed freed too little."""
        self.settling = 0
        """Checks over the limit not judged: a connection the last shed dropped was still
        open (``RELEASE_S``)."""
        self.rss = 0
        """The RSS (bytes) at the last check."""
        self.again = False
        """The last answer over the limit came without a check under it since the shed
        before: that shed freed too little (``FleetHub._shed`` then drops every port)."""

    def over(self, now: float | None = None, *, releasing: bool = False) -> int | None:
        """The RSS (bytes) when it is over the limit, due to be checked and not held since the
        last shed (grown by less than ``REGROW`` of the limit), else ``None``; after an
        answer over the limit the next check waits ``COOLDOWN_S``. ``releasing``: a
        connection the last shed dropped is not closed yet (what it held is not freed yet):
        an RSS over the limit is then not judged, until ``RELEASE_S`` after that shed."""
        if self.limit_bytes is None:
            return None
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        rss = rss_bytes()
        self.rss = rss or 0
        if rss is None or rss <= self.limit_bytes:
            self._next = now + CHECK_S
            self._shed_at = None
            return None
        if self._shed_at is not None and releasing and now < self._shed_t + RELEASE_S:
            self._next = now + CHECK_S
            self.settling += 1
            return None
        if self._shed_at is not None and rss <= self._shed_at + self.limit_bytes * REGROW:
            self._next = now + COOLDOWN_S
            self.futile += 1
            return None
        self._next = now + COOLDOWN_S
        self.again = self._shed_at is not None
        self._shed_at, self._shed_t = rss, now
        return rss
