"""One admission and eviction policy for a whole pool (issue 40), fed by every engine's access
records and byte-weighted.

Today each engine steers the pool alone (``kvpool_connector.admission`` and ``.eviction``): its
doorkeeper sees 1/N of the repeats and its exact LRU of capacity/N removes chunks other engines
still use. ``PoolPolicy`` is the same decision made once for the pool: every engine's records go
into one admission policy and one eviction order over the pool's real capacity in bytes.

An access record (``AccessRecord``) is one scheduled request of one engine: its layout digest,
the chained chunk hashes of its prompt (``kvpool_connector.keys.chunk_hashes``), the bytes one
chunk takes in the pool (every TP/PP rank's keys together) and how many leading chunks the engine
would save. A chunk is named by ``(layout digest, chunk hash)``: the same prompt under two
layouts is two objects in the pool.

Per record (``PoolPolicy.record``):

1. **Admission.** One ``kvpool_connector.admission.AdaptiveAdmission`` for the pool: ghost caches
   of *all* and *doorkeeper* (W-TinyLFU's doorkeeper: Einziger et al., "TinyLFU: A Highly
   Efficient Cache Admission Policy", ACM TOS 2017, section 3.4.2) at the pool's capacity, so the
   doorkeeper sees every engine's repeats. The record's chunks admitted are the leading
   ``min(engine's own count, policy's count)``.
2. **Eviction** (``eviction``):

   - ``"lru"`` (the default, chosen by the table in docs/policy.md): an exact LRU in bytes whose
     order is *leaf first*: a record touches its chunks from the last to the first, so a
     prompt's first chunk is the most recent of its chunks and a chunk is always more recent
     than every chunk that extends it. The LRU then removes the tail of a prefix before its head
     and never leaves a chunk whose prefix is gone (chained hashes: chunk ``i`` is only ever a
     hit when chunks ``0..i-1`` are). This is RadixAttention's eviction, LRU over the leaves of
     the prefix tree (Zheng et al., "SGLang: Efficient Execution of Structured Language Model
     Programs", NeurIPS 2024, section 3); vLLM frees a request's blocks tail first for the same
     reason. The engines' own LRU touches in prompt order, so it evicts a prompt's head first.
   - ``"s3fifo"``: S3-FIFO in bytes (Yang et al., "FIFO queues are all you need for cache
     eviction", SOSP 2023, Algorithm 1): a small FIFO of 10% of the bytes, a main FIFO, a ghost
     FIFO of keys; 2-bit frequencies; inserted leaf first like the LRU. The frequency-aware
     candidate the table compares.

3. **Pins.** A pinned chunk (``pin``) is never evicted; its bytes count against the capacity
   while it is in the pool. An admitted chunk that cannot fit once every unpinned chunk is gone
   is not admitted, nor is any chunk after it.

The pool's bytes never exceed ``capacity_bytes``. ``Decision`` says what the pool must do for a
record: which of its chunks to save, and which chunks (of any record) to remove. A chunk inserted
and evicted within one record is in neither list (it never reached the pool).

Memory: one ``OrderedDict`` entry per resident chunk (a ``(digest, hash)`` tuple key and its
bytes), plus the admission's ghosts and Bloom filter (``AdaptiveAdmission``'s docstring, bounded
by ``max_ghost_keys``): about 530 bytes per resident chunk in all, hash strings not counted
(tracemalloc, whole conversation trace at 20M tokens: 19.6 MiB for 39,062 resident chunks).
A 1 TiB pool of 2 MiB chunks (524,288 chunks) would take about 270 MiB.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

from kvpool_connector.admission import AdaptiveAdmission

__all__ = [
    "S3FIFO",
    "AccessRecord",
    "AdmissionKind",
    "Decision",
    "EvictionKind",
    "LeafFirstLRU",
    "PolicyKey",
    "PoolPolicy",
]

DOORKEEPER_MAX_MIB = 4
"""The pool-wide doorkeeper's Bloom filter takes at most this many MiB a generation (two
generations; the snapshot carries their OR, so at most this much a snapshot). It is sized at
10 bits an entry of ``8 x capacity_chunks``; past the cap it holds fewer entries than the
capacity's chunks and forgets sooner (a generation turns over after its entries)."""

_DOORKEEPER_MAX_CHUNKS = (DOORKEEPER_MAX_MIB << 20) // 10

