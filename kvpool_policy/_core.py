"""The policy service's record-applying core (``PolicyCore``, ``ServiceCounters``): record
batches in, removals and snapshots out, without sockets. ``kvpool_policy.service`` runs it
behind its sockets and re-exports its public names (its module docstring: the checks, budgets
and counted drops this applies).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool_connector.keys import KEY_PREFIX
from kvpool_connector.policy_client import MAX_QUEUED
from kvpool_connector.policy_wire import (
    MAX_HASHES,
    MAX_RECORDS,
    WIRE_VERSION,
    AdmissionSnapshot,
    PolicyLayout,
    PolicyRecord,
    RecordBatch,
)
from kvpool_policy._remover import MAX_LAYOUTS, Remover
from kvpool_policy.policy import AccessRecord, PolicyKey, PoolPolicy

logger = logging.getLogger("kvpool.policy")

DEFAULT_BUDGET = 50_000
"""Chunk hashes a second one key may send (a record costs its hashes). A busy engine schedules
tens to a few hundred requests a second of tens of chunks each (a few thousand to 20,000
hashes); the service applies about 180,000 chunk accesses a second on one core
(``bench/bench_policy_service.py``), so one key cannot take more than a share of it."""

MAX_KEYS_PER_CHUNK = 4_096
"""Keys one chunk of a layout may fan out to (prefixes x layers; whole-chunk keys count one a
prefix). A real layout has one prefix per rank (TP x PP x PCP x DCP shards) and, for layer-wise
keys, one key per layer: 32 ranks x 128 layers fit; 256 x 1,024 (2.1M key strings from 8
hashes) does not, and such a layout is refused."""

LAYOUTS_PER_KEY = 8
"""Layouts one key may declare (beyond it: refused and counted, ``layouts_refused``): an engine
has one, a key serving a few engines a few; the service's ``MAX_LAYOUTS`` are shared by all."""

LAYOUT_IDLE_S = 600.0
"""A layout no record named for this long and holding no chunk the policy counts is forgotten
when a key's quota or the service's table is full (so a flood of declarations does not hold
the table for ever)."""

MIN_POOL_CHUNKS = 4
"""A record's chunk bytes are at most ``capacity_bytes // MIN_POOL_CHUNKS``: one chunk cannot
claim the pool."""

MIN_CHUNK_BYTES = 64 << 10
"""The chunk size the doorkeeper is sized for at least (``PoolPolicy``'s ``min_chunk_bytes``;
its Bloom filter is capped at ``kvpool_policy.policy.DOORKEEPER_MAX_MIB``): a first record of
1-byte chunks cannot make it allocate capacity/1 entries."""

DOORKEEPER_SHARE = 8
"""One key feeds the doorkeeper at most a generation's entries over ``DOORKEEPER_SHARE`` a
second (its records past it still move chunks, they only leave the admission's state alone):
a chunk asked for stays in the filter at least ``DOORKEEPER_SHARE`` seconds against one key's
flood, so a flood of records that save nothing (``wants=0``) cannot wipe the other engines'
repeats."""

COUNTER_MAX = 2**63 - 1
"""Every counter saturates here (msgpack encodes it)."""

_DIGEST = re.compile(r"[0-9a-f]{12}")
_HASH = re.compile(r"[0-9a-f]{32}(?:[0-9a-f]{32})?")
_SHARD = r"tp\d+\.pcp\d+\.dcp\d+\.pp\d+\.g\d+"
_MAX_PREFIXES = 256
_MAX_LAYERS = 4_096
_MAX_SENDERS = 65_536


