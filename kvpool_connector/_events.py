"""KV events for KV-aware routers: what the pool holds, in vLLM's own ``BlockStored`` /
``BlockRemoved`` vocabulary (``vllm.distributed.kv_events``).

vLLM publishes a connector's events with its own KV-event publisher (``kv_events_config``,
ZMQ), next to the events of its GPU prefix cache. The path, as in vLLM's connectors (LMCache,
MooncakeStore):

* worker: every step ``get_kv_connector_kv_cache_events`` hands over a ``KVPoolKVEvents``
  holding one ``ChunkWritten`` per chunk whose value this worker's save wrote to the pool (put
  result 0; keys the pool already held are not announced again) and a ``PoolFlushed`` per
  operator flush that removed this engine's keys. vLLM merges the workers' containers
  (``KVOutputAggregator``: ``add_events`` and ``increment_workers``).
* scheduler: ``update_connector_output`` feeds them to ``PoolEventJoiner``, which joins a chunk
  with the request's vLLM block hashes (``Request.block_hashes``, the hashes a router knows; pool
  keys use the connector's own chunk hashes) and emits one ``BlockStored`` per chunk once every
  shard of the layout wrote it (``ChunkWritten.shards``: what a lookup requires before it counts
  a hit), per KV-cache group (``group_idx``: a hybrid model's groups are stored apart), and it
  was not announced already (two requests of one step may both write a chunk);
  ``take_events`` hands the events to vLLM's publisher.
* a flush of this engine's keys (``reset_cache`` with ``reset_flush_scope``, or an operator
  flush reaching a worker) emits ``BlockRemoved``, one per group, for the chunks announced so
  far (the last ``REMEMBERED_CHUNKS`` of them). The pool's own evictions are not seen by the
  connector and are not announced: a router then expects a hit that the lookup does not find,
  and the engine computes the prefix (a miss, never wrong KV).

Nothing here runs unless vLLM's ``kv_events_config.enable_kv_cache_events`` is set.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import ExternalBlockHash, maybe_convert_block_hash

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "REMEMBERED_CHUNKS",
    "ChunkWritten",
    "KVPoolKVEvents",
    "PoolEventJoiner",
    "PoolFlushed",
    "kv_events_enabled",
]

REMEMBERED_CHUNKS = 65_536
"""Announced chunks whose block hashes the scheduler keeps for a later ``BlockRemoved`` (at
most ~10 MB of hashes at 4 hashes per chunk); older ones are forgotten first."""


class ChunkWritten(KVCacheEvent):
    """Worker -> scheduler: this worker's save wrote chunk ``chunk`` (index in the request's
    chunk hashes) of request ``req_id`` under shard ``shard`` (``ParallelLayout`` string) for
    KV-cache group ``group``; a chunk is a pool hit once ``shards`` distinct shards wrote it."""

    req_id: str
    chunk: int
    shard: str
    shards: int
    group: int = 0


class PoolFlushed(KVCacheEvent):
    """Worker -> scheduler: an operator flush removed this engine's keys (``scope``: the
    console's flush scope)."""

    scope: str


