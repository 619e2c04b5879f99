"""The live pool-wide policy service (issue 40 item 1): ``kvpool-policy serve``, one per pool,
beside the master.

It runs one ``PoolPolicy`` over the pool's capacity (by default following the master's used
bytes below its watermark: ``kvpool_policy._fill``), fed by every engine's access records, and
publishes its admission decision; what falls out of it is removed with its own Mooncake store
client (``_remover``). The wire is ``kvpool_connector.policy_wire``; the engines' side is
``kvpool_connector.policy_client``.

Who may connect, and what each may do and cost (the house security rule):

* records port ``P`` (PULL, CURVE server with the hub's key pair): only public keys in the hub's
  ``authorized_keys/agent/`` (``kvpool_agent.auth.AllowList``, ZAP domain
  ``RECORDS_DOMAIN``). A key may send ``budget`` chunk hashes a second (a token bucket of two
  seconds' worth; a batch costs its records' hashes, at least 1, plus the keys a chunk of each
  layout it newly declares fans out to); batches over it are dropped and counted
  (``over_budget``). A message over ``MAX_BATCH_BYTES`` is cut by ZMQ (``MAXMSGSIZE``); one
  that does not decode, names a layout whose prefixes are not that digest's kvpool keys, or
  negative ``seq``/``dropped`` is dropped whole (``malformed``), as is a record with a
  malformed hash or chunk bytes its layout did not first say. What a record can do: move
  chunks in the policy's order, so a key can make the service remove chunks of the layouts it
  names (what an agent key's engine can do to the pool anyway: it writes and removes keys) and
  never a key outside ``kvpool@`` or a pinned one; and, once the pool is full, the chunks its
  layouts hold are capped at a fair share of the capacity (``PolicyCore``), so one key's
  records cannot evict the other keys' layouts below theirs. Connections are capped per key
  like the snapshot port's (below; only a scheduler's ``PolicyClient`` connects, one PUSH per
  DP rank): past the cap a connection's handshake is refused (or, admitted in a burst, it is
  shut down at its first batch, which is dropped unapplied with the batches it queued);
  counted (``records_connections_over_cap``, per key in ``records_over_cap_by_key``). Each
  connection queues at most ``_RECORDS_HWM`` batches of ``MAX_BATCH_BYTES``, so what the
  records connections hold is at most agent keys x their cap x that. Every bound:
  docs/security.md.
* snapshots port ``P+1`` (XPUB): agent, viewer and operator keys (``SNAPSHOT_DOMAIN``); a slow
  subscriber loses snapshots (ZMQ's send high-water mark, ``SNAPSHOT_HWM``), never slows the
  service. Subscribers are capped per key (``kvpool_agent.key_caps``, V1): a viewer or
  operator key holds ``max_subscribers_per_key`` (``MAX_SUBSCRIBERS_PER_KEY``), an agent key
  one per engine scheduler it serves (``MAX_AGENT_CONNECTIONS_PER_KEY`` engine-bound,
  ``MAX_AGENT_CONNECTIONS_PER_FLEET_KEY`` fleet-wide, the same caps as on ``P``: the service's
  own, far below the hub's agent caps, which count every worker's connection); past it a
  subscriber's handshake is refused (or, admitted in a burst, it is shut down at its
  subscription), so it gets no snapshot; counted (``subscribers_over_cap``, per key in
  ``over_cap_by_key``). A subscriber holds at most ``SNAPSHOT_HWM + 1`` snapshots (queued, and
  one in flight), so what the subscribers hold is at most subscribers x that x a snapshot's
  bytes (docs/security.md).

Publishing: a snapshot goes out every ``snapshot_every_s`` (``SNAPSHOT_EVERY_S``), when the
admission's mode flips, and in the loop's turn that takes a new subscriber's subscription, so
it has a snapshot at once rather than at the next periodic one (``snapshots_on_subscription``),
whole for it; between whole ones, deltas of the filter (``kvpool_policy._deltas``).
Those are at most one a ``SUBSCRIBED_EVERY_S`` (subscriptions coming faster share one), so
subscription churn cannot make the service encode snapshots back to back; a refused subscriber
triggers none.

Counted drops (``counters``): records the senders report dropped (``RecordBatch.dropped``),
batches lost between (gaps in ``seq``), over budget, malformed; each sender's ``seq`` and
``dropped`` step is taken at most ``MAX_QUEUED`` a batch and every counter saturates at
``COUNTER_MAX`` (a snapshot always encodes). A batch or a publish that raises is counted
(``errors``, logged once) and never stops the service.

An HA pool (``--master etcd://...``): the service's store client follows the serving leader
(``kvpool_policy._leader``: the masters' ``/health`` watched, the client made again after a
leader change, no store call while none serves). Restart: the pool's keys (the serving
leader's ``/get_all_keys``) are read at start; each layout's
chunks become resident (least recently used first: in the order ``--order-file`` kept, chunks
it does not name after them, else in listing order; ``kvpool_policy._order_file``) once an
engine's record says their chunk bytes. Whatever the service removes follows ``_remover``'s
rule, so a restarted service that under-counts leaves the rest to the master's watermark.

The loop itself never calls the store: removals and pin reads run on the store thread
(``kvpool_policy._store_calls``), so a master that does not answer (a call waits 30-90 s in the
Mooncake client when it is SIGSTOPped, measured) holds up only them.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import httpx
import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvpool_agent.auth import AllowList, KeyPaths, bound_engine
from kvpool_agent.key_caps import (
    MAX_SUBSCRIBERS_PER_KEY,
    CappedAdmission,
    KeyCaps,
    KeyKind,
    admit_message,
)
from kvpool_agent.masters import leader_admin_url
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_connector.policy_wire import (
    MAX_BATCH_BYTES,
    SNAPSHOT_EVERY_S,
    RecordBatch,
    policy_ports,
)
from kvpool_connector.removal_rule import grace_s_of
from kvpool_policy._core import (
    COUNTER_MAX,
    DEFAULT_BUDGET,
    DOORKEEPER_SHARE,
    LAYOUT_IDLE_S,
    LAYOUTS_PER_KEY,
    MAX_KEYS_PER_CHUNK,
    MIN_CHUNK_BYTES,
    MIN_POOL_CHUNKS,
    PolicyCore,
    ServiceCounters,
    _sat,
    pool_chunks,
)
from kvpool_policy._deltas import SnapshotDeltas
from kvpool_policy._fill import FillFollower
from kvpool_policy._leader import LeaderFollower, LeaderWatch
from kvpool_policy._order_file import ORDER_EVERY_S, OrderWriter, order_found, read_order
from kvpool_policy._remover import Remover
from kvpool_policy._store_calls import StoreCalls
from kvpool_policy.policy import AdmissionKind, PoolPolicy

__all__ = [
    "COUNTER_MAX",
    "DEFAULT_BUDGET",
    "DOORKEEPER_SHARE",
    "LAYOUTS_PER_KEY",
    "LAYOUT_IDLE_S",
    "MAX_AGENT_CONNECTIONS_PER_FLEET_KEY",
    "MAX_AGENT_CONNECTIONS_PER_KEY",
    "MAX_KEYS_PER_CHUNK",
    "MIN_CHUNK_BYTES",
    "MIN_POOL_CHUNKS",
    "RECORDS_DOMAIN",
    "SNAPSHOT_DOMAIN",
    "SNAPSHOT_EVERY_MS_RANGE",
    "SNAPSHOT_HWM",
    "SUBSCRIBED_EVERY_S",
    "PolicyCore",
    "PolicyService",
    "ServiceCounters",
    "SnapshotSchedule",
    "pool_chunks",
]

logger = logging.getLogger("kvpool.policy")

RECORDS_DOMAIN = "kvpool-policy-records"
SNAPSHOT_DOMAIN = "kvpool-policy-snapshots"

MAX_AGENT_CONNECTIONS_PER_KEY = 32
"""Default connections one engine-bound agent key may hold open on each of the service's ports,
records ``P`` and snapshots ``P+1`` (``kvpool-policy serve --max-agent-connections-per-key``).
Only an engine's scheduler connects (its ``PolicyClient``: one PUSH to ``P``, one SUB to
``P+1``; workers never do), and vLLM runs one engine core, so one scheduler, per data-parallel
rank: an engine needs its DP size on each port (its DP ranks share one engine
id, so one bound key, when ``kv_connector_extra_config.engine_id`` names it; vLLM's own
``engine_id`` gets ``_dp<rank>`` per rank, one scheduler an id). 32: DP 32, or DP 16 with every
scheduler's old connection still held after its host died (a dead peer's connection is seen
closed only when TCP gives up, minutes later). The hub's cap for the same key (1,024) counts
every worker's agent connection."""