@dataclass
class ServiceCounters:
    """What the service did (all since its start)."""

    records: int = 0
    sender_dropped: int = 0
    lost_batches: int = 0
    over_budget: int = 0
    malformed: int = 0
    snapshots: int = 0
    """Snapshots published (each kind: periodic, on a flip, for new subscribers)."""
    snapshots_on_subscription: int = 0
    """Of ``snapshots``, those published at once for new subscribers (at most one a
    ``kvpool_policy.service.SUBSCRIBED_EVERY_S``) rather than at the next periodic one."""
    snapshot_deltas: int = 0
    """Of ``snapshots``, deltas (``kvpool_policy._deltas``)."""
    snapshot_bytes: int = 0
    """Bytes of the snapshots published (encoded; each subscriber receives every one)."""
    layouts_refused: int = 0
    """Layout declarations refused: a differing redeclaration of a known digest, over a key's
    ``LAYOUTS_PER_KEY``, over ``MAX_LAYOUTS`` or ``MAX_KEYS_PER_CHUNK``."""
    share_capped: int = 0
    """Chunks of records not inserted because their layouts' key held its fair share."""
    errors: int = 0
    """Batches or publishes that raised (logged once each kind)."""
    admission_capped: int = 0
    """Records that did not feed the doorkeeper: their key's share of its Bloom insertions
    (``DOORKEEPER_SHARE``) was spent."""
    wrong_engine: int = 0
    """Batches of an engine-bound agent key (``kvpool-agent authorize --engine``) naming
    another engine id: dropped whole (their records counted ``malformed``)."""
    subscribers_over_cap: int = 0
    """Snapshot subscribers refused for their key's cap (``kvpool_agent.key_caps``): at the
    handshake, or shut down at their subscription."""
    records_connections_over_cap: int = 0
    """Records connections (port ``P``) refused for their agent key's cap: at the handshake,
    or shut down at their first batch (never applied, nor the batches queued behind it; those
    batches are not decoded, so not in ``dropped`` either)."""
    evicted_chunks: int = 0
    """Chunks the policy evicted (queued for removal); ``evicted_bytes``: their bytes."""
    evicted_bytes: int = 0
    senders: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    """(key, engine) -> (last seq, last reported dropped)."""
    over_cap_by_key: dict[str, int] = field(default_factory=dict)
    """Key name (``ROLE/FILE-STEM``) -> its subscribers refused for its cap."""
    records_over_cap_by_key: dict[str, int] = field(default_factory=dict)
    """Agent key name -> its records connections refused for its cap."""

    @property
    def dropped(self) -> int:
        return min(COUNTER_MAX, self.sender_dropped + self.over_budget + self.malformed)


def _sat(n: int) -> int:
    return min(COUNTER_MAX, n)


@dataclass
class _Declared:
    layout: PolicyLayout
    owner: str
    used: float