PolicyKey = tuple[str, str]
"""A chunk of the pool: ``(layout digest, chunk hash)``."""

EvictionKind = Literal["lru", "s3fifo"]
"""``PoolPolicy``'s eviction orders (module docstring)."""

AdmissionKind = Literal["adaptive", "all"]
"""``PoolPolicy``'s admissions: the pool-wide ghosts and doorkeeper, or every chunk."""


@dataclass(frozen=True, slots=True)
class AccessRecord:
    """One engine's scheduled request, as the policy sees it.

    Attributes:
        digest: the engine's layout digest (``kvpool_connector.keys``).
        hashes: chained chunk hashes of the prompt's whole chunks, in prompt order (32 hex
            digits each: ``AdaptiveAdmission`` reads its probes from them).
        chunk_bytes: bytes one chunk takes in the pool, every TP/PP rank's keys (> 0).
        wants: leading chunks the engine would save (``len(hashes)`` with ``admission: all``,
            and for a ``kv_producer``, whose saves are its decode engine's hand-over).
        engine: who sent it (for counts only; decisions do not depend on it).
    """

    digest: str
    hashes: tuple[str, ...]
    chunk_bytes: int
    wants: int
    engine: str = ""


@dataclass(slots=True)
class Decision:
    """What the pool does for one record.

    Attributes:
        hits: leading chunks of the record the pool held before it (what the engine loads).
        admitted: leading chunks of the record the policy admits (a prefix of ``hashes``).
        saves: chunks of the record to store now (admitted, absent before, still resident).
        removals: chunks to remove from the pool, least valuable first (resident before this
            record; none is pinned).
    """

    hits: int
    admitted: int
    saves: list[PolicyKey] = field(default_factory=list)
    removals: list[PolicyKey] = field(default_factory=list)