MAX_AGENT_CONNECTIONS_PER_FLEET_KEY = 8 * MAX_AGENT_CONNECTIONS_PER_KEY
"""Default connections one fleet-wide agent key (authorized without ``--engine``) may hold open
on each port (``--max-agent-connections-per-fleet-key``): 256, every scheduler of eight engines
of ``MAX_AGENT_CONNECTIONS_PER_KEY`` (or 256 engines without data parallelism). A fleet with
more schedulers on one key raises it, or gives its engines engine-bound keys."""

SNAPSHOT_HWM = 1
"""Snapshots queued per subscriber (ZMQ ``SNDHWM`` of the snapshot port); libzmq holds one more
in flight, encrypted for that connection. A subscriber needs the newest only: each is the whole
state (never a delta), so one that falls behind just skips the ones it missed."""

SUBSCRIBED_EVERY_S = 0.1
"""A snapshot published for new subscribers comes at most once in this many seconds: at most
10 extra encodes of the Bloom filter (up to ``DOORKEEPER_MAX_MIB``) a second however fast
subscribers come and go, beside the periodic ones."""

SNAPSHOT_EVERY_MS_RANGE = (100, 60_000)
"""``--snapshot-every-ms``'s bounds (ms): no more than ``SUBSCRIBED_EVERY_S``'s 10 encodes of
the filter a second; no slower than a minute, far past any engine's ``policy_stale_ms``, which
must be above twice the interval (``kvpool_policy.cli`` warns past half the default 3 s)."""

