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
  skips them as bad messages. libzmq keeps every distinct topic of every subscriber, so a
  subscription to a topic the hub does not publish (a bug, or a viewer growing the hub's
  memory) bans that key for ``SUBSCRIPTION_BAN_S`` (ZAP refuses its handshakes on every port;
  counted in ``refused_by_key``) and rebuilds the XPUB, which frees every subscription:
  consoles' SUB sockets reconnect and subscribe again, each getting a snapshot. Without keys
  the port is rebuilt, nobody banned;
- ``P+2`` ROUTER, read-only commands (``snapshot``, ``health`` without the probe, ``drain``,
  ``flush`` with ``dry_run=True``, ``pins``), at most ``MAX_PENDING_PER_CONNECTION`` in flight per
  connection, ``MAX_PENDING_PER_KEY`` per key (over all its connections) and
  ``MAX_PENDING - OPERATOR_RESERVE`` in all; with keys a ``viewer`` or ``operator`` key (an
  operator key is still read-only here);
- ``P+3`` ROUTER, only with keys: every command, also ``flush``, ``health`` with ``probe``,
  ``forget``, ``pin`` and ``unpin`` (at most ``PIN_COMMANDS_PER_MIN`` per key); only
  ``operator`` keys. ``OPERATOR_RESERVE`` of the pending slots are only for
  this port.
- ``metrics_port`` (``kvpool-agent hub`` default ``P+4``): HTTP, Prometheus ``/metrics`` over
  the fleet state (``kvpool_agent._metrics``), read-only and without authentication (scrapers
  speak plain HTTP): bound on HOST without keys (where the ports above are open too), on
  127.0.0.1 with keys unless ``metrics_host`` names another address.

