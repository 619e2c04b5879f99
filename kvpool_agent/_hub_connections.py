"""Which connection holds the hub's memory: the TCP connections libzmq accepted on each port, the
bytes each has received (the kernel's ``tcpi_bytes_received``), and dropping one of them alone.

Why: libzmq holds a multipart message whole until its last part and gives the hub no part of it
before (``kvpool_agent._memory_guard``), so the hub cannot see who is sending one. It can see
the bytes each TCP connection received: the hub's monitor of each port reports every accepted
connection with its file descriptor (``EVENT_ACCEPTED``), ``getsockopt(TCP_INFO)`` gives the
bytes received on it, and ``shutdown(2)`` of that descriptor makes libzmq drop that connection
alone (its engine fails on the next read and its session discards the message half received:
libzmq's ``session_base_t::clean_pipes``). Issue 42: before, every connection but the
operator's was dropped for one viewer's message, and every console and agent reconnected.

The bytes a connection received are counted from a baseline taken every ``BASELINE_S`` while
the hub's RSS is below ``CALM`` of its limit and kept while it is above, so the connection
that sent a message growing the hub from there to the limit shows that growth.
``FleetHub._shed`` drops the connection that received the most since its baseline when that is
at least ``REGROW`` of the limit (``kvpool_agent._memory_guard``); else, or when the RSS stays
over the limit after such a drop, it rebuilds every port but the operator's as before.

Linux only (``TCP_INFO``'s ``tcpi_bytes_received``, Linux 4.1+); elsewhere no connection is
tracked and the hub rebuilds its ports. The descriptor is libzmq's: the hub never closes it,
only shuts the connection down, after checking the peer address is still the one accepted
(a descriptor closed by libzmq and reused is left alone).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from dataclasses import dataclass

__all__ = ["BASELINE_S", "CALM", "Connection", "ConnectionTable"]

log = logging.getLogger("kvpool.hub")

BASELINE_S = 1.0
"""Seconds between two baselines of every connection's bytes received (a read of
``TCP_INFO`` costs ~1 us: 2,304 agents cost ~3 ms a second of the hub thread)."""
CALM = 3 / 4
"""Fraction of the memory limit under which baselines are taken."""
_TCPI_BYTES_RECEIVED = 128
"""Offset of ``tcpi_bytes_received`` (u64) in Linux's ``struct tcp_info``."""
_TCP_INFO_LEN = 256


@dataclass
class Connection:
    """One accepted TCP connection of port ``port``: libzmq's descriptor ``fd``, its peer
    ``peer`` (``host:port``) and ``baseline`` bytes received when last counted."""

    port: str
    fd: int
    peer: str
    baseline: int


def _peer_and_received(fd: int) -> tuple[str, int] | None:
    """``(peer, bytes received)`` of TCP socket ``fd``, ``None`` when it is none (closed,
    reused for another file, not TCP)."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        host, port = s.getpeername()[:2]
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, ValueError, AttributeError):
        return None
    finally:
        s.close()  # the duplicate: libzmq's descriptor stays open
    if len(info) < _TCPI_BYTES_RECEIVED + 8:
        return None
    return f"{host}:{port}", struct.unpack_from("Q", info, _TCPI_BYTES_RECEIVED)[0]


class ConnectionTable:
    """The hub's accepted connections by descriptor (hub thread only)."""

    def __init__(self) -> None:
        self._conns: dict[int, Connection] = {}
        self._next_baseline = 0.0

    def __len__(self) -> int:
        return len(self._conns)

    def accepted(self, port: str, fd: int) -> None:
        """libzmq accepted a connection on ``port`` as descriptor ``fd``."""
        got = _peer_and_received(fd)
        if got is not None:
            self._conns[fd] = Connection(port, fd, got[0], got[1])

    def closed(self, fd: int) -> None:
        """libzmq closed descriptor ``fd`` (its peer disconnected, or the hub dropped it)."""
        self._conns.pop(fd, None)

    def closed_port(self, port: str) -> None:
        """Every connection of ``port`` is gone (the port was rebuilt)."""
        for fd in [fd for fd, c in self._conns.items() if c.port == port]:
            del self._conns[fd]

    def baseline(self, calm: bool, now: float | None = None) -> None:
        """Count every connection's bytes received from now on, when ``calm`` (the RSS under
        ``CALM`` of the limit) and ``BASELINE_S`` has passed since the last time; a
        descriptor that is no longer its connection is forgotten."""
        now = time.monotonic() if now is None else now
        if not calm or now < self._next_baseline:
            return
        self._next_baseline = now + BASELINE_S
        for fd, c in list(self._conns.items()):
            got = _peer_and_received(fd)
            if got is None or got[0] != c.peer:
                del self._conns[fd]
            else:
                c.baseline = got[1]

    def heaviest(self) -> tuple[Connection, int] | None:
        """The connection that received the most bytes since its baseline, with that count;
        ``None`` when none is tracked."""
        best: tuple[Connection, int] | None = None
        for fd, c in list(self._conns.items()):
            got = _peer_and_received(fd)
            if got is None or got[0] != c.peer:
                del self._conns[fd]
                continue
            grown = got[1] - c.baseline
            if best is None or grown > best[1]:
                best = (c, grown)
        return best

    def drop(self, conn: Connection) -> bool:
        """Shut ``conn`` down (libzmq then closes it and frees what it held for it); False when
        its descriptor is no longer that connection."""
        got = _peer_and_received(conn.fd)
        if got is None or got[0] != conn.peer:
            self._conns.pop(conn.fd, None)
            return False
        s = socket.socket(fileno=os.dup(conn.fd))
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError as e:
            log.warning("kvpool hub: cannot shut down connection %s: %s", conn.peer, e)
            return False
        finally:
            s.close()
        self._conns.pop(conn.fd, None)
        return True
