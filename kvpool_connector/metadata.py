"""What the scheduler tells the workers each step (vLLM's ``KVConnectorMetadata``).

The scheduler side (``KVPoolScheduler``) decides, per request, which chunks to load from the
pool and which to save to it; the worker side (``KVPoolWorker``) moves the bytes. A *chunk* is
``chunk_size`` tokens = ``blocks_per_chunk`` whole vLLM blocks; chunk ``i`` of a request covers
block ids ``block_ids[i * blocks_per_chunk : (i + 1) * blocks_per_chunk]`` and is stored under
``PoolKey(model, digest, layout, chunk_hashes[i])`` (``digest``: the worker's layout digest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["KVPoolConnectorMetadata", "LoadOutcomes", "LoadSpec", "ReqMeta"]


@dataclass
class LoadSpec:
    """What to load for one request (vLLM Ascend's ``LoadSpec``), in tokens.

    ``vllm_cached_tokens``: tokens vLLM's local prefix cache already holds (not loaded).
    ``kvpool_cached_tokens``: leading tokens the pool holds, a whole number of chunks and
    always less than the prompt length (the last prompt token is never claimed).
    ``can_load``: set by ``update_state_after_alloc`` once vLLM allocated blocks for them.
    ``lease_expires_ms``: wall-clock ms when the lookup's leases expire (Mooncake grants
    ``default_kv_lease_ttl`` on exists), ``None`` if the backend has no leases.
    """

    vllm_cached_tokens: int
    kvpool_cached_tokens: int
    can_load: bool = False
    lease_expires_ms: float | None = None

    @property
    def num_tokens_to_load(self) -> int:
        return max(0, self.kvpool_cached_tokens - self.vllm_cached_tokens)


@dataclass
class ReqMeta:
    """One request's work for this step.

    Attributes:
        req_id: vLLM request id.
        block_ids: the request's vLLM block ids (KV-cache group 0), in token order.
        group_block_ids: with several KV-cache groups (vLLM's hybrid allocator), every
            group's block table, position for position (the null block, id 0, where vLLM
            holds nothing: before a sliding window); empty with one group.
        chunk_hashes: ``keys.chunk_hashes`` of the prompt, one per whole chunk.
        load: chunks ``[load.vllm_cached_tokens // chunk_size,
            load.kvpool_cached_tokens // chunk_size)`` are loaded; ``None``: nothing to load.
        save_from_chunk, save_to_chunk: chunks in ``[save_from_chunk, save_to_chunk)`` are
            complete after this step and must be saved (empty range: nothing to save).
        is_last_save: no further saves will follow for this request (the worker may report it
            finished sending once this save is done).
        save_job: the scheduler holds this save's sliding-window blocks (vLLM frees blocks
            that leave the window while the request runs) and Mamba state blocks until every
            worker reported the job in ``LoadOutcomes.saves_done``; ``None`` when nothing is
            held.
        boundary_states: Mamba states (align mode) to save this step, ``(group, chunk,
            block id)``: the state after chunk ``chunk`` of group ``group`` is in block
            ``block id``, as vLLM handed it over (``boundary_state_offloads``), never read from
            the block table by position.
    """

    req_id: str
    block_ids: list[int]
    chunk_hashes: list[str]
    load: LoadSpec | None = None
    save_from_chunk: int = 0
    save_to_chunk: int = 0
    is_last_save: bool = False
    group_block_ids: tuple[list[int], ...] = ()
    save_job: int | None = None
    boundary_states: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def has_save(self) -> bool:
        """Whether this step saves anything for the request: chunks or Mamba states."""
        return self.save_to_chunk > self.save_from_chunk or bool(self.boundary_states)


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    """Per-step metadata: ``requests`` to load or save, ``preempted`` request ids whose
    pending loads must be abandoned; with ``eviction: connector``
    (``kvpool_connector.eviction``), ``evict``: chunk hashes worker rank 0 removes from the pool
    before this step's saves, and ``keep``: chunks evicted earlier and taken back since, whose
    removal (still waiting for a lease) is dropped."""

    requests: list[ReqMeta] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    evict: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)


@dataclass
class LoadOutcomes(KVConnectorWorkerMetadata):
    """What the workers' loads really brought in, and which held saves ended (worker ->
    scheduler, once per step).

    ``outcomes``: request id -> ``(accepted, loaded)`` tokens: what vLLM accepted from the
    pool for the request and what the load wrote before its first failed chunk. vLLM merges
    the workers' objects of one step with ``aggregate``; a request counts what every rank
    loaded (the minimum), since a block failed on any rank is recomputed on all.
    ``saves_done``: ``ReqMeta.save_job`` -> workers that finished it (summed by
    ``aggregate``); the scheduler releases the job's blocks once every worker did.
    """

    outcomes: dict[str, tuple[int, int]] = field(default_factory=dict)
    saves_done: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> LoadOutcomes:
        """Merge another worker's outcomes of the same step (per request, the minimum; per
        save job, the sum of workers)."""
        assert isinstance(other, LoadOutcomes)
        merged = dict(self.outcomes)
        for rid, (accepted, loaded) in other.outcomes.items():
            mine = merged.get(rid)
            merged[rid] = (accepted, loaded if mine is None else min(mine[1], loaded))
        done = dict(self.saves_done)
        for job, n in other.saves_done.items():
            done[job] = done.get(job, 0) + n
        return LoadOutcomes(merged, done)
