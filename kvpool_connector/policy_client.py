"""An engine's side of the pool-wide policy service (issue 40 item 1): send access records,
decide saves from the service's last admission snapshot, and fall back when it is away.

``PolicyClient.admit(hashes)`` is called once per scheduled request, on the scheduler thread,
and never waits: it reads the last snapshot (a reference swap) and appends the record to a
bounded queue. A thread of its own owns both sockets (ZMQ sockets are not thread-safe): it
sends the queue in batches with ``zmq.NOBLOCK`` (send high-water mark ``SEND_HWM`` batches) and
receives snapshots. A record that finds the queue full, or whose batch ZMQ refuses (the
service slow or away), is dropped and counted (``dropped``, also sent in every batch so the
service counts it too).

Who is in charge (``in_charge``): ``"service"`` while a snapshot arrived within ``stale_s``
and the records socket is connected (its monitor saw the handshake); otherwise ``"master"``:
every chunk is saved and the master's own eviction (``eviction_high_watermark_ratio`` below
1.0) keeps the pool from wedging full. With a ``reporter`` (the scheduler's agent) the sender
thread reports who is in charge, how long the service has been silent and the records sent and
dropped every ``REPORT_EVERY_S`` and at once on a change (``Reporter.policy``): the console
shows it per engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Literal

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool_agent.auth import ClientKeys
from kvpool_agent.reporter import NullReporter, Reporter
from kvpool_connector.admission import doorkeeper_seen
from kvpool_connector.policy_wire import (
    WIRE_VERSION,
    AdmissionSnapshot,
    PolicyLayout,
    PolicyRecord,
    RecordBatch,
    SnapshotReader,
    policy_ports,
)

__all__ = ["DEFAULT_STALE_S", "MAX_QUEUED", "REPORT_EVERY_S", "SEND_HWM", "InCharge",
           "KeyRefused", "PolicyClient", "wait_snapshot"]

logger = logging.getLogger(__name__)

InCharge = Literal["service", "master"]

DEFAULT_STALE_S = 3.0
"""Seconds without a snapshot after which an engine takes the service for down (six of its
``SNAPSHOT_EVERY_S``)."""

MAX_QUEUED = 4_096
"""Records waiting for the sender thread at most; more are dropped and counted."""

SEND_HWM = 64
"""Batches ZMQ queues for the service at most (``SNDHWM``); past it a send is dropped."""

REPORT_EVERY_S = 1.0
"""Seconds between two ``Reporter.policy`` events (a change of ``in_charge`` is reported at
once)."""

_BATCH = 256
_TICK_S = 0.02


class PolicyClient:
    """One engine's records sender and snapshot reader (module docstring).

    Args:
        address: the service's ``tcp://HOST:P`` (``policy_wire.policy_ports``).
        keys: the fleet's agent keys (``KeyPaths.client("agent")``; the service holds the
            hub's pair); ``None`` = no CURVE (a service started without keys, tests only).
        engine: this engine's id (the service counts per engine).
        layout: this engine's layout (digest, every shard's key prefix).
        chunk_bytes: bytes of one chunk in the pool, every rank's keys (> 0).
        stale_s: seconds without a snapshot before the master is in charge.
        reporter: the scheduler's agent events (``Reporter.policy``); ``None``: no agent.
        admit_all: save every chunk whatever the snapshot says, and still send the records
            (a ``kv_producer``: its saves are what its decode engine loads, and the service
            must know they are in the pool to count and remove them).

    Attributes:
        sent: records handed to ZMQ (``dropped``: not delivered, queue full or ZMQ refused).

    Raises:
        ValueError: a bad ``address`` or ``chunk_bytes`` < 1.
    """

    def __init__(self, address: str, keys: ClientKeys | None, engine: str,
                 layout: PolicyLayout, chunk_bytes: int, *,
                 stale_s: float = DEFAULT_STALE_S, reporter: Reporter | None = None,
                 admit_all: bool = False) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self._records_at, self._snapshots_at = policy_ports(address)
        self._keys, self.engine, self.layout = keys, engine, layout
        self.chunk_bytes, self.stale_s = chunk_bytes, stale_s
        self.admit_all = admit_all
        self._queue: deque[PolicyRecord] = deque()
        self._snapshot: AdmissionSnapshot | None = None
        self._reader = SnapshotReader()
        self._heard = -float("inf")
        self._started = time.monotonic()
        self._address = address
        self._reporter = reporter if reporter is not None else NullReporter()
        # Two writers, one counter each: the scheduler thread's and the sender thread's.
        self._dropped_queued = self._dropped_sent = 0
        self.sent = 0
        # Set by the sender thread from the records socket's monitor.
        self.records_connected = False
        self._seq = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kvpool-policy-client",
                                        daemon=True)
        self._thread.start()

    @property
    def deltas_missed(self) -> int:
        """Snapshot deltas not applied (``SnapshotReader.missed``)."""
        return self._reader.missed

    @property
    def dropped(self) -> int:
        return self._dropped_queued + self._dropped_sent

    @property
    def snapshot(self) -> AdmissionSnapshot | None:
        """The last snapshot, if it is fresh (``stale_s``)."""
        if time.monotonic() - self._heard > self.stale_s:
            return None
        return self._snapshot

    @property
    def in_charge(self) -> InCharge:
        """``"service"``: a fresh snapshot and the records socket connected (the service
        hears this engine); else ``"master"``."""
        return "service" if self.records_connected and self.snapshot is not None else "master"

    def admit(self, hashes: Sequence[str], wants: int | None = None) -> int:
        """Leading chunks of ``hashes`` (a prompt's chained chunk hashes) to save, by the last
        fresh snapshot (all of them without one, or with ``admit_all``), and queue the access
        record. ``wants``:
        the most this engine would save (default all). Never blocks."""
        most = len(hashes) if wants is None else min(wants, len(hashes))
        snap = self.snapshot if self.records_connected and not self.admit_all else None
        admitted = most
        if snap is not None and snap.doorkeeper and snap.bits:
            admitted = min(most, doorkeeper_seen(snap.bloom, snap.bits, hashes))
        if len(self._queue) >= MAX_QUEUED:
            self._dropped_queued += 1
        else:
            self._queue.append(PolicyRecord(self.layout.digest, list(hashes), self.chunk_bytes,
                                            admitted))
        return admitted

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = self._ctx.socket(kind)
        s.linger = 0
        if self._keys is not None:
            self._keys.apply(s)
        return s

    def _run(self) -> None:
        push = self._socket(zmq.PUSH)
        push.sndhwm = SEND_HWM
        # Queue only to a connected service: with it away a send fails at once (counted).
        push.immediate = True
        # The monitor before the connect: a handshake done before it was attached (a NULL
        # handshake on loopback can be) was never seen, and the client stayed "master" for
        # good (CI saw one stay so for 60 s).
        mon = push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        push.connect(self._records_at)
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._snapshots_at)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        decoder = msgspec.msgpack.Decoder(AdmissionSnapshot)
        encoder = msgspec.msgpack.Encoder()
        reported: InCharge | None = None
        reported_at = -float("inf")
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(_TICK_S * 1e3)))
                if sub in events:
                    self._receive(sub, decoder)
                while mon in events and mon.poll(0):
                    ev = recv_monitor_message(mon)["event"]
                    self.records_connected = ev == zmq.EVENT_HANDSHAKE_SUCCEEDED
                self._send(push, encoder)
                reported, reported_at = self._report(reported, reported_at)
        finally:
            push.disable_monitor()
            mon.close(0)
            push.close(0)
            sub.close(0)

    def _report(self, reported: InCharge | None,
                reported_at: float) -> tuple[InCharge | None, float]:
        """Tell the agent who is in charge (``Reporter.policy``) on a change or once
        ``REPORT_EVERY_S`` passed since ``reported_at`` (monotonic s); returns what was
        reported last and when."""
        now = time.monotonic()
        who = self.in_charge
        if who == reported and now - reported_at < REPORT_EVERY_S:
            return reported, reported_at
        silent_s = now - (self._heard if self._snapshot is not None else self._started)
        snap = self._snapshot
        self._reporter.policy(who, self._address, silent_s * 1e3, self.stale_s * 1e3,
                              self.records_connected, self.sent, self.dropped,
                              snap.removed if snap is not None else 0)
        return who, now

    def _receive(self, sub: zmq.Socket[bytes], decoder: msgspec.msgpack.Decoder[
            AdmissionSnapshot]) -> None:
        while True:
            try:
                data = sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                snap = decoder.decode(data)
            except msgspec.DecodeError:
                continue
            if snap.v == WIRE_VERSION:
                self._snapshot, self._heard = self._reader.take(snap), time.monotonic()

    def _send(self, push: zmq.Socket[bytes], encoder: msgspec.msgpack.Encoder) -> None:
        while self._queue:
            n = min(_BATCH, len(self._queue))
            records = [self._queue.popleft() for _ in range(n)]
            batch = RecordBatch(WIRE_VERSION, self.engine, self._seq, self.dropped,
                                [self.layout], records)
            try:
                push.send(encoder.encode(batch), zmq.NOBLOCK)
            except zmq.Again:  # the service is slow or away: the engine never waits
                self._dropped_sent += n
                continue
            self._seq += 1
            self.sent += n

    def close(self) -> None:
        """Stop the sender thread (records still queued are dropped)."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._ctx.term()


class KeyRefused(RuntimeError):
    """The service refused this key at its CURVE handshake (its ZAP handler answered 400: the
    key is not in its ``authorized_keys/ROLE/``, or ``hub.key`` is not the service's pair)."""


def wait_snapshot(address: str, keys: ClientKeys | None,
                  timeout_s: float = DEFAULT_STALE_S) -> AdmissionSnapshot | None:
    """The service's next admission snapshot at ``address`` (``tcp://HOST:P``; it publishes on
    ``P+1``), or ``None`` when none came within ``timeout_s`` (the master in charge): what
    ``kvpool-policy status`` shows. ``keys``: an agent, viewer or operator pair.

    Raises:
        ValueError: a bad ``address``.
        KeyRefused: the service refused ``keys`` at the handshake (libzmq's client sees
            ``EVENT_HANDSHAKE_FAILED_AUTH`` at once: a refusal is not a service that is down).
    """
    at = policy_ports(address)[1]
    ctx = zmq.Context()
    sub: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    sub.linger = 0
    mon: zmq.Socket[bytes] | None = None
    if keys is not None:
        keys.apply(sub)
        mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(AdmissionSnapshot)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    if mon is not None:
        poller.register(mon, zmq.POLLIN)
    try:
        sub.connect(at)
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(left * 1e3))))
            if not ready:
                break
            if mon is not None and mon in ready:
                event = recv_monitor_message(mon)
                raise KeyRefused(f"{at} refused the key at its handshake (ZAP status "
                                 f"{event['value']})")
            try:
                snap = decoder.decode(sub.recv())
            except msgspec.DecodeError:
                continue
            if snap.v == WIRE_VERSION:
                return snap
        return None
    finally:
        if mon is not None:
            sub.disable_monitor()
            mon.close(0)
        sub.close(0)
        ctx.term()
