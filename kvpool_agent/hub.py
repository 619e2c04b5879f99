"""The fleet hub: agents report to it, consoles watch it and send commands through it.

Ports, for ``address="tcp://HOST:P"``. With keys (``kvpool-agent keygen --role hub``) every
port is a CURVE server and a ZAP handler (pyzmq's ``ThreadAuthenticator`` with
``kvpool_agent.auth.AllowList``) admits only the public keys in ``authorized_keys/<role>/``;
a refused handshake is counted per port (``refused_connections``, also sent to consoles in
``FleetUpdate.refused_connections``). Without keys every port is plain and the hub binds
loopback unless run ``--insecure`` (``kvpool_agent.cli``).

- ``P``   ROUTER, agents connect (DEALER) and send ``Report`` / ``CommandReply``; with keys an
  ``agent`` key;
- ``P+1`` XPUB, consoles subscribe (SUB) to ``FleetUpdate``: a snapshot on a join, then
  deltas, per update tier (``kvpool_agent._hub_updates``); with keys a ``viewer`` or
  ``operator`` key. libzmq applies each connection's subscriptions to that connection (prefix
  matching), so no subscriber changes what another receives. Not ``XPUB_MANUAL``: there the
  hub's ``SUBSCRIBE`` goes to the connection libzmq last queued a subscription from, and a
  non-subscription message (any ``XSUB`` may send one) shifts that pairing, so one subscriber
  could hand another's subscription to itself and blind it. A subscription to a topic the hub
  does not publish bans that key for ``SUBSCRIPTION_BAN_S`` and rebuilds the XPUB (libzmq keeps
  every distinct topic of every subscriber);
- ``P+2`` ROUTER, read-only commands (``snapshot``, ``health`` without the probe, ``drain``,
  ``flush`` with ``dry_run=True``: each pool listed once, ``kvpool_agent._hub_listings``;
  ``pins``), at most ``MAX_PENDING_PER_CONNECTION`` in flight per
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
message: connections per key on every port (``kvpool_agent.key_caps``), commands
in flight per key (above), engine work per key and minute (``kvpool_agent._work_budget``),
targets per command (``MAX_TARGETS``), audit bytes per key and minute
(``kvpool_agent._audit``), agent ids and state bytes per engine (``kvpool_agent._fleet``),
messages queued per connection and the largest message each port reads
(``kvpool_agent._hub_memory``), and the process's RSS (``memory_limit_bytes``: past it the
connections holding unread bytes are dropped, else ports are rebuilt,
``kvpool_agent._memory_guard``). Refusals are counted per key (``refused_by_key``).
The one thread serves the operator first: each turn it takes the operator port's frames, then
at most ``_AGENT_BATCH`` agent frames (for ``_AGENT_SLICE_S`` at most, taking the operator's
frames again before each) and ``_READONLY_BATCH`` read-only commands (for
``_READONLY_SLICE_S`` at most), taking the operator's frames again before each read-only
command, so an operator command waits for one agent batch or one read-only command at most.

Commands and replies are bound to connections (``kvpool_agent._hub_commands``), agent ids to
theirs and the agent key that registered them (``kvpool_agent._fleet``); agents silent for
``forget_after_s``, or whose key left the allow list (``kvpool_agent._hub_revocation``: a
revoked key keeps no power on any port), are dropped and consoles told (``forgotten``).

One thread owns every socket. This module is that thread: its loop, agents' reports, consoles'
subscriptions and the updates it publishes. The rest is one module per concept: the sockets and
who may connect (``kvpool_agent._hub_sockets``), command routing (``kvpool_agent._hub_commands``),
what each key may cost (``kvpool_agent._hub_quotas``, ``kvpool_agent._work_budget``), one pool
listing per pool (``kvpool_agent._hub_listings``), the counters (``kvpool_agent._hub_counters``),
the state file (``kvpool_agent._hub_state``), the fleet's state (which agent said what, who a
command goes to, the update frames: ``kvpool_agent._fleet``) and the audit trail
(``kvpool_agent._audit``).

Over 600 lines: this docstring (the hub's ports and bounds, 60 lines) and one read-through
property per counter (tests and embedders read ``hub.reports``) around the thread's loop.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import TracebackType

import zmq

from kvpool_agent._audit import AUDIT_BACKUPS, AUDIT_KEY_BYTES_PER_MIN, AUDIT_MAX_BYTES, AuditTrail
from kvpool_agent._fleet import ENGINES_PER_UPDATE, MAX_AGENTS, Fleet
from kvpool_agent._hub_commands import (
    MAX_TARGETS,
    OPERATOR_ONLY,
    UNAUTHORISED,
    CommandRouter,
)
from kvpool_agent._hub_connections import ConnectionTable
from kvpool_agent._hub_counters import HubCounters
from kvpool_agent._hub_notices import RefusalNotices
from kvpool_agent._hub_quotas import (
    MAX_PENDING,
    MAX_PENDING_PER_CONNECTION,
    MAX_PENDING_PER_KEY,
    OPERATOR_RESERVE,
    PIN_COMMANDS_PER_MIN,
    Quotas,
)
from kvpool_agent._hub_revocation import Revocations
from kvpool_agent._hub_sockets import ZAP_DOMAINS, HubPorts, HubSockets, hub_ports, user_id
from kvpool_agent._hub_state import TENURE_KEPT_S, StateFile
from kvpool_agent._hub_updates import SUBSCRIPTION_BAN_S, UpdateStreams
from kvpool_agent._memory_guard import MemoryGuard
from kvpool_agent._metrics import FleetCollector
from kvpool_agent._reuse_service import (
    REUSE_REFRESH_S,
    WHATIF_REFRESH_S,
    ReuseService,
    pool_capacity_tokens,
)
from kvpool_agent._saved_chunks import MAX_LAYOUTS_PER_ENGINE_KEY, MAX_LAYOUTS_PER_FLEET_KEY
from kvpool_agent._work_budget import WORK_UNITS_PER_MIN
from kvpool_agent.auth import AllowList, bound_elsewhere, bound_engine, bound_pool
from kvpool_agent.key_caps import (
    MAX_AGENT_CONNECTIONS_PER_FLEET_KEY,
    MAX_AGENT_CONNECTIONS_PER_KEY,
    MAX_CONNECTIONS_PER_KEY,
    MAX_SUBSCRIBERS_PER_KEY,
    KeyCaps,
)
from kvpool_agent.metrics_http import MetricsEndpoint
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    EngineState,
    ProtocolError,
    Report,
    SeqTracker,
    decode,
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

FORGET_AFTER_S = 600.0
"""Default ``forget_after_s``: agents silent this long are dropped."""
_FORGET_CHECK_S = 1.0
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
            listing the pool (a flush, dry run or not), listing pins or probing, less for
            ``health``, ``snapshot`` and ``drain`` (``kvpool_agent._work_budget.COSTS``); past
            it a key's commands are answered ``hub busy``.
        memory_limit_bytes: past this RSS (bytes, the whole process's) the hub drops the
            connections holding the most unread bytes, or rebuilds the console port, and
            every port but the operator's when a shed freed too little
            (``kvpool_agent._memory_guard``): the bound for what libzmq cannot bound, a
            multipart message. ``None``: no limit (a hub embedded in
            a larger process).
        max_subscribers_per_key, max_connections_per_key: connections one viewer or operator
            key may hold open on ``P+1`` and on each command port (with keys; 0: none),
            ``kvpool_agent.key_caps``.
        max_agent_connections_per_key, max_agent_connections_per_fleet_key: connections one
            engine-bound agent key, and one fleet-wide agent key, may hold open on ``P`` (with
            keys; 0: none), ``kvpool_agent.key_caps``.
        reuse_refresh_s: the live reuse ceiling over agents' lookups (``Report.accesses``,
            ``kvpool_agent._reuse_service``) is recomputed at most this often (s), on its own
            thread; ``whatif_refresh_s``: its what-if curves (the costly part). Consoles get
            them in snapshots (``FleetUpdate.reuse``).

    Counters (read from any thread): ``counters`` (``kvpool_agent._hub_counters.HubCounters``:
    what each counts); those older than that object are also attributes of the hub
    (``hub.reports``, ``hub.memory_sheds``, ``hub.refused_by_key``...).

    Raises:
        ValueError: bad address, only one of the two key arguments, a cap below 0.
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
        max_subscribers_per_key: int = MAX_SUBSCRIBERS_PER_KEY,
        max_connections_per_key: int = MAX_CONNECTIONS_PER_KEY,
        max_agent_connections_per_key: int = MAX_AGENT_CONNECTIONS_PER_KEY,
        max_agent_connections_per_fleet_key: int = MAX_AGENT_CONNECTIONS_PER_FLEET_KEY,
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
        self._guard = MemoryGuard(memory_limit_bytes)
        self.snapshot_interval_s, self.delta_interval_s = snapshot_interval_s, delta_interval_s
        self.forget_after_s = forget_after_s
        self.counters = HubCounters()
        self.seq_tracker = SeqTracker()
        self._fleet = Fleet()
        self._state = StateFile(self.state_file, self._fleet)
        # Connections are kept only where a memory limit may have to drop one of them.
        self._connections = ConnectionTable() if memory_limit_bytes is not None else None
        self._sockets = HubSockets(self.ports, self.authorized_keys_dir, self.secret_key_file,
                                   self.counters, self._connections,
                                   KeyCaps({
                                       "pub": {"console": max_subscribers_per_key},
                                       "commands": {"console": max_connections_per_key},
                                       "curve": {"console": max_connections_per_key},
                                       "agents": {"engine": max_agent_connections_per_key,
                                                  "fleet": max_agent_connections_per_fleet_key},
                                   }))
        self._commands = CommandRouter(self._sockets, self._fleet, self._audit, self.counters,
                                       Quotas(work_units_per_min))
        self._revocations = Revocations(self._sockets, self._fleet, self._commands)
        self._notices = RefusalNotices(self._sockets)
        self._updates = UpdateStreams(self._sockets, self._fleet, self.counters,
                                      self.seq_tracker, snapshot_interval_s, delta_interval_s)
        self._stop, self._ready = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics: MetricsEndpoint | None = None
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
                self.metrics = MetricsEndpoint(self._collector(), self._metrics_host(),
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

    @property
    def allow(self) -> AllowList | None:
        """The keys the hub admits (``None`` without keys)."""
        return self._sockets.allow

    @property
    def gaps(self) -> int:
        """Agent messages the hub never received, from their sequence numbers."""
        return self.seq_tracker.total_gaps

    @property
    def reports(self) -> int:
        """``HubCounters.reports``."""
        return self.counters.reports

    @property
    def commands(self) -> int:
        """``HubCounters.commands``."""
        return self.counters.commands

    @property
    def refused(self) -> int:
        """``HubCounters.refused``."""
        return self.counters.refused

    @property
    def busy(self) -> int:
        """``HubCounters.busy``."""
        return self.counters.busy

    @property
    def memory_sheds(self) -> int:
        """``HubCounters.memory_sheds``."""
        return self.counters.memory_sheds

    @property
    def takeover_refused(self) -> int:
        """``HubCounters.takeover_refused``."""
        return self.counters.takeover_refused

    @property
    def pool_binding_refused(self) -> int:
        """``HubCounters.pool_binding_refused``."""
        return self.counters.pool_binding_refused

    @property
    def oversized_states(self) -> int:
        """``HubCounters.oversized_states``."""
        return self.counters.oversized_states

    @property
    def fleet_full(self) -> int:
        """``HubCounters.fleet_full``."""
        return self.counters.fleet_full

    @property
    def rejected_replies(self) -> int:
        """``HubCounters.rejected_replies``."""
        return self.counters.rejected_replies

    @property
    def lost_replies(self) -> int:
        """``HubCounters.lost_replies``."""
        return self.counters.lost_replies

    @property
    def forgotten(self) -> int:
        """``HubCounters.forgotten``."""
        return self.counters.forgotten

    @property
    def bad_messages(self) -> int:
        """``HubCounters.bad_messages``."""
        return self.counters.bad_messages

    @property
    def refused_connections(self) -> dict[str, int]:
        """``HubCounters.refused_connections``: CURVE handshakes refused per port."""
        return self.counters.refused_connections

    @property
    def refused_by_key(self) -> dict[str, int]:
        """``HubCounters.refused_by_key``: refusals per key name."""
        return self.counters.refused_by_key

    def _host(self) -> str:
        return self.ports.agents[len("tcp://"):].rpartition(":")[0]

    def _metrics_host(self) -> str:
        if self.metrics_host is not None:
            return self.metrics_host
        return "127.0.0.1" if self.secret_key_file is not None else self._host()

    def _collector(self) -> FleetCollector:
        return FleetCollector(self._fleet.states, lambda: dict(self.seq_tracker.gaps),
                              self.counters.metrics, lambda: time.time() * 1e3,
                              self.reuse.ceilings, self.reuse.not_in_pool,
                              lambda ids: self._fleet.members(ids, self.allow.bound_pools()
                                                              if self.allow else frozenset()),
                              self.counters.by_label)

    # -- the thread --------------------------------------------------------------------------

    def _shed(self, rss: int) -> None:
        """The RSS is over ``memory_limit_bytes`` (``kvpool_agent._memory_guard``): drop the
        heaviest connections, by the bytes they sent the hub has not read, until those cover
        the growth since the RSS was calm (``ConnectionTable.shed``: a multipart message held
        whole is its sender's alone); when none holds ``REGROW`` of the limit, rebuild the
        console port (the subscribers' send queues, the hub's largest: round 5), and when the
        last shed freed too little, answer every command in flight with an error and rebuild
        every port but the operator's (agents keep their ids from their new connections). A
        shed of connections is judged once libzmq closed them (``ConnectionTable.releasing``,
        ``MemoryGuard.over``): it frees what they held only then."""
        limit, table = self.memory_limit_bytes or 0, self._connections
        dropped = table.shed(rss, limit) if table is not None else 0
        self.counters.connection_sheds += dropped
        if dropped:
            return
        self.counters.memory_sheds += 1
        if not self._guard.again:
            log.warning("kvpool hub: RSS %d MiB over the memory limit of %d MiB, no connection "
                        "holds it: the console port is rebuilt (subscribers reconnect)",
                        rss >> 20, limit >> 20)
            self._sockets.rebuild("pub")
            return
        log.warning("kvpool hub: RSS %d MiB over the memory limit of %d MiB: every port but "
                    "the operator's is rebuilt (connections drop and reconnect; a multipart "
                    "message held whole by libzmq is freed)", rss >> 20, limit >> 20)
        self._commands.expire(time.monotonic(),
                              "hub over its memory limit: connections dropped")
        self._sockets.rebuild_all_but_operator()
        self._fleet.reset_routes()

    def _close(self) -> None:
        self._state.save()
        self._sockets.close()
        self._audit.close()

    def _run(self) -> None:
        try:
            self._state.load()
            self._sockets.bind()
        except BaseException as e:
            self._error = e
            if hasattr(self._sockets, "ctx"):
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
            if self._sockets.curve is not None else " (no keys: plain)",
        )
        next_forget = 0.0
        next_save = next_refresh = time.monotonic() + _STATE_SAVE_S
        socks = self._sockets
        try:
            while not self._stop.is_set():
                try:
                    events = dict(socks.poller.poll(50))
                    # The operator first, and again after each batch of the others: an
                    # operator frame waits for one small batch at most (socket reads that find
                    # nothing cost a microsecond; unread frames make the next poll return).
                    self._recv_operator()
                    self._recv_agents(_AGENT_BATCH)
                    self._commands.recv(socks.plain, curve=False, limit=_READONLY_BATCH,
                                        until=time.monotonic() + _READONLY_SLICE_S,
                                        between=self._recv_operator)
                    self._recv_operator()
                    if socks.pub in events:
                        self._updates.recv_subscriptions()
                    socks.recv_monitors(events)
                    now = time.monotonic()
                    rss = self._guard.over(now, releasing=self._connections is not None
                                           and self._connections.releasing)
                    if rss is not None:
                        self._shed(rss)
                    elif self._connections is not None and self.memory_limit_bytes:
                        self._connections.baseline(self._guard.rss, self.memory_limit_bytes, now)
                    self._commands.expire(now)
                    self._revocations.sweep(now)  # keys gone from authorized_keys/
                    if now >= next_forget:
                        next_forget = now + _FORGET_CHECK_S
                        self._commands.note_forgotten(
                            self._fleet.forget_silent(self.forget_after_s), "silent"
                        )
                        self._fleet.prune_tenure(TENURE_KEPT_S)
                        self._commands.listings.prune(now)
                        self._audit.tick()
                    if now >= next_save and (self._fleet.tenure_changed or now >= next_refresh):
                        next_save = now + _STATE_SAVE_S
                        next_refresh = now + _STATE_REFRESH_S
                        self._state.save()
                    self._updates.publish_due(now, self.reuse.view)
                except Exception:
                    log.exception("kvpool hub: loop iteration failed")
                    time.sleep(0.05)
        finally:
            self._close()

    # -- agents ------------------------------------------------------------------------------

    def _recv_operator(self) -> None:
        # EVENTS first: the common case (nothing from the operator) costs no exception.
        curve = self._sockets.curve
        if curve is not None and int(curve.get(zmq.EVENTS)) & zmq.POLLIN:
            self._commands.recv(curve, curve=True, limit=_OPERATOR_BATCH, until=0.0)

    def _recv_agents(self, limit: int) -> None:
        until = time.monotonic() + _AGENT_SLICE_S
        for _ in range(limit):
            # A report may be ~MAX_MESSAGE_BYTES to decode and validate (~8 ms for 1 MiB):
            # the operator waits for one agent frame at most, not a batch of 64.
            self._recv_operator()
            if time.monotonic() >= until:
                return
            try:
                frames = self._sockets.agents.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self._connections is not None:
                self._connections.took("agents", frames)
            if not self._sockets.admit("agents", frames[-1]):
                continue  # a connection past its key's cap: shut down, its report dropped
            if len(frames) != 2:
                self.counters.bad("agents", f"{len(frames) - 1} frames, expected 1")
                continue
            rid, frame = frames[0].bytes, frames[1]
            try:
                msg = decode(frame.bytes)
            except ProtocolError as e:
                self.counters.bad("agents", str(e))
                continue
            # With keys, the agent key the ZAP handler admitted (z85; agent ids are bound to it)
            # while it is still listed: a revoked key's message is refused. Without keys "".
            identity = user_id(frame) if self.allow is not None else ""
            if (key := self._sockets.listed_key("agents", identity)) is None:
                continue
            if isinstance(msg, Report):
                self._on_report(rid, msg, identity, key)
            elif isinstance(msg, CommandReply):
                self._commands.on_reply(rid, msg)
            else:
                self.counters.bad("agents", f"unexpected {type(msg).__name__} from an agent")

    def _on_report(self, rid: bytes, rep: Report, identity: str, key: str) -> None:
        bound = self.allow is not None and bound_engine(key) is not None
        elsewhere = bound_elsewhere(key, rep.state.source) if self.allow is not None else None
        refused = elsewhere or self._fleet.accept(rid, rep, identity, bound=bound,
                                                  pool=bound_pool(key) or "")
        if refused is not None:
            self.counters.count_report_refused(refused)
            self.counters.bad("agents", refused)
            self.counters.refuse(key, refused)
            self._notices.tell(rid, refused, own=elsewhere is not None)
            return
        self.counters.reports += 1
        aid = rep.state.source.agent_id
        self.reuse.add(rep.state.source.model, rep.accesses)
        if self.allow is None:  # no keys: no identity to budget
            over = self.reuse.split(rep)
        else:
            # Charged to the key itself: a key authorized again under the same name (rotated
            # after a leak) starts a budget of its own; the refusal is counted by name.
            over = self.reuse.split(rep, identity, MAX_LAYOUTS_PER_FLEET_KEY
                                    if bound_engine(key) is None else MAX_LAYOUTS_PER_ENGINE_KEY)
        if over:
            self.counters.refuse(key, f"layout budget spent: {over} chunk ids of a new "
                                 "layout left out of the miss split")
        self.counters.unsplit_accesses = self.reuse.unsplit_accesses
        self.counters.layouts_full = self.reuse.saved.layouts_full
        self.counters.layouts_over_budget = self.reuse.saved.layouts_over_budget
        self.seq_tracker.observe(aid, rep.seq)
        records = self._fleet.unaudited_flushes(aid, rep.state.flushes)
        budget = f"agent:{key}" if records else ""
        for rec in records:
            # The agent's own claim of who started it, prefixed with the agent it came from.
            req = CommandRequest(v=PROTOCOL_VERSION, seq=0, request_id=rec.request_id,
                                 command="flush", sender=rec.who, targets=[aid],
                                 flush=rec.flush)
            if not self._audit.record(f"agent:{aid} ({rec.who})", req, [aid], [CommandReply(
                    v=PROTOCOL_VERSION, seq=0, request_id=rec.request_id, agent_id=aid,
                    ok=rec.ok, error=rec.error, flush=rec.result)], channel="agents",
                    budget_key=budget):
                self.counters.refuse(budget, "audit budget spent: own flush line suppressed")
