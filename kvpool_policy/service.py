"""The live pool-wide policy service (issue 40 item 1): ``kvpool-policy serve``, one per pool,
beside the master.

It runs one ``PoolPolicy`` over the pool's capacity, fed by every engine's access records, and
publishes its admission decision; what falls out of it is removed with its own Mooncake store
client (``_remover``). The wire is ``kvpool_connector.policy_wire``; the engines' side is
``kvpool_connector.policy_client``.

Who may connect, and what each may do and cost (the house security rule):

* records port ``P`` (PULL, CURVE server with the hub's key pair): only public keys in the hub's
  ``authorized_keys/agent/`` (``kvpool_agent.auth.AllowList``, ZAP domain
  ``RECORDS_DOMAIN``). A key may send ``budget`` records a second (a token bucket of two
  seconds' worth); records over it are dropped and counted (``over_budget``). A message over
  ``MAX_BATCH_BYTES`` is cut by ZMQ (``MAXMSGSIZE``); one that does not decode, names a layout
  whose prefixes are not that digest's kvpool keys, or holds a malformed hash is dropped whole
  (``malformed``). What a record can do: move chunks in the policy's order, so a key can make
  the service remove chunks of the layouts it names (what an agent key's engine can do to the
  pool anyway: it writes and removes keys) and never a key outside ``kvpool@`` or a pinned one.
* snapshots port ``P+1`` (PUB): agent, viewer and operator keys (``SNAPSHOT_DOMAIN``); a slow
  subscriber loses snapshots (ZMQ's send high-water mark), never slows the service.

Counted drops (``counters``): records the senders report dropped (``RecordBatch.dropped``),
batches lost between (gaps in ``seq``), over budget, malformed.

Restart: the pool's keys (the master's ``/get_all_keys``) are read at start; each layout's
chunks become resident (least recently used first, in listing order) once an engine's record
says their chunk bytes. Whatever the service removes follows ``_remover``'s rule, so a
restarted service that under-counts leaves the rest to the master's watermark.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvpool_agent.auth import AllowList, KeyPaths
from kvpool_agent.masters import leader_admin_url
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_connector.keys import KEY_PREFIX
from kvpool_connector.policy_wire import (
    MAX_BATCH_BYTES,
    MAX_HASHES,
    MAX_RECORDS,
    SNAPSHOT_EVERY_S,
    WIRE_VERSION,
    AdmissionSnapshot,
    PolicyLayout,
    RecordBatch,
    policy_ports,
)
from kvpool_connector.removal_rule import grace_s_of
from kvpool_policy._remover import Remover
from kvpool_policy.policy import AccessRecord, PoolPolicy

__all__ = [
    "DEFAULT_BUDGET",
    "RECORDS_DOMAIN",
    "SNAPSHOT_DOMAIN",
    "PolicyCore",
    "PolicyService",
    "ServiceCounters",
    "pool_chunks",
]

logger = logging.getLogger("kvpool.policy")

RECORDS_DOMAIN = "kvpool-policy-records"
SNAPSHOT_DOMAIN = "kvpool-policy-snapshots"

DEFAULT_BUDGET = 2_000
"""Records a second one key may send. A busy engine schedules tens to a few hundred requests
a second; the service applies about 180,000 chunk accesses a second on one core
(``bench/bench_policy_service.py`` on a slice: about 2,800 records of 64 chunks), so one key
cannot take more than a share of it."""

_DIGEST = re.compile(r"[0-9a-f]{12}")
_HASH = re.compile(r"[0-9a-f]{32}(?:[0-9a-f]{32})?")
_SHARD = r"tp\d+\.pcp\d+\.dcp\d+\.pp\d+\.g\d+"
_MAX_PREFIXES = 256
_MAX_LAYERS = 4_096
_MAX_SENDERS = 65_536
_REMOVE_EVERY_S = 0.05
_PINS_EVERY_S = 1.0


@dataclass
class ServiceCounters:
    """What the service did (all since its start)."""

    records: int = 0
    sender_dropped: int = 0
    lost_batches: int = 0
    over_budget: int = 0
    malformed: int = 0
    snapshots: int = 0
    senders: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    """(key, engine) -> (last seq, last reported dropped)."""

    @property
    def dropped(self) -> int:
        return self.sender_dropped + self.over_budget + self.malformed


def _layout_ok(lay: PolicyLayout) -> bool:
    if not _DIGEST.fullmatch(lay.digest) or not 0 < len(lay.prefixes) <= _MAX_PREFIXES:
        return False
    if len(lay.layers) > _MAX_LAYERS or any(not 0 <= n < _MAX_LAYERS for n in lay.layers):
        return False
    model = lay.prefixes[0].split("@")[1] if lay.prefixes[0].count("@") == 4 else ""
    shard = re.compile(re.escape(f"{KEY_PREFIX}{model}@{lay.digest}@") + _SHARD + "@")
    return bool(model) and all(shard.fullmatch(p) for p in lay.prefixes)


def pool_chunks(keys: list[str]) -> dict[str, list[str]]:
    """Digest -> chunk hashes (each once, in listing order) of the kvpool keys in ``keys``
    (the master's ``/get_all_keys``): what a restarted service finds resident."""
    out: dict[str, dict[str, None]] = {}
    for key in keys:
        parts = key.split("@")
        if len(parts) in (5, 6) and key.startswith(KEY_PREFIX) and _HASH.fullmatch(parts[4]):
            out.setdefault(parts[2], {})[parts[4]] = None
    return {d: list(hs) for d, hs in out.items()}


class PolicyCore:
    """The service without sockets: record batches in, removals out (tests drive it).

    Args:
        policy: the pool-wide policy.
        remover: where removals go (``None``: none are made, e.g. a model run).
        budget: records a second per key (``DEFAULT_BUDGET``).
        found: digest -> chunk hashes found in the pool at start (``pool_chunks``).
        clock: monotonic seconds.
    """

    def __init__(self, policy: PoolPolicy, remover: Remover | None, *,
                 budget: int = DEFAULT_BUDGET, found: dict[str, list[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy, self.remover, self.budget = policy, remover, budget
        self.counters = ServiceCounters()
        self._found = dict(found or {})
        self._tokens: dict[str, tuple[float, float]] = {}
        self._clock = clock
        self._pinned: dict[str, frozenset[str]] = {}

    def _spend(self, who: str, n: int) -> bool:
        now = self._clock()
        tokens, then = self._tokens.get(who, (2.0 * self.budget, now))
        tokens = min(2.0 * self.budget, tokens + (now - then) * self.budget)
        ok = tokens >= n
        self._tokens[who] = (tokens - n if ok else tokens, now)
        return ok

    def _sequence(self, who: str, batch: RecordBatch) -> None:
        c = self.counters
        key = (who, batch.engine[:128])
        last = c.senders.get(key)
        if last is None and len(c.senders) >= _MAX_SENDERS:
            return
        seq0, dropped0 = last if last is not None else (-1, 0)
        if batch.seq > seq0 + 1 and last is not None:
            c.lost_batches += batch.seq - seq0 - 1
        if batch.dropped > dropped0:
            c.sender_dropped += batch.dropped - dropped0
        c.senders[key] = (max(seq0, batch.seq), max(dropped0, batch.dropped))

    def apply(self, batch: RecordBatch, who: str) -> None:
        """Apply one batch from key ``who`` (checks and budget: module docstring of
        ``kvpool_policy.service``)."""
        c = self.counters
        if (batch.v != WIRE_VERSION or len(batch.records) > MAX_RECORDS
                or not all(_layout_ok(lay) for lay in batch.layouts)):
            c.malformed += len(batch.records)
            return
        self._sequence(who, batch)
        if not self._spend(who, len(batch.records)):
            c.over_budget += len(batch.records)
            return
        known = {lay.digest for lay in batch.layouts}
        if self.remover is not None:
            known = {lay.digest for lay in batch.layouts if self.remover.learn(lay)}
        for rec in batch.records:
            if (rec.digest not in known or len(rec.hashes) > MAX_HASHES
                    or not 0 < rec.chunk_bytes <= self.policy.capacity_bytes
                    or rec.wants < 0 or not all(_HASH.fullmatch(h) for h in rec.hashes)):
                c.malformed += 1
                continue
            self._adopt(rec.digest, rec.chunk_bytes)
            dec = self.policy.record(AccessRecord(rec.digest, tuple(rec.hashes),
                                                  rec.chunk_bytes, rec.wants, batch.engine))
            c.records += 1
            if self.remover is not None:
                self.remover.keep(dec.saves)
                self.remover.evict(dec.removals)

    def _adopt(self, digest: str, chunk_bytes: int) -> None:
        """A layout found in the pool at start becomes resident once its chunk bytes are
        known (its first record)."""
        hashes = self._found.pop(digest, None)
        if hashes:
            gone = self.policy.adopt([(digest, h) for h in hashes], chunk_bytes)
            logger.info("kvpool policy: %d chunks of layout %s found in the pool, %d over the "
                        "capacity removed", len(hashes), digest, len(gone))
            if self.remover is not None:
                self.remover.evict(gone)

    def sync_pins(self) -> None:
        """Pinned chunks leave the eviction order; unpinned ones come back (``Remover.pinned``)."""
        if self.remover is None:
            return
        now = self.remover.pinned()
        for digest in set(now) | set(self._pinned):
            new, old = now.get(digest, frozenset()), self._pinned.get(digest, frozenset())
            self.policy.pin([(digest, h) for h in new - old])
            self.policy.unpin([(digest, h) for h in old - new])
        self._pinned = now

    def snapshot(self, service: str, version: int) -> AdmissionSnapshot:
        dk = self.policy.doorkeeper_snapshot()
        bits, bloom = dk if dk is not None else (0, b"")
        removed = self.remover.removed if self.remover is not None else 0
        return AdmissionSnapshot(
            WIRE_VERSION, service, version, self.policy.doorkeeper_active, bits, bloom,
            self.policy.capacity_bytes, self.policy.used_bytes, self.counters.records,
            self.counters.dropped, removed, self.policy.pinned_chunks)


class PolicyService:
    """``kvpool-policy serve`` (module docstring).

    Args:
        listen: ``tcp://HOST:P`` to bind (records on ``P``, snapshots on ``P+1``).
        keys: the hub's keys directory (``hub.key_secret``, ``authorized_keys/``).
        backend: the service's own store client.
        capacity_bytes: the bytes the policy may fill (below the master's watermark).
        admin_url: the master's admin URL (``/get_all_keys`` at start); ``None``: none read.
        budget: records a second per key.

    Raises:
        ValueError: a bad ``listen`` or keys directory (names the fix).
        zmq.ZMQError: a port is taken.
    """

    def __init__(self, listen: str, keys: KeyPaths, backend: MooncakeBackend,
                 capacity_bytes: int, *, admin_url: str | None = None,
                 budget: int = DEFAULT_BUDGET) -> None:
        records_at, snapshots_at = policy_ports(listen)
        public, secret = keys.hub()
        found = pool_chunks(_all_keys(admin_url)) if admin_url else {}
        self.remover = Remover(backend, grace_s_of(backend.transfer_timeout_ms()))
        # The engines saved what a record says (they decide from the snapshot): the policy
        # follows, so it holds what the pool holds.
        self.core = PolicyCore(PoolPolicy(capacity_bytes, engines_decide=True), self.remover,
                               budget=budget, found=found)
        self.service_id = secrets.token_hex(8)
        self.ctx = zmq.Context()
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        allow = AllowList(keys.authorized_dir, {RECORDS_DOMAIN: ("agent",),
                                                SNAPSHOT_DOMAIN: ("agent", "viewer", "operator")})
        for domain in (RECORDS_DOMAIN, SNAPSHOT_DOMAIN):
            self.auth.configure_curve_callback(domain, allow)
        self.records = self._server(zmq.PULL, RECORDS_DOMAIN, public, secret)
        self.records.maxmsgsize = MAX_BATCH_BYTES
        self.snapshots = self._server(zmq.PUB, SNAPSHOT_DOMAIN, public, secret)
        self.snapshots.sndhwm = 16
        try:
            self.records.bind(records_at)
            self.snapshots.bind(snapshots_at)
        except zmq.ZMQError:
            self.close()
            raise
        self._version = 0

    def _server(self, kind: int, domain: str, public: bytes, secret: bytes) -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = self.ctx.socket(kind)
        s.linger = 0
        s.zap_domain = domain.encode()
        s.curve_server = True
        s.curve_publickey, s.curve_secretkey = public, secret
        return s

    def _publish(self) -> None:
        self._version += 1
        snap = self.core.snapshot(self.service_id, self._version)
        try:
            self.snapshots.send(msgspec.msgpack.encode(snap), zmq.NOBLOCK)
        except zmq.Again:
            return
        self.core.counters.snapshots += 1

    def _receive(self, decoder: msgspec.msgpack.Decoder[RecordBatch]) -> None:
        for _ in range(256):  # then removals and snapshots get their turn
            try:
                frame = self.records.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            who = str(frame.get("User-Id"))
            try:
                batch = decoder.decode(frame.bytes)
            except msgspec.DecodeError:
                self.core.counters.malformed += 1
                continue
            self.core.apply(batch, who)

    def serve(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set."""
        decoder = msgspec.msgpack.Decoder(RecordBatch)
        published = removed = pins = -float("inf")
        doorkeeper = False
        while not stop.is_set():
            if self.records.poll(int(_REMOVE_EVERY_S * 1e3)):
                self._receive(decoder)
            now = time.monotonic()
            if now - pins >= _PINS_EVERY_S:
                pins = now
                self.core.sync_pins()
            if now - removed >= _REMOVE_EVERY_S:
                removed = now
                self.remover.step()
            flipped = self.core.policy.doorkeeper_active != doorkeeper
            if flipped or now - published >= SNAPSHOT_EVERY_S:
                doorkeeper = self.core.policy.doorkeeper_active
                published = now
                self._publish()

    def close(self) -> None:
        self.records.close(0)
        self.snapshots.close(0)
        self.auth.stop()
        self.ctx.term()


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