def _layout_ok(lay: PolicyLayout) -> bool:
    if not _DIGEST.fullmatch(lay.digest) or not 0 < len(lay.prefixes) <= _MAX_PREFIXES:
        return False
    if len(lay.layers) > _MAX_LAYERS or any(not 0 <= n < _MAX_LAYERS for n in lay.layers):
        return False
    if len(lay.prefixes) * max(1, len(lay.layers)) > MAX_KEYS_PER_CHUNK:
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

    Layouts: a digest keeps the layout it was first declared with and the key that declared it
    (its owner); a differing redeclaration is refused (``layouts_refused``); a key declares at
    most ``LAYOUTS_PER_KEY``; the first record of a layout fixes its chunk bytes (records that
    disagree are malformed). Fair share: when a record's new chunks do not fit the capacity
    without evicting and other keys' layouts hold chunks, the chunks of its layout's owner may
    grow to ``capacity / owners holding chunks`` at most: past it the owner's own oldest
    chunks make room, and new chunks they cannot make room for are not inserted
    (``share_capped``; the master's watermark covers them). So one key's records cannot evict
    the other keys' layouts below their share.

    Args:
        policy: the pool-wide policy.
        remover: where removals go (``None``: none are made, e.g. a model run).
        budget: chunk hashes a second per key (``DEFAULT_BUDGET``).
        found: digest -> chunk hashes found in the pool at start (``pool_chunks``), the
            least recently used first (``_order_file.order_found``).
        clock: monotonic seconds.
        max_chunk_bytes: a record's chunk bytes at most (default: the capacity over
            ``MIN_POOL_CHUNKS``).
    """

    def __init__(self, policy: PoolPolicy, remover: Remover | None, *,
                 budget: int = DEFAULT_BUDGET, found: dict[str, list[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 max_chunk_bytes: int | None = None) -> None:
        self.policy, self.remover, self.budget = policy, remover, budget
        self.counters = ServiceCounters()
        self._found = dict(found or {})
        self._tokens: dict[str, tuple[float, float]] = {}
        self._clock = clock
        self._pinned: dict[str, frozenset[str]] = {}
        self._max_chunk_bytes = (max_chunk_bytes if max_chunk_bytes is not None
                                 else max(1, policy.capacity_bytes // MIN_POOL_CHUNKS))
        self._layouts: dict[str, _Declared] = {}
        self._chunk_bytes: dict[str, int] = {}
        self._resident: dict[str, int] = {}  # digest -> chunks the policy counts resident
        self._feeds: dict[str, tuple[float, float]] = {}  # key -> doorkeeper tokens, when

    def _spend(self, who: str, n: int) -> bool:
        now = self._clock()
        tokens, then = self._tokens.get(who, (2.0 * self.budget, now))
        tokens = min(2.0 * self.budget, tokens + (now - then) * self.budget)
        ok = tokens >= n
        self._tokens[who] = (tokens - n if ok else tokens, now)
        return ok

    def _feeds_admission(self, who: str, n: int) -> bool:
        """``who`` may add ``n`` more hashes to the doorkeeper (``DOORKEEPER_SHARE``); always,
        and uncounted, when the policy admits everything (there is no doorkeeper to feed)."""
        if self.policy.admission == "all":
            return True
        rate = self.policy.doorkeeper_entries / DOORKEEPER_SHARE
        now = self._clock()
        tokens, then = self._feeds.get(who, (rate, now))
        tokens = min(rate, tokens + (now - then) * rate)
        ok = tokens >= n
        self._feeds[who] = (tokens - n if ok else tokens, now)
        if not ok:
            self.counters.admission_capped = _sat(self.counters.admission_capped + 1)
        return ok

    def _sequence(self, who: str, batch: RecordBatch) -> None:
        c = self.counters
        key = (who, batch.engine[:128])
        last = c.senders.get(key)
        if last is None and len(c.senders) >= _MAX_SENDERS:
            return
        seq0, dropped0 = last if last is not None else (-1, 0)
        # One batch moves a sender's counts by MAX_QUEUED at most (what its queue can lose).
        if batch.seq > seq0 + 1 and last is not None:
            c.lost_batches = _sat(c.lost_batches + min(MAX_QUEUED, batch.seq - seq0 - 1))
        if batch.dropped > dropped0:
            c.sender_dropped = _sat(c.sender_dropped + min(MAX_QUEUED, batch.dropped - dropped0))
        c.senders[key] = (batch.seq, batch.dropped)

    def _declaration_cost(self, lay: PolicyLayout) -> int:
        known = self._layouts.get(lay.digest)
        return 0 if known is not None and known.layout == lay else (
            len(lay.prefixes) * max(1, len(lay.layers)))

    def _declare(self, lay: PolicyLayout, who: str) -> bool:
        now = self._clock()
        known = self._layouts.get(lay.digest)
        if known is not None:
            if known.layout != lay:
                return False
            known.used = now
            return True
        if (sum(1 for d in self._layouts.values() if d.owner == who) >= LAYOUTS_PER_KEY
                or len(self._layouts) >= MAX_LAYOUTS):
            self._expire(now)
        if (sum(1 for d in self._layouts.values() if d.owner == who) >= LAYOUTS_PER_KEY
                or len(self._layouts) >= MAX_LAYOUTS):
            return False
        if self.remover is not None and not self.remover.learn(lay):
            return False
        self._layouts[lay.digest] = _Declared(lay, who, now)
        return True

    def _expire(self, now: float) -> None:
        """Forget layouts idle for ``LAYOUT_IDLE_S`` that hold no chunk."""
        for digest, d in list(self._layouts.items()):
            if now - d.used >= LAYOUT_IDLE_S and not self._resident.get(digest):
                del self._layouts[digest]
                self._chunk_bytes.pop(digest, None)
                if self.remover is not None:
                    self.remover.forget(digest)

    def _record_ok(self, rec: PolicyRecord, known: set[str]) -> bool:
        if (rec.digest not in known or len(rec.hashes) > MAX_HASHES
                or not 0 < rec.chunk_bytes <= self._max_chunk_bytes
                or rec.wants < 0 or not all(_HASH.fullmatch(h) for h in rec.hashes)):
            return False
        return self._chunk_bytes.setdefault(rec.digest, rec.chunk_bytes) == rec.chunk_bytes

    def _fair(self, rec: PolicyRecord) -> tuple[int, list[PolicyKey]]:
        """``(wants, evicted)``: when the pool must evict for ``rec``'s new chunks and another
        key's layouts hold chunks, a layout owner over its fair share (class docstring) makes
        room from its own oldest chunks first (``evicted``); what they cannot free is not
        inserted (``wants`` less those new chunks)."""
        head = rec.hashes[:rec.wants]
        policy = self.policy
        new = [i for i, h in enumerate(head) if (rec.digest, h) not in policy]
        need = policy.used_bytes + len(new) * rec.chunk_bytes - policy.capacity_bytes
        if need <= 0:
            return rec.wants, []
        owner = self._layouts[rec.digest].owner
        owners = {d.owner for g, d in self._layouts.items() if self._resident.get(g)} | {owner}
        if len(owners) == 1:
            return rec.wants, []
        mine = {g for g, d in self._layouts.items() if d.owner == owner}
        held = sum(self._resident.get(g, 0) * self._chunk_bytes.get(g, 0) for g in mine)
        over = held + len(new) * rec.chunk_bytes - policy.capacity_bytes // len(owners)
        if over <= 0:
            return rec.wants, []
        own = min(need, over)
        evicted = policy.evict_oldest(mine, own, {(rec.digest, h) for h in rec.hashes})
        short = own - sum(self._chunk_bytes.get(g, 0) for g, _ in evicted)
        if short <= 0:
            return rec.wants, evicted
        cut = min(len(new), -(-short // rec.chunk_bytes))
        self.counters.share_capped = _sat(self.counters.share_capped + cut)
        return (new[len(new) - cut] if cut else rec.wants), evicted

    def _account(self, saves: list[PolicyKey], removals: list[PolicyKey]) -> None:
        res = self._resident
        for d, _ in saves:
            res[d] = res.get(d, 0) + 1
        for d, _ in removals:
            res[d] = max(0, res.get(d, 0) - 1)
        self._evicted(removals)

    def _evicted(self, chunks: list[PolicyKey]) -> None:
        c = self.counters
        c.evicted_chunks = _sat(c.evicted_chunks + len(chunks))
        c.evicted_bytes = _sat(c.evicted_bytes + sum(self._chunk_bytes.get(d, 0)
                                                     for d, _ in chunks))

    def apply(self, batch: RecordBatch, who: str) -> None:
        """Apply one batch from key ``who`` (checks and budget: module docstring of
        ``kvpool_policy.service``)."""
        c = self.counters
        if (batch.v != WIRE_VERSION or len(batch.records) > MAX_RECORDS or batch.seq < 0
                or batch.dropped < 0 or not all(_layout_ok(lay) for lay in batch.layouts)):
            c.malformed = _sat(c.malformed + max(1, len(batch.records)))
            return
        self._sequence(who, batch)
        cost = (sum(len(r.hashes) for r in batch.records)
                + sum(self._declaration_cost(lay) for lay in batch.layouts))
        if not self._spend(who, max(1, cost)):
            c.over_budget = _sat(c.over_budget + len(batch.records))
            return
        known: set[str] = set()
        for lay in batch.layouts:
            if self._declare(lay, who):
                known.add(lay.digest)
            else:
                c.layouts_refused = _sat(c.layouts_refused + 1)
        for rec in batch.records:
            if not self._record_ok(rec, known):
                c.malformed = _sat(c.malformed + 1)
                continue
            self._adopt(rec.digest, rec.chunk_bytes)
            wants, own = self._fair(rec)
            dec = self.policy.record(
                AccessRecord(rec.digest, tuple(rec.hashes), rec.chunk_bytes, wants,
                             batch.engine),
                feed_admission=self._feeds_admission(who, len(rec.hashes)))
            removals = own + dec.removals
            self._account(dec.saves, removals)
            c.records = _sat(c.records + 1)
            if self.remover is not None:
                self.remover.keep(dec.saves)
                self.remover.evict(removals)

    def _adopt(self, digest: str, chunk_bytes: int) -> None:
        """A layout found in the pool at start becomes resident once its chunk bytes are
        known (its first record)."""
        hashes = self._found.pop(digest, None)
        if hashes:
            gone = self.policy.adopt([(digest, h) for h in hashes], chunk_bytes)
            logger.info("kvpool policy: %d chunks of layout %s found in the pool, %d over the "
                        "capacity removed", len(hashes), digest, len(gone))
            self._account([(digest, h) for h in hashes if (digest, h) in self.policy], [])
            self._evicted(gone)
            if self.remover is not None:
                self.remover.evict(gone)

    def resize(self, capacity_bytes: int) -> int:
        """The policy fills ``capacity_bytes`` from now on (``PoolPolicy.resize``); what no
        longer fits is evicted and handed to the remover. Returns the chunks evicted.

        Raises:
            ValueError: ``capacity_bytes`` < 1.
        """
        gone = self.policy.resize(capacity_bytes)
        self._account([], gone)
        if self.remover is not None:
            self.remover.evict(gone)
        return len(gone)

    def order(self) -> list[PolicyKey]:
        """What the order file keeps (``kvpool_policy._order_file``): the chunks found at start
        whose layout no record named yet, in their found order, then the policy's order (the
        next to evict first)."""
        waiting = [(d, h) for d, hashes in self._found.items() for h in hashes]
        return waiting + self.policy.order()

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
            WIRE_VERSION, service, _sat(version), self.policy.doorkeeper_active, bits, bloom,
            self.policy.capacity_bytes, self.policy.used_bytes, _sat(self.counters.records),
            self.counters.dropped, _sat(removed), self.policy.pinned_chunks)