_REMOVE_EVERY_S = 0.05
_PINS_EVERY_S = 1.0
_RECEIVE_S = 0.05  # one receive pass at most, then removals and snapshots get their turn
_RECORDS_HWM = 8  # batches queued per connection (each up to MAX_BATCH_BYTES)
_SUBSCRIPTION_BYTES = 1024  # a subscription needs 1 byte (all snapshots), a CURVE INITIATE ~300
_SUBSCRIPTION_HWM = 4  # subscription messages queued per subscriber (a client sends one)
_SUBSCRIPTIONS_PER_TURN = 256
_MONITOR_EVENTS_PER_TURN = 1024
_CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_LOGGED_FIRST = 3  # refusals of a key logged one by one, then every _LOGGED_EVERY th
_LOGGED_EVERY = 1000


class SnapshotSchedule:
    """When the service's loop publishes a snapshot (module docstring, "Publishing"): ``due``
    says why, or None.

    Args:
        every_s: the periodic interval (s).
        clock: monotonic seconds.
    """

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self._clock = every_s, clock
        self.subscribed = False
        """An accepted subscription came after the last publication (set by the loop)."""
        self.serves_subscription = False
        """The publication ``due`` last announced serves a subscription that waited, whatever
        made it due: it must be whole (its subscriber has no filter a delta applies on)."""
        self._periodic = self._early = -math.inf

    def due(self, flipped: bool) -> Literal["periodic", "subscribed"] | None:
        """Whether to publish now: ``"periodic"`` (the interval passed, or the admission's mode
        ``flipped``), ``"subscribed"`` (a subscription waits and the last such publication is
        ``SUBSCRIBED_EVERY_S`` old), else None. Either serves every subscription taken so far."""
        now = self._clock()
        why: Literal["periodic", "subscribed"] | None = None
        if flipped or now - self._periodic >= self.every_s:
            why, self._periodic = "periodic", now
        elif self.subscribed and now - self._early >= SUBSCRIBED_EVERY_S:
            why, self._early = "subscribed", now
        if why is not None:
            self.serves_subscription, self.subscribed = self.subscribed, False
        return why