class LeafFirstLRU:
    """An exact LRU in bytes over unpinned resident chunks (``PoolPolicy``'s ``"lru"``).

    The caller touches and inserts a record's chunks last to first (module docstring); this
    class only keeps the order.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[PolicyKey, int] = OrderedDict()
        self.bytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, key: PolicyKey) -> None:
        self._order.move_to_end(key)

    def oldest(self) -> Iterator[tuple[PolicyKey, int]]:
        """Chunks and their bytes from the next victim on (no change)."""
        return iter(self._order.items())

    def to_front(self, key: PolicyKey) -> None:
        """Make ``key`` the least recently used (``PoolPolicy.adopt``)."""
        self._order.move_to_end(key, last=False)

    def insert(self, key: PolicyKey, nbytes: int) -> None:
        self._order[key] = nbytes
        self.bytes += nbytes

    def remove(self, key: PolicyKey) -> int:
        """Take ``key`` out of the order (it is being pinned); its bytes."""
        nbytes = self._order.pop(key)
        self.bytes -= nbytes
        return nbytes

    def victim(self) -> PolicyKey | None:
        """Evict the least recently used chunk; ``None`` when empty."""
        if not self._order:
            return None
        key, nbytes = self._order.popitem(last=False)
        self.bytes -= nbytes
        return key


class S3FIFO:
    """S3-FIFO in bytes (Yang et al., SOSP 2023, Algorithm 1; ``PoolPolicy``'s ``"s3fifo"``).

    Args:
        capacity_bytes: the bytes the queues may hold (sizes the small queue and the ghost).
        small_fraction: the small FIFO's share of ``capacity_bytes`` (the paper's 10%).
    """

    _MAX_FREQ = 3  # two bits, as in the paper

    def __init__(self, capacity_bytes: int, small_fraction: float = 0.1) -> None:
        self._small_cap = max(1, int(capacity_bytes * small_fraction))
        self._ghost_cap = max(1, capacity_bytes - self._small_cap)
        self._small: OrderedDict[PolicyKey, int] = OrderedDict()
        self._main: OrderedDict[PolicyKey, int] = OrderedDict()
        self._ghost: OrderedDict[PolicyKey, int] = OrderedDict()
        self._freq: dict[PolicyKey, int] = {}
        self._small_bytes = self._main_bytes = self._ghost_bytes = 0

    @property
    def bytes(self) -> int:
        return self._small_bytes + self._main_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def touch(self, key: PolicyKey) -> None:
        self._freq[key] = min(self._MAX_FREQ, self._freq[key] + 1)

    def oldest(self) -> Iterator[tuple[PolicyKey, int]]:
        """Chunks and their bytes, the small FIFO's oldest first, then the main FIFO's (no
        change)."""
        return itertools.chain(self._small.items(), self._main.items())

    def insert(self, key: PolicyKey, nbytes: int) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = nbytes
            self._main_bytes += nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def remove(self, key: PolicyKey) -> int:
        del self._freq[key]
        if key in self._small:
            nbytes = self._small.pop(key)
            self._small_bytes -= nbytes
        else:
            nbytes = self._main.pop(key)
            self._main_bytes -= nbytes
        return nbytes

    def _to_ghost(self, key: PolicyKey, nbytes: int) -> None:
        self._ghost[key] = nbytes
        self._ghost_bytes += nbytes
        while self._ghost_bytes > self._ghost_cap:
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]

    def victim(self) -> PolicyKey | None:
        """Evict one chunk (the paper's ``evict``); ``None`` when empty."""
        while self._small or self._main:
            if self._small and (self._small_bytes >= self._small_cap or not self._main):
                key, nbytes = self._small.popitem(last=False)
                self._small_bytes -= nbytes
                if self._freq[key] > 1:  # used again while small: promoted, not evicted
                    self._main[key] = nbytes
                    self._main_bytes += nbytes
                    continue
                del self._freq[key]
                self._to_ghost(key, nbytes)
                return key
            key, nbytes = self._main.popitem(last=False)
            if self._freq[key] > 0:  # second chance, one frequency step less
                self._freq[key] -= 1
                self._main[key] = nbytes
                continue
            self._main_bytes -= nbytes
            del self._freq[key]
            return key
        return None


class PoolPolicy:
    """The pool-wide policy (module docstring).

    Args:
        capacity_bytes: the pool's capacity for KV chunks (bytes, > 0): what the master's
            segments hold, below its own eviction watermark.
        eviction: ``"lru"`` (leaf-first exact LRU) or ``"s3fifo"``.
        admission: ``"adaptive"`` (the pool-wide ghosts and doorkeeper) or ``"all"``.
        half_life: ``AdaptiveAdmission``'s, in records (> 0).
        engines_decide: the engines admit from the policy's published snapshot (the live
            service, ``kvpool_policy.service``) and a record's ``wants`` is what they saved:
            the policy inserts those chunks, so it holds what the pool holds, and its own
            admission only keeps its state (ghosts, doorkeeper) for the next snapshot.
        min_chunk_bytes: the smallest chunk the admission is sized for (bytes, >= 1): a first
            record of tiny chunks cannot size the doorkeeper past the capacity's real chunks.

    The admission's ghosts count chunks: they are sized on the first record, at
    ``capacity_bytes // max(chunk_bytes, min_chunk_bytes)`` chunks, at most what
    ``DOORKEEPER_MAX_MIB`` allows (with layouts of different chunk sizes on one pool they
    approximate the capacity).

    Attributes:
        used_bytes: bytes of chunks resident now (pinned included), <= ``capacity_bytes``.
        records: records seen so far.

    Raises:
        ValueError: ``capacity_bytes`` < 1 or an unknown ``eviction``/``admission``.
    """

    def __init__(self, capacity_bytes: int, eviction: EvictionKind = "lru",
                 admission: AdmissionKind = "adaptive",
                 half_life: int = 200, engines_decide: bool = False,
                 min_chunk_bytes: int = 1) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        if eviction not in ("lru", "s3fifo") or admission not in ("adaptive", "all"):
            raise ValueError(f"unknown eviction {eviction!r} or admission {admission!r}")
        self.capacity_bytes = capacity_bytes
        self._order: LeafFirstLRU | S3FIFO = (
            LeafFirstLRU() if eviction == "lru" else S3FIFO(capacity_bytes))
        self._admission_kind = admission
        self._half_life = half_life
        self._engines_decide = engines_decide
        self._min_chunk_bytes = max(1, min_chunk_bytes)
        self._doorkeeper_entries = max(4096, 8 * min(
            _DOORKEEPER_MAX_CHUNKS, max(1, capacity_bytes // self._min_chunk_bytes)))
        # Sized on the first record: its ghosts count chunks, so they need a chunk's bytes.
        self._admission: AdaptiveAdmission | None = None
        self._pinned: set[PolicyKey] = set()
        self._pinned_resident: dict[PolicyKey, int] = {}
        self._pinned_bytes = 0
        self.records = 0

    @property
    def used_bytes(self) -> int:
        return self._order.bytes + self._pinned_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned_resident

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned_resident)

    @property
    def admission(self) -> AdmissionKind:
        """The admission it was built with (``"adaptive"`` or ``"all"``)."""
        return self._admission_kind

    @property
    def doorkeeper_active(self) -> bool:
        """The last record was admitted by the doorkeeper (what a snapshot would publish)."""
        return self._admission is not None and self._admission.doorkeeper_active

    @property
    def pinned_chunks(self) -> int:
        """Chunks pinned (``pin``), resident or not."""
        return len(self._pinned)

    def doorkeeper_snapshot(self) -> tuple[int, bytes] | None:
        """The pool-wide doorkeeper's ``(bits, bloom)`` (``AdaptiveAdmission``'s), ``None``
        before the first record or with ``admission="all"``."""
        return None if self._admission is None else self._admission.doorkeeper_snapshot()

    def doorkeeper_changes(self) -> set[int] | None:
        """The 64-bit words of ``doorkeeper_snapshot``'s bloom that may have changed since the
        last call; ``None``: the whole filter may have (or there is none yet)."""
        return None if self._admission is None else self._admission.doorkeeper_changes()

    def adopt(self, keys: Iterable[PolicyKey], chunk_bytes: int) -> list[PolicyKey]:
        """Chunks found in the pool without a record (a restarted service lists the pool):
        resident from now on, as the least recently used, in the order given (the first is
        evicted first). Returns the chunks to remove so the pool fits ``capacity_bytes``.

        Raises:
            ValueError: ``chunk_bytes`` < 1.
        """
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        new = [k for k in keys if k not in self]
        for key in reversed(new):
            if key in self._pinned:
                self._pinned_resident[key] = chunk_bytes
                self._pinned_bytes += chunk_bytes
            else:
                self._order.insert(key, chunk_bytes)
                if isinstance(self._order, LeafFirstLRU):
                    self._order.to_front(key)
        return self._fit()

    def resize(self, capacity_bytes: int) -> list[PolicyKey]:
        """Fill ``capacity_bytes`` from now on (``kvpool_policy._fill``: the service's share
        following the master's used bytes). Returns the chunks to remove so the pool fits it
        (none when it grows). S3-FIFO's queues keep the sizes they were built with.

        Raises:
            ValueError: ``capacity_bytes`` < 1.
        """
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        return self._fit()

    def _fit(self) -> list[PolicyKey]:
        """Evict the oldest unpinned chunks until the pool fits ``capacity_bytes``."""
        evicted: list[PolicyKey] = []
        while self.used_bytes > self.capacity_bytes:
            victim = self._order.victim()
            if victim is None:  # only pinned chunks left: they stay (over capacity)
                break
            evicted.append(victim)
        return evicted

    def order(self) -> list[PolicyKey]:
        """The unpinned resident chunks, the next to evict first (a copy: what
        ``kvpool_policy._order_file`` keeps across a restart)."""
        return [key for key, _ in self._order.oldest()]

    def evict_oldest(self, digests: AbstractSet[str], nbytes: int,
                     exclude: AbstractSet[PolicyKey], max_scan: int = 65_536,
                     ) -> list[PolicyKey]:
        """Evict the oldest unpinned chunks of ``digests`` (in the eviction order), none of
        ``exclude``, until ``nbytes`` are freed or none is left among the ``max_scan`` oldest
        chunks; the chunks evicted (the service's fair share: a layout over it makes room
        from its own chunks)."""
        out: list[PolicyKey] = []
        freed = 0
        for key, size in itertools.islice(self._order.oldest(), max_scan):
            if freed >= nbytes:
                break
            if key[0] in digests and key not in exclude:
                out.append(key)
                freed += size
        for key in out:
            self._order.remove(key)
        return out

    def pin(self, keys: Iterable[PolicyKey]) -> None:
        """Never evict ``keys`` (resident now or saved later) until ``unpin``."""
        for key in keys:
            if key in self._pinned:
                continue
            self._pinned.add(key)
            if key in self._order:
                nbytes = self._order.remove(key)
                self._pinned_resident[key] = nbytes
                self._pinned_bytes += nbytes

    def unpin(self, keys: Iterable[PolicyKey]) -> None:
        """``keys`` become evictable again, as the most recently used chunks."""
        for key in keys:
            self._pinned.discard(key)
            nbytes = self._pinned_resident.pop(key, None)
            if nbytes is not None:
                self._pinned_bytes -= nbytes
                self._order.insert(key, nbytes)

    @property
    def doorkeeper_entries(self) -> int:
        """Chunks one generation of the doorkeeper's Bloom filter holds (before the first
        record: as sized for ``min_chunk_bytes``)."""
        return self._doorkeeper_entries

    def _admit(self, rec: AccessRecord, feed: bool) -> int:
        if self._admission_kind == "all" or not feed:
            return min(rec.wants, len(rec.hashes))
        if self._admission is None:
            chunks = min(_DOORKEEPER_MAX_CHUNKS, max(
                1, self.capacity_bytes // max(rec.chunk_bytes, self._min_chunk_bytes)))
            self._doorkeeper_entries = max(4096, 8 * chunks)
            self._admission = AdaptiveAdmission(chunks, half_life=self._half_life,
                                                track_changes=True)
        admitted = self._admission.admit(rec.hashes)
        return min(rec.wants, len(rec.hashes) if self._engines_decide else admitted)

    def _make_room(self, nbytes: int, evicted: dict[PolicyKey, None]) -> bool:
        """Evict until ``nbytes`` more fit; ``False`` (nothing more evicted) if they cannot."""
        if nbytes > self.capacity_bytes - self._pinned_bytes:
            return False
        while self.used_bytes + nbytes > self.capacity_bytes:
            key = self._order.victim()
            # Never empty here: with every unpinned chunk gone, pinned + nbytes fit (checked).
            assert key is not None
            evicted[key] = None
        return True

    def record(self, rec: AccessRecord, *, feed_admission: bool = True) -> Decision:
        """Apply one access record (module docstring, steps 1-3). ``feed_admission=False``:
        the record leaves the admission's state (ghosts, doorkeeper) as it was and saves its
        leading ``wants`` chunks (the service's cap on what one key feeds the doorkeeper).

        Raises:
            ValueError: ``chunk_bytes`` < 1 or ``wants`` < 0.
        """
        if rec.chunk_bytes < 1 or rec.wants < 0:
            raise ValueError(f"chunk_bytes must be >= 1 and wants >= 0, got "
                             f"{rec.chunk_bytes}, {rec.wants}")
        self.records += 1
        keys = [(rec.digest, h) for h in rec.hashes]
        hits = 0
        for key in keys:
            if key not in self:
                break
            hits += 1
        was = {k for k in keys[hits:] if k in self}.union(keys[:hits])
        admitted = self._admit(rec, feed_admission)
        evicted: dict[PolicyKey, None] = {}
        inserted: dict[PolicyKey, int] = {}  # chunk -> its index in the record
        # Last to first: each chunk ends more recent than the chunks that extend it.
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if key in self._order:
                self._order.touch(key)
            elif key in self._pinned_resident:
                continue
            elif i < admitted:
                if not self._make_room(rec.chunk_bytes, evicted):
                    admitted = i  # what pins leave is too small: the rest is not admitted
                    continue
                if key in self._pinned:
                    self._pinned_resident[key] = rec.chunk_bytes
                    self._pinned_bytes += rec.chunk_bytes
                else:
                    self._order.insert(key, rec.chunk_bytes)
                inserted[key] = i
        # Chunks inserted past a later refusal would be saved without their prefix: undone.
        for key, i in inserted.items():
            if i >= admitted and key not in evicted:
                self._drop(key)
        # Net of the record: a chunk may be evicted and inserted again within it.
        return Decision(
            hits=hits, admitted=admitted,
            saves=[k for k, i in reversed(inserted.items())
                   if i < admitted and k not in was and k in self],
            removals=[k for k in evicted
                      if k not in self and (k in was or k not in inserted)])

    def _drop(self, key: PolicyKey) -> None:
        nbytes = self._pinned_resident.pop(key, None)
        if nbytes is None:
            self._order.remove(key)
        else:
            self._pinned_bytes -= nbytes

