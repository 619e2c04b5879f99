"""``KVPoolWorker``: the worker-side data path of the connector (vLLM's worker role).

Per engine step vLLM calls, in this order: ``start_load_kv`` (before the forward pass),
``wait_for_layer_load`` / ``save_kv_layer`` around each attention layer (layer-wise mode),
``wait_for_save`` (after the forward pass), ``get_finished`` and
``get_block_ids_with_load_errors``. The worker turns the scheduler's ``KVPoolConnectorMetadata``
into backend batch calls that move whole vLLM blocks by address (zero copy from/into the
registered KV caches):

* a chunk ``i`` of a request is blocks ``block_ids[i * bpc:(i + 1) * bpc]`` (``bpc`` =
  ``chunk_size // block_size``) and one key ``PoolKey(model, layout, chunk_hashes[i])`` whose
  value is those blocks' bytes over all layers (layer, region, block order); in layer-wise mode
  one key per (chunk, layer), ``PoolKey.layer(i)``;
* saves run on a background thread after the device finished writing the blocks; a request
  whose save hit ``NO_AVAILABLE_HANDLE`` (pool full) skips its remaining saves, later requests
  try again;
* loads run inline before the forward pass, per layer on a background thread (layer-wise),
  or fully in the background with completion reported by ``get_finished`` (``load_async``);
* every block whose load failed or returned fewer bytes than its size is reported by
  ``get_block_ids_with_load_errors`` so vLLM (``kv_load_failure_policy="recompute"``)
  recomputes it; bytes of such a block are never trusted.

Contract with the scheduler side: saves are asynchronous, so ``request_finished`` must delay
freeing (return ``True``) for every request that had a save scheduled; the worker reports such a
request in ``get_finished``'s ``finished_sending`` once it is in ``finished_req_ids`` and all its
saves are done. Requests listed in ``metadata.preempted`` have their in-flight transfers waited
for before the step's forward pass may reuse their blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Protocol

import torch

from kvpool_agent.reporter import NullReporter, Reporter
from kvpool_agent.vocabulary import error_name
from kvpool_connector.backends.base import Backend, BackendError
from kvpool_connector.device import DeviceSync, device_sync_for
from kvpool_connector.keys import ParallelLayout, PoolKey, normalize_model_name, shard_prefix
from kvpool_connector.layout import KVLayout, LayerLayout, ranges_for_blocks
from kvpool_connector.metadata import KVPoolConnectorMetadata, ReqMeta

__all__ = ["KVPoolWorker", "LayerLoadTimeout", "WorkerCounters", "WorkerSettings"]

logger = logging.getLogger(__name__)

_NO_HANDLE = -200
_ALREADY_EXISTS = -705


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


class LayerLoadTimeout(TimeoutError):
    """``wait_for_layer_load`` waited longer than ``layerwise_timeout_ms``. The step's loaded
    blocks are already reported as failed (recomputed) when this is raised."""


@dataclass
class WorkerCounters:
    """Running totals of this worker (bytes, keys, blocks), for tests, benchmarks and the agent."""

    saved_bytes: int = 0
    saved_keys: int = 0
    save_skipped_keys: int = 0
    save_failed_keys: int = 0
    loaded_bytes: int = 0
    loaded_keys: int = 0
    load_failed_keys: int = 0
    load_failed_blocks: int = 0
    layer_timeouts: int = 0


@dataclass
class _Unit:
    """One key to move: its address ranges and the vLLM block ids whose bytes it carries."""

    req_id: str
    key: str
    chunk: int
    addrs: list[int]
    sizes: list[int]
    block_ids: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


@dataclass
class _LayerSaveAcc:
    """A request's layer-wise save of one step so far: bytes stored, chunks that failed."""

    nbytes: int = 0
    bad_chunks: set[int] = field(default_factory=set)
    error: str | None = None


_SavePlan = tuple[ReqMeta, list[list[_Unit]]]
"""A request and, per chunk to save, its units."""


@dataclass
class _ReqLoad:
    req: ReqMeta
    first_chunk: int
    units: list[_Unit] = field(default_factory=list)
    failed_chunks: set[int] = field(default_factory=set)
    error: str | None = None
    nbytes: int = 0