class KVPoolKVEvents(KVConnectorKVEvents):
    """The container vLLM carries from the workers to the scheduler (``KVConnectorOutput.
    kv_cache_events``). Holds ``ChunkWritten`` / ``PoolFlushed`` reports, never published as
    they are: the scheduler turns them into ``BlockStored`` / ``BlockRemoved``."""

    def __init__(self, events: list[KVCacheEvent] | None = None) -> None:
        self._events: list[KVCacheEvent] = list(events or [])
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Append another worker's reports (vLLM's aggregator merges them this way)."""
        self._events.extend(events)

    def aggregate(self) -> KVPoolKVEvents:
        """Nothing to do: the scheduler joins reports by chunk and shard."""
        return self

    def increment_workers(self, count: int = 1) -> None:
        """Count workers merged in (kept for vLLM's interface; quorum is by shard)."""
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        """Every report held."""
        return list(self._events)

    def get_number_of_workers(self) -> int:
        """Workers merged into this container."""
        return self._workers

    def clear_events(self) -> None:
        """Drop every report."""
        self._events.clear()
        self._workers = 1


def kv_events_enabled(kv_events_config: object) -> bool:
    """Whether vLLM publishes KV events (``VllmConfig.kv_events_config``)."""
    return bool(getattr(kv_events_config, "enable_kv_cache_events", False))


class PoolEventJoiner:
    """Scheduler side: turns the workers' reports into the events vLLM publishes.

    Args:
        medium: ``BlockStored.medium`` / ``BlockRemoved.medium`` naming the pool (the
            connector passes its backend name, e.g. ``mooncake``).
        chunk_size: tokens per pool chunk.
        hash_block_size: tokens per vLLM block hash (``Request.block_hashes``); divides
            ``chunk_size``.
        remember: announced chunks kept for ``BlockRemoved`` (oldest forgotten first).

    Raises:
        ValueError: ``chunk_size`` is not a positive multiple of ``hash_block_size``.
    """

    def __init__(self, *, medium: str, chunk_size: int, hash_block_size: int,
                 remember: int = REMEMBERED_CHUNKS) -> None:
        if hash_block_size <= 0 or chunk_size <= 0 or chunk_size % hash_block_size:
            raise ValueError(f"chunk_size ({chunk_size}) must be a positive multiple of vLLM's "
                             f"hash block size ({hash_block_size})")
        self.medium = medium
        self.chunk_size = chunk_size
        self.hash_block_size = hash_block_size
        self._per_chunk = chunk_size // hash_block_size
        self._remember = remember
        self._requests: dict[str, Request] = {}
        # (request id, chunk, group) -> shards that wrote it so far.
        self._partial: dict[tuple[str, int, int], set[str]] = {}
        # (group, the chunk's block hashes), oldest first.
        self._announced: OrderedDict[tuple[int, tuple[ExternalBlockHash, ...]], None] = (
            OrderedDict())
        self._out: list[KVCacheEvent] = []

    def track(self, request: Request) -> None:
        """Keep ``request`` (its block hashes and tokens) until ``release``."""
        self._requests[request.request_id] = request

    def release(self, req_ids: Iterable[str]) -> None:
        """Forget requests whose saves are all reported (or that never saved); chunks of
        theirs that not every shard wrote are never announced."""
        for rid in req_ids:
            if self._requests.pop(rid, None) is not None and self._partial:
                for key in [k for k in self._partial if k[0] == rid]:
                    del self._partial[key]

    def add(self, reports: list[KVCacheEvent]) -> None:
        """Join the workers' reports of one step (``ChunkWritten``, ``PoolFlushed``)."""
        for ev in reports:
            if isinstance(ev, ChunkWritten):
                if ev.req_id not in self._requests:
                    continue  # released (or never saving): nothing to join it with
                key = (ev.req_id, ev.chunk, ev.group)
                shards = self._partial.setdefault(key, set())
                shards.add(ev.shard)
                if len(shards) >= ev.shards:
                    del self._partial[key]
                    self._stored(ev.req_id, ev.chunk, ev.group)
            elif isinstance(ev, PoolFlushed):
                self.flushed()

    def _stored(self, rid: str, chunk: int, group: int) -> None:
        request = self._requests.get(rid)
        if request is None:
            return
        n = self._per_chunk
        hashes = request.block_hashes[chunk * n:(chunk + 1) * n]
        if len(hashes) < n:
            return  # vLLM has not hashed these tokens (cannot happen for a saved chunk)
        block_hashes = [maybe_convert_block_hash(h) for h in hashes]
        key = (group, tuple(block_hashes))
        if key in self._announced:
            # Two requests of one step wrote the same chunk: the router knows it already.
            self._announced.move_to_end(key)
            return
        lora = request.lora_request
        ev = BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=(maybe_convert_block_hash(request.block_hashes[chunk * n - 1])
                               if chunk else None),
            token_ids=list(request.all_token_ids[chunk * self.chunk_size:
                                                 (chunk + 1) * self.chunk_size]),
            block_size=self.hash_block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=self.medium,
            lora_name=lora.name if lora else None,
            group_idx=group,
        )
        self._out.append(ev)
        self._announced[key] = None
        while len(self._announced) > self._remember:
            self._announced.popitem(last=False)

    def flushed(self) -> None:
        """This engine's keys left the pool: per KV-cache group, one ``BlockRemoved`` for every
        chunk announced (and remembered) so far."""
        by_group: dict[int, list[ExternalBlockHash]] = {}
        for group, chunk in self._announced:
            by_group.setdefault(group, []).extend(chunk)
        self._announced.clear()
        for group, hashes in sorted(by_group.items()):
            self._out.append(BlockRemoved(block_hashes=hashes, medium=self.medium,
                                          group_idx=group))

    def take(self) -> list[KVCacheEvent]:
        """The events to publish since the last call, in order."""
        out, self._out = self._out, []
        return out
