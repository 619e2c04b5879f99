"""``KVPoolWorker``: the worker-side data path of the connector (vLLM's worker role).

Per engine step vLLM calls, in this order: ``start_load_kv`` (before the forward pass),
``wait_for_layer_load`` / ``save_kv_layer`` around each attention layer (layer-wise mode),
``wait_for_save`` (after the forward pass), ``get_finished`` and
``get_block_ids_with_load_errors``. The worker turns the scheduler's ``KVPoolConnectorMetadata``
into transfer plans (``_planning``: which keys and byte ranges for which blocks; a chunk of
``chunk_size`` tokens is one key, or one per layer in layer-wise mode) and runs them as backend
batch calls that move whole vLLM blocks by address (zero copy from/into the registered caches):

* saves run on a background thread after the device finished writing the blocks; a request
  whose save hit ``NO_AVAILABLE_HANDLE`` (pool full) skips its remaining saves, later requests
  try again; saves past ``save_budget_bytes`` in flight are skipped, never queued
  (``_transfers.SaveQueue``);
* loads run inline before the forward pass, per layer on a background thread (layer-wise),
  or fully in the background with completion reported by ``get_finished`` (``load_async``)
  (``_transfers.LoadRunner``);
* every block whose load failed, returned fewer bytes than its size or (with ``checksum``)
  did not match its digest is reported by ``get_block_ids_with_load_errors`` so vLLM
  (``kv_load_failure_policy="recompute"``) recomputes it; bytes of such a block are never
  trusted. Each load's outcome (tokens accepted, tokens loaded) goes to the scheduler through
  ``build_connector_worker_meta`` (``LoadOutcomes``), where hit tokens are counted once.

Several KV-cache groups (vLLM's hybrid allocator, ``_groups``): one planner per group, keys
``.g<group>``; a hit is the longest prefix every group can serve (``_groups.hybrid_hit``), loads
are asynchronous and a load with any failed key fails its whole request (vLLM recomputes it
from scratch: its block-level failure report cannot name a group), reported by
``take_failed_requests``. Each save with a ``save_job`` is reported in ``LoadOutcomes.saves_done``
once it ended. MLA (KV the same on every TP rank, ``stripe``): rank ``r`` of ``n`` saves chunk
``i`` only when ``i % n == r``; every rank loads every chunk. GQA/MHA values per KV-head share
(``_heads``, ``shares``): one planner per share the rank holds, keys ``tp<share>``; a chunk is a
hit once every share of it is in the pool, whichever engines of which TP sizes wrote them.
Pipeline stages with ``store_pp_layer_partition`` (``_stages``): one planner per stored layer
range the stage holds (and share), keys ``pp<range>``; a chunk is a hit once every range is in
the pool, whichever stages of which PP splits wrote them.

Contract with the scheduler side: saves are asynchronous, so ``request_finished`` must delay
freeing (return ``True``) for every request that had a save scheduled; the worker reports such a
request in ``get_finished``'s ``finished_sending`` once it is in ``finished_req_ids`` and all its
saves are done. Requests listed in ``metadata.preempted`` have their queued saves dropped and
their running transfers waited for before the step's forward pass may reuse their blocks.

Why this module is long (over 600 lines): it is vLLM's whole worker-side connector interface
(``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``, ``get_finished``... each a few lines over the planners and the transfer
threads) plus the per-rank set-up ``register_kv_caches`` does (KV-head shares, layer ranges,
hybrid groups, checksums); that set-up is the piece that would move out, into a layout builder.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Protocol

import torch

from kvpool_agent.reporter import NullReporter, Reporter
from kvpool_agent.vocabulary import error_name
from kvpool_connector._checksum import CHECKSUM_BYTES, CHECKSUM_NAME, DigestSlots
from kvpool_connector._device import DeviceSync, device_sync_for
from kvpool_connector._groups import KVGroup, hybrid_hit
from kvpool_connector._heads import HeadShares, share_layers
from kvpool_connector._layout import KVLayout, LayerLayout
from kvpool_connector._layout_digest import (
    LayoutFacts,
    ModelFacts,
    describe_layout,
    layer_signatures,
)
from kvpool_connector._planning import (
    KeyTransfer,
    LoadPlan,
    TransferPlanner,
    blocks_per_chunk,
    leading_hits,
    load_block_ids,
    lookup_layouts,
)
from kvpool_connector._stages import LayerRanges, plan_ranges
from kvpool_connector._transfers import (
    ChecksumBuffers,
    LoadRunner,
    SaveQueue,
    WorkerCounters,
)
from kvpool_connector.backends.base import Backend, BackendError
from kvpool_connector.keys import ParallelLayout, chunk_keys, normalize_model_name, shard_prefix
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadOutcomes, ReqMeta
from kvpool_connector.staging import attach_staging

__all__ = ["KVPoolWorker", "WorkerCounters", "WorkerSettings"]

logger = logging.getLogger(__name__)


class WorkerSettings(Protocol):
    """The connector settings the worker reads (``kvpool_connector.config.KVPoolConfig``
    provides them)."""

    @property
    def block_size(self) -> int: ...  # tokens per vLLM block
    @property
    def chunk_size(self) -> int: ...  # tokens per pool key, a multiple of block_size
    @property
    def use_layerwise(self) -> bool: ...
    @property
    def load_async(self) -> bool: ...
    @property
    def layerwise_timeout_ms(self) -> int: ...
    @property
    def save_budget_bytes(self) -> int: ...  # bytes of saves in flight at most
    @property
    def checksum(self) -> bool: ...  # values carry an XXH3-64 digest, verified on load
    @property
    def hash_algo(self) -> str: ...  # chunk-hash function, part of the layout digest


_WRITTEN_CHUNKS_KEPT = 1 << 16
"""Written chunks kept for ``take_written_chunks`` at most (oldest dropped first)."""

_DIGEST_SLOTS = 4096
"""Keys per batch call with the integrity check on (larger batches are split)."""

_SavePlan = tuple[ReqMeta, list[list[KeyTransfer]]]
"""A request and, per chunk to save, its transfers."""


def _ranges(indices: Sequence[int]) -> str:
    """Sorted indices as runs: ``[0, 1, 2, 4]`` -> ``0-2,4``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class KVPoolWorker:
    """Worker side of ``KVPoolConnector``: saves and loads whole KV blocks through a ``Backend``.

    Args:
        config: connector settings (``block_size``, ``chunk_size``, ``use_layerwise``,
            ``load_async``, ``layerwise_timeout_ms``).
        layout: this worker's shard (TP/PCP/DCP/PP rank, KV-cache group); part of every key.
        model: the model name (normalised with ``keys.normalize_model_name``).
        backend: the pool client; the caller owns it (``shutdown`` does not close it).
        reporter: the agent's event buffer; ``None`` = a capacity-0 reporter (drops events).
        tp_size, pcp_size, dcp_size, pp_size: sizes of the parallel layout. ``lookup_chunks``
            requires a chunk from every rank combination; pass ``tp_size=1`` when KV heads are
            replicated (MLA: every TP rank uses ``tp0``).
        num_blocks: vLLM's number of KV blocks, when known, to pick the block dimension of
            the cache tensors without guessing.
        groups: vLLM's KV-cache groups (``_groups.kv_groups``); ``None``: one full-attention
            group of every registered layer.
        stripe: ``(rank, size)``: this worker saves chunk ``i`` only when
            ``i % size == rank`` (MLA: the TP rank and size; every rank writes the same KV, so
            each writes a share of it once); ``(0, 1)`` saves every chunk.
        shares: the KV-head shares this rank holds (``_heads.plan_shares``): values per share,
            keys ``tp<share>``, lookups over all ``shares.store_size`` shares (``layout``'s
            and ``tp_size``'s TP fields are then not used); ``None``: values per rank.
        kv_share: ``LayoutFacts.kv_share`` without ``shares``: why values are per rank.
        pp_partition: ``store_pp_layer_partition`` (layers per stored range, ``_stages``):
            values per layer range, keys ``pp<range>``, lookups over every range (``layout``'s
            and ``pp_size``'s PP fields are then not used); ``None``: values per stage.
        total_layers: the model's layers (with ``pp_partition``); ``None``: the registered
            layers are the whole model.
        evicts: this worker removes the chunks ``KVPoolConnectorMetadata.evict`` names
            (``eviction: connector``; one worker per engine, every rank's keys).
        cpus: the CPUs of the save and load threads and their copy helpers
            (``_cpus.transfer_cpus``); ``None``: where they start.

    Attributes:
        pinned_keys: with ``evicts``, the keys a pin holds (``Pins.pinned_keys``): never
            removed by the eviction; ``None``: no pins known.
        layout_facts: what this worker's layout digest covers; ``None`` until
            ``register_kv_caches``, which computes it (and the keys' prefixes) once.

    Raises:
        ValueError: ``chunk_size`` is not a positive multiple of ``block_size``.
    """

    def __init__(
        self,
        config: WorkerSettings,
        layout: ParallelLayout,
        model: str,
        backend: Backend,
        reporter: Reporter | None = None,
        *,
        tp_size: int = 1,
        pcp_size: int = 1,
        dcp_size: int = 1,
        pp_size: int = 1,
        num_blocks: int | None = None,
        groups: Sequence[KVGroup] | None = None,
        stripe: tuple[int, int] = (0, 1),
        shares: HeadShares | None = None,
        kv_share: str = "",
        pp_partition: Sequence[int] | None = None,
        total_layers: int | None = None,
        evicts: bool = False,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.blocks_per_chunk = blocks_per_chunk(config.block_size, config.chunk_size)
        # eviction: connector: this worker removes every rank's keys of the chunks the
        # scheduler's LRU evicts (one worker per engine), except keys a pin holds.
        self.evicts = evicts
        self.pinned_keys: Callable[[], AbstractSet[str]] | None = None
        self.groups: list[KVGroup] | None = list(groups) if groups is not None else None
        self.stripe = stripe
        self.config = config
        self.shares, self._kv_share = shares, kv_share
        self._pp_partition, self._total_layers = pp_partition, total_layers
        # Stored layer ranges this stage holds (or why none): known at registration.
        self.ranges: LayerRanges | None = None
        self._pp_split = ""
        # The rank's own shard and TP size: per-rank values if the caches cannot be shared.
        self._rank_layout, self._rank_tp_size = layout, tp_size
        if shares is not None:
            layout, tp_size = replace(layout, tp_rank=shares.first_share), shares.store_size
        self.layout = layout
        self.model = normalize_model_name(model)
        self.backend = backend
        self.reporter = reporter if reporter is not None else NullReporter()
        self._sizes = {"tp_size": tp_size, "pcp_size": pcp_size, "dcp_size": dcp_size,
                       "pp_size": pp_size}
        self._lookup_layouts = lookup_layouts(layout, **self._sizes)
        self._lookup_prefixes: list[str] = []
        self._num_blocks_hint = num_blocks
        self.layout_facts: LayoutFacts | None = None
        self._digest = ""
        self.kv: KVLayout | None = None
        self._planner: TransferPlanner | None = None
        # One planner per head share held (``_planner`` is the first); one share without.
        self._planners: list[TransferPlanner] = []
        # Hybrid models: one planner per KV-cache group (and share), one list of lookup
        # prefixes per KV-cache group.
        self._group_planners: list[TransferPlanner] = []
        self._group_prefixes: list[list[str]] = []
        # Save jobs (ReqMeta.save_job) per submitted batch (None: nothing was submitted).
        self._save_jobs: list[tuple[Future[None] | None, list[int]]] = []
        self.counters = WorkerCounters()
        self._device: DeviceSync = DeviceSync()
        self._scratch: torch.Tensor | None = None
        self._value_block_bytes = self._layer_block_bytes = 0
        self._lock = threading.Lock()
        self._loads = LoadRunner(
            backend, self.reporter, self.counters, self._lock, chunk_size=config.chunk_size,
            blocks_per_chunk=self.blocks_per_chunk,
            layerwise_timeout_ms=config.layerwise_timeout_ms, cpus=cpus,
        )
        self._saves = SaveQueue(backend, self.reporter, self.counters, self._lock,
                                blocks_per_chunk=self.blocks_per_chunk,
                                budget_bytes=config.save_budget_bytes,
                                # Settings objects of older callers may not name it.
                                nice=getattr(config, "save_nice", 0), cpus=cpus)
        self._loads.fail_whole_requests = self.hybrid
        self._meta: KVPoolConnectorMetadata | None = None
        self._step_saves: list[_SavePlan] | None = None
        # Requests with a save scheduled, and those of them vLLM reported finished.
        self._saving_reqs: set[str] = set()
        self._finished_reqs: set[str] = set()
        self._closed = False

    # ------------------------------------------------------------------ registration

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        model_facts: ModelFacts | None = None,
        layer_ids: Sequence[int] | None = None,
    ) -> None:
        """Record each layer's block regions, compute the layout digest of this worker's keys
        (reported to the agent) and register the cache memory with the backend.

        Args:
            kv_caches: vLLM's ``{layer_name: tensor or tuple of tensors}`` paged caches.
            model_facts: what vLLM's configuration says about the model and its KV, hashed
                into the layout digest with the caches' own layout; ``None`` = nothing known.
            layer_ids: the model's index of each layer of ``kv_caches`` (a pipeline stage's
                are not 0-based); ``None``: 0, 1, ... in order.

        Raises:
            ValueError: the cache layout cannot be described (see ``KVLayout``).
            BackendError: the backend refused to register the memory.
        """
        kv = KVLayout.from_kv_caches(kv_caches, self._num_blocks_hint)
        if self.shares is not None:
            try:
                share_layers(kv_caches, kv.num_blocks, self.shares, self.shares.first_share)
            except ValueError as exc:  # no KV-head dimension to cut the caches along
                self._per_rank(str(exc))
        self._plan_ranges(kv_caches, kv, layer_ids)
        if self.config.checksum and kv.device.type != "cpu":
            raise ValueError(
                f"kv_connector_extra_config.checksum needs the KV caches in host memory, they "
                f"are on {kv.device}: turn checksum off")
        facts = describe_layout(
            kv_caches, kv.num_blocks, model=self.model, facts=model_facts or ModelFacts(),
            block_size=self.config.block_size, chunk_size=self.config.chunk_size,
            checksum=CHECKSUM_NAME if self.config.checksum else "",
            hash_algo=self.config.hash_algo,
            groups=" | ".join(self._describe_groups(kv)) if self.hybrid else "",
            shares=self.shares, kv_share=self._kv_share, pp_split=self._pp_split,
            total_layers=self._total_layers, **self._sizes)
        digest = facts.digest
        for addr, size in kv.spans:
            self.backend.register_buffer(addr, size)
        biggest = max(r.block_len for layer in kv.layers for r in layer.regions)
        # Destination for bytes of blocks vLLM already holds in its prefix cache: a chunk is
        # fetched whole, but those blocks may be shared with running requests.
        self._scratch = torch.empty(biggest, dtype=torch.uint8, device=kv.device)
        self.backend.register_buffer(self._scratch.data_ptr(), biggest)
        if self.config.checksum:
            self._enable_checksum(kv, self._scratch.data_ptr())
        # Settings objects of older callers may not name it: the default (None) then.
        attach_staging([self._loads.calls, self._saves.calls], self.backend, kv.device.type,
                       getattr(self.config, "staging_buffer_bytes", None),
                       self.blocks_per_chunk * kv.block_bytes + CHECKSUM_BYTES)
        self._device = device_sync_for(kv.device)
        shards = self._shard_layers(kv_caches, kv)
        # Bytes of one block of one value: the rank's whole block, or one head share's (of
        # every stored layer range: they are the same layers' worth on average).
        self._value_block_bytes = sum(layer.block_bytes for layer in shards[0][1])
        self._layer_block_bytes = shards[0][1][0].block_bytes
        if self.ranges is not None:
            self._value_block_bytes = (self._layer_block_bytes * sum(self.ranges.partition)
                                       // self.ranges.store_size)
        self._planners = [
            TransferPlanner(
                layers, shard_prefix(self.model, digest, lay),
                block_size=self.config.block_size, chunk_size=self.config.chunk_size,
                layerwise=self.config.use_layerwise, scratch=self._scratch.data_ptr())
            for lay, layers in shards]
        self._planner = self._planners[0]
        self._lookup_prefixes = [shard_prefix(self.model, digest, lay)
                                 for lay in self._lookup_layouts]
        if self.hybrid:
            assert self.groups is not None
            self._group_planners = [
                TransferPlanner(
                    [layers[kv.layer_index(n)] for n in g.layer_names],
                    shard_prefix(self.model, digest, replace(lay, group=g.index)),
                    block_size=self.config.block_size, chunk_size=self.config.chunk_size,
                    layerwise=False, scratch=self._scratch.data_ptr(), group=g)
                for g in self.groups for lay, layers in shards]
            self._group_prefixes = [
                [shard_prefix(self.model, digest, replace(lay, group=g.index))
                 for lay in self._lookup_layouts] for g in self.groups]
        self.layout_facts, self._digest = facts, digest
        self.kv = kv
        self.reporter.layout(digest, facts.as_dict())
        logger.info(
            "kvpool worker %s/%s: layout digest %s, %d layers, %d blocks, %d bytes/block, "
            "%d memory spans (%s)", self.model, self.layout, digest, len(kv.layers),
            kv.num_blocks, kv.block_bytes, len(kv.spans), facts,
        )

    def _per_rank(self, why: str) -> None:
        """Store values per rank after all (``why``: ``LayoutFacts.kv_share``)."""
        logger.warning("kvpool worker %s: values per TP rank, not per KV-head share: %s",
                       self.model, why)
        self.shares, self._kv_share = None, why
        self.layout, self._sizes["tp_size"] = self._rank_layout, self._rank_tp_size
        self._lookup_layouts = lookup_layouts(self.layout, **self._sizes)

    def _plan_ranges(self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
                     kv: KVLayout, layer_ids: Sequence[int] | None) -> None:
        """Decide the stored layer ranges this stage holds (``_stages``), or why it keeps
        per-stage values (``LayoutFacts.pp_split``)."""
        if self._pp_partition is None:
            return
        ids = list(layer_ids) if layer_ids is not None else list(range(len(kv.layers)))
        signatures = layer_signatures(kv_caches, kv.num_blocks, self.shares)
        ranges = plan_ranges(
            ids, self._total_layers if self._total_layers is not None else len(ids),
            self._pp_partition, uniform=len(set(signatures)) == 1,
            groups=len(self.groups) if self.groups is not None else 1)
        if isinstance(ranges, str):
            logger.warning("kvpool worker %s: values per pipeline stage, not per layer "
                           "range: %s", self.model, ranges)
            self._pp_split = ranges
            return
        self.ranges, self._pp_split = ranges, ranges.describe()
        self.layout = replace(self.layout, pp_rank=ranges.first)
        self._sizes["pp_size"] = ranges.store_size
        self._lookup_layouts = lookup_layouts(self.layout, **self._sizes)

    def _shard_layers(self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
                      kv: KVLayout) -> list[tuple[ParallelLayout, list[LayerLayout]]]:
        """Each shard this worker writes and reads, with the layers (regions) of its values:
        its one rank's whole caches, or one entry per KV-head share it holds, each cut into
        the stored layer ranges the stage holds."""
        if self.shares is None:
            by_share = [(self.layout, kv.layers)]
        else:
            by_share = [(replace(self.layout, tp_rank=s),
                         share_layers(kv_caches, kv.num_blocks, self.shares, s))
                        for s in self.shares.shares]
        if self.ranges is None:
            return by_share
        return [(replace(lay, pp_rank=r), layers[cut])
                for lay, layers in by_share for r, cut in self.ranges.local_slices()]

    @property
    def shard_layouts(self) -> list[ParallelLayout]:
        """The shards whose values this worker writes: its rank, or each KV-head share and
        stored layer range it holds (``operations.KeyScope``: a flush of this engine removes
        them all)."""
        tps = [self.layout.tp_rank] if self.shares is None else list(self.shares.shares)
        pps = [self.layout.pp_rank] if self.ranges is None else list(self.ranges.held)
        return [replace(self.layout, tp_rank=t, pp_rank=p) for t in tps for p in pps]

    @property
    def own_shards(self) -> list[str]:
        """``shard_layouts`` as strings (``tp0.pcp0.dcp0.pp0.g0``)."""
        return [str(x) for x in self.shard_layouts]

    def _enable_checksum(self, kv: KVLayout, scratch: int) -> None:
        """Register the integrity check's host buffers (``_checksum``) and hand them to the
        load and save threads."""
        load_slots, save_slots = DigestSlots(_DIGEST_SLOTS), DigestSlots(_DIGEST_SLOTS)
        staging_bytes = self.blocks_per_chunk * kv.block_bytes
        staging = torch.empty(staging_bytes, dtype=torch.uint8)
        self._checksum_buffers = (load_slots, save_slots, staging)
        for addr, size in ((load_slots.addr, load_slots.nbytes),
                           (save_slots.addr, save_slots.nbytes),
                           (staging.data_ptr(), staging_bytes)):
            self.backend.register_buffer(addr, size)
        self._loads.checksum = ChecksumBuffers(load_slots, staging.data_ptr(), staging_bytes,
                                               scratch)
        self._saves.checksum = save_slots

    def _describe_groups(self, kv: KVLayout) -> list[str]:
        """Each group as the layout digest and the console show it: ``KVGroup.describe``,
        the group's KV bytes per token on this worker (``16384B/tok``; a Mamba group's bytes
        of one state, ``B/state``) and its layers' indices
        (``L0-2,4``): a group's values are its layers' KV, so engines that group the same
        layers otherwise (another vLLM) never share."""
        out = []
        for g in self.groups or ():
            idx = sorted(kv.layer_index(n) for n in g.layer_names)
            per_block = sum(kv.layers[i].block_bytes for i in idx)
            size = (f"{per_block}B/state" if g.kind == "mamba"
                    else f"{per_block // g.block_size}B/tok")
            out.append(f"{g.describe()} {size} L{_ranges(idx)}")
        return out

    @property
    def hybrid(self) -> bool:
        """Whether the engine runs several KV-cache groups (or one that is not full
        attention): planned per group (see the module docstring)."""
        return self.groups is not None and (
            len(self.groups) > 1 or self.groups[0].kind != "full")

    @property
    def layout_digest(self) -> str:
        """The layout digest in this worker's keys.

        Raises:
            RuntimeError: ``register_kv_caches`` was not called yet.
        """
        if not self._digest:
            raise RuntimeError("register_kv_caches must be called before the layout is known")
        return self._digest

    def _require_kv(self) -> tuple[KVLayout, TransferPlanner]:
        if self.kv is None or self._planner is None:
            raise RuntimeError("register_kv_caches must be called before transfers")
        return self.kv, self._planner

    def lookup_chunks(self, chunk_hashes: list[str]) -> int:
        """Number of leading chunks whose keys exist for every rank of the parallel layout
        (and every layer, in layer-wise mode), under this worker's layout digest.

        Raises:
            RuntimeError: ``register_kv_caches`` was not called.
            BackendError: the store failed to answer for some key (never reported as a miss).
        """
        if not chunk_hashes:
            return 0
        kv = self._require_kv()[0]
        if self.hybrid:
            return self._lookup_groups(chunk_hashes)
        keys = self._lookup_keys(kv, chunk_hashes)
        hits, code = leading_hits(self.backend.batch_exists(keys), len(keys) // len(chunk_hashes))
        if code is not None:
            raise BackendError(
                f"lookup failed: batch_exists returned {code} ({error_name(code)})", code)
        return hits

    def rank_keys(self, chunk_hashes: Sequence[str]) -> list[str]:
        """Every rank's keys of ``chunk_hashes`` in this layout (and every layer, layer-wise):
        the keys ``lookup_chunks`` asks for, chunk-major (``kvpool_connector.pins``).

        Raises:
            RuntimeError: ``register_kv_caches`` was not called.
            ValueError: a hybrid model (several KV-cache groups: not pinned).
        """
        kv = self._require_kv()[0]
        if self.hybrid:
            raise ValueError("pins of a model with several KV-cache groups are not supported")
        return self._lookup_keys(kv, list(chunk_hashes))

    def _lookup_keys(self, kv: KVLayout, chunk_hashes: list[str]) -> list[str]:
        """Every shard's keys of ``chunk_hashes`` (every layer of it, layer-wise), chunk-major:
        a stored layer range has its partition's layers, another stage as many as this one."""
        if not self.config.use_layerwise:
            return chunk_keys(self._lookup_prefixes, chunk_hashes)
        if self.ranges is None:
            return chunk_keys(self._lookup_prefixes, chunk_hashes, range(len(kv.layers)))
        partition = self.ranges.partition
        per_shard = [(chunk_keys([p], chunk_hashes, range(partition[lay.pp_rank])),
                      partition[lay.pp_rank])
                     for p, lay in zip(self._lookup_prefixes, self._lookup_layouts, strict=True)]
        return [k for i in range(len(chunk_hashes))
                for keys, n in per_shard for k in keys[i * n:(i + 1) * n]]

    @property
    def key_bytes(self) -> int:
        """Bytes of one key's value on this rank (a whole chunk of its rank or KV-head share,
        or one layer of it layer-wise); other ranks' and shares' values of one layout are the
        same size (stored layer ranges: the mean over the ranges)."""
        kv = self._require_kv()[0]
        chunk = self.blocks_per_chunk * self._value_block_bytes
        if not self.config.use_layerwise:
            return chunk
        if self.ranges is not None:  # one layer of a range; every layer's is the same size
            return self.blocks_per_chunk * self._layer_block_bytes
        return chunk // len(kv.layers)

    def _lookup_groups(self, chunk_hashes: list[str]) -> int:
        """``lookup_chunks`` of a hybrid model: one ``batch_exists`` over every group's keys,
        then the longest prefix every group can serve (``_groups.hybrid_hit``)."""
        assert self.groups is not None
        keys = [k for prefixes in self._group_prefixes
                for k in chunk_keys(prefixes, chunk_hashes)]
        results = self.backend.batch_exists(keys)
        bad = min(results, default=0)
        if bad < 0:
            raise BackendError(
                f"lookup failed: batch_exists returned {bad} ({error_name(bad)})", bad)
        n, shards = len(chunk_hashes), len(self._lookup_layouts)
        present = []
        for g in range(len(self.groups)):
            row = results[g * n * shards:(g + 1) * n * shards]
            present.append([all(r == 1 for r in row[c * shards:(c + 1) * shards])
                            for c in range(n)])
        return hybrid_hit(self.groups, present, self.blocks_per_chunk)

    @property
    def chunk_pool_bytes(self) -> int:
        """Bytes one chunk takes in the pool, every rank's keys of it; 0 for a hybrid model
        (its groups' values differ in size)."""
        kv = self._require_kv()[0]
        if self.hybrid:
            return 0
        return len(self._lookup_keys(kv, ["0" * 32])) * self.key_bytes

    def _evict(self, chunk_hashes: list[str], keep: list[str]) -> None:
        """Remove every rank's keys (every group's, hybrid) of ``chunk_hashes`` but pinned
        ones before this step's saves, and drop the waiting removals of ``keep``'s
        (``SaveQueue.remove``)."""
        self._saves.remove(self._all_keys(chunk_hashes), keep=self._all_keys(keep),
                           pinned=self.pinned_keys)

    def _all_keys(self, chunk_hashes: list[str]) -> list[str]:
        if not chunk_hashes:
            return []
        kv = self._require_kv()[0]
        if self.hybrid:
            return [k for prefixes in self._group_prefixes
                    for k in chunk_keys(prefixes, chunk_hashes)]
        return self._lookup_keys(kv, chunk_hashes)

    # ------------------------------------------------------------------ loads

    def start_load_kv(self, metadata: KVPoolConnectorMetadata) -> None:
        """Begin this step's loads (and remember the step's metadata for the layer hooks).

        Synchronous mode: returns after every load finished (failures are recorded for
        ``get_block_ids_with_load_errors``). Layer-wise mode: loads run per layer in the
        background, ``wait_for_layer_load`` waits. ``load_async``: loads run in the
        background and finish through ``get_finished``.

        Raises:
            RuntimeError: ``register_kv_caches`` was not called.
        """
        kv = self._require_kv()[0]
        self._meta = metadata
        self._step_saves = None
        self._loads.settle_stale()
        if metadata.preempted:
            self._settle_preempted(metadata.preempted)
        if (metadata.evict or metadata.keep) and self.evicts:
            self._evict(metadata.evict, metadata.keep)
        plans = []
        for req in metadata.requests:
            try:
                plan = self._plan_load(req)
            except (ValueError, IndexError) as exc:
                # IndexError: a block id outside the registered caches (LayerLayout.addr);
                # like bad metadata it fails this request, never vLLM's worker thread.
                self._fail_request_blocks(req, str(exc))
                continue
            if plan is not None:
                plans.append(plan)
        self._loads.start(plans, self._device, load_async=self.config.load_async,
                          layerwise=kv if self.config.use_layerwise else None)

    def _plan_load(self, req: ReqMeta) -> LoadPlan | None:
        """The one planner's load, or every group's and share's load in one plan (hybrid models,
        several head shares), in chunk order."""
        planners = self._group_planners if self.hybrid else self._planners
        if len(planners) == 1:
            return planners[0].load(req)
        parts = [p for p in (gp.load(req) for gp in planners) if p is not None]
        if not parts:
            return None
        return LoadPlan(req, min(p.first_chunk for p in parts),
                        sorted((t for p in parts for t in p.transfers), key=lambda t: t.chunk))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer ``layer_name``'s blocks of this step are loaded (layer-wise mode;
        returns at once otherwise), at most ``layerwise_timeout_ms``. A timeout never raises:
        the step's load blocks are reported by ``get_block_ids_with_load_errors`` (vLLM
        recomputes them) and the late loader is waited for before the next step's forward
        pass (``LoadRunner.wait_for_layer``)."""
        self._loads.wait_for_layer(layer_name)

    # ------------------------------------------------------------------ saves

    def _plan_saves(self, metadata: KVPoolConnectorMetadata) -> list[_SavePlan]:
        out: list[_SavePlan] = []
        for req in metadata.requests:
            if not req.has_save:
                continue
            with self._lock:
                self._saving_reqs.add(req.req_id)
            try:
                rows = self._plan_save(req)
            except (ValueError, IndexError) as exc:  # IndexError: see start_load_kv
                logger.error("kvpool save skipped: %s", exc)
                self.reporter.error("save", "BAD_METADATA", str(exc), req_id=req.req_id)
                continue
            if rows:
                out.append((req, rows))
        return out

    def _plan_save(self, req: ReqMeta) -> list[list[KeyTransfer]]:
        """Per chunk of the save range this worker writes (its stripe), the transfers of
        every group and head share; then one row per Mamba state vLLM handed over this step."""
        self._require_kv()
        planners = self._group_planners if self.hybrid else self._planners
        if len(planners) == 1:
            return planners[0].save(req, self.stripe)
        chunked = [p for p in planners if p.group is None or p.group.kind != "mamba"]
        per_group = [p.save(req, self.stripe) for p in chunked]
        rows = [[t for g in per_group for t in g[i]] for i in range(len(per_group[0]))
                ] if per_group else []
        return rows + [row for p in planners if p.group is not None and p.group.kind == "mamba"
                       for row in p.save(req, self.stripe)]

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None,
                      **kwargs: Any) -> None:
        """Layer-wise mode: save layer ``layer_name``'s chunks scheduled for this step, after
        the device finished writing them. No-op in whole-chunk mode.

        ``kv_layer`` and ``attn_metadata`` are vLLM's arguments; the worker reads the bytes from
        the registered caches, so they are not needed.
        """
        if not self.config.use_layerwise or self._meta is None:
            return
        kv = self._require_kv()[0]
        idx = kv.layer_index(layer_name)
        if self._step_saves is None:
            self._step_saves = self._plan_saves(self._meta)
        if not self._step_saves:
            return
        per_req = [(req, [t for row in rows for t in row if t.layer == idx])
                   for req, rows in self._step_saves]
        self._saves.submit(per_req, self._device, layer=idx, n_layers=len(kv.layers))

    def wait_for_save(self, metadata: KVPoolConnectorMetadata | None = None) -> None:
        """Submit this step's whole-chunk saves (after the forward pass); returns without
        waiting for the transfer. In layer-wise mode the layers were already submitted."""
        meta = metadata or self._meta
        if meta is None:
            return
        if self.config.use_layerwise:
            if self._step_saves is None:
                # No save_kv_layer call this step: still track the requests so the
                # scheduler's delayed frees are released through get_finished.
                self._step_saves = self._plan_saves(meta)
            return
        plans = self._plan_saves(meta)
        fut = None
        if plans:
            fut = self._saves.submit(
                [(req, [t for row in rows for t in row]) for req, rows in plans], self._device)
        jobs = [req.save_job for req in meta.requests if req.save_job is not None]
        if jobs:
            with self._lock:
                self._save_jobs.append((fut, jobs))

    # ------------------------------------------------------------------ completion

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)`` as vLLM's ``KVConnectorBase_V1`` expects.

        ``finished_sending``: requests in ``finished_req_ids`` (now or in an earlier call) that
        had saves scheduled and whose saves are all done. ``finished_recving``: requests whose
        ``load_async`` load ended (successfully or not; failures are in
        ``get_block_ids_with_load_errors``).
        """
        with self._lock:
            self._finished_reqs |= finished_req_ids & self._saving_reqs
            finished = set(self._finished_reqs)
        sending = finished - self._saves.pending(finished)
        with self._lock:
            self._finished_reqs -= sending
            self._saving_reqs -= sending
            done = sending | (finished_req_ids - self._saving_reqs)
        self._saves.forget(done)
        recving = self._loads.take_finished()
        return (sending or None), (recving or None)

    def build_connector_worker_meta(self) -> LoadOutcomes | None:
        """This step's load outcomes for the scheduler (``LoadOutcomes``); ``None`` when no
        load ended since the last call."""
        outcomes = self._loads.take_outcomes()
        with self._lock:
            ended = [jobs for fut, jobs in self._save_jobs if fut is None or fut.done()]
            self._save_jobs = [(f, j) for f, j in self._save_jobs
                               if not (f is None or f.done())]
        done = {job: 1 for jobs in ended for job in jobs}
        return LoadOutcomes(outcomes, done) if outcomes or done else None

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed since the last call (hybrid models, where a failure is
        reported per request: vLLM's ``failed_recving``)."""
        return self._loads.take_failed_requests()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed or was partial since the last call (then cleared)."""
        return self._loads.take_failed_blocks()

    def _fail_request_blocks(self, req: ReqMeta, why: str) -> None:
        if req.load is None:
            return
        blocks = load_block_ids(req, self.config.block_size)
        if self.hybrid:
            self._loads.fail_request(req.req_id)
        else:
            self._loads.fail_blocks(blocks)
        self._loads.record_outcome(req.req_id, req.load.num_tokens_to_load, 0,
                                   finished=self.config.load_async)
        logger.error("kvpool load of request %s not possible: %s", req.req_id, why)
        self.reporter.transfer_finished(req.req_id, "load", ok=False, error_name="BAD_METADATA",
                                        failed_blocks=len(blocks), after_hit=True)

    def handle_preemptions(self, preempted: set[str]) -> None:
        """vLLM's ``handle_preemptions`` hook (runs every step before the step zeroes or reuses
        freed blocks): wait for a timed-out layer-wise loader of the previous step and for
        transfers touching blocks of the ``preempted`` requests."""
        self._loads.settle_stale()
        if preempted:
            self._settle_preempted(preempted)

    def _settle_preempted(self, preempted: set[str]) -> None:
        """Wait for transfers touching blocks of preempted requests: vLLM may hand those
        blocks to other requests in this very step."""
        self._saves.settle(preempted)
        for f in self._loads.futures_of(preempted):
            f.result()

    # ------------------------------------------------------------------ KV events

    def enable_kv_events(self) -> None:
        """Record every chunk a save writes, for ``take_written_chunks`` (vLLM's KV events,
        ``kvpool_connector._events``). Off unless called: recording costs a set per save."""
        with self._lock:
            if self._saves.written is None:
                self._saves.written = deque(maxlen=_WRITTEN_CHUNKS_KEPT)

    def take_written_chunks(self) -> list[tuple[str, int, int]]:
        """``(request id, chunk index, KV-cache group)`` of every chunk whose value a save of
        this worker wrote to the pool (put result 0) since the last call, the last
        ``_WRITTEN_CHUNKS_KEPT`` at most; empty when not recorded. A request reported in
        ``get_finished``'s ``finished_sending`` has all its chunks in this or an earlier
        call."""
        return self._saves.take_written()

    @property
    def lookup_shards(self) -> int:
        """Shards that must hold a chunk before a lookup counts it a hit (every rank of the
        split parallel dimensions; ``lookup_chunks``)."""
        return len(self._lookup_layouts)

    def drain_saves(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted save has finished; True if all did within
        ``timeout_s`` seconds (``None``: no limit)."""
        return self._saves.drain(timeout_s)

    @property
    def inflight_saves(self) -> int:
        """Save batches submitted and not finished yet."""
        return self._saves.inflight

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Finish in-flight saves (up to ``timeout_s`` seconds) and stop the transfer threads.
        Idempotent. The backend stays open (its owner closes it)."""
        if self._closed:
            return
        self._closed = True
        self._loads.shutdown()
        if not self.drain_saves(timeout_s):
            logger.warning("kvpool worker shutdown: saves still running after %.0f s", timeout_s)
        self._saves.shutdown()