class PolicyService:
    """``kvpool-policy serve`` (module docstring).

    Args:
        listen: ``tcp://HOST:P`` to bind (records on ``P``, snapshots on ``P+1``).
        keys: the hub's keys directory (``hub.key_secret``, ``authorized_keys/``).
        backend: the service's own store client.
        capacity_bytes: the bytes the policy may fill (below the master's watermark).
        admin_url: the master's admin URL (``/get_all_keys`` at start); ``None``: none read.
        budget: chunk hashes a second per key.
        max_subscribers_per_key: snapshot subscribers one viewer or operator key may hold
            open (0: no cap).
        max_agent_connections_per_key: connections one engine-bound agent key may hold open
            on each port (records, snapshots; 0: no cap).
        max_agent_connections_per_fleet_key: those of a fleet-wide agent key (0: no cap).
        snapshot_every_s: the periodic snapshot's interval (s; ``--snapshot-every-ms``).
        reconnect: makes a new store client (an HA pool's, over ``etcd://``): with it and
            ``admin_url`` the client follows the pool's leader (``LeaderFollower``).
        admission: ``"adaptive"`` (the pool-wide doorkeeper decides what engines save) or
            ``"all"`` (every snapshot admits everything: the service only evicts, a live
            pool-wide leaf-first LRU; ``bench/bench_fleet.py``'s ``service-lru`` baseline).
        order_file: where the eviction order is kept across restarts (read at start,
            written every ``order_every_s`` and at ``close``; ``kvpool_policy._order_file``);
            ``None``: not kept (a restart orders the pool's chunks as the master lists them).
        order_every_s: seconds between two writes of ``order_file`` at most.
        fill: makes the capacity follow the master's used bytes (``kvpool_policy._fill``,
            ``--fill auto``; its reader starts here, stops at ``close``); ``None``: the
            capacity stays ``capacity_bytes``.

    Raises:
        ValueError: a bad ``listen`` or keys directory (names the fix).
        zmq.ZMQError: a port is taken.
    """

    def __init__(self, listen: str, keys: KeyPaths, backend: MooncakeBackend,
                 capacity_bytes: int, *, admin_url: str | None = None,
                 budget: int = DEFAULT_BUDGET,
                 max_subscribers_per_key: int = MAX_SUBSCRIBERS_PER_KEY,
                 max_agent_connections_per_key: int = MAX_AGENT_CONNECTIONS_PER_KEY,
                 max_agent_connections_per_fleet_key: int = MAX_AGENT_CONNECTIONS_PER_FLEET_KEY,
                 snapshot_every_s: float = SNAPSHOT_EVERY_S,
                 reconnect: Callable[[], MooncakeBackend] | None = None,
                 admission: AdmissionKind = "adaptive", order_file: Path | None = None,
                 order_every_s: float = ORDER_EVERY_S,
                 fill: FillFollower | None = None) -> None:
        self.follower: LeaderFollower | None = None
        self.fill = fill
        self.order_writer = (OrderWriter(order_file, order_every_s) if order_file is not None
                             else None)
        records_at, snapshots_at = policy_ports(listen)
        agents: dict[KeyKind, int] = {"engine": max_agent_connections_per_key,
                                      "fleet": max_agent_connections_per_fleet_key}
        # Viewer and operator keys never reach P (RECORDS_DOMAIN admits agent keys only).
        self.caps = KeyCaps({"records": agents,
                             "snapshots": {"console": max_subscribers_per_key, **agents}})
        public, secret = keys.hub()
        found = pool_chunks(_all_keys(admin_url)) if admin_url else {}
        if order_file is not None:
            kept = read_order(order_file)
            found = order_found(found, kept)
            logger.info("kvpool policy: order file %s names %d chunks, %d of them in the "
                        "pool's %d", order_file, len(kept), _named(found, kept),
                        sum(map(len, found.values())))
        # Store calls (removals, pin reads) run on a thread of their own: a master that does
        # not answer holds them up, never the records or the snapshots (_store_calls).
        self.store_calls = StoreCalls()
        self.remover = Remover(backend, grace_s_of(backend.transfer_timeout_ms()),
                               calls=self.store_calls)
        # The engines saved what a record says (they decide from the snapshot): the policy
        # follows, so it holds what the pool holds.
        self.core = PolicyCore(PoolPolicy(capacity_bytes, engines_decide=True,
                                          admission=admission,
                                          min_chunk_bytes=MIN_CHUNK_BYTES),
                               self.remover, budget=budget, found=found)
        self._failed: set[str] = set()
        self.service_id = secrets.token_hex(8)
        self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.allow = allow = AllowList(keys.authorized_dir, {RECORDS_DOMAIN: ("agent",),
                                                SNAPSHOT_DOMAIN: ("agent", "viewer", "operator")})
        capped = CappedAdmission(allow, self.caps, {RECORDS_DOMAIN: "records",
                                                    SNAPSHOT_DOMAIN: "snapshots"})
        for domain in (RECORDS_DOMAIN, SNAPSHOT_DOMAIN):
            self.auth.configure_curve_callback(domain, capped)
        self.records = self._server(zmq.PULL, RECORDS_DOMAIN, public, secret)
        self.records.maxmsgsize = MAX_BATCH_BYTES
        self.records.rcvhwm = _RECORDS_HWM
        # Right after the socket: its connections' descriptors, to free their places.
        self._records_monitor = self.records.get_monitor_socket(_CONNECTION_EVENTS)
        # XPUB, verbose: every subscription reaches the service, which counts its
        # connection for its key (kvpool_agent.key_caps).
        self.snapshots = self._server(zmq.XPUB, SNAPSHOT_DOMAIN, public, secret)
        self.snapshots.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.snapshots.maxmsgsize = _SUBSCRIPTION_BYTES
        self.snapshots.rcvhwm = _SUBSCRIPTION_HWM
        # A subscriber needs the newest snapshot only: a stalled one holds SNAPSHOT_HWM + 1
        # (each at most DOORKEEPER_MAX_MIB of Bloom filter), not 1,000 (libzmq's default).
        self.snapshots.sndhwm = SNAPSHOT_HWM
        # Right after the socket: its connections' descriptors, to free their places.
        self._monitor = self.snapshots.get_monitor_socket(_CONNECTION_EVENTS)
        try:
            self.records.bind(records_at)
            self.snapshots.bind(snapshots_at)
        except zmq.ZMQError:
            self.close()
            raise
        self._version = 0
        self._schedule = SnapshotSchedule(snapshot_every_s)
        self._deltas = SnapshotDeltas()
        # Connections open on the snapshot port: accepted less disconnected (``/metrics``).
        self.snapshot_connections = 0
        if reconnect is not None and admin_url:
            self.follower = LeaderFollower(LeaderWatch(admin_url).start(), self.remover,
                                           reconnect)
        if fill is not None:
            fill.reader.start()

    def _server(self, kind: int, domain: str, public: bytes, secret: bytes) -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = self.ctx.socket(kind)
        s.linger = 0
        s.zap_domain = domain.encode()
        s.curve_server = True
        s.curve_publickey, s.curve_secretkey = public, secret
        return s

    def _publish(self, subscribed: bool, whole: bool) -> None:
        """Publish a snapshot; ``subscribed``: for new subscribers (``SnapshotSchedule``),
        counted in ``snapshots_on_subscription`` too; ``whole``: never a delta (a subscription
        waited: its subscriber has no filter a delta could apply on)."""
        self._version += 1
        snap = self.core.snapshot(self.service_id, self._version)
        msg = self._deltas.message(snap, self.core.policy.doorkeeper_changes(), whole=whole)
        data = msgspec.msgpack.encode(msg)
        try:
            self.snapshots.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return
        self._deltas.sent(msg)
        c = self.core.counters
        c.snapshots = _sat(c.snapshots + 1)
        c.snapshot_bytes = _sat(c.snapshot_bytes + len(data))
        if msg.base:
            c.snapshot_deltas = _sat(c.snapshot_deltas + 1)
        if subscribed:
            c.snapshots_on_subscription = _sat(c.snapshots_on_subscription + 1)

    def _guard(self, what: str, step: Callable[[], object]) -> None:
        """Run one step of the loop; an exception is counted (``errors``) and logged once per
        kind, never raised out of ``serve``."""
        try:
            step()
        except Exception:  # one bad batch or publish never stops the service
            c = self.core.counters
            c.errors = _sat(c.errors + 1)
            if what not in self._failed:
                self._failed.add(what)
                logger.exception("kvpool policy: %s failed (counted in errors; logged once)",
                                 what)

    def _receive(self, decoder: msgspec.msgpack.Decoder[RecordBatch]) -> None:
        until = time.monotonic() + _RECEIVE_S
        for _ in range(256):  # then removals and snapshots get their turn
            if time.monotonic() >= until:
                return
            try:
                frame = self.records.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if not admit_message(self.caps, "records", frame):
                continue  # a connection past its key's cap, shut down: its batch unapplied
            who = str(frame.get("User-Id"))
            try:
                batch = decoder.decode(frame.bytes)
            except msgspec.DecodeError:
                self.core.counters.malformed = _sat(self.core.counters.malformed + 1)
                continue
            bound = bound_engine(self.allow.name(RECORDS_DOMAIN, who.encode()) or "")
            if bound is not None and batch.engine != bound:
                # An engine-bound key speaks for its engine only (counts of another engine's
                # id would be spoofed).
                c = self.core.counters
                c.wrong_engine = _sat(c.wrong_engine + 1)
                c.malformed = _sat(c.malformed + max(1, len(batch.records)))
                continue
            self._guard("a record batch", functools.partial(self.core.apply, batch, who))

    def _connections(self) -> None:
        """Take the subscriptions (a subscriber past its key's cap is shut down: it never gets
        a snapshot), free the places of both ports' closed connections and count both ports'
        refusals."""
        for _ in range(_SUBSCRIPTIONS_PER_TURN):
            try:
                msg = self.snapshots.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            # libzmq has applied it to its connection already. A subscription is what counts
            # a connection for its key; an unsubscription (a connection closing) is none. An
            # admitted one asks for a snapshot soon (a refused one, shut down, none).
            if msg.bytes[:1] == b"\x01" and admit_message(self.caps, "snapshots", msg):
                self._schedule.subscribed = True
        for monitor in (self._monitor, self._records_monitor):
            for _ in range(_MONITOR_EVENTS_PER_TURN):
                if not monitor.poll(0):
                    break
                ev = recv_monitor_message(monitor)
                if not ev["event"] & _CONNECTION_EVENTS:
                    continue
                # Accepted too: the descriptor's number reused, the connection it was is gone.
                self.caps.closed(ev["value"])
                if monitor is self._records_monitor:
                    continue
                if ev["event"] == zmq.EVENT_ACCEPTED:
                    self.snapshot_connections += 1
                elif ev["event"] == zmq.EVENT_DISCONNECTED:
                    self.snapshot_connections = max(0, self.snapshot_connections - 1)
        c = self.core.counters
        for r in self.caps.drain_refusals():
            records = r.port == "records"
            by_key = c.records_over_cap_by_key if records else c.over_cap_by_key
            if records:
                c.records_connections_over_cap = _sat(c.records_connections_over_cap + 1)
            else:
                c.subscribers_over_cap = _sat(c.subscribers_over_cap + 1)
            key = self.allow.name(RECORDS_DOMAIN if records else SNAPSHOT_DOMAIN,
                                  r.identity.encode()) or r.identity
            n = by_key[key] = by_key.get(key, 0) + 1
            if n <= _LOGGED_FIRST or n % _LOGGED_EVERY == 0:
                logger.warning("kvpool policy: %s #%d of key %s refused: past the cap of %d "
                               "per key (%s)",
                               "records connection" if records else "snapshot subscriber", n,
                               key, r.cap, "at the handshake" if r.handshake else "shut down")

    def serve(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set."""
        decoder = msgspec.msgpack.Decoder(RecordBatch)
        removed = pins = -float("inf")
        doorkeeper = False
        poller = zmq.Poller()
        for sock in (self.records, self.snapshots, self._monitor, self._records_monitor):
            poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            events = dict(poller.poll(int(_REMOVE_EVERY_S * 1e3)))
            if self.records in events:
                self._receive(decoder)
            self._guard("taking subscriptions", self._connections)
            now = time.monotonic()
            if now - pins >= _PINS_EVERY_S:
                pins = now
                self._guard("reading pins", self.core.sync_pins)
            if now - removed >= _REMOVE_EVERY_S:
                removed = now
                if self.follower is not None:
                    self._guard("following the pool's leader", self.follower.step)
                self._guard("removing", self.remover.step)
            if (fill := self.fill) is not None:
                self._guard("following the master's fill",
                            functools.partial(fill.step, self.core, now))
            if (order := self.order_writer) is not None and order.due():
                self._guard("writing the order file",
                            lambda: order.write_soon(self.core.order()))
            why = self._schedule.due(self.core.policy.doorkeeper_active != doorkeeper)
            if why is not None:
                doorkeeper = self.core.policy.doorkeeper_active
                # A periodic publication serves a waiting subscription too: whole then (a
                # delta first left a new subscriber without a filter up to FULL_EVERY_S).
                self._guard("publishing a snapshot",
                            functools.partial(self._publish, why == "subscribed",
                                              self._schedule.serves_subscription))

    def close(self) -> None:
        if self.order_writer is not None:
            self.order_writer.close(self.core.order())
        # The monitor is stopped at the socket first: libzmq's I/O thread would otherwise
        # block sending the closing connections' events to a monitor already closed.
        self.snapshots.disable_monitor()
        self._monitor.close(0)
        self.records.disable_monitor()
        self._records_monitor.close(0)
        self.records.close(0)
        self.snapshots.close(0)
        self.auth.stop()
        self.ctx.term()
        self.store_calls.close()
        if self.follower is not None:
            self.follower.close()
        if self.fill is not None:
            self.fill.reader.close()


def _named(found: dict[str, list[str]], kept: list[tuple[str, str]]) -> int:
    """Chunks of ``found`` that ``kept`` names."""
    named = set(kept)
    return sum((d, h) in named for d, hashes in found.items() for h in hashes)


def _all_keys(admin_url: str) -> list[str]:
    """The pool's keys from the master (``/get_all_keys``); none when it cannot answer (the
    service then starts empty and the master's watermark covers what it does not know)."""
    try:
        r = httpx.get(f"{leader_admin_url(admin_url)}/get_all_keys", timeout=10.0)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        logger.warning("kvpool policy: the pool's keys not read (%s): starting empty", exc)
        return []
    return [k for k in r.text.splitlines() if k]

