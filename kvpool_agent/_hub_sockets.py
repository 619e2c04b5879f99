"""The hub's sockets: its four ports, who may connect to each (CURVE and ZAP), what libzmq may
queue per connection, and rebuilding a port (``kvpool_agent.hub`` has what each port is for).

With keys every port is a CURVE server whose ZAP domain (``PORT_DOMAIN``) admits only the
public keys of the roles ``ZAP_DOMAINS`` names (``kvpool_agent.auth.AllowList``, pyzmq's
``ThreadAuthenticator``); a refused handshake is counted per port from the socket's monitor
(``HubCounters.refused_connections``). Every queue is bounded in messages per connection and
every message in bytes (``kvpool_agent._hub_memory``: the sum the hub promises), and every
port's connections per key (``kvpool_agent.key_caps``: refused at the handshake, or shut down
at their first message past the cap).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_fixed
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvpool_agent._hub_connections import ConnectionTable
from kvpool_agent._hub_counters import HubCounters
from kvpool_agent._hub_memory import (
    AGENT_RCVHWM,
    AGENT_SNDHWM,
    COMMAND_RCVHWM,
    COMMAND_SNDHWM,
    MAX_COMMAND_BYTES,
    PUB_SNDHWM,
)
from kvpool_agent._key_files import check_private
from kvpool_agent.auth import AllowList, Role
from kvpool_agent.key_caps import CappedAdmission, KeyCaps, admit_message
from kvpool_agent.protocol import MAX_MESSAGE_BYTES

__all__ = [
    "MAX_SUBSCRIPTION_BYTES",
    "PORT_DOMAIN",
    "ZAP_DOMAINS",
    "HubPorts",
    "HubSockets",
    "hub_ports",
    "user_id",
]

log = logging.getLogger("kvpool.hub")

ZAP_DOMAINS: dict[str, tuple[Role, ...]] = {
    "agents": ("agent",),
    "subscribers": ("viewer", "operator"),
    "viewer": ("viewer", "operator"),
    "operator": ("operator",),
}
"""ZAP domain -> roles whose keys it accepts; each port's domain is in ``PORT_DOMAIN``."""
PORT_DOMAIN = {"agents": "agents", "pub": "subscribers", "commands": "viewer",
               "curve": "operator"}
"""Port name -> its ZAP domain: one a port, so a key's connections are capped per port
(``kvpool_agent.key_caps``)."""
_DOMAIN_PORT = {domain: port for port, domain in PORT_DOMAIN.items()}
_PORT_ATTR = {"agents": "agents", "pub": "pub", "commands": "plain", "curve": "curve"}
"""Port name -> the ``HubSockets`` attribute holding its socket."""
_SUBSCRIPTION_RCVHWM = 32
"""Subscription messages queued per console connection (a console sends 18 at its start;
more wait in TCP, nothing is lost)."""
MAX_SUBSCRIPTION_BYTES = 1024
"""Longest message the XPUB reads (bytes); a longer one drops its connection. libzmq keeps
each subscribed topic in a trie of ~50 bytes per topic byte for as long as the subscriber
stays, so one 16 MiB subscription held ~800 MiB of the hub. A subscription needs 24 bytes,
a CURVE handshake's INITIATE (bounded by the same limit) ~300."""
_MAX_MONITOR_EVENTS = 1024
"""Monitor events read per port and loop turn."""
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


@dataclass(frozen=True)
class HubPorts:
    """The four endpoints of a hub (``kvpool_agent.hub``'s module docstring)."""

    agents: str
    pub: str
    commands: str
    curve: str


def hub_ports(address: str, *, connect: bool = False) -> HubPorts:
    """Endpoints for ``tcp://HOST:P``: agents ``P``, pub ``P+1``, commands ``P+2``, curve ``P+3``.

    ``connect``: the address is one to connect to (a console, an engine's ``agent_address``, a
    store agent's ``--hub``), so the listen-only wildcards (``*``, an empty host) are refused;
    libzmq's connect raised ``Invalid argument`` on them.

    Raises:
        ValueError: not ``tcp://HOST:PORT`` with a numeric port in 1..65532, or a wildcard host
            with ``connect`` (the message gives an example of the right form).
    """
    example = "tcp://127.0.0.1:7600" if connect else "tcp://0.0.0.0:7600"
    if not address.startswith("tcp://") or ":" not in address[6:]:
        raise ValueError(f"hub address {address!r}: expected tcp://HOST:PORT (e.g. {example})")
    host, _, port_s = address[6:].rpartition(":")
    if connect and host in ("", "*"):
        raise ValueError(f"hub address {address!r}: {host or 'an empty host'} is where a hub "
                         f"listens; connect to the hub's host, e.g. {example}")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"hub address {address!r}: port {port_s!r} is not a number") from None
    if not 0 < port <= 65535 - 3:
        raise ValueError(f"hub address {address!r}: port must be in 1..65532 (uses P..P+3)")
    return HubPorts(*(f"tcp://{host}:{port + i}" for i in range(4)))


