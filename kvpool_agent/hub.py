"""The fleet hub: agents report to it, consoles watch it and send commands through it.

Over 500 lines: every path a frame takes through the one socket-owning thread (routing,
quotas, reply binding, who may connect) is kept in one module so it can be checked in one
reading.

Ports, for ``address="tcp://HOST:P"``. With keys (``kvpool-agent keygen --role hub``) every
port is a CURVE server and a ZAP handler (pyzmq's ``ThreadAuthenticator`` with
``kvpool_agent.auth.AllowList``) admits only the public keys in ``authorized_keys/<role>/``;
a refused handshake is counted per port (``refused_connections``, also sent to consoles in
``FleetUpdate.refused_connections``). Without keys every port is plain and the hub binds
loopback unless run ``--insecure`` (``kvpool_agent.cli``).

- ``P``   ROUTER, agents connect (DEALER) and send ``Report`` / ``CommandReply``; with keys an
  ``agent`` key;
- ``P+1`` XPUB, consoles subscribe (SUB) to ``FleetUpdate``; a new subscription triggers a
  full snapshot, so a console that joins late sees every agent at once; with keys a
  ``viewer`` or ``operator`` key. The full-rate stream (a delta every
  ``delta_interval_s``) is plain ``FleetUpdate`` frames; a subscription to
  ``kvpool_agent.protocol.tier_topic(ms)`` gets that slower tier's frames, the topic then the
  update (a console decodes each agent once per redraw, not four times).
  libzmq applies each connection's subscriptions to that connection (prefix matching), so no
  subscriber changes what another receives. Not ``XPUB_MANUAL``: there the hub's
  ``SUBSCRIBE`` goes to the connection libzmq last queued a subscription from, and a
  non-subscription message (any ``XSUB`` may send one) shifts that pairing, so one subscriber
  could hand another's subscription to itself and blind it. ``FleetClient`` subscribes to
  ``protocol.FULL_RATE_TOPICS`` for the full-rate stream alone; a ``b""`` subscriber
  (consoles before tiers) also gets the frames of every tier some console subscribed to, and
  skips them as bad messages;
- ``P+2`` ROUTER, read-only commands (``snapshot``, ``health`` without the probe, ``drain``,
  ``flush`` with ``dry_run=True``), at most ``MAX_PENDING_PER_CONNECTION`` in flight per
  connection and ``MAX_PENDING - OPERATOR_RESERVE`` in all; with keys a ``viewer`` or
  ``operator`` key (an operator key is still read-only here);
- ``P+3`` ROUTER, only with keys: every command, also ``flush``, ``health`` with ``probe`` and
  ``forget``; only ``operator`` keys. ``OPERATOR_RESERVE`` of the pending slots are only for
  this port.
- ``metrics_port`` (``kvpool-agent hub`` default ``P+4``): HTTP, Prometheus ``/metrics`` over
  the fleet state (``kvpool_agent._metrics``), read-only and without authentication (scrapers
  speak plain HTTP): bound on HOST without keys (where the ports above are open too), on
  127.0.0.1 with keys unless ``metrics_host`` names another address.

Commands and replies are bound to connections: the hub forwards a command under a fresh
unguessable request id (``secrets.token_hex``) to the routing id each target agent last
reported from, and accepts a reply only from that routing id, for that id, once. Agent ids are
bound to their connection and, with keys, to the agent key that registered them
(``kvpool_agent._fleet``). Agents silent for ``forget_after_s`` are dropped and consoles told
(``FleetUpdate.forgotten``).

One thread owns every socket. This module is that thread: sockets, message routing and pending
commands; the fleet's state (which agent said what, who a command goes to, the update frames)
is ``kvpool_agent._fleet`` and the audit trail ``kvpool_agent._audit``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvpool_agent._audit import AUDIT_BACKUPS, AUDIT_MAX_BYTES, AuditTrail
from kvpool_agent._fleet import ENGINES_PER_UPDATE, FULL_RATE, MAX_AGENTS, Fleet
from kvpool_agent._metrics import FleetCollector, MetricsServer
from kvpool_agent.auth import AllowList, Role, _check_private, bound_engine
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    DrainArgs,
    EngineState,
    ProtocolError,
    Report,
    SeqTracker,
    decode,
    encode,
    tier_of,
    tier_topic,
)

__all__ = [
    "ENGINES_PER_UPDATE",
    "FORGET_AFTER_S",
    "MAX_AGENTS",
    "MAX_PENDING",
    "MAX_PENDING_PER_CONNECTION",
    "OPERATOR_ONLY",
    "OPERATOR_RESERVE",
    "UNAUTHORISED",
    "ZAP_DOMAINS",
    "FleetHub",
    "HubPorts",
    "hub_ports",
]

log = logging.getLogger("kvpool.hub")

UNAUTHORISED = "unauthorised: flush needs the operator key (kvpool-agent keygen --role operator)"
OPERATOR_ONLY = (
    "unauthorised: {what} needs the operator key (kvpool-agent keygen --role operator)"
)

MAX_PENDING = 1024
"""Commands in flight at once; more are answered at once with an error."""
OPERATOR_RESERVE = 256
"""Pending slots only the operator port P+3 may use, so read-only traffic never starves it."""
MAX_PENDING_PER_CONNECTION = 16
"""Commands one connection of the read-only port P+2 may have in flight."""
FORGET_AFTER_S = 600.0
"""Default ``forget_after_s``: agents silent this long are dropped."""
_FORGET_CHECK_S = 1.0
MAX_TIMEOUT_MS = 600_000
_MAX_FRAMES_PER_LOOP = 1024
_MAX_READ_BYTES = 16 * 1024 * 1024
_MAX_SUBSCRIPTION_BYTES = 1024
"""Longest message the XPUB reads (bytes); a longer one drops its connection. libzmq keeps
each subscribed topic in a trie of ~50 bytes per topic byte for as long as the subscriber
stays, so one 16 MiB subscription held ~800 MiB of the hub. A subscription needs 24 bytes,
a CURVE handshake's INITIATE (bounded by the same limit) ~300."""