@dataclass
class _LayerwiseLoad:
    """A step's layer-wise load: per layer an event set when its keys have landed."""

    per_layer: list[list[_Unit]]
    reqs: dict[str, _ReqLoad]
    done: list[threading.Event]
    cancelled: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False
    future: Future[None] | None = None


def _ranks(size: int, own: int) -> range:
    """Ranks a lookup must find: all of a parallel dimension, or this worker's own rank when
    the dimension is not split (size 1)."""
    return range(size) if size > 1 else range(own, own + 1)


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
    ) -> None:
        if config.block_size <= 0 or config.chunk_size % config.block_size:
            raise ValueError(
                f"chunk_size ({config.chunk_size}) must be a positive multiple of block_size "
                f"({config.block_size})"
            )
        self.config = config
        self.layout = layout
        self.model = normalize_model_name(model)
        self.backend = backend
        self.reporter = reporter if reporter is not None else NullReporter()
        self.blocks_per_chunk = config.chunk_size // config.block_size
        self._rank_layouts = [
            ParallelLayout(tp, pcp, dcp, pp, layout.group)
            for tp, pcp, dcp, pp in product(
                _ranks(tp_size, layout.tp_rank), _ranks(pcp_size, layout.pcp_rank),
                _ranks(dcp_size, layout.dcp_rank), _ranks(pp_size, layout.pp_rank),
            )
        ]
        self._num_blocks_hint = num_blocks
        self._timeout_s = config.layerwise_timeout_ms / 1e3
        self.kv: KVLayout | None = None
        self.counters = WorkerCounters()
        self._device: DeviceSync = DeviceSync()
        self._scratch: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self._save_futures: list[Future[None]] = []
        self._meta: KVPoolConnectorMetadata | None = None
        self._layerwise: _LayerwiseLoad | None = None
        self._step_saves: list[_SavePlan] | None = None
        self._failed_blocks: set[int] = set()
        self._finished_recving: set[str] = set()
        self._async_loads: dict[str, Future[None]] = {}
        self._pending_saves: dict[str, int] = {}
        self._saving_reqs: set[str] = set()
        self._finished_reqs: set[str] = set()
        self._pool_full_reqs: set[str] = set()
        # Save thread only: per request, layer-wise bytes/failed keys/error of this step.
        self._layer_save_acc: dict[str, _LayerSaveAcc] = {}
        self._closed = False

    # ------------------------------------------------------------------ registration

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
    ) -> None:
        """Record each layer's block regions and register the cache memory with the backend.

        Args:
            kv_caches: vLLM's ``{layer_name: tensor or tuple of tensors}`` paged caches.

        Raises:
            ValueError: the cache layout cannot be described (see ``KVLayout``).
            BackendError: the backend refused to register the memory.
        """
        kv = KVLayout.from_kv_caches(kv_caches, self._num_blocks_hint)
        for addr, size in kv.spans:
            self.backend.register_buffer(addr, size)
        biggest = max(r.block_len for layer in kv.layers for r in layer.regions)
        # Destination for bytes of blocks vLLM already holds in its prefix cache: a chunk is
        # fetched whole, but those blocks may be shared with running requests.
        self._scratch = torch.empty(biggest, dtype=torch.uint8, device=kv.device)
        self.backend.register_buffer(self._scratch.data_ptr(), biggest)
        self._device = device_sync_for(kv.device)
        self.kv = kv
        logger.info(
            "kvpool worker %s/%s: %d layers, %d blocks, %d bytes/block, %d memory spans",
            self.model, self.layout, len(kv.layers), kv.num_blocks, kv.block_bytes, len(kv.spans),
        )

    def _require_kv(self) -> KVLayout:
        if self.kv is None:
            raise RuntimeError("register_kv_caches must be called before transfers")
        return self.kv

    # ------------------------------------------------------------------ keys

    def _chunk_key(self, chunk_hash: str, layout: ParallelLayout | None = None) -> PoolKey:
        return PoolKey(self.model, layout or self.layout, chunk_hash)

    def _unit_keys(self, chunk_hash: str) -> list[str]:
        """Keys of one chunk of this shard: one, or one per layer in layer-wise mode."""
        key = self._chunk_key(chunk_hash)
        if self.config.use_layerwise:
            return [str(key.layer(layer.index)) for layer in self._require_kv().layers]
        return [str(key)]

    def lookup_chunks(self, chunk_hashes: list[str]) -> int:
        """Number of leading chunks whose keys exist for every rank of the parallel layout
        (and every layer, in layer-wise mode).

        Raises:
            BackendError: the store failed to answer for some key (never reported as a miss).
        """
        if not chunk_hashes:
            return 0
        layers = (
            [layer.index for layer in self._require_kv().layers]
            if self.config.use_layerwise else [None]
        )
        # Hot path (one scheduler lookup per request): plain string joins on prefixes built
        # once, the same strings str(PoolKey)/str(LayerPoolKey) give.
        prefixes = [shard_prefix(self.model, lay) for lay in self._rank_layouts]
        suffixes = ["" if i is None else f"@L{i}" for i in layers]
        keys = [p + h + sfx for h in chunk_hashes for p in prefixes for sfx in suffixes]
        results = self.backend.batch_exists(keys)
        per_chunk = len(self._rank_layouts) * len(layers)
        for n in range(len(chunk_hashes)):
            block = results[n * per_chunk : (n + 1) * per_chunk]
            bad = [r for r in block if r < 0]
            if bad:
                raise BackendError(f"lookup failed: batch_exists returned {bad[0]}", bad[0])
            if not all(r == 1 for r in block):
                return n
        return len(chunk_hashes)

    # ------------------------------------------------------------------ planning

    def _chunk_blocks(self, req: ReqMeta, chunk: int) -> list[int]:
        bpc = self.blocks_per_chunk
        blocks = req.block_ids[chunk * bpc : (chunk + 1) * bpc]
        if len(blocks) != bpc:
            raise ValueError(
                f"request {req.req_id}: chunk {chunk} needs blocks [{chunk * bpc}, "
                f"{(chunk + 1) * bpc}) but only {len(req.block_ids)} block ids were given"
            )
        return blocks

    def _units(
        self, req: ReqMeta, chunks: Iterable[int], skip_below_block: int = 0
    ) -> list[list[_Unit]]:
        """Per chunk, its units (one, or one per layer). Blocks at request positions below
        ``skip_below_block`` are routed to the scratch buffer (loads only)."""
        kv = self._require_kv()
        scratch = self._scratch.data_ptr() if self._scratch is not None else 0
        out: list[list[_Unit]] = []
        for chunk in chunks:
            blocks = self._chunk_blocks(req, chunk)
            first = chunk * self.blocks_per_chunk
            skip = frozenset(
                b for j, b in enumerate(blocks) if first + j < skip_below_block
            )
            kept = [b for b in blocks if b not in skip]
            h = req.chunk_hashes[chunk]
            groups: list[Sequence[LayerLayout]] = (
                [[layer] for layer in kv.layers] if self.config.use_layerwise else [kv.layers]
            )
            units = []
            for key, layers in zip(self._unit_keys(h), groups, strict=True):
                addrs, sizes = ranges_for_blocks(layers, blocks, skip, scratch)
                units.append(_Unit(req.req_id, key, chunk, addrs, sizes, kept))
            out.append(units)
        return out

    def _plan_load(self, req: ReqMeta) -> _ReqLoad | None:
        spec = req.load
        if spec is None or spec.num_tokens_to_load <= 0:
            return None
        cs = self.config.chunk_size
        first, last = spec.vllm_cached_tokens // cs, spec.kvpool_cached_tokens // cs
        plan = _ReqLoad(req=req, first_chunk=first)
        skip_below = spec.vllm_cached_tokens // self.config.block_size
        for units in self._units(req, range(first, last), skip_below):
            plan.units.extend(units)
        return plan

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
        kv = self._require_kv()
        self._meta = metadata
        self._step_saves = None
        stale = self._layerwise
        self._layerwise = None
        if stale is not None and stale.future is not None and not stale.future.done():
            # A timed-out layer-wise load may still be writing; let it land before this
            # step's forward pass reads or recomputes those blocks.
            try:
                stale.future.result(timeout=self._timeout_s)
            except TimeoutError:
                logger.error("kvpool: a timed-out layer-wise load is still running")
        if metadata.preempted:
            self._settle_preempted(metadata.preempted)
        plans: dict[str, _ReqLoad] = {}
        for req in metadata.requests:
            try:
                plan = self._plan_load(req)
            except ValueError as exc:
                self._fail_request_blocks(req, str(exc))
                continue
            if plan is not None:
                plans[req.req_id] = plan
        if not plans:
            return
        for plan in plans.values():
            self.reporter.transfer_started(
                plan.req.req_id, "load",
                len({u.chunk for u in plan.units}) * self.blocks_per_chunk,
                sum(u.nbytes for u in plan.units),
                layers_total=len(kv.layers) if self.config.use_layerwise else 0,
                lease_expires_ms=plan.req.load.lease_expires_ms if plan.req.load else None,
            )
        # Loads overwrite blocks only after the compute stream's earlier work on them (e.g.
        # vLLM zeroing newly allocated blocks) has finished.
        marker = self._device.record()
        if self.config.load_async:
            fut = self._loader.submit(self._run_async_load, plans, marker)
            with self._lock:
                for rid in plans:
                    self._async_loads[rid] = fut
        elif self.config.use_layerwise:
            per_layer: list[list[_Unit]] = [[] for _ in kv.layers]
            for plan in plans.values():
                for i, unit in enumerate(plan.units):
                    per_layer[i % len(kv.layers)].append(unit)
            job = _LayerwiseLoad(
                per_layer=per_layer, reqs=plans, done=[threading.Event() for _ in kv.layers]
            )
            self._layerwise = job
            job.future = self._loader.submit(self._run_layerwise_load, job, marker)
        else:
            self._device.wait(marker)
            self._get(list(plans.values()), [u for p in plans.values() for u in p.units])
            self._finish_loads(plans.values())

    def _get(self, plans: Sequence[_ReqLoad], units: list[_Unit]) -> None:
        """One backend batch get; records per-chunk failures in the plans."""
        if not units:
            return
        by_req = {p.req.req_id: p for p in plans}
        try:
            results = self.backend.batch_get_into(
                [u.key for u in units], [u.addrs for u in units], [u.sizes for u in units]
            )
        except BackendError as exc:
            name = error_name(exc.code) if exc.code is not None else "BACKEND_ERROR"
            logger.error("kvpool load of %d keys failed: %s", len(units), exc)
            results = [exc.code if exc.code is not None else -1] * len(units)
            for p in plans:
                p.error = p.error or name
        for unit, res in zip(units, results, strict=True):
            plan = by_req[unit.req_id]
            if res == unit.nbytes:
                plan.nbytes += res
                with self._lock:
                    self.counters.loaded_keys += 1
                    self.counters.loaded_bytes += res
                continue
            # A short read is as bad as a missing key: the block holds stale bytes.
            plan.failed_chunks.add(unit.chunk)
            plan.error = plan.error or (error_name(res) if res < 0 else "PARTIAL_READ")
            with self._lock:
                self.counters.load_failed_keys += 1

    def _finish_loads(self, plans: Iterable[_ReqLoad], timed_out: bool = False) -> None:
        """Report each request's load and record its failed blocks."""
        cs = self.config.chunk_size
        for plan in plans:
            spec = plan.req.load
            assert spec is not None
            failed = {b for u in plan.units if u.chunk in plan.failed_chunks for b in u.block_ids}
            with self._lock:
                self._failed_blocks |= failed
                self.counters.load_failed_blocks += len(failed)
            ok_end = (
                min(plan.failed_chunks) if plan.failed_chunks else spec.kvpool_cached_tokens // cs
            )
            tokens = max(0, ok_end * cs - spec.vllm_cached_tokens)
            if tokens:
                self.reporter.loaded(plan.req.req_id, tokens)
            self.reporter.transfer_finished(
                plan.req.req_id, "load", ok=not failed and not timed_out, nbytes=plan.nbytes,
                error_name=("TIMEOUT" if timed_out else plan.error) if failed else None,
                failed_blocks=len(failed), after_hit=True, timed_out=timed_out,
            )
            if failed:
                logger.warning(
                    "kvpool load of request %s: %d blocks failed (%s); they will be recomputed",
                    plan.req.req_id, len(failed), "TIMEOUT" if timed_out else plan.error,
                )

    def _run_async_load(self, plans: dict[str, _ReqLoad], marker: Any) -> None:
        try:
            self._device.wait(marker)
            self._get(list(plans.values()), [u for p in plans.values() for u in p.units])
        except Exception as exc:  # never lose a request: fail its blocks instead
            logger.exception("kvpool async load crashed")
            for p in plans.values():
                p.failed_chunks.update(u.chunk for u in p.units)
                p.error = p.error or type(exc).__name__
        self._finish_loads(plans.values())
        with self._lock:
            for rid in plans:
                self._async_loads.pop(rid, None)
                self._finished_recving.add(rid)

    def _run_layerwise_load(self, job: _LayerwiseLoad, marker: Any) -> None:
        n_layers = len(job.per_layer)
        self._device.wait(marker)
        for i, units in enumerate(job.per_layer):
            if job.cancelled.is_set():
                break
            try:
                self._get(list(job.reqs.values()), units)
            except Exception as exc:  # fail this layer's blocks, keep the engine going
                logger.exception("kvpool layer-wise load crashed")
                for u in units:
                    job.reqs[u.req_id].failed_chunks.add(u.chunk)
                    job.reqs[u.req_id].error = type(exc).__name__
            for rid in job.reqs:
                self.reporter.transfer_progress(rid, "load", i + 1)
            job.done[i].set()
        if job.cancelled.is_set():
            for d in job.done:
                d.set()
            return
        if n_layers:
            self._finish_loads(job.reqs.values())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer ``layer_name``'s blocks of this step are loaded (layer-wise mode;
        returns at once otherwise).

        Raises:
            LayerLoadTimeout: not loaded within ``layerwise_timeout_ms``; the step's blocks
                are marked failed first, and later layers of the step do not wait again.
        """
        job = self._layerwise
        if job is None or job.timed_out:
            return
        idx = self._require_kv().layer_index(layer_name)
        if job.done[idx].wait(self._timeout_s):
            return
        job.timed_out = True
        job.cancelled.set()
        with self._lock:
            self.counters.layer_timeouts += 1
        for plan in job.reqs.values():
            plan.failed_chunks.update(u.chunk for u in plan.units)
        self._finish_loads(job.reqs.values(), timed_out=True)
        raise LayerLoadTimeout(
            f"layer-wise load of layer {layer_name!r} ({len(job.reqs)} requests) did not "
            f"finish within layerwise_timeout_ms={self.config.layerwise_timeout_ms}; its blocks "
            "are reported as load errors and will be recomputed (check the pool's health)"
        )

    # ------------------------------------------------------------------ saves

    def _plan_saves(self, metadata: KVPoolConnectorMetadata) -> list[_SavePlan]:
        out: list[_SavePlan] = []
        for req in metadata.requests:
            if req.save_to_chunk <= req.save_from_chunk:
                continue
            with self._lock:
                self._saving_reqs.add(req.req_id)
            try:
                units = self._units(req, range(req.save_from_chunk, req.save_to_chunk))
            except ValueError as exc:
                logger.error("kvpool save skipped: %s", exc)
                self.reporter.error("save", "BAD_METADATA", str(exc), req_id=req.req_id)
                continue
            out.append((req, units))
        return out

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None,
                      **kwargs: Any) -> None:
        """Layer-wise mode: save layer ``layer_name``'s chunks scheduled for this step, after
        the device finished writing them. No-op in whole-chunk mode.

        ``kv_layer`` and ``attn_metadata`` are vLLM's arguments; the worker reads the bytes from
        the registered caches, so they are not needed.
        """
        if not self.config.use_layerwise or self._meta is None:
            return
        idx = self._require_kv().layer_index(layer_name)
        if self._step_saves is None:
            self._step_saves = self._plan_saves(self._meta)
        plans = self._step_saves
        if not plans:
            return
        n_layers = len(self._require_kv().layers)
        per_req = [(req, [units[idx] for units in chunks]) for req, chunks in plans]
        self._submit_save(per_req, layer=idx, n_layers=n_layers)

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
        if plans:
            self._submit_save([(req, [u for units in chunks for u in units])
                               for req, chunks in plans])

    def _submit_save(
        self, per_req: list[tuple[ReqMeta, list[_Unit]]], layer: int | None = None,
        n_layers: int = 0,
    ) -> None:
        marker = self._device.record()
        with self._lock:
            for req, _ in per_req:
                self._pending_saves[req.req_id] = self._pending_saves.get(req.req_id, 0) + 1
        if layer in (None, 0):
            for req, units in per_req:
                chunks = len({u.chunk for u in units})
                self.reporter.transfer_started(
                    req.req_id, "save", chunks * self.blocks_per_chunk,
                    sum(u.nbytes for u in units) * (n_layers or 1), layers_total=n_layers,
                )
        fut = self._saver.submit(self._run_save, per_req, marker, layer, n_layers)
        with self._lock:
            self._save_futures = [f for f in self._save_futures if not f.done()]
            self._save_futures.append(fut)

    def _run_save(
        self, per_req: list[tuple[ReqMeta, list[_Unit]]], marker: Any, layer: int | None,
        n_layers: int,
    ) -> None:
        try:
            self._device.wait(marker)
            self._save(per_req, layer, n_layers)
        except Exception as exc:  # a failed save never reaches the engine: it is reported
            logger.exception("kvpool save crashed")
            for req, _ in per_req:
                self.reporter.transfer_finished(req.req_id, "save", ok=False,
                                                error_name=type(exc).__name__)
        finally:
            with self._lock:
                for req, _ in per_req:
                    left = self._pending_saves.get(req.req_id, 1) - 1
                    if left <= 0:
                        self._pending_saves.pop(req.req_id, None)
                    else:
                        self._pending_saves[req.req_id] = left

    def _save(
        self, per_req: list[tuple[ReqMeta, list[_Unit]]], layer: int | None, n_layers: int
    ) -> None:
        todo: list[_Unit] = []
        skipped: dict[str, int] = {}
        for req, units in per_req:
            if req.req_id in self._pool_full_reqs:
                skipped[req.req_id] = len(units)
                continue
            todo.extend(units)
        if todo:
            exists = self._exists_or_unknown([u.key for u in todo])
            todo = [u for u, e in zip(todo, exists, strict=True) if e != 1]
        results: dict[str, int] = {}
        if todo:
            try:
                codes = self.backend.batch_put_from(
                    [u.key for u in todo], [u.addrs for u in todo], [u.sizes for u in todo]
                )
            except BackendError as exc:
                logger.error("kvpool save of %d keys failed: %s", len(todo), exc)
                codes = [exc.code if exc.code is not None else -1] * len(todo)
            results = {u.key: c for u, c in zip(todo, codes, strict=True)}
        last_layer = layer is None or layer == n_layers - 1
        for req, units in per_req:
            rid = req.req_id
            if rid in skipped:
                self._count_skip(rid, skipped[rid], "NO_AVAILABLE_HANDLE", n_layers)
                continue
            nbytes, error, failed, full = 0, None, 0, 0
            bad_chunks: set[int] = set()
            for u in units:
                code = results.get(u.key, 0)
                if code in (0, _ALREADY_EXISTS):
                    if u.key in results and code == 0:
                        nbytes += u.nbytes
                    continue
                bad_chunks.add(u.chunk)
                if code == _NO_HANDLE:
                    full += 1
                else:
                    failed += 1
                    error = error or error_name(code)
            with self._lock:
                self.counters.saved_bytes += nbytes
                self.counters.saved_keys += sum(
                    1 for u in units if results.get(u.key) == 0)
                self.counters.save_failed_keys += failed
            if full:
                # Pool full: this request's later saves are skipped, other requests retry.
                with self._lock:
                    self._pool_full_reqs.add(rid)
                self._count_skip(rid, full, "NO_AVAILABLE_HANDLE", n_layers)
            if layer is not None:
                # Layer-wise: one finished event per request and step, summing its layers.
                acc = self._layer_save_acc.setdefault(rid, _LayerSaveAcc())
                acc.nbytes += nbytes
                acc.bad_chunks |= bad_chunks
                acc.error = acc.error or error
                nbytes, bad_chunks, error = acc.nbytes, acc.bad_chunks, acc.error
                if not full:
                    self.reporter.transfer_progress(rid, "save", layer + 1)
                if last_layer or full:
                    self._layer_save_acc.pop(rid, None)
            if last_layer or full:
                self.reporter.transfer_finished(
                    rid, "save", ok=not bad_chunks, nbytes=nbytes,
                    error_name="NO_AVAILABLE_HANDLE" if full else error,
                    failed_blocks=len(bad_chunks) * self.blocks_per_chunk,
                )

    def _exists_or_unknown(self, keys: list[str]) -> list[int]:
        """``batch_exists`` so already-stored chunks are not sent again; on a store error
        every key counts as unknown (the put decides)."""
        try:
            return self.backend.batch_exists(keys)
        except BackendError:
            return [0] * len(keys)

    def _count_skip(self, req_id: str, keys: int, reason: str, n_layers: int = 0) -> None:
        """Count ``keys`` skipped keys; the report is in blocks (a layer-wise key holds one
        layer of its blocks, so ``n_layers`` of them make whole blocks)."""
        with self._lock:
            self.counters.save_skipped_keys += keys
        blocks = keys * self.blocks_per_chunk
        self.reporter.save_skipped(req_id, blocks // n_layers if n_layers else blocks, reason)

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
            sending = {r for r in self._finished_reqs if r not in self._pending_saves}
            self._finished_reqs -= sending
            self._saving_reqs -= sending
            self._pool_full_reqs -= sending
            for r in finished_req_ids - self._saving_reqs:
                self._pool_full_reqs.discard(r)
            recving, self._finished_recving = self._finished_recving, set()
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed or was partial since the last call (then cleared)."""
        with self._lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def _fail_request_blocks(self, req: ReqMeta, why: str) -> None:
        spec = req.load
        if spec is None:
            return
        lo = spec.vllm_cached_tokens // self.config.block_size
        hi = -(-spec.kvpool_cached_tokens // self.config.block_size)
        blocks = set(req.block_ids[lo:hi])
        with self._lock:
            self._failed_blocks |= blocks
            self.counters.load_failed_blocks += len(blocks)
        logger.error("kvpool load of request %s not possible: %s", req.req_id, why)
        self.reporter.transfer_finished(req.req_id, "load", ok=False, error_name="BAD_METADATA",
                                        failed_blocks=len(blocks), after_hit=True)

    def handle_preemptions(self, preempted: set[str]) -> None:
        """vLLM's ``handle_preemptions`` hook (runs before the step zeroes or reuses freed
        blocks): wait for transfers touching blocks of the ``preempted`` requests."""
        if preempted:
            self._settle_preempted(preempted)

    def _settle_preempted(self, preempted: set[str]) -> None:
        """Wait for transfers touching blocks of preempted requests: vLLM may hand those
        blocks to other requests in this very step."""
        with self._lock:
            saving = any(r in self._pending_saves for r in preempted)
            loads = [f for r, f in self._async_loads.items() if r in preempted]
            futures = list(self._save_futures) if saving else []
        for f in [*futures, *loads]:
            f.result()

    def drain_saves(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted save has finished; True if all did within
        ``timeout_s`` seconds (``None``: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            futures = list(self._save_futures)
        for f in futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(timeout=left)
            except TimeoutError:
                return False
        return True

    @property
    def inflight_saves(self) -> int:
        """Save batches submitted and not finished yet."""
        with self._lock:
            return sum(1 for f in self._save_futures if not f.done())

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Finish in-flight saves (up to ``timeout_s`` seconds) and stop the transfer threads.
        Idempotent. The backend stays open (its owner closes it)."""
        if self._closed:
            return
        self._closed = True
        if self._layerwise is not None:
            self._layerwise.cancelled.set()
        if not self.drain_saves(timeout_s):
            logger.warning("kvpool worker shutdown: saves still running after %.0f s", timeout_s)
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._saver.shutdown(wait=False, cancel_futures=True)