def user_id(frame: zmq.Frame) -> str:
    """The ZAP User-Id of a frame's connection (the z85 CURVE public key), ``""`` if none."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return ""


class HubSockets:
    """The bound sockets of one hub, owned by the hub thread (built by ``bind``).

    Args:
        ports: the endpoints.
        authorized_keys_dir: ``authorized_keys/`` with one directory of public keys per role,
            or ``None`` (no keys: every port plain).
        secret_key_file: the hub's CURVE secret key, or ``None``.
        counters: where refused handshakes are counted.
        connections: where the accepted connections are kept, from each port's monitor
            (``kvpool_agent._hub_connections``); ``None``: not kept.
        caps: connections per key on each port (with keys only); ``None``: uncapped.
    """

    def __init__(self, ports: HubPorts, authorized_keys_dir: Path | None,
                 secret_key_file: Path | None, counters: HubCounters,
                 connections: ConnectionTable | None = None,
                 caps: KeyCaps | None = None) -> None:
        self.ports = ports
        self.connections = connections
        self.caps = caps if authorized_keys_dir is not None else None
        self.authorized_keys_dir = authorized_keys_dir
        self.secret_key_file = secret_key_file
        self.counters = counters
        self.allow: AllowList | None = None
        self.auth: ThreadAuthenticator | None = None
        self.socks: list[zmq.Socket[bytes]] = []
        # Monitor socket -> the port name its handshake failures are counted under.
        self.monitors: dict[zmq.Socket[bytes], str] = {}
        self.poller = zmq.Poller()
        self.curve: zmq.Socket[bytes] | None = None

    def bind(self) -> None:
        """Start the ZAP handler (with keys) and bind every port.

        Raises:
            ValueError: a key file or the keys directory cannot be used (the message says
                which and what to do).
            zmq.ZMQError: a port is in use (the message names the address).
        """
        self.ctx = zmq.Context()
        self._keys = self._load_keys()
        self.agents = self._socket(zmq.ROUTER, "agents", self.ports.agents)
        self.pub = self._socket(zmq.XPUB, "pub", self.ports.pub)
        self.plain = self._socket(zmq.ROUTER, "commands", self.ports.commands)
        if self._keys is not None:
            self.curve = self._socket(zmq.ROUTER, "curve", self.ports.curve)

    def key_name(self, domain: str, identity: str) -> str | None:
        """The authorized key's name on port ``domain`` (``agent/eng-0.engine``), ``plain``
        without keys; ``None`` for a key not listed for that port (now): never the raw
        identity, which would name a key binding nothing (a fleet-wide agent key)."""
        if self.allow is None:
            return "plain"
        return self.allow.name(PORT_DOMAIN[domain], identity.encode())

    def unlisted_name(self, identity: str) -> str:
        """What a key no longer listed is counted as: ``revoked:`` and the name it had
        (``revoked:agent/imp-0.engine``: not the name a key rotated under it now holds)."""
        former = self.allow.former_name(identity.encode()) if self.allow is not None else None
        return f"revoked:{former or 'unlisted ' + identity[:8]}"

    def listed_key(self, port: str, identity: str) -> str | None:
        """``key_name`` of a message's key on ``port``; ``None`` for a key no longer listed
        there (revoked, or rotated away under its file name, on a connection opened before):
        the message is refused and counted against it (``unlisted_name``)."""
        name = self.key_name(port, identity)
        if name is None:
            why = "revoked: key no longer in authorized_keys; message dropped"
            self.counters.bad(port, why)
            self.counters.refuse(self.unlisted_name(identity), why)
        return name

    def _socket(self, kind: int, name: str, endpoint: str) -> zmq.Socket[bytes]:
        """A bound socket of port ``name``, registered with the poller (and its monitor)."""
        # Tracked before bind: a socket left out of self.socks would make ctx.term() in
        # close() wait for it forever when a later bind fails.
        s: zmq.Socket[bytes] = self.ctx.socket(kind)
        self.socks.append(s)
        s.setsockopt(zmq.LINGER, 0)
        # Per connection, in messages (libzmq counts no bytes): each port's messages are
        # bounded in bytes, so each queue is too (kvpool_agent._hub_memory).
        s.setsockopt(zmq.SNDHWM, {"agents": AGENT_SNDHWM, "pub": PUB_SNDHWM}.get(
            name, COMMAND_SNDHWM))
        # What each port needs, so a part over it is refused at its header (libzmq
        # buffers a multipart message whole before the hub sees any part of it).
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES if name == "agents"
                     else MAX_COMMAND_BYTES)
        if name in ("commands", "curve"):
            s.setsockopt(zmq.RCVHWM, COMMAND_RCVHWM)
        if name == "agents":
            s.setsockopt(zmq.RCVHWM, AGENT_RCVHWM)
        if kind == zmq.ROUTER:
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if kind == zmq.XPUB:
            # Every subscription reaches the hub (a join snapshot), also repeats.
            s.setsockopt(zmq.XPUB_VERBOSE, 1)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            # libzmq adds every queued subscription to its trie when the hub reads the first:
            # a short queue per connection bounds what one read adds before the hub sees it.
            s.setsockopt(zmq.RCVHWM, _SUBSCRIPTION_RCVHWM)
        if self._keys is not None:
            s.curve_publickey, s.curve_secretkey = self._keys
            s.curve_server = True
            s.zap_domain = PORT_DOMAIN[name].encode()
        try:
            s.bind(endpoint)
        except zmq.ZMQError as e:
            raise zmq.ZMQError(e.errno, f"kvpool hub cannot bind {endpoint}: {e}") from e
        events = (_HANDSHAKE_FAILED if self._keys is not None else 0) | (
            _CONNECTION_EVENTS if self.connections is not None or self.caps is not None
            else 0)
        if events:
            # Right after bind: a handshake refused (or a connection accepted) within those
            # microseconds goes unseen.
            mon = s.get_monitor_socket(events)
            self.monitors[mon] = name
            if self._keys is not None:
                self.counters.refused_connections.setdefault(name, 0)
            self.poller.register(mon, zmq.POLLIN)
        self.poller.register(s, zmq.POLLIN)
        return s

    def rebuild(self, name: str) -> None:
        """Close port ``name``'s socket (freeing all libzmq holds for its connections: the
        XPUB's subscription trie, messages queued or half received) and bind a new one on the
        same endpoint: agents' and consoles' sockets reconnect by themselves (a console's
        subscription brings a snapshot)."""
        old: zmq.Socket[bytes] = getattr(self, _PORT_ATTR[name])
        # The monitor is stopped at the socket first: closing the socket closes its
        # connections, and libzmq's I/O thread would otherwise block for ever sending their
        # events to a monitor already closed (the whole hub then stops answering).
        old.disable_monitor()
        for mon, port in list(self.monitors.items()):
            if port == name:
                self.poller.unregister(mon)
                del self.monitors[mon]
                mon.close(linger=0)
        if self.connections is not None:
            self.connections.closed_port(name)
        if self.caps is not None:
            self.caps.closed_port(name)
        self.poller.unregister(old)
        self.socks.remove(old)
        old.close(linger=0)
        kind = zmq.XPUB if name == "pub" else zmq.ROUTER

        def bind() -> zmq.Socket[bytes]:
            try:
                return self._socket(kind, name, getattr(self.ports, name))
            except zmq.ZMQError:
                self.socks.pop().close(linger=0)  # tracked by _socket before its bind failed
                raise

        # The closed listener is released by libzmq's I/O thread: moments, not more.
        setattr(self, _PORT_ATTR[name], Retrying(
            retry=retry_if_exception_type(zmq.ZMQError), stop=stop_after_attempt(50),
            wait=wait_fixed(0.02), reraise=True)(bind))

    def rebuild_all_but_operator(self) -> None:
        """Rebuild every port but the operator's: only operator keys reach it, and an operator
        must keep reaching the hub while a viewer's message is being dropped."""
        for name in _PORT_ATTR:
            if name != "curve":
                self.rebuild(name)

    def _load_keys(self) -> tuple[bytes, bytes] | None:
        """The hub's CURVE pair, with the ZAP handler started; ``None`` without keys."""
        if self.authorized_keys_dir is None or self.secret_key_file is None:
            return None
        adir = self.authorized_keys_dir
        if not adir.is_dir():
            raise ValueError(
                f"authorized_keys_dir {adir} is not a directory (kvpool-agent keygen --role hub "
                "DIR creates DIR/authorized_keys/)"
            )
        if any(adir.glob("*.key")) and not any((adir / r).is_dir() for r in ("agent", "viewer",
                                                                           "operator")):
            raise ValueError(
                f"authorized_keys_dir {adir} has the old layout (keys directly in it): put each "
                "public key in authorized_keys/agent/, viewer/ or operator/ (README, Security)"
            )
        try:
            real = check_private(self.secret_key_file)
            public, secret = zmq.auth.load_certificate(str(real))
        except (OSError, ValueError) as e:
            raise ValueError(f"secret_key_file {self.secret_key_file}: {e}") from None
        if not secret:
            raise ValueError(f"secret_key_file {self.secret_key_file} holds no secret key")
        self.allow = AllowList(adir, ZAP_DOMAINS)
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        for domain in ZAP_DOMAINS:
            self.auth.configure_curve_callback(
                domain, CappedAdmission(self.allow, self.caps, _DOMAIN_PORT))
        return public, secret

    def admit(self, port: str, frame: zmq.Frame) -> bool:
        """A message came in on ``port`` in ``frame`` (a part of it): False when its connection
        is one past its key's cap, which is then shut down (``kvpool_agent.key_caps``)."""
        return self.caps is None or admit_message(self.caps, port, frame)

    def count_cap_refusals(self) -> None:
        """Count the connections refused for their key's cap since the last call
        (``HubCounters.connections_over_cap``, and per key)."""
        if self.caps is None:
            return
        for r in self.caps.drain_refusals():
            self.counters.connections_over_cap += 1
            self.counters.refuse(
                self.key_name(r.port, r.identity) or self.unlisted_name(r.identity),
                f"connection on {r.port} past the cap of {r.cap} per key "
                f"({'refused at the handshake' if r.handshake else 'shut down'})")

    def recv_monitors(self, events: dict[zmq.Socket[bytes], int]) -> None:
        """Count the handshakes refused on each port whose monitor has ``events``, and keep
        its connections accepted and closed (``connections``, ``caps``); count the
        connections refused for their key's cap."""
        self.count_cap_refusals()
        for mon, name in self.monitors.items():
            if mon not in events:
                continue
            for _ in range(_MAX_MONITOR_EVENTS):
                if not mon.poll(0):
                    break
                ev = recv_monitor_message(mon)
                if ev["event"] & _CONNECTION_EVENTS:
                    # The event's value is the connection's file descriptor.
                    if self.connections is not None:
                        if ev["event"] == zmq.EVENT_ACCEPTED:
                            self.connections.accepted(name, ev["value"])
                        else:
                            self.connections.closed(ev["value"])
                    if self.caps is not None:
                        # Accepted too: the number reused, the connection it was is gone.
                        self.caps.closed(ev["value"])
                    continue
                if not ev["event"] & _HANDSHAKE_FAILED:
                    continue
                self.counters.refused_connections[name] += 1
                n = self.counters.refused_connections[name]
                if n <= 3 or n % 1000 == 0:
                    log.warning(
                        "kvpool hub: refused connection #%d on %s (%s, %s): no key, a key "
                        "not in authorized_keys/%s, or past its cap per key", n, name,
                        ev["endpoint"].decode(errors="replace"), zmq.Event(ev["event"]).name,
                        "|".join(ZAP_DOMAINS[PORT_DOMAIN[name]]))

    def close(self) -> None:
        """Close every socket and the context. Idempotent only through the hub's one call."""
        for s in self.socks:
            s.disable_monitor()  # before the monitors close (``rebuild``)
        for m in self.monitors:
            m.close(linger=0)
        for s in self.socks:
            s.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()

