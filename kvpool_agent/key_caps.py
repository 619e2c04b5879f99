"""Connections per key on a CURVE port: how many each key may hold open, and refusing the rest
(issue 42; the hub's ports, and the policy service's snapshot port, V1, and records port).

Why: every connection adds its queues to what the server holds (``kvpool_agent._hub_memory``
for the hub): a subscriber up to 33 MiB of update frames, a command connection 128 MiB of
commands, an agent connection 192 MiB of reports and commands, and a descriptor. Uncapped, one
key chose the server's memory bound and its descriptors by opening connections (stalled
subscribers, a connection flood to the file limit); capped per key, the bound is a function of
the server's settings and the keys it authorized.

The cap depends on the port and on the key's kind (``KeyKind``, from its name in the allow
list, ``kvpool_agent.auth``): a viewer or operator key (``console``) holds a few consoles and
dashboards; an agent key holds one connection per connector process (the scheduler and every
worker rank each run one agent, ``kvpool_agent.agent``), so an agent key bound to one engine
(``engine``) at most that engine's processes (``MAX_AGENT_CONNECTIONS_PER_KEY``, one per agent
id the hub lets an engine hold) and a fleet-wide agent key (``fleet``) at most the fleet's
(``MAX_AGENT_CONNECTIONS_PER_FLEET_KEY``, the agents a hub keeps).

How: libzmq names no key in its monitor's events (only the descriptor) and no descriptor to the
ZAP handler (only the peer's IP), but every message it hands the server carries both: the ZAP
``User-Id`` (the key, z85) and ``ZMQ_SRCFD`` (the descriptor of the connection it came in on).

- A connection counts for its key on its port from its first message (a subscriber's
  subscription, a console's first command, an agent's first report) until the port's monitor
  reports its descriptor closed (``closed``) or the port is rebuilt (``closed_port``).
- The ZAP handler (``CappedAdmission``) refuses the handshake of a key whose counted connections
  on the port, plus those admitted in the last ``ADMIT_WINDOW_S`` that have sent nothing yet,
  reach the cap: the connection fails its handshake, so it never subscribes, gets no frame and
  reports nothing (counted per port like any refused handshake; libzmq retries a client's
  connection every 0.1 s or more).
- A connection admitted in a burst (handshakes that all passed before any sent) whose first
  message comes past the cap is shut down by the server's thread (``admit_message``) before the
  server acts on the message; the messages it queued before that (a records connection's
  batches) are dropped too and count no further refusal, until its descriptor is seen closed.

Every refusal is handed to the server's thread (``drain_refusals``), which counts it (the hub:
``HubCounters.connections_over_cap`` and per key in ``refused_by_key``; the policy service:
``ServiceCounters.subscribers_over_cap`` on its snapshot port, ``records_connections_over_cap``
on its records port). Only with keys: without them no connection has a key to count.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import zmq

from kvpool_agent._fleet import MAX_AGENTS, MAX_AGENTS_PER_ENGINE
from kvpool_agent.auth import AllowList, bound_engine

__all__ = [
    "ADMIT_WINDOW_S",
    "MAX_AGENT_CONNECTIONS_PER_FLEET_KEY",
    "MAX_AGENT_CONNECTIONS_PER_KEY",
    "MAX_CONNECTIONS_PER_KEY",
    "MAX_SUBSCRIBERS_PER_KEY",
    "CappedAdmission",
    "KeyCaps",
    "KeyKind",
    "Refusal",
    "admit_message",
    "key_kind",
    "shut_down",
]

KeyKind = Literal["console", "engine", "fleet"]
"""A key's kind for its cap: a viewer or operator key, an agent key bound to one engine
(``kvpool-agent authorize --engine``), a fleet-wide agent key."""

MAX_SUBSCRIBERS_PER_KEY = 8
"""Default subscribers one viewer or operator key may hold open on the hub's ``P+1``
(``kvpool-agent hub --max-subscribers-per-key``) and on the policy service's snapshot port
(``kvpool-policy serve --max-subscribers-per-key``): a few consoles and dashboards."""
MAX_CONNECTIONS_PER_KEY = 16
"""Default command connections one key may hold open on each command port (``P+2``, ``P+3``;
``--max-connections-per-key``): a console holds one per port."""
MAX_AGENT_CONNECTIONS_PER_KEY = MAX_AGENTS_PER_ENGINE
"""Default connections one engine-bound agent key may hold open on the hub's agent port ``P``
(``kvpool-agent hub --max-agent-connections-per-key``): one per agent id the hub lets one
engine hold (1,024). A real engine runs one agent per connector process (DP x TP x PP workers
and a scheduler per DP rank: 65 for DP 1 x TP 8 x PP 8), so it stays far under it, also while
the connections of a crashed host of it are not yet seen closed. The policy service's snapshot
ports cap agent keys at their own, far lower, numbers (only schedulers connect to them:
``kvpool_policy.service.MAX_AGENT_CONNECTIONS_PER_KEY``)."""
MAX_AGENT_CONNECTIONS_PER_FLEET_KEY = MAX_AGENTS
"""Default connections one fleet-wide agent key (authorized without ``--engine``) may hold open
on ``P`` (``--max-agent-connections-per-fleet-key``): such a key may be every engine's, so the
agents a hub keeps at most (16,384)."""
ADMIT_WINDOW_S = 60.0
"""A handshake admitted counts against its key's cap for this long (s) before its connection
sends a first message; a connection silent longer holds a descriptor and no queued bytes."""


def key_kind(name: str) -> KeyKind:
    """The kind of the authorized key named ``name`` (``ROLE/FILE-STEM``, ``AllowList.name``)."""
    if not name.startswith("agent/"):
        return "console"
    return "fleet" if bound_engine(name) is None else "engine"


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
    the rest on the server's thread; one lock between them.

    Args:
        caps: port name -> key kind -> connections one key of that kind may hold open on the
            port (0 or missing: no cap).

    Raises:
        ValueError: a cap below 0.
    """

    def __init__(self, caps: Mapping[str, Mapping[KeyKind, int]]) -> None:
        low = {f"{port}/{kind}": n for port, kinds in caps.items()
               for kind, n in kinds.items() if n < 0}
        if low:
            raise ValueError(f"connection caps per key must be 0 (none) or more, got {low}")
        self.caps = {port: dict(kinds) for port, kinds in caps.items()}
        self._lock = threading.Lock()
        self._owner: dict[int, tuple[str, str]] = {}  # descriptor -> (port, identity)
        # Descriptors shut down past the cap -> (port, identity): their queued messages are
        # dropped without counting the connection again.
        self._shut: dict[int, tuple[str, str]] = {}
        self._held: dict[tuple[str, str], int] = {}
        # (port, identity) -> its cap, from its kind when the ZAP handler last admitted it.
        self._cap: dict[tuple[str, str], int] = {}
        # (port, identity) -> monotonic times of handshakes admitted, not yet seen sending.
        self._admitted: dict[tuple[str, str], deque[float]] = {}
        self._refusals: list[Refusal] = []

    def cap(self, port: str, kind: KeyKind) -> int:
        """Connections a key of ``kind`` may hold open on ``port`` (0: no cap)."""
        return self.caps.get(port, {}).get(kind, 0)

    def held(self, port: str, identity: str) -> int:
        """Connections ``identity`` holds on ``port`` (counted from their first message)."""
        with self._lock:
            return self._held.get((port, identity), 0)

    def admit(self, port: str, identity: str, kind: KeyKind = "console",
              now: float | None = None) -> bool:
        """ZAP thread: may ``identity`` (z85), a key of ``kind``, open one more connection on
        ``port``."""
        cap = self.cap(port, kind)
        slot = (port, identity)
        now = time.monotonic() if now is None else now
        with self._lock:
            self._cap[slot] = cap
            if cap == 0:
                return True
            pending = self._admitted.setdefault(slot, deque())
            while pending and pending[0] <= now - ADMIT_WINDOW_S:
                pending.popleft()
            if self._held.get(slot, 0) + len(pending) >= cap:
                self._refusals.append(Refusal(port, identity, cap, handshake=True))
                return False
            pending.append(now)
            return True

    def seen(self, port: str, fd: int, identity: str) -> bool:
        """Server thread: a message came from ``identity`` on ``port`` over descriptor ``fd``;
        False when it is a new connection past the key's cap (the caller shuts it down)."""
        if fd < 0:
            return True
        slot = (port, identity)
        with self._lock:
            cap = self._cap.get(slot, 0)  # never admitted through these caps: not capped
            if cap == 0 or self._owner.get(fd) == slot:
                return True
            if self._shut.get(fd) == slot:
                return False
            # A descriptor reused before its close was reported: the old connection is gone.
            self._release(fd)
            pending = self._admitted.get(slot)
            if pending:
                pending.popleft()
            if self._held.get(slot, 0) >= cap:
                self._refusals.append(Refusal(port, identity, cap, handshake=False))
                self._shut[fd] = slot
                return False
            self._owner[fd] = slot
            self._held[slot] = self._held.get(slot, 0) + 1
            return True

    def closed(self, fd: int) -> None:
        """Server thread: descriptor ``fd`` was closed (or accepted anew: its old one is gone)."""
        with self._lock:
            self._release(fd)

    def closed_port(self, port: str) -> None:
        """Server thread: every connection of ``port`` is gone (the port was rebuilt)."""
        with self._lock:
            for fd in [fd for fd, (p, _) in self._owner.items() if p == port]:
                self._release(fd)
            for fd in [fd for fd, (p, _) in self._shut.items() if p == port]:
                del self._shut[fd]
            for slot in [s for s in self._admitted if s[0] == port]:
                del self._admitted[slot]

    def drain_refusals(self) -> list[Refusal]:
        """Server thread: the refusals since the last call (to count them)."""
        with self._lock:
            out, self._refusals = self._refusals, []
            return out

    def _release(self, fd: int) -> None:
        self._shut.pop(fd, None)
        slot = self._owner.pop(fd, None)
        if slot is None:
            return
        n = self._held[slot] - 1
        if n:
            self._held[slot] = n
        else:
            del self._held[slot]