ZAP_DOMAINS: dict[str, tuple[Role, ...]] = {
    "agents": ("agent",),
    "viewer": ("viewer", "operator"),
    "operator": ("operator",),
}
"""ZAP domain -> roles whose keys it accepts; each port's domain is in ``_PORT_DOMAIN``."""
_PORT_DOMAIN = {"agents": "agents", "pub": "viewer", "commands": "viewer", "curve": "operator"}
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True)
class HubPorts:
    """The four endpoints of a hub (see the module docstring)."""

    agents: str
    pub: str
    commands: str
    curve: str


def hub_ports(address: str) -> HubPorts:
    """Endpoints for ``tcp://HOST:P``: agents ``P``, pub ``P+1``, commands ``P+2``, curve ``P+3``.

    Raises:
        ValueError: not ``tcp://HOST:PORT`` with a numeric port.
    """
    if not address.startswith("tcp://") or ":" not in address[6:]:
        raise ValueError(
            f"hub address {address!r}: expected tcp://HOST:PORT (e.g. tcp://0.0.0.0:7600)"
        )
    host, _, port_s = address[6:].rpartition(":")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"hub address {address!r}: port {port_s!r} is not a number") from None
    if not 0 < port <= 65535 - 3:
        raise ValueError(f"hub address {address!r}: port must be in 1..65532 (uses P..P+3)")
    return HubPorts(*(f"tcp://{host}:{port + i}" for i in range(4)))


@dataclass
class _Pending:
    sock: zmq.Socket[bytes]
    client: bytes
    req: CommandRequest
    who: str
    deadline: float
    expected: list[str]
    plain: bool
    # Agent id -> the routing id the command was sent to: the only one whose reply counts.
    routes: dict[str, bytes] = field(default_factory=dict)
    replies: dict[str, CommandReply] = field(default_factory=dict)


@dataclass
class _Stream:
    """One update stream the hub publishes: its ``topic`` (``b""`` for the full-rate one),
    ``interval_s`` between deltas, last ``seq`` sent and when the next delta is due
    (``time.monotonic()`` s)."""

    topic: bytes
    interval_s: float
    seq: int = 0
    due: float = 0.0