Cost is bounded per key (the ZAP User-Id's key name; ``plain`` without keys), not per
message: commands in flight per key (above), explicit targets per command (``MAX_TARGETS``;
unknown ones are answered by one ``hub`` reply), audit bytes per key and minute
(``kvpool_agent._audit``), agent ids per engine (``kvpool_agent._fleet.MAX_AGENTS_PER_ENGINE``),
state bytes per engine (``MAX_ENGINE_STATE_BYTES``), agent frames queued per connection
(``AGENT_RCVHWM``), and the largest message each port reads (``MAX_COMMAND_BYTES`` on the
command ports, ``MAX_MESSAGE_BYTES`` on the agent port, ``_MAX_SUBSCRIPTION_BYTES`` on the
XPUB), and the process's RSS (``memory_limit_bytes``, ``kvpool-agent hub --memory-limit-mb``:
past it every port but the operator's is rebuilt, which frees what libzmq holds for the
connections (not again while the RSS stays over it without growing), a multipart
message included; ``kvpool_agent._memory_guard``; what each queue holds:
``kvpool_agent._hub_memory``). Refusals are counted per key (``refused_by_key``, ``/metrics``
``kvpool_hub_refused_key_<name>_total``).
The one thread serves the operator first: each turn it takes the operator port's frames, then
at most ``_AGENT_BATCH`` agent frames (for ``_AGENT_SLICE_S`` at most, taking the operator's
frames again before each) and ``_READONLY_BATCH`` read-only commands (for
``_READONLY_SLICE_S`` at most), taking the operator's frames again before each read-only
command, so an operator command waits for one agent batch or one read-only command at most.

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
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import msgspec
import zmq
import zmq.auth
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_fixed
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvpool_agent._answers import checked_answer, unvouched_note
from kvpool_agent._audit import AUDIT_BACKUPS, AUDIT_KEY_BYTES_PER_MIN, AUDIT_MAX_BYTES, AuditTrail
from kvpool_agent._fleet import ENGINES_PER_UPDATE, FULL_RATE, MAX_AGENTS, Fleet
from kvpool_agent._hub_memory import (
    AGENT_RCVHWM,
    AGENT_SNDHWM,
    COMMAND_RCVHWM,
    COMMAND_SNDHWM,
    MAX_COMMAND_BYTES,
    MAX_UPDATE_FRAME_BYTES,
    PUB_SNDHWM,
)
from kvpool_agent._hub_state import TENURE_KEPT_S, StateFile
from kvpool_agent._memory_guard import MemoryGuard
from kvpool_agent._metrics import FleetCollector, MetricsServer
from kvpool_agent._reuse_service import (
    REUSE_REFRESH_S,
    WHATIF_REFRESH_S,
    ReuseService,
    pool_capacity_tokens,
)
from kvpool_agent._work_budget import WORK_UNITS_PER_MIN, WorkBudget, cost
from kvpool_agent.audit import AUDIT_IDS_SHOWN
from kvpool_agent.auth import AllowList, Role, _check_private, bound_engine
from kvpool_agent.protocol import (
    FULL_RATE_TOPICS,
    MAX_MESSAGE_BYTES,
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
    "MAX_PENDING_PER_KEY",
    "MAX_TARGETS",
    "OPERATOR_ONLY",
    "OPERATOR_RESERVE",
    "PIN_COMMANDS_PER_MIN",
    "SUBSCRIPTION_BAN_S",
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
MAX_PENDING_PER_KEY = 64
"""Commands one key may have in flight on the read-only port P+2, over all its connections
(``plain`` counts as one key)."""
PIN_COMMANDS_PER_MIN = 30
"""``pin`` and ``unpin`` commands one operator key may send per minute (sliding window); more
are refused at once, unaudited, like a full pending quota. Bounds what a flood of pins costs
the workers (each pin reads and upserts up to ``MAX_PIN_TOKENS`` tokens' values) and the
audit file."""
MAX_TARGETS = 4096
"""Agent ids one command may name (``targets``); a longer list is refused at once."""
FORGOTTEN_SHOWN = 1000
"""Agent ids a ``forget`` reply lists at most (``forgotten_count`` has them all), so the reply
stays far below ``MAX_MESSAGE_BYTES``."""
FORGET_AFTER_S = 600.0
"""Default ``forget_after_s``: agents silent this long are dropped."""
_FORGET_CHECK_S = 1.0
MAX_TIMEOUT_MS = 600_000
_MAX_FRAMES_PER_LOOP = 1024
_OPERATOR_BATCH = 64
_AGENT_BATCH = 64
_READONLY_BATCH = 64
"""Frames per loop turn and port: the operator port's first (taken again before each
read-only command and after the agents' batch), then agents', then read-only commands'."""
_AGENT_SLICE_S = 0.01
"""A turn stops taking agent frames after this long (s)."""
_READONLY_SLICE_S = 0.01
"""A turn stops taking read-only commands after this long (s), so agents get their turn."""
_STATE_SAVE_S = 2.0
_STATE_REFRESH_S = 60.0
SUBSCRIPTION_BAN_S = 600.0
"""How long (s) a key that subscribed to an unknown topic is refused on every port."""
_SUBSCRIPTION_RCVHWM = 32
"""Subscription messages queued per console connection (a console sends 18 at its start;
more wait in TCP, nothing is lost)."""
_KNOWN_TOPICS = frozenset((b"", *FULL_RATE_TOPICS))
"""Subscriptions the hub publishes to, besides the tiers' (``tier_of``)."""
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
_PORT_ATTR = {"agents": "agents_sock", "pub": "pub", "commands": "plain", "curve": "curve"}
"""Port name -> the ``FleetHub`` attribute holding its socket."""
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
    key: str = ""
    # Targets the fleet does not hold: answered together in one reply.
    unknown: list[str] = field(default_factory=list)
    # Pools left out of a pool-wide command: reported by one engine-bound key alone.
    unvouched: list[str] = field(default_factory=list)
    # Agent id -> the routing id the command was sent to: the only one whose reply counts.
    routes: dict[str, bytes] = field(default_factory=dict)
    replies: dict[str, CommandReply] = field(default_factory=dict)
    # Flush: agent id -> its pool's key count when sent (``Fleet.pool_keys``).
    pool_keys: dict[str, int | None] = field(default_factory=dict)


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
            the ``kvpool.hub`` log line; the read-only port's lines go to
            ``audit_file.readonly``, agents' own flushes to ``audit_file.agents``
            (``kvpool_agent._audit``).
        snapshot_interval_s: full FleetUpdate snapshots this often, and on a join (a
            subscription), at most one per ``delta_interval_s``: each goes to every
            subscriber, so a subscriber repeating its subscription cannot make the hub
            encode and send the whole fleet to everyone as fast as it sends them.
        delta_interval_s: deltas (agents that reported since the last update) this often.
        forget_after_s: agents silent this long (s) are dropped, with ``forgotten`` in the next
            update and a log line.
        audit_max_bytes: each audit file rotates at this size (bytes), keeping
            ``audit_backups`` older files (``FILE.1`` newest).
        audit_key_bytes_per_min: audit bytes one key's read-only commands (and an agent key's
            own flushes) write per minute; the rest is summarised in one line.
        state_file: a small JSON file (written atomically, mode 0600) keeping which key has
            held each engine id since when, so pool-wide flush targets survive a hub restart;
            ``None`` keeps it in memory only.
        metrics_port: serve Prometheus ``/metrics`` (``kvpool_agent._metrics``) over HTTP on
            this port; ``None`` serves none.
        metrics_host: the address ``/metrics`` binds; ``None``: the hub's host without keys,
            127.0.0.1 with keys (the endpoint has no authentication, so a keyed hub never
            exposes it beyond the host unless asked to).
        work_units_per_min: engine work one key may cause a minute: one unit per agent
            reached by a dry-run flush, ``pins`` or ``health --probe``
            (``kvpool_agent._work_budget``); past it such commands are answered ``hub busy``.
        memory_limit_bytes: past this RSS (bytes, the whole process's) the hub rebuilds every
            port but the operator's (``kvpool_agent._memory_guard``): the bound for what
            libzmq cannot bound, a multipart message. ``None``: no limit (a hub embedded in
            a larger process).
        reuse_refresh_s: the live reuse ceiling over agents' lookups (``Report.accesses``,
            ``kvpool_agent._reuse_service``) is recomputed at most this often (s), on its own
            thread; ``whatif_refresh_s``: its what-if curves (the costly part). Consoles get
            them in snapshots (``FleetUpdate.reuse``).

    Counters (read from any thread): ``reports``, ``commands``, ``refused`` (commands needing
    the operator key on P+2), ``busy`` (commands refused for a full pending quota or a key's
    spent engine work budget), ``memory_sheds`` (times the RSS passed ``memory_limit_bytes``),
    ``takeover_refused`` (reports for an id another live connection holds),
    ``oversized_states`` (reports over ``MAX_STATE_BYTES``), ``fleet_full`` (reports refused
    for ``MAX_AGENTS`` or ``MAX_FLEET_STATE_BYTES``), ``rejected_replies`` (replies from
    a connection the command was not sent to, unknown ids, repeats), ``lost_replies`` (to a
    console gone before its answer), ``forgotten``,
    ``bad_messages``, ``refused_connections`` (port name ``agents``/``pub``/``commands``/
    ``curve`` -> CURVE handshakes refused: no key, or a key not authorized for the port),
    ``refused_by_key`` (key name, ``plain`` without keys -> its commands, reports or audit
    lines refused for a budget, a missing role or a bound; logged rate-limited).

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
        audit_key_bytes_per_min: int = AUDIT_KEY_BYTES_PER_MIN,
        state_file: str | Path | None = None,
        memory_limit_bytes: int | None = None,
        work_units_per_min: int = WORK_UNITS_PER_MIN,
        reuse_refresh_s: float = REUSE_REFRESH_S,
        whatif_refresh_s: float = WHATIF_REFRESH_S,
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
        self._audit = AuditTrail(self.audit_file, audit_max_bytes, audit_backups,
                                 audit_key_bytes_per_min)
        self.state_file = Path(state_file) if state_file else None
        self.memory_limit_bytes = memory_limit_bytes
        self._work = WorkBudget(work_units_per_min)
        self._guard = MemoryGuard(memory_limit_bytes)
        self.memory_sheds = 0
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
        self.lost_replies = 0
        self.forgotten = 0
        self.refused_connections: dict[str, int] = {}
        self.refused_by_key: dict[str, int] = {}
        self.allow: AllowList | None = None
        self.seq_tracker = SeqTracker()
        self._fleet = Fleet()
        self._state = StateFile(self.state_file, self._fleet)
        self._pending: dict[str, _Pending] = {}
        # Update streams (FULL_RATE or a tier's ms), each started by its first subscriber: a
        # hub watched by tier consoles only never encodes the full-rate one. A stream stays on
        # once subscribed: unsubscriptions cannot be told apart from forged ones (any
        # subscriber can send one), and a stream nobody reads costs encoding only.
        self._streams: dict[int, _Stream] = {}
        # Per agent, so each agent sees its own gap-free command sequence.
        self._agent_seq: dict[str, int] = {}
        # Operator key -> when its last PIN_COMMANDS_PER_MIN pin/unpin commands were taken.
        self._pin_times: dict[str, deque[float]] = {}
        self._want_snapshot = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics: MetricsServer | None = None
        self.reuse = ReuseService(
            refresh_s=reuse_refresh_s, whatif_refresh_s=whatif_refresh_s,
            capacity=lambda model, size: pool_capacity_tokens(
                (st for st, _ in self._fleet.states().values()), model, size))

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
        self.reuse.start()
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
        self.reuse.stop(timeout_s)

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
                    "memory_sheds": self.memory_sheds,
                    # CURVE handshakes refused per port (hubs with keys).
                    **{f"refused_handshakes_{port}": n
                       for port, n in self.refused_connections.items()},
                    # Refusals per key: the names of the keys the hub authorized.
                    **{f"refused_key_{_metric_word(key)}": n
                       for key, n in dict(self.refused_by_key).items()}}

        return FleetCollector(self._fleet.states, lambda: dict(self.seq_tracker.gaps),
                              counters, lambda: time.time() * 1e3, self.reuse.ceilings)

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
        self._keys = self._load_keys()
        self.poller = zmq.Poller()

        self.agents_sock = self._socket(zmq.ROUTER, "agents", self.ports.agents)
        self.pub = self._socket(zmq.XPUB, "pub", self.ports.pub)
        self.plain = self._socket(zmq.ROUTER, "commands", self.ports.commands)
        self.curve: zmq.Socket[bytes] | None = None
        if self._keys is not None:
            self.curve = self._socket(zmq.ROUTER, "curve", self.ports.curve)

    def _socket(self, kind: int, name: str, endpoint: str) -> zmq.Socket[bytes]:
        """A bound socket of port ``name``, registered with the poller (and its monitor)."""
        # Tracked before bind: a socket left out of self.socks would make ctx.term() in
        # _close() wait for it forever when a later bind fails.
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
            # Every subscription reaches _recv_subscriptions (a join snapshot), also
            # repeats.
            s.setsockopt(zmq.XPUB_VERBOSE, 1)
            s.setsockopt(zmq.MAXMSGSIZE, _MAX_SUBSCRIPTION_BYTES)
            # libzmq adds every queued subscription to its trie when the hub reads the first:
            # a short queue per connection bounds what one read adds before the hub sees it.
            s.setsockopt(zmq.RCVHWM, _SUBSCRIPTION_RCVHWM)
        if self._keys is not None:
            s.curve_publickey, s.curve_secretkey = self._keys
            s.curve_server = True
            s.zap_domain = _PORT_DOMAIN[name].encode()
        try:
            s.bind(endpoint)
        except zmq.ZMQError as e:
            raise zmq.ZMQError(e.errno, f"kvpool hub cannot bind {endpoint}: {e}") from e
        if self._keys is not None:
            # Right after bind: a handshake refused within those microseconds goes uncounted.
            mon = s.get_monitor_socket(_HANDSHAKE_FAILED)
            self.monitors[mon] = name
            self.refused_connections.setdefault(name, 0)
            self.poller.register(mon, zmq.POLLIN)
        self.poller.register(s, zmq.POLLIN)
        return s

    def _rebuild(self, name: str) -> None:
        """Close port ``name``'s socket (freeing all libzmq holds for its connections: the
        XPUB's subscription trie, messages queued or half received) and bind a new one on the
        same endpoint: agents' and consoles' sockets reconnect by themselves (a console's
        subscription brings a snapshot)."""
        for mon, port in list(self.monitors.items()):
            if port == name:
                self.poller.unregister(mon)
                del self.monitors[mon]
                mon.close(linger=0)
        old: zmq.Socket[bytes] = getattr(self, _PORT_ATTR[name])
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

    def _shed(self, rss: int) -> None:
        """The RSS is over ``memory_limit_bytes`` (``kvpool_agent._memory_guard``): answer
        every command in flight with an error, then rebuild every port but the operator's;
        agents keep their ids when they report again from their new connections."""
        self.memory_sheds += 1
        log.warning("kvpool hub: RSS %d MiB over the memory limit of %d MiB: every port but "
                    "the operator's is rebuilt (connections drop and reconnect; a multipart "
                    "message held whole by libzmq is freed)", rss >> 20,
                    (self.memory_limit_bytes or 0) >> 20)
        for internal, pend in list(self._pending.items()):
            for aid in pend.expected:
                if aid not in pend.replies:
                    pend.replies[aid] = self._agent_error(
                        pend.req, aid, "hub over its memory limit: connections dropped")
            self._maybe_finish(internal)
        # Not the operator port: only operator keys reach it, and an operator must keep
        # reaching the hub while a viewer's message is being dropped.
        for name in _PORT_ATTR:
            if name != "curve":
                self._rebuild(name)
        self._fleet.reset_routes()

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
        self._state.save()
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
            self._state.load()
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
        next_snapshot = next_forget = last_snapshot = 0.0
        next_save = next_refresh = time.monotonic() + _STATE_SAVE_S
        try:
            while not self._stop.is_set():
                try:
                    events = dict(self.poller.poll(50))
                    # The operator first, and again after each batch of the others: an
                    # operator frame waits for one small batch at most (socket reads that find
                    # nothing cost a microsecond; unread frames make the next poll return).
                    self._recv_operator()
                    self._recv_agents(_AGENT_BATCH)
                    self._recv_commands(self.plain, curve=False, limit=_READONLY_BATCH)
                    self._recv_operator()
                    if self.pub in events:
                        self._recv_subscriptions()
                    for mon in self.monitors:
                        if mon in events:
                            self._recv_monitors(mon)
                    now = time.monotonic()
                    rss = self._guard.over(now)
                    if rss is not None:
                        self._shed(rss)
                    self._expire(now)
                    if now >= next_forget:
                        next_forget = now + _FORGET_CHECK_S
                        self._note_forgotten(
                            self._fleet.forget_silent(self.forget_after_s), "silent"
                        )
                        self._fleet.prune_tenure(TENURE_KEPT_S)
                        self._audit.tick()
                    if now >= next_save and (self._fleet.tenure_changed or now >= next_refresh):
                        next_save = now + _STATE_SAVE_S
                        next_refresh = now + _STATE_REFRESH_S
                        self._state.save()
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

    def _recv_operator(self) -> None:
        # EVENTS first: the common case (nothing from the operator) costs no exception.
        if self.curve is not None and int(self.curve.get(zmq.EVENTS)) & zmq.POLLIN:
            self._recv_commands(self.curve, curve=True, limit=_OPERATOR_BATCH)

    def _refuse(self, key: str, why: str) -> None:
        """Count one refusal of ``key``'s (a command, report or audit line over a budget or
        bound), logged for a key's first 3 and every 1000th."""
        n = self.refused_by_key[key] = self.refused_by_key.get(key, 0) + 1
        if n <= 3 or n % 1000 == 0:
            log.warning("kvpool hub: refused #%d of key %s: %s", n, key, why[:200])

    def _recv_agents(self, limit: int) -> None:
        until = time.monotonic() + _AGENT_SLICE_S
        for _ in range(limit):
            # A report may be ~MAX_MESSAGE_BYTES to decode and validate (~8 ms for 1 MiB):
            # the operator waits for one agent frame at most, not a batch of 64.
            self._recv_operator()
            if time.monotonic() >= until:
                return
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

    def _key_name(self, domain: str, identity: str) -> str:
        """The authorized key's name (``agent/eng-0.engine``), ``plain`` without keys."""
        if self.allow is None:
            return "plain"
        return self.allow.name(_PORT_DOMAIN[domain], identity.encode()) or identity

    def _on_report(self, rid: bytes, rep: Report, identity: str) -> None:
        bound = (self.allow is not None
                 and bound_engine(self._key_name("agents", identity)) is not None)
        refused = (self._bound_elsewhere(rep, identity)
                   or self._fleet.accept(rid, rep, identity, bound=bound))
        if refused is not None:
            if refused.startswith("takeover:"):
                self.takeover_refused += 1
            elif refused.startswith("oversized:"):
                self.oversized_states += 1
            elif refused.startswith("full:"):
                self.fleet_full += 1
            self._bad("agents", refused)
            self._refuse(self._key_name("agents", identity), refused)
            return
        self.reports += 1
        aid = rep.state.source.agent_id
        self.reuse.add(rep.state.source.model, rep.accesses)
        self.seq_tracker.observe(aid, rep.seq)
        records = self._fleet.unaudited_flushes(aid, rep.state.flushes)
        budget = f"agent:{self._key_name('agents', identity)}" if records else ""
        for rec in records:
            # The agent's own claim of who started it, prefixed with the agent it came from.
            req = CommandRequest(v=PROTOCOL_VERSION, seq=0, request_id=rec.request_id,
                                 command="flush", sender=rec.who, targets=[aid],
                                 flush=rec.flush)
            if not self._audit.record(f"agent:{aid} ({rec.who})", req, [aid], [CommandReply(
                    v=PROTOCOL_VERSION, seq=0, request_id=rec.request_id, agent_id=aid,
                    ok=rec.ok, error=rec.error, flush=rec.result)], channel="agents",
                    budget_key=budget):
                self._refuse(budget, "audit budget spent: own flush line suppressed")

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
                msg = self.pub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frame = msg.bytes
            if frame[:1] not in (b"\x00", b"\x01"):
                self._bad("pub", "not a subscription message")
                continue
            # libzmq has applied it to its connection already; an unsubscription needs nothing.
            subscribe, topic = frame[:1] == b"\x01", frame[1:]
            tier = tier_of(topic)
            if subscribe and tier is None and topic not in _KNOWN_TOPICS:
                self._unknown_subscription(_user_id(msg) if self.allow is not None else "",
                                           topic)
                return
            if subscribe:
                self._want_snapshot = True
                key = FULL_RATE if tier is None else tier
                if key not in self._streams:
                    self._fleet.add_stream(key)
                    self._streams[key] = _Stream(
                        b"" if tier is None else tier_topic(tier),
                        max(key / 1e3, self.delta_interval_s))

    def _unknown_subscription(self, identity: str, topic: bytes) -> None:
        """A subscription to no topic the hub publishes: a bug or an attack on the hub's memory
        (libzmq keeps every distinct topic of every subscriber, ~50 bytes per topic byte).
        With keys the key is banned for ``SUBSCRIPTION_BAN_S`` (refused at its next
        handshake on every port, counted and logged by name); with or without keys the XPUB
        is rebuilt, which frees every subscription (consoles subscribe again)."""
        key = self._key_name("pub", identity)
        why = f"subscribed to an unknown topic {topic[:40]!r} ({len(topic)} bytes)"
        self._bad("pub", why)
        if self.allow is not None:
            self.allow.ban(identity.encode(), SUBSCRIPTION_BAN_S)
            why += f"; key banned for {SUBSCRIPTION_BAN_S:g} s"
        self._refuse(key, why)
        log.warning("kvpool hub: %s by key %s: the console port is rebuilt", why, key)
        self._rebuild("pub")

    def _publish(self, kind: str, key: int) -> None:
        """One update (``snapshot`` or ``delta``) on stream ``key``: frames numbered on from
        the stream's last, each its topic (none for the full-rate stream) then the update."""
        stream = self._streams[key]
        updates = self._fleet.updates(kind, stream.seq + 1, dict(self.seq_tracker.gaps),
                                      stream=key)
        stream.seq += len(updates)
        if kind == "snapshot":
            updates[0].reuse = self.reuse.view()
        for upd in updates:
            upd.refused_connections = dict(self.refused_connections)
            frame = stream.topic + encode(upd)
            if len(frame) > MAX_UPDATE_FRAME_BYTES:
                # Cannot happen by _fleet's budgets; if it did, the queue bound would not hold.
                self._bad("pub", f"update frame of {len(frame)} bytes > "
                          f"{MAX_UPDATE_FRAME_BYTES}: not sent")
                continue
            try:
                self.pub.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                log.debug("kvpool hub: publish dropped (no room)")

    # -- commands ----------------------------------------------------------------------------

    def _recv_commands(self, sock: zmq.Socket[bytes], *, curve: bool, limit: int) -> None:
        where = "curve" if curve else "commands"
        until = time.monotonic() + _READONLY_SLICE_S
        for _ in range(limit):
            if not curve:
                # The operator waits for one read-only command at most.
                self._recv_operator()
                if time.monotonic() >= until:
                    return
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
                key = self._key_name(where, _user_id(frame))
                who = f"key:{key}" + (f" ({msg.sender})" if msg.sender else "")
            else:
                key = "plain"
                who = f"plain:{msg.sender or 'anonymous'}"
            self._on_command(sock, client, msg, who, key, curve=curve)

    def _record(self, who: str, key: str, req: CommandRequest, targets: list[str],
                replies: list[CommandReply], *, curve: bool, refused: bool = False) -> None:
        """Audit one command: the operator port's lines in full, the read-only port's within
        ``key``'s budget (a line over it is counted as a refusal of ``key``)."""
        if not self._audit.record(who, req, targets, replies, refused=refused,
                                  channel="operator" if curve else "readonly",
                                  budget_key=None if curve else key):
            self._refuse(key, "audit budget spent: line suppressed")

    def _on_command(
        self, sock: zmq.Socket[bytes], client: bytes, req: CommandRequest, who: str, key: str,
        *, curve: bool,
    ) -> None:
        self.commands += 1
        needs_key = None
        if req.command == "flush" and (req.flush is None or not req.flush.dry_run):
            needs_key = UNAUTHORISED
        elif req.command == "health" and req.probe:
            needs_key = OPERATOR_ONLY.format(what="health --probe")
        elif req.command in ("forget", "pin", "unpin"):
            needs_key = OPERATOR_ONLY.format(what=req.command)
        refusal = needs_key if not curve else None
        if len(req.targets) > MAX_TARGETS:
            refusal = f"refused: {len(req.targets)} targets, at most {MAX_TARGETS} per command"
        elif refusal is not None:
            self.refused += 1
        if refusal is not None:
            self._refuse(key, refusal)
            reply = self._agent_error(req, "hub", refusal)
            # What was tried: the targets it named (the line shows the first few). Audited
            # before the answer leaves, so whoever holds the answer finds the line.
            self._record(who, key, req, list(req.targets), [reply], curve=curve, refused=True)
            self._send_client(sock, client, [reply])
            return
        if req.command == "forget":
            self._forget(sock, client, req, who)
            return
        busy = self._busy(client, key, curve=curve, command=req.command)
        if busy is not None:
            # Not audited: a flood of read-only commands must not fill the audit file.
            self.busy += 1
            self._refuse(key, busy)
            self._send_client(sock, client, [self._agent_error(req, "hub", busy)])
            return
        targets, problem, unvouched = self._fleet.targets(req)
        if problem is not None:
            reply = self._agent_error(req, "hub", problem + unvouched_note(unvouched))
            self._record(who, key, req, targets, [reply], curve=curve)
            self._send_client(sock, client, [reply])
            return
        routes = {aid: self._fleet.routing_id(aid) for aid in targets}
        # Unknown ids get one answer for them all: a request naming thousands costs one reply
        # and one short audit line, not one of each per id.
        unknown = [aid for aid, r in routes.items() if r is None]
        known = {aid: r for aid, r in routes.items() if r is not None}
        targets = list(known)
        wait_s = self._work.spend(key, cost(req, len(known)))
        if wait_s is not None:
            # Not audited, like a full pending quota: a flood must not fill the audit file.
            self.busy += 1
            why = (f"hub busy: this key's engine work budget ({self._work.capacity} agent "
                   f"commands a minute of dry-run flush, pins, health --probe) is spent; "
                   f"retry in {wait_s:.0f} s")
            self._refuse(key, why)
            self._send_client(sock, client, [self._agent_error(req, "hub", why)])
            return
        pend = _Pending(
            sock=sock,
            client=client,
            req=req,
            who=who,
            deadline=time.monotonic() + min(max(req.timeout_ms, 1), MAX_TIMEOUT_MS) / 1e3,
            expected=targets,
            plain=not curve,
            key=key,
            unknown=unknown,
            unvouched=unvouched,
        )
        if not targets:
            self._finish(pend)
            return
        internal = secrets.token_hex(16)
        self._pending[internal] = pend
        # Without the targets: agents do not read them, and a request naming MAX_TARGETS ids
        # (~1.1 MB) would be queued once per target agent (AGENT_SNDHWM deep each).
        fwd = msgspec.structs.replace(req, request_id=internal, targets=[])
        if req.drain is not None:
            # No agent waits longer than the hub waits for its reply.
            fwd.drain = DrainArgs(timeout_ms=min(max(req.drain.timeout_ms, 0), req.timeout_ms,
                                                 MAX_TIMEOUT_MS))
        for aid, routing_id in known.items():
            if req.command == "flush":
                pend.pool_keys[aid] = self._fleet.pool_keys(aid)
            fwd.seq = self._agent_seq[aid] = self._agent_seq.get(aid, 0) + 1
            try:
                self.agents_sock.send_multipart([routing_id, encode(fwd)], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                pend.replies[aid] = self._agent_error(req, aid, f"agent unreachable: {e}")
                continue
            pend.routes[aid] = routing_id
        self._maybe_finish(internal)

    def _busy(self, client: bytes, key: str, *, curve: bool,
              command: str = "") -> str | None:
        """Why a new command cannot be taken now (a full pending quota, a key's pin commands
        over ``PIN_COMMANDS_PER_MIN``), else ``None``."""
        if len(self._pending) >= MAX_PENDING:
            return f"hub busy: {MAX_PENDING} commands in flight, retry later"
        if curve:
            if command not in ("pin", "unpin"):
                return None
            # Each pin makes a worker read and upsert up to MAX_PIN_TOKENS tokens' values.
            now = time.monotonic()
            sent = self._pin_times.setdefault(key, deque(maxlen=PIN_COMMANDS_PER_MIN))
            if len(sent) == PIN_COMMANDS_PER_MIN and now - sent[0] < 60.0:
                return (f"hub busy: {PIN_COMMANDS_PER_MIN} pin/unpin commands of this key in "
                        f"the last minute; retry in {60.0 - (now - sent[0]):.0f} s")
            sent.append(now)
            return None
        plain = [p for p in self._pending.values() if p.plain]
        if len(plain) >= MAX_PENDING - OPERATOR_RESERVE:
            return "hub busy: the read-only port's commands in flight are at their limit"
        if sum(1 for p in plain if p.client == client) >= MAX_PENDING_PER_CONNECTION:
            return (
                f"hub busy: {MAX_PENDING_PER_CONNECTION} commands of this connection in "
                "flight, wait for their replies"
            )
        if sum(1 for p in plain if p.key == key) >= MAX_PENDING_PER_KEY:
            return (f"hub busy: {MAX_PENDING_PER_KEY} commands of this key in flight (all "
                    "its connections), wait for their replies")
        return None

    def _forget(
        self, sock: zmq.Socket[bytes], client: bytes, req: CommandRequest, who: str
    ) -> None:
        if not req.targets:
            reply = self._agent_error(req, "hub", "forget needs targets (engine or agent ids)")
        else:
            ids = self._fleet.forget(req.targets)
            self._note_forgotten(ids, f"forget by {who}")
            named = ", ".join(req.targets[:AUDIT_IDS_SHOWN])
            more = len(req.targets) - AUDIT_IDS_SHOWN
            reply = CommandReply(
                v=PROTOCOL_VERSION,
                seq=0,
                request_id=req.request_id,
                agent_id="hub",
                ok=bool(ids),
                error=None if ids else f"no agent or engine named {named}"
                + (f" (and {more} more)" if more > 0 else ""),
                forgotten=ids[:FORGOTTEN_SHOWN],
                forgotten_count=len(ids),
            )
        self._audit.record(who, req, list(req.targets), [reply])
        self._send_client(sock, client, [reply])

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
        self._finish(pend)

    def _finish(self, pend: _Pending) -> None:
        """Audit, then answer the console (flush answers checked, unknown targets in one reply)."""
        replies = [checked_answer(pend.req, pend.replies[a], (pend.pool_keys.get(a),
                                                              self._fleet.pool_keys(a)))
                   for a in pend.expected]
        if len(pend.unknown) == 1:
            (aid,) = pend.unknown
            replies.append(self._agent_error(pend.req, aid, f"unknown agent {aid!r}"))
        elif pend.unknown:
            first = ", ".join(pend.unknown[:AUDIT_IDS_SHOWN])
            replies.append(self._agent_error(
                pend.req, "hub", f"unknown agents: {len(pend.unknown)} ({first}"
                + (", ..." if len(pend.unknown) > AUDIT_IDS_SHOWN else "") + ")"))
        if pend.unvouched:
            replies.append(self._agent_error(pend.req, "hub", "not sent"
                                             + unvouched_note(pend.unvouched)))
        self._record(pend.who, pend.key, pend.req, [*pend.expected, *pend.unknown], replies,
                     curve=not pend.plain)
        self._send_client(pend.sock, pend.client, replies)

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
            # Rate-limited: a console that disconnects with replies pending is no log flood.
            self.lost_replies += 1
            if self.lost_replies <= 10 or self.lost_replies % 1000 == 0:
                log.warning("kvpool hub: reply #%d to a console lost (%s)",
                            self.lost_replies, e)


def _user_id(frame: zmq.Frame) -> str:
    """The ZAP User-Id of a frame's connection (the z85 CURVE public key), ``""`` if none."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return ""


def _metric_word(key: str) -> str:
    """``key`` as a Prometheus name part (``viewer/ops-1`` -> ``viewer_ops_1``)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", key)[:120]