class CappedAdmission:
    """The ZAP credentials provider of a capped server (pyzmq ``configure_curve_callback``): a
    key the allow list accepts in a domain, while its connections on the domain's port are
    under the cap of its kind.

    Args:
        allow: the keys the server admits per ZAP domain.
        caps: the caps (``None``: uncapped).
        ports: ZAP domain -> the port name its connections are capped under.
    """

    def __init__(self, allow: AllowList, caps: KeyCaps | None, ports: Mapping[str, str]) -> None:
        self.allow, self.caps, self.ports = allow, caps, ports

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's hook: may ``key`` (z85) connect in ``domain``."""
        if not self.allow.callback(domain, key):
            return False
        if self.caps is None:
            return True
        kind = key_kind(self.allow.name(domain, key) or "")
        return self.caps.admit(self.ports[domain], key.decode(), kind)


def admit_message(caps: KeyCaps, port: str, frame: zmq.Frame) -> bool:
    """Server thread: a message came in on ``port`` in ``frame`` (a part of it); False when its
    connection is one past its key's cap, which is then shut down (``shut_down``): the caller
    drops the message."""
    try:
        fd = int(frame.get(zmq.SRCFD))
        identity = str(frame.get("User-Id"))
    except zmq.ZMQError:
        return True
    if caps.seen(port, fd, identity):
        return True
    shut_down(fd)
    return False


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