class FleetHub:
    """The hub process (or thread) of a fleet.

    Args:
        address: ``tcp://HOST:P``; binds ``P..P+3`` (see module docstring).
        authorized_keys_dir: the hub's ``authorized_keys/`` with one directory of public keys
            (``*.key``) per role: ``agent/``, ``viewer/``, ``operator/``
            (``kvpool_agent.auth``). Read again when a role's directory changes.
        secret_key_file: the hub's CURVE secret key (``hub.key_secret`` from
            ``kvpool-agent keygen --role hub``). Both or neither: with them every port requires
            a key.
        audit_file: append one JSON line per command (who, what, scope, result) here, besides
            the ``kvpool.hub`` log line.
        snapshot_interval_s: full FleetUpdate snapshots this often, and on a join (a
            subscription), at most one per ``delta_interval_s``: each goes to every
            subscriber, so a subscriber repeating its subscription cannot make the hub
            encode and send the whole fleet to everyone as fast as it sends them.
        delta_interval_s: deltas (agents that reported since the last update) this often.
        forget_after_s: agents silent this long (s) are dropped, with ``forgotten`` in the next
            update and a log line.
        audit_max_bytes: the audit file rotates at this size (bytes), keeping
            ``audit_backups`` older files (``FILE.1`` newest).
        metrics_port: serve Prometheus ``/metrics`` (``kvpool_agent._metrics``) over HTTP on
            this port; ``None`` serves none.
        metrics_host: the address ``/metrics`` binds; ``None``: the hub's host without keys,
            127.0.0.1 with keys (the endpoint has no authentication, so a keyed hub never
            exposes it beyond the host unless asked to).

    Counters (read from any thread): ``reports``, ``commands``, ``refused`` (commands needing
    the operator key on P+2), ``busy`` (commands refused for a full pending quota),
    ``takeover_refused`` (reports for an id another live connection holds),
    ``oversized_states`` (reports over ``MAX_STATE_BYTES``), ``fleet_full`` (reports refused
    for ``MAX_AGENTS`` or ``MAX_FLEET_STATE_BYTES``), ``rejected_replies`` (replies from
    a connection the command was not sent to, unknown ids, repeats), ``forgotten``,
    ``bad_messages``, ``refused_connections`` (port name ``agents``/``pub``/``commands``/
    ``curve`` -> CURVE handshakes refused: no key, or a key not authorized for the port).

    Raises:
        ValueError: bad address, or only one of the two key arguments.
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:7600",
        *,
        authorized_keys_dir: str | Path | None = None,
        secret_key_file: str | Path | None = None,
        audit_file: str | Path | None = None,
        snapshot_interval_s: float = 2.0,
        delta_interval_s: float = 0.25,
        forget_after_s: float = FORGET_AFTER_S,
        audit_max_bytes: int = AUDIT_MAX_BYTES,
        audit_backups: int = AUDIT_BACKUPS,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
    ) -> None:
        self.address = address
        self.ports = hub_ports(address)
        if (authorized_keys_dir is None) != (secret_key_file is None):
            raise ValueError(
                "FleetHub: give both authorized_keys_dir and secret_key_file (kvpool-agent "
                "keygen --role hub DIR writes DIR/authorized_keys/ and DIR/hub.key_secret) or "
                "neither"
            )
        self.authorized_keys_dir = Path(authorized_keys_dir) if authorized_keys_dir else None
        self.secret_key_file = Path(secret_key_file) if secret_key_file else None
        self.audit_file = Path(audit_file) if audit_file else None
        self._audit = AuditTrail(self.audit_file, audit_max_bytes, audit_backups)
        self.snapshot_interval_s = snapshot_interval_s
        self.delta_interval_s = delta_interval_s
        self.forget_after_s = forget_after_s
        self.bad_messages = 0
        self.reports = 0
        self.commands = 0
        self.refused = 0
        self.busy = 0
        self.takeover_refused = 0
        self.oversized_states = 0
        self.fleet_full = 0
        self.rejected_replies = 0
        self.forgotten = 0
        self.refused_connections: dict[str, int] = {}
        self.allow: AllowList | None = None
        self.seq_tracker = SeqTracker()
        self._fleet = Fleet()
        self._pending: dict[str, _Pending] = {}
        # Update streams (FULL_RATE or a tier's ms), each started by its first subscriber: a
        # hub watched by tier consoles only never encodes the full-rate one. A stream stays on
        # once subscribed: unsubscriptions cannot be told apart from forged ones (any
        # subscriber can send one), and a stream nobody reads costs encoding only.
        self._streams: dict[int, _Stream] = {}
        # Per agent, so each agent sees its own gap-free command sequence.
        self._agent_seq: dict[str, int] = {}
        self._want_snapshot = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics: MetricsServer | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> FleetHub:
        """Bind the ports and start the hub thread.

        Raises:
            zmq.ZMQError: a port is in use (the message names the address).
            OSError/ValueError: a key file cannot be read.
        """
        self._thread = threading.Thread(target=self._run, name="kvpool-hub", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        if self.metrics_port is not None:
            try:
                self.metrics = MetricsServer(self._collector(), self._metrics_host(),
                                             self.metrics_port)
            except OSError:
                self.stop()
                raise
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the sockets. Idempotent."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> FleetHub:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- read access for tests and embedding -------------------------------------------------

    def fleet(self) -> dict[str, tuple[EngineState, float]]:
        """Agent id -> (latest state, hub receive time of its last message, ms since epoch)."""
        return self._fleet.states()

    def _host(self) -> str:
        return self.ports.agents[len("tcp://"):].rpartition(":")[0]

    def _metrics_host(self) -> str:
        if self.metrics_host is not None:
            return self.metrics_host
        return "127.0.0.1" if self.secret_key_file is not None else self._host()

    def _collector(self) -> FleetCollector:
        def counters() -> dict[str, int]:
            return {"reports": self.reports, "commands": self.commands,
                    "refused": self.refused, "busy": self.busy,
                    "bad_messages": self.bad_messages, "forgotten": self.forgotten,
                    # CURVE handshakes refused per port (hubs with keys).
                    **{f"refused_handshakes_{port}": n
                       for port, n in self.refused_connections.items()}}

        return FleetCollector(self._fleet.states, lambda: dict(self.seq_tracker.gaps),
                              counters, lambda: time.time() * 1e3)

    @property
    def gaps(self) -> int:
        """Agent messages the hub never received, from their sequence numbers."""
        return self.seq_tracker.total_gaps

    # -- the thread --------------------------------------------------------------------------

    def _bind(self) -> None:
        self.ctx = zmq.Context()
        self.auth: ThreadAuthenticator | None = None
        self.socks: list[zmq.Socket[bytes]] = []
        # Monitor socket -> the port name its handshake failures are counted under.
        self.monitors: dict[zmq.Socket[bytes], str] = {}
        keys = self._load_keys()

        def sock(kind: int, name: str, endpoint: str) -> zmq.Socket[bytes]:
            # Tracked before bind: a socket left out of self.socks would make ctx.term() in
            # _close() wait for it forever when a later bind fails.
            s: zmq.Socket[bytes] = self.ctx.socket(kind)
            self.socks.append(s)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 1000)
            s.setsockopt(zmq.MAXMSGSIZE, _MAX_READ_BYTES)
            if kind == zmq.ROUTER:
                s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if kind == zmq.XPUB:
                # Every subscription reaches _recv_subscriptions (a join snapshot), also
                # repeats.
                s.setsockopt(zmq.XPUB_VERBOSE, 1)
                s.setsockopt(zmq.MAXMSGSIZE, _MAX_SUBSCRIPTION_BYTES)
            if keys is not None:
                s.curve_publickey, s.curve_secretkey = keys
                s.curve_server = True
                s.zap_domain = _PORT_DOMAIN[name].encode()
                mon = s.get_monitor_socket(_HANDSHAKE_FAILED)
                self.monitors[mon] = name
                self.refused_connections[name] = 0
            try:
                s.bind(endpoint)
            except zmq.ZMQError as e:
                raise zmq.ZMQError(e.errno, f"kvpool hub cannot bind {endpoint}: {e}") from e
            return s

        self.agents_sock = sock(zmq.ROUTER, "agents", self.ports.agents)
        self.pub = sock(zmq.XPUB, "pub", self.ports.pub)
        self.plain = sock(zmq.ROUTER, "commands", self.ports.commands)
        self.curve: zmq.Socket[bytes] | None = None
        if keys is not None:
            self.curve = sock(zmq.ROUTER, "curve", self.ports.curve)

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
            real = _check_private(self.secret_key_file)
            public, secret = zmq.auth.load_certificate(str(real))
        except (OSError, ValueError) as e:
            raise ValueError(f"secret_key_file {self.secret_key_file}: {e}") from None
        if not secret:
            raise ValueError(f"secret_key_file {self.secret_key_file} holds no secret key")
        self.allow = AllowList(adir, ZAP_DOMAINS)
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        for domain in ZAP_DOMAINS:
            self.auth.configure_curve_callback(domain, self.allow)
        return public, secret

    def _close(self) -> None:
        for m in self.monitors:
            m.close(linger=0)
        for s in self.socks:
            s.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        self._audit.close()

    def _recv_monitors(self, mon: zmq.Socket[bytes]) -> None:
        name = self.monitors[mon]
        for _ in range(_MAX_FRAMES_PER_LOOP):
            if not mon.poll(0):
                return
            ev = recv_monitor_message(mon)
            if ev["event"] & _HANDSHAKE_FAILED:
                self.refused_connections[name] += 1
                n = self.refused_connections[name]
                if n <= 3 or n % 1000 == 0:
                    log.warning(
                        "kvpool hub: refused connection #%d on %s (%s, %s): no key or a key not "
                        "in authorized_keys/%s", n, name, ev["endpoint"].decode(errors="replace"),
                        zmq.Event(ev["event"]).name, "|".join(ZAP_DOMAINS[_PORT_DOMAIN[name]]),
                    )

    def _run(self) -> None:
        try:
            self._bind()
        except BaseException as e:
            self._error = e
            if hasattr(self, "socks"):
                self._close()
            self._ready.set()
            return
        self._ready.set()
        log.info(
            "kvpool hub: agents %s, consoles %s, commands %s%s",
            self.ports.agents,
            self.ports.pub,
            self.ports.commands,
            f", operator commands {self.ports.curve} (CURVE keys on every port)"
            if self.curve is not None else " (no keys: plain)",
        )
        poller = zmq.Poller()
        for s in [*self.socks, *self.monitors]:
            poller.register(s, zmq.POLLIN)
        next_snapshot = next_forget = last_snapshot = 0.0
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(50))
                    if self.agents_sock in events:
                        self._recv_agents()
                    if self.pub in events:
                        self._recv_subscriptions()
                    if self.plain in events:
                        self._recv_commands(self.plain, curve=False)
                    if self.curve is not None and self.curve in events:
                        self._recv_commands(self.curve, curve=True)
                    for mon in self.monitors:
                        if mon in events:
                            self._recv_monitors(mon)
                    now = time.monotonic()
                    self._expire(now)
                    if now >= next_forget:
                        next_forget = now + _FORGET_CHECK_S
                        self._note_forgotten(
                            self._fleet.forget_silent(self.forget_after_s), "silent"
                        )
                    joined = self._want_snapshot and now >= last_snapshot + self.delta_interval_s
                    if joined or now >= next_snapshot:
                        self._want_snapshot = False
                        last_snapshot = now
                        next_snapshot = now + self.snapshot_interval_s
                        # A snapshot is an update of every stream (the full-rate one first).
                        for key, stream in sorted(self._streams.items()):
                            stream.due = now + stream.interval_s
                            self._publish("snapshot", key)
                    else:
                        for key, stream in self._streams.items():
                            if now >= stream.due:
                                stream.due = now + stream.interval_s
                                if self._fleet.changed_for(key):
                                    self._publish("delta", key)
                except Exception:
                    log.exception("kvpool hub: loop iteration failed")
                    time.sleep(0.05)
        finally:
            self._close()

    def _bad(self, where: str, why: str) -> None:
        self.bad_messages += 1
        if self.bad_messages <= 10 or self.bad_messages % 1000 == 0:
            log.warning(
                "kvpool hub: dropped bad message #%d on %s: %s", self.bad_messages, where, why[:200]
            )

    # -- agents ------------------------------------------------------------------------------

    def _recv_agents(self) -> None:
        for _ in range(_MAX_FRAMES_PER_LOOP):
            try:
                frames = self.agents_sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._bad("agents", f"{len(frames) - 1} frames, expected 1")
                continue
            rid, frame = frames[0].bytes, frames[1]
            try:
                msg = decode(frame.bytes)
            except ProtocolError as e:
                self._bad("agents", str(e))
                continue
            if isinstance(msg, Report):
                # With keys, the agent key the ZAP handler admitted (z85); agent ids are bound
                # to it. Without keys every agent is "".
                self._on_report(rid, msg, _user_id(frame) if self.allow is not None else "")
            elif isinstance(msg, CommandReply):
                self._on_reply(rid, msg)
            else:
                self._bad("agents", f"unexpected {type(msg).__name__} from an agent")

    def _on_report(self, rid: bytes, rep: Report, identity: str) -> None:
        refused = self._bound_elsewhere(rep, identity) or self._fleet.accept(rid, rep, identity)
        if refused is not None:
            if refused.startswith("takeover:"):
                self.takeover_refused += 1
            elif refused.startswith("oversized:"):
                self.oversized_states += 1
            elif refused.startswith("full:"):
                self.fleet_full += 1
            self._bad("agents", refused)
            return
        self.reports += 1
        aid = rep.state.source.agent_id
        self.seq_tracker.observe(aid, rep.seq)
        for rec in self._fleet.unaudited_flushes(aid, rep.state.flushes):
            # The agent's own claim of who started it, prefixed with the agent it came from.
            req = CommandRequest(v=PROTOCOL_VERSION, seq=0, request_id=rec.request_id,
                                 command="flush", sender=rec.who, targets=[aid],
                                 flush=rec.flush)
            self._audit.record(f"agent:{aid} ({rec.who})", req, [aid], [CommandReply(
                v=PROTOCOL_VERSION, seq=0, request_id=rec.request_id, agent_id=aid,
                ok=rec.ok, error=rec.error, flush=rec.result)])

    def _bound_elsewhere(self, rep: Report, identity: str) -> str | None:
        """Why a report from an engine-bound agent key names another engine, else ``None``.

        The agent id counts too: it must be the engine id or ``<engine id>/<one part>``
        (``Source``'s forms), else a bound key could hold another engine's agent id (commands
        sent to that id would reach it, and that engine's own agent would be refused)."""
        if self.allow is None:
            return None
        name = self.allow.name(_PORT_DOMAIN["agents"], identity.encode()) or ""
        engine = bound_engine(name)
        src = rep.state.source
        if engine is None:
            return None
        if engine != src.engine_id:
            return (f"takeover: key {name} is bound to engine {engine!r}; report for "
                    f"{src.engine_id!r} dropped")
        head, _, tail = src.agent_id.partition(engine + "/")
        if src.agent_id != engine and (head or not tail or "/" in tail):
            return (f"takeover: key {name} is bound to engine {engine!r}; agent id "
                    f"{src.agent_id!r} is not one of its agents; report dropped")
        return None

    # -- consoles ----------------------------------------------------------------------------

    def _note_forgotten(self, ids: list[str], why: str) -> None:
        if ids:
            self.forgotten += len(ids)
            log.warning("kvpool hub: forgot %d agent(s) (%s): %s", len(ids), why,
                        ", ".join(ids[:20]))

    def _recv_subscriptions(self) -> None:
        for _ in range(_MAX_FRAMES_PER_LOOP):
            try:
                frame = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frame[:1] not in (b"\x00", b"\x01"):
                self._bad("pub", "not a subscription message")
                continue
            # libzmq has applied it to its connection already; an unsubscription needs nothing.
            subscribe, topic = frame[:1] == b"\x01", frame[1:]
            tier = tier_of(topic)
            if subscribe:
                self._want_snapshot = True
                key = FULL_RATE if tier is None else tier
                if key not in self._streams:
                    self._fleet.add_stream(key)
                    self._streams[key] = _Stream(
                        b"" if tier is None else tier_topic(tier),
                        max(key / 1e3, self.delta_interval_s))

    def _publish(self, kind: str, key: int) -> None:
        """One update (``snapshot`` or ``delta``) on stream ``key``: frames numbered on from
        the stream's last, each its topic (none for the full-rate stream) then the update."""
        stream = self._streams[key]
        updates = self._fleet.updates(kind, stream.seq + 1, dict(self.seq_tracker.gaps),
                                      stream=key)
        stream.seq += len(updates)
        for upd in updates:
            upd.refused_connections = dict(self.refused_connections)
            try:
                self.pub.send(stream.topic + encode(upd), zmq.NOBLOCK)
            except zmq.Again:
                log.debug("kvpool hub: publish dropped (no room)")

    # -- commands ----------------------------------------------------------------------------

    def _recv_commands(self, sock: zmq.Socket[bytes], *, curve: bool) -> None:
        where = "curve" if curve else "commands"
        for _ in range(_MAX_FRAMES_PER_LOOP):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._bad(where, f"{len(frames) - 1} frames, expected 1")
                continue
            client, frame = frames[0].bytes, frames[1]
            try:
                msg = decode(frame.bytes)
            except ProtocolError as e:
                self._bad(where, str(e))
                continue
            if not isinstance(msg, CommandRequest):
                self._bad(where, f"unexpected {type(msg).__name__} from a console")
                continue
            if self.allow is not None:
                user = _user_id(frame)
                domain = _PORT_DOMAIN["curve" if curve else "commands"]
                name = self.allow.name(domain, user.encode()) or user
                who = f"key:{name}" + (f" ({msg.sender})" if msg.sender else "")
            else:
                who = f"plain:{msg.sender or 'anonymous'}"
            self._on_command(sock, client, msg, who, curve=curve)

    def _on_command(
        self, sock: zmq.Socket[bytes], client: bytes, req: CommandRequest, who: str, *, curve: bool
    ) -> None:
        self.commands += 1
        needs_key = None
        if req.command == "flush" and (req.flush is None or not req.flush.dry_run):
            needs_key = UNAUTHORISED
        elif req.command == "health" and req.probe:
            needs_key = OPERATOR_ONLY.format(what="health --probe")
        elif req.command == "forget":
            needs_key = OPERATOR_ONLY.format(what="forget")
        if needs_key is not None and not curve:
            self.refused += 1
            reply = self._agent_error(req, "hub", needs_key)
            self._send_client(sock, client, [reply])
            self._audit.record(who, req, [], [reply], refused=True)
            return
        if req.command == "forget":
            self._forget(sock, client, req, who)
            return
        busy = self._busy(client, curve=curve)
        if busy is not None:
            # Not audited: a flood of read-only commands must not fill the audit file.
            self.busy += 1
            self._send_client(sock, client, [self._agent_error(req, "hub", busy)])
            return
        targets, problem = self._fleet.targets(req)
        if problem is not None:
            reply = self._agent_error(req, "hub", problem)
            self._send_client(sock, client, [reply])
            self._audit.record(who, req, targets, [reply])
            return
        internal = secrets.token_hex(16)
        pend = _Pending(
            sock=sock,
            client=client,
            req=req,
            who=who,
            deadline=time.monotonic() + min(max(req.timeout_ms, 1), MAX_TIMEOUT_MS) / 1e3,
            expected=targets,
            plain=not curve,
        )
        self._pending[internal] = pend
        fwd = msgspec.structs.replace(req, request_id=internal)
        if req.drain is not None:
            # No agent waits longer than the hub waits for its reply.
            fwd.drain = DrainArgs(timeout_ms=min(max(req.drain.timeout_ms, 0), req.timeout_ms,
                                                 MAX_TIMEOUT_MS))
        for aid in targets:
            routing_id = self._fleet.routing_id(aid)
            if routing_id is None:
                pend.replies[aid] = self._agent_error(req, aid, f"unknown agent {aid!r}")
                continue
            fwd.seq = self._agent_seq[aid] = self._agent_seq.get(aid, 0) + 1
            try:
                self.agents_sock.send_multipart([routing_id, encode(fwd)], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                pend.replies[aid] = self._agent_error(req, aid, f"agent unreachable: {e}")
                continue
            pend.routes[aid] = routing_id
        self._maybe_finish(internal)

    def _busy(self, client: bytes, *, curve: bool) -> str | None:
        """Why a new command cannot be taken now (a full pending quota), else ``None``."""
        if len(self._pending) >= MAX_PENDING:
            return f"hub busy: {MAX_PENDING} commands in flight, retry later"
        if curve:
            return None
        plain = [p for p in self._pending.values() if p.plain]
        if len(plain) >= MAX_PENDING - OPERATOR_RESERVE:
            return "hub busy: the read-only port's commands in flight are at their limit"
        if sum(1 for p in plain if p.client == client) >= MAX_PENDING_PER_CONNECTION:
            return (
                f"hub busy: {MAX_PENDING_PER_CONNECTION} commands of this connection in "
                "flight, wait for their replies"
            )
        return None

    def _forget(
        self, sock: zmq.Socket[bytes], client: bytes, req: CommandRequest, who: str
    ) -> None:
        if not req.targets:
            reply = self._agent_error(req, "hub", "forget needs targets (engine or agent ids)")
        else:
            ids = self._fleet.forget(req.targets)
            self._note_forgotten(ids, f"forget by {who}")
            reply = CommandReply(
                v=PROTOCOL_VERSION,
                seq=0,
                request_id=req.request_id,
                agent_id="hub",
                ok=bool(ids),
                error=None if ids else f"no agent or engine named {', '.join(req.targets)}",
                forgotten=ids,
            )
        self._send_client(sock, client, [reply])
        self._audit.record(who, req, list(req.targets), [reply])

    def _on_reply(self, rid: bytes, rep: CommandReply) -> None:
        pend = self._pending.get(rep.request_id)
        if (
            pend is None
            or pend.routes.get(rep.agent_id) != rid
            or rep.agent_id in pend.replies
        ):
            self.rejected_replies += 1
            self._bad("agents", f"reply {rep.request_id[:40]!r} of {rep.agent_id[:80]!r} "
                      "not expected from this connection")
            return
        self.seq_tracker.observe(rep.agent_id, rep.seq)
        pend.replies[rep.agent_id] = msgspec.structs.replace(rep, request_id=pend.req.request_id)
        self._maybe_finish(rep.request_id)

    def _expire(self, now: float) -> None:
        for internal in [k for k, p in self._pending.items() if now >= p.deadline]:
            pend = self._pending[internal]
            for aid in pend.expected:
                if aid not in pend.replies:
                    pend.replies[aid] = self._agent_error(
                        pend.req, aid, f"timeout after {pend.req.timeout_ms} ms"
                    )
            self._maybe_finish(internal)

    def _maybe_finish(self, internal: str) -> None:
        pend = self._pending.get(internal)
        if pend is None or len(pend.replies) < len(pend.expected):
            return
        del self._pending[internal]
        replies = [pend.replies[a] for a in pend.expected]
        self._send_client(pend.sock, pend.client, replies)
        self._audit.record(pend.who, pend.req, pend.expected, replies)

    def _agent_error(self, req: CommandRequest, agent_id: str, error: str) -> CommandReply:
        return CommandReply(
            v=PROTOCOL_VERSION,
            seq=0,
            request_id=req.request_id,
            agent_id=agent_id,
            ok=False,
            error=error,
        )

    def _send_client(
        self, sock: zmq.Socket[bytes], client: bytes, replies: list[CommandReply]
    ) -> None:
        try:
            sock.send_multipart([client, *(encode(r) for r in replies)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("kvpool hub: reply to a console lost (%s)", e)


def _user_id(frame: zmq.Frame) -> str:
    """The ZAP User-Id of a frame's connection (the z85 CURVE public key), ``""`` if none."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return ""
