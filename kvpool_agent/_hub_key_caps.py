"""Connections per key on the hub's console ports: how many each key may hold open, and refusing
the rest (issue 42).

Why: every connection adds its queues to what the hub holds (``kvpool_agent._hub_memory``): a
subscriber up to 33 MiB of update frames, a command connection 128 MiB of commands. Uncapped, a
viewer key chose the hub's memory bound by opening connections (stalled subscribers, a
connection flood to the file limit); capped per key, the bound is a function of the hub's
settings and the keys it authorized.

How: libzmq names no key in its monitor's events (only the descriptor) and no descriptor to the
ZAP handler (only the peer's IP), but every message it hands the hub carries both: the ZAP
``User-Id`` (the key, z85) and ``ZMQ_SRCFD`` (the descriptor of the connection it came in on).

- A connection counts for its key on its port from its first message (a subscriber's
  subscription, a console's first command) until the port's monitor reports its descriptor
  closed (``closed``) or the port is rebuilt (``closed_port``).
- The ZAP handler (``admit``) refuses the handshake of a key whose counted connections on the
  port, plus those admitted in the last ``ADMIT_WINDOW_S`` that have sent nothing yet, reach
  the cap: the connection fails its handshake, so it never subscribes and gets no frame
  (counted per port in ``refused_connections`` like any refused handshake; libzmq retries it
  every 0.1 s).
- A connection admitted in a burst (handshakes that all passed before any sent) whose first
  message comes past the cap is shut down by the hub thread (``seen`` returns False).

Every refusal is handed to the hub thread (``drain_refusals``), which counts it
(``HubCounters.connections_over_cap``, and per key in ``refused_by_key``). Only with keys:
without them every console is the one key ``plain`` (loopback).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

__all__ = [
    "ADMIT_WINDOW_S",
    "CAPPED_PORTS",
    "MAX_CONNECTIONS_PER_KEY",
    "MAX_SUBSCRIBERS_PER_KEY",
    "KeyCaps",
    "Refusal",
    "shut_down",
]

log = logging.getLogger("kvpool.hub")

MAX_SUBSCRIBERS_PER_KEY = 8
"""Default subscribers (``P+1`` connections) one viewer or operator key may hold open
(``kvpool-agent hub --max-subscribers-per-key``): a few consoles and dashboards."""
MAX_CONNECTIONS_PER_KEY = 16
"""Default command connections one key may hold open on each command port (``P+2``, ``P+3``;
``--max-connections-per-key``): a console holds one per port."""
ADMIT_WINDOW_S = 60.0
"""A handshake admitted counts against its key's cap for this long (s) before its connection
sends a first message; a connection silent longer holds a descriptor and no queued bytes."""
CAPPED_PORTS = ("pub", "commands", "curve")
"""The ports whose connections are capped per key; ``pub`` takes the subscriber cap, the command
ports the connection cap. Agent keys' connections (``P``) are not capped: a fleet-wide key
holds one per engine process."""


@dataclass(frozen=True)
class Refusal:
    """One connection refused for its key's cap: its ``port``, key ``identity`` (z85), the
    ``cap`` and whether it was refused at the handshake (``handshake``) or shut down after it
    sent past the cap."""

    port: str
    identity: str
    cap: int
    handshake: bool


class KeyCaps:
    """Connections held per key and port (module docstring). ``admit`` runs on the ZAP thread,
    the rest on the hub thread; one lock between them.

    Args:
        subscribers: cap per key on ``pub`` (0: none).
        connections: cap per key on each command port (0: none).

    Raises:
        ValueError: a cap below 0.
    """

    def __init__(self, subscribers: int = MAX_SUBSCRIBERS_PER_KEY,
                 connections: int = MAX_CONNECTIONS_PER_KEY) -> None:
        if subscribers < 0 or connections < 0:
            raise ValueError(f"connection caps per key must be 0 (none) or more, got "
                             f"subscribers={subscribers}, connections={connections}")
        self.caps = {"pub": subscribers, "commands": connections, "curve": connections}
        self._lock = threading.Lock()
        self._owner: dict[int, tuple[str, str]] = {}  # descriptor -> (port, identity)
        self._held: dict[tuple[str, str], int] = {}
        # (port, identity) -> monotonic times of handshakes admitted, not yet seen sending.
        self._admitted: dict[tuple[str, str], deque[float]] = {}
        self._refusals: list[Refusal] = []

    def held(self, port: str, identity: str) -> int:
        """Connections ``identity`` holds on ``port`` (counted from their first message)."""
        with self._lock:
            return self._held.get((port, identity), 0)

    def admit(self, port: str, identity: str, now: float | None = None) -> bool:
        """ZAP thread: may ``identity`` (z85) open one more connection on ``port``."""
        cap = self.caps.get(port, 0)
        if cap == 0:
            return True
        now = time.monotonic() if now is None else now
        slot = (port, identity)
        with self._lock:
            pending = self._admitted.setdefault(slot, deque())
            while pending and pending[0] <= now - ADMIT_WINDOW_S:
                pending.popleft()
            if self._held.get(slot, 0) + len(pending) >= cap:
                self._refusals.append(Refusal(port, identity, cap, handshake=True))
                return False
            pending.append(now)
            return True

    def seen(self, port: str, fd: int, identity: str) -> bool:
        """Hub thread: a message came from ``identity`` on ``port`` over descriptor ``fd``;
        False when it is a new connection past the key's cap (the caller shuts it down)."""
        cap = self.caps.get(port, 0)
        if cap == 0 or fd < 0:
            return True
        slot = (port, identity)
        with self._lock:
            if self._owner.get(fd) == slot:
                return True
            # A descriptor reused before its close was reported: the old connection is gone.
            self._release(fd)
            pending = self._admitted.get(slot)
            if pending:
                pending.popleft()
            if self._held.get(slot, 0) >= cap:
                self._refusals.append(Refusal(port, identity, cap, handshake=False))
                return False
            self._owner[fd] = slot
            self._held[slot] = self._held.get(slot, 0) + 1
            return True

    def closed(self, fd: int) -> None:
        """Hub thread: descriptor ``fd`` was closed (or accepted anew: its old one is gone)."""
        with self._lock:
            self._release(fd)

    def closed_port(self, port: str) -> None:
        """Hub thread: every connection of ``port`` is gone (the port was rebuilt)."""
        with self._lock:
            for fd in [fd for fd, (p, _) in self._owner.items() if p == port]:
                self._release(fd)
            for slot in [s for s in self._admitted if s[0] == port]:
                del self._admitted[slot]

    def drain_refusals(self) -> list[Refusal]:
        """Hub thread: the refusals since the last call (to count them)."""
        with self._lock:
            out, self._refusals = self._refusals, []
            return out

    def _release(self, fd: int) -> None:
        slot = self._owner.pop(fd, None)
        if slot is None:
            return
        n = self._held[slot] - 1
        if n:
            self._held[slot] = n
        else:
            del self._held[slot]


def shut_down(fd: int) -> bool:
    """Shut down the TCP connection of libzmq's descriptor ``fd`` (libzmq then closes it and
    frees what it held for it; the descriptor itself stays libzmq's). False when ``fd`` is no
    TCP connection any more."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        s.getpeername()  # a listener or a closed connection has none: left alone
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    finally:
        s.close()  # the duplicate
    return True
