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
that sent a message growing the hub from there to the limit shows that growth. Bytes the hub
has read from a port's socket since the baselines (``took``: messages consumed, decoded and
bounded elsewhere) are no connection's weight: a port's connections weigh at most what they
received less what the hub read of the port (round 5: an agent key's honest reports, read
at once, made its connection the heaviest while a viewer's stalled subscribers held the memory,
and it was dropped for nothing). ``FleetHub._shed`` drops the heaviest connections in order
until their weight covers the RSS's growth since the baselines (``shed``), when the weight of
all is at least ``REGROW`` of the limit (``kvpool_agent._memory_guard``; round 5: one viewer's
multipart messages split over 12 connections, each under ``REGROW``, made every port be
rebuilt); else it rebuilds ports. The connections a shed dropped are ``releasing`` until the
port's monitor reports them closed: libzmq frees what they held only then, and the guard does
not judge the shed before (``kvpool_agent._memory_guard``, ``RELEASE_S``).

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

import zmq

from kvpool_agent._memory_guard import REGROW, rss_bytes

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
_FRAME_OVERHEAD = 64
"""Bytes on the wire per frame beyond its body, at most (ZMTP framing, CURVE's MESSAGE command:
name, nonce, MAC): what a read frame counts as consumed beyond its length."""


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
        # Descriptor -> peer of the connections the last shed dropped, until libzmq closes them.
        self._releasing: dict[int, str] = {}
        self._shed_t = 0.0
        self._next_baseline = 0.0
        # Port -> bytes the hub read from its socket since the baselines (``took``).
        self._consumed: dict[str, int] = {}
        self.calm_rss = 0
        """The hub's RSS (bytes) when the baselines were last taken."""

    def took(self, port: str, frames: list[zmq.Frame]) -> None:
        """The hub read the message ``frames`` from ``port``'s socket."""
        self._consumed[port] = self._consumed.get(port, 0) + sum(
            len(f) + _FRAME_OVERHEAD for f in frames)

    def __len__(self) -> int:
        return len(self._conns)

    def accepted(self, port: str, fd: int) -> None:
        """libzmq accepted a connection on ``port`` as descriptor ``fd``. It did not exist at
        the last baseline, so every byte it received counts (baseline 0): the monitor's event
        can come after its first megabytes (a busy hub thread), and counting from then hid a
        connection's whole multipart message (a CI run rebuilt every port for it)."""
        self._released(fd)  # the number reused: the connection it was is closed
        got = _peer_and_received(fd)
        if got is not None:
            self._conns[fd] = Connection(port, fd, got[0], 0)

    def closed(self, fd: int) -> None:
        """libzmq closed descriptor ``fd`` (its peer disconnected, or the hub dropped it)."""
        self._conns.pop(fd, None)
        self._released(fd)

    def closed_port(self, port: str) -> None:
        """Every connection of ``port`` is gone (the port was rebuilt)."""
        for fd in [fd for fd, c in self._conns.items() if c.port == port]:
            del self._conns[fd]
        self._releasing.clear()

    @property
    def releasing(self) -> bool:
        """A connection the last shed dropped is not closed by libzmq yet: what it held is not
        freed yet (libzmq's I/O thread first reads what the kernel still holds for it)."""
        return bool(self._releasing)

    def _released(self, fd: int) -> None:
        if self._releasing.pop(fd, None) is not None and not self._releasing:
            log.info("kvpool hub: the connections dropped for memory are closed, %.2f s after "
                     "the shed: RSS %d MiB", time.monotonic() - self._shed_t,
                     (rss_bytes() or 0) >> 20)

    def baseline(self, rss: int, limit: int, now: float | None = None) -> None:
        """Count every connection's bytes received, and the bytes the hub reads, from now on,
        when the RSS ``rss`` is under ``CALM`` of the limit ``limit`` (bytes) and
        ``BASELINE_S`` has passed since the last time; a descriptor that is no longer its
        connection is forgotten."""
        now = time.monotonic() if now is None else now
        if rss >= limit * CALM or now < self._next_baseline:
            return
        self._next_baseline = now + BASELINE_S
        self._consumed.clear()
        self.calm_rss = rss
        for fd, c in list(self._conns.items()):
            got = _peer_and_received(fd)
            if got is None or got[0] != c.peer:
                del self._conns[fd]
            else:
                c.baseline = got[1]

    def heaviest_first(self) -> list[tuple[Connection, int]]:
        """The connections that hold bytes, with their weight (bytes), heaviest first: what
        each received since its baseline, at most what its port's connections received and
        the hub did not read (``took``)."""
        grown: list[tuple[Connection, int]] = []
        for fd, c in list(self._conns.items()):
            got = _peer_and_received(fd)
            if got is None or got[0] != c.peer:
                del self._conns[fd]
            else:
                grown.append((c, got[1] - c.baseline))
        held: dict[str, int] = {}
        for c, n in grown:
            held[c.port] = held.get(c.port, 0) + n
        weights = [(c, min(n, held[c.port] - self._consumed.get(c.port, 0))) for c, n in grown]
        return sorted((w for w in weights if w[1] > 0), key=lambda w: -w[1])

    def shed(self, rss: int, limit: int) -> int:
        """The hub's RSS ``rss`` is over its limit ``limit`` (bytes): drop the heaviest
        connections (``heaviest_first``) in order until their weight covers the RSS's growth
        since the baselines, when all weigh ``REGROW`` of the limit or more together; the
        number dropped (0: none weighs enough), ``releasing`` until libzmq closed them."""
        self._releasing.clear()
        self._shed_t = time.monotonic()
        weights = self.heaviest_first()
        if sum(w for _, w in weights) < limit * REGROW:
            return 0
        freed = dropped = 0
        for c, w in weights:
            if freed >= rss - self.calm_rss:
                break
            if self.drop(c):
                freed, dropped = freed + w, dropped + 1
                log.warning("kvpool hub: RSS %d MiB over the memory limit of %d MiB: the "
                            "connection from %s on port %s, %d MiB received and not read "
                            "since the RSS was calm, is dropped (others stay)", rss >> 20,
                            limit >> 20, c.peer, c.port, w >> 20)
        return dropped

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
        self._releasing[conn.fd] = conn.peer
        return True
