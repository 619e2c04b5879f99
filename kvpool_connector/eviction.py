"""Eviction: who decides which chunks leave the pool.

``kv_connector_extra_config.eviction`` picks it (``KVPoolConfig.eviction``):

* ``pool`` (default): the pool does. Mooncake evicts once usage passes
  ``eviction_high_watermark_ratio``, ``eviction_ratio`` of its objects at a time, by lease
  order (``lease_timeout``, shard by shard: a put sets it to now, an exists or get to now +
  ``default_kv_lease_ttl``), and never an object under a lease. That pool holds less than its
  capacity, in an order far from LRU when requests come faster than the lease TTL (measured in
  docs/benchmarks.md).
* ``connector``: the scheduler keeps an exact LRU of this engine's chunks of
  ``admission_pool_tokens`` (``ConnectorEviction``): every chunk of a request it schedules that
  the LRU holds is refreshed, every chunk its admission policy saves is inserted, and the least
  recently used chunks past the capacity are removed from the pool by worker rank 0 before that
  step's saves (``KVPoolConnectorMetadata.evict``; every rank's keys, never by force: a key
  refused under a reader's lease is tried again on a later step no sooner than the transport's
  transfer timeout after the refusal, ``_removals``). The pool then holds what an exact LRU of
  that capacity (under the admission policy) holds, if its own eviction never runs first: set
  the master's ``eviction_high_watermark_ratio`` above the share of the segments that
  ``admission_pool_tokens`` fills.

With several engines on one pool each one steers only the chunks it scheduled, in a capacity of
its own (``admission_pool_tokens``: its share). Keys are shared by layout, so one engine may
remove a chunk another still uses; the other then recomputes it (a load in progress holds a
lease, a load that outlived its lease is failed as ``LEASE_EXPIRED``, and a load that finds
the chunk gone recomputes it).

Memory: one ``OrderedDict`` entry per chunk of the capacity (a hex hash key, about
200 bytes per entry: 2M tokens at chunk 256 is 7,813 entries, ~1.6 MB), and as many for the
last ``RECENT_EVICTIONS`` evicted chunks (~1.6 MB).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

__all__ = ["RECENT_EVICTIONS", "ConnectorEviction", "EvictionMode", "watermark_conflict"]

EvictionMode = Literal["pool", "connector"]
"""Values of ``kv_connector_extra_config.eviction``."""


RECENT_EVICTIONS = 8_192
"""Chunks evicted in earlier steps that ``ConnectorEviction`` remembers (their removal may still
wait for a lease): one of them inserted again is sent back as ``keep``."""


class ConnectorEviction:
    """``eviction: connector``: an exact LRU of chunk hashes (module docstring).

    Per scheduler step: ``record`` each newly scheduled request, then ``take`` the step's
    removals (and the chunks whose earlier removal must be dropped).

    Args:
        capacity_chunks: chunks this engine may keep in the pool (``admission_pool_tokens //
            chunk_size``), >= 1.

    Attributes:
        evicted: chunks handed out for removal so far.

    Raises:
        ValueError: ``capacity_chunks`` < 1.
    """

    def __init__(self, capacity_chunks: int) -> None:
        if capacity_chunks < 1:
            raise ValueError(f"capacity_chunks must be >= 1, got {capacity_chunks}")
        self.capacity = capacity_chunks
        self._lru: OrderedDict[str, None] = OrderedDict()
        # This step's evictions (a chunk inserted again in the same step is never sent), the
        # earlier steps' (bounded), and chunks of those inserted again.
        self._step: dict[str, None] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._keep: dict[str, None] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, chunk_hash: object) -> bool:
        return chunk_hash in self._lru

    def record(self, hashes: Sequence[str], admitted: int) -> None:
        """A request is scheduled: refresh each of ``hashes`` (its prompt's chained chunk
        hashes, ``keys.chunk_hashes``) the LRU holds, insert the first ``admitted`` ones it
        does not (those its admission policy saves), in prompt order (as
        ``kvpool_replay.lru_hits`` does), then evict the least recently used chunks past the
        capacity, except this request's own (a prompt longer than the capacity keeps its
        chunks; the pool's own eviction is the bound then)."""
        lru = self._lru
        for i, h in enumerate(hashes):
            if h in lru:
                lru.move_to_end(h)
            elif i < admitted:
                lru[h] = None
                if h in self._step:  # evicted earlier in this step: never sent
                    del self._step[h]
                elif h in self._recent:
                    del self._recent[h]
                    self._keep[h] = None
        if len(lru) <= self.capacity:
            return
        own = set(hashes)
        while len(lru) > self.capacity:
            h = next(iter(lru))
            if h in own:
                break
            del lru[h]
            self._step[h] = None

    def take(self) -> tuple[list[str], list[str]]:
        """The step's ``(evict, keep)``: chunk hashes to remove from the pool, least recently
        used first, and chunks evicted in an earlier step and inserted again since, whose
        removal (if a lease still delays it) must be dropped."""
        evict, keep = list(self._step), list(self._keep)
        self._step.clear()
        self._keep.clear()
        self.evicted += len(evict)
        recent = self._recent
        for h in evict:
            recent[h] = None
        while len(recent) > RECENT_EVICTIONS:
            del recent[next(iter(recent))]
        return evict, keep


def watermark_conflict(capacity_tokens: int, chunk_size: int, chunk_bytes: int, pool_bytes: int,
                       watermark: float) -> str | None:
    """Why the master would evict before the connector's LRU is full, or ``None``.

    Args:
        capacity_tokens: ``admission_pool_tokens``.
        chunk_size: tokens per chunk.
        chunk_bytes: bytes one chunk takes in the pool, every rank's keys (bytes).
        pool_bytes: the pool's capacity (``PoolStats.total_bytes``, bytes); 0 = unknown.
        watermark: the master's ``eviction_high_watermark_ratio`` (as configured).
    """
    need = capacity_tokens // chunk_size * chunk_bytes
    if not pool_bytes or need <= watermark * pool_bytes:
        return None
    return (f"eviction 'connector' keeps {capacity_tokens:,} tokens ({need:,} bytes), above "
            f"the master's watermark ({watermark:g} of {pool_bytes:,} bytes): Mooncake evicts "
            f"first, in its own order; start mooncake_master with "
            f"--eviction_high_watermark_ratio=1.0 (and set it in the Mooncake config) or lower "
            f"admission_pool_tokens to {int(watermark * pool_bytes) // chunk_bytes * chunk_size:,}")
