"""Running transfer plans against the backend: the worker's load and save threads.

``LoadRunner`` moves a step's ``LoadPlan``s into the KV caches: inline before the forward pass,
per layer on a background thread (layer-wise; ``wait_for_layer`` waits for one layer), or
wholly in the background (``load_async``, finished through ``take_finished``). Every block of
a chunk whose key failed or came back short is kept for ``take_failed_blocks`` (vLLM
recomputes it).

``SaveQueue`` stores chunks on a background thread once the device finished writing them:
keys the pool already holds are not sent again, and a request whose save hit
``NO_AVAILABLE_HANDLE`` (pool full) skips its remaining saves (later requests try again).

Both report every transfer to the agent and add to one ``WorkerCounters``. ``KVPoolWorker``
owns them and calls them from vLLM's hooks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvpool_agent.reporter import Reporter
from kvpool_agent.vocabulary import ErrorCode, error_name
from kvpool_connector._device import DeviceSync
from kvpool_connector._layout import KVLayout
from kvpool_connector._planning import LoadPlan, Transfer, by_layer, loaded_tokens
from kvpool_connector.backends.base import Backend, BackendError
from kvpool_connector.metadata import ReqMeta

__all__ = ["LayerLoadTimeout", "LoadRunner", "SaveQueue", "WorkerCounters"]

logger = logging.getLogger(__name__)

_STORED = (0, ErrorCode.OBJECT_ALREADY_EXISTS)
"""Per-key put results after which the key holds the chunk (another engine may have won)."""

_FULL = ErrorCode.NO_AVAILABLE_HANDLE


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
class _ReqLoad:
    """One request's load of this step: its plan and what happened to it so far."""

    plan: LoadPlan
    failed_chunks: set[int] = field(default_factory=set)
    error: str | None = None
    nbytes: int = 0


@dataclass
class _LayerwiseLoad:
    """A step's layer-wise load: per layer an event set when its keys have landed."""

    kv: KVLayout
    per_layer: list[list[Transfer]]
    reqs: dict[str, _ReqLoad]
    done: list[threading.Event]
    cancelled: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False
    future: Future[None] | None = None


class LoadRunner:
    """A worker's loads (see the module docstring).

    Args:
        backend, reporter, counters: where bytes come from, events go to, totals add up.
        lock: guards ``counters`` (shared with ``SaveQueue``) and this runner's state.
        chunk_size, blocks_per_chunk: the connector's chunk geometry.
        layerwise_timeout_ms: how long ``wait_for_layer`` waits for one layer.
    """

    def __init__(self, backend: Backend, reporter: Reporter, counters: WorkerCounters,
                 lock: threading.Lock, *, chunk_size: int, blocks_per_chunk: int,
                 layerwise_timeout_ms: int) -> None:
        self.backend, self.reporter, self.counters = backend, reporter, counters
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load")
        self._lock = lock
        self._chunk_size = chunk_size
        self._blocks_per_chunk = blocks_per_chunk
        self._timeout_ms = layerwise_timeout_ms
        self._layerwise: _LayerwiseLoad | None = None
        self._failed_blocks: set[int] = set()
        self._finished: set[str] = set()
        self._async: dict[str, Future[None]] = {}

    def settle_stale(self) -> None:
        """Forget the previous step's layer-wise load; a timed-out one may still be writing,
        so let it land before this step's forward pass reads or recomputes those blocks."""
        stale, self._layerwise = self._layerwise, None
        if stale is not None and stale.future is not None and not stale.future.done():
            try:
                stale.future.result(timeout=self._timeout_ms / 1e3)
            except TimeoutError:
                logger.error("kvpool: a timed-out layer-wise load is still running")

    def start(self, plans: Sequence[LoadPlan], device: DeviceSync, *, load_async: bool,
              layerwise: KVLayout | None) -> None:
        """Run ``plans``: inline (returns when done), in the background (``load_async``) or
        per layer of ``layerwise`` (the registered caches, in layer-wise mode)."""
        if not plans:
            return
        loads = {p.req.req_id: _ReqLoad(p) for p in plans}
        n_layers = len(layerwise.layers) if layerwise is not None else 0
        for p in plans:
            spec = p.req.load
            self.reporter.transfer_started(
                p.req.req_id, "load", len({t.chunk for t in p.transfers}) * self._blocks_per_chunk,
                sum(t.nbytes for t in p.transfers), layers_total=n_layers,
                lease_expires_ms=spec.lease_expires_ms if spec else None,
            )
        # Loads overwrite blocks only after the compute stream's earlier work on them (e.g.
        # vLLM zeroing newly allocated blocks) has finished.
        marker = device.record()
        if load_async:
            fut = self.executor.submit(self._run_async, loads, device, marker)
            with self._lock:
                for rid in loads:
                    self._async[rid] = fut
        elif layerwise is not None:
            job = _LayerwiseLoad(
                kv=layerwise,
                per_layer=by_layer((t for p in plans for t in p.transfers), n_layers),
                reqs=loads, done=[threading.Event() for _ in range(n_layers)],
            )
            self._layerwise = job
            job.future = self.executor.submit(self._run_layerwise, job, device, marker)
        else:
            device.wait(marker)
            self._get(loads, [t for p in plans for t in p.transfers])
            self._finish(loads.values())

    def _get(self, loads: Mapping[str, _ReqLoad], transfers: list[Transfer]) -> None:
        """One backend batch get; records per-chunk failures in ``loads`` (by request id)."""
        if not transfers:
            return
        try:
            results = self.backend.batch_get_into(
                [t.key for t in transfers], [t.addrs for t in transfers],
                [t.sizes for t in transfers],
            )
        except BackendError as exc:
            name = error_name(exc.code) if exc.code is not None else "BACKEND_ERROR"
            logger.error("kvpool load of %d keys failed: %s", len(transfers), exc)
            code = exc.code if exc.code is not None else ErrorCode.INTERNAL_ERROR
            results = [code] * len(transfers)
            for ld in loads.values():
                ld.error = ld.error or name
        for t, res in zip(transfers, results, strict=True):
            load = loads[t.req_id]
            if res == t.nbytes:
                load.nbytes += res
                with self._lock:
                    self.counters.loaded_keys += 1
                    self.counters.loaded_bytes += res
                continue
            # A short read is as bad as a missing key: the block holds stale bytes.
            load.failed_chunks.add(t.chunk)
            load.error = load.error or (error_name(res) if res < 0 else "PARTIAL_READ")
            with self._lock:
                self.counters.load_failed_keys += 1

    def _finish(self, loads: Iterable[_ReqLoad], timed_out: bool = False) -> None:
        """Report each request's load and record its failed blocks."""
        for load in loads:
            req = load.plan.req
            assert req.load is not None
            failed = load.plan.blocks_of(load.failed_chunks)
            self.fail_blocks(failed)
            tokens = loaded_tokens(req.load, load.failed_chunks, self._chunk_size)
            if tokens:
                self.reporter.loaded(req.req_id, tokens)
            error = "TIMEOUT" if timed_out else load.error
            self.reporter.transfer_finished(
                req.req_id, "load", ok=not failed and not timed_out, nbytes=load.nbytes,
                error_name=error if failed else None,
                failed_blocks=len(failed), after_hit=True, timed_out=timed_out,
            )
            if failed:
                logger.warning(
                    "kvpool load of request %s: %d blocks failed (%s); they will be recomputed",
                    req.req_id, len(failed), error,
                )

    def _run_async(self, loads: dict[str, _ReqLoad], device: DeviceSync, marker: Any) -> None:
        try:
            device.wait(marker)
            self._get(loads, [t for ld in loads.values() for t in ld.plan.transfers])
        except Exception as exc:  # never lose a request: fail its blocks instead
            logger.exception("kvpool async load crashed")
            for ld in loads.values():
                ld.failed_chunks.update(t.chunk for t in ld.plan.transfers)
                ld.error = ld.error or type(exc).__name__
        self._finish(loads.values())
        with self._lock:
            for rid in loads:
                self._async.pop(rid, None)
                self._finished.add(rid)

    def _run_layerwise(self, job: _LayerwiseLoad, device: DeviceSync, marker: Any) -> None:
        device.wait(marker)
        for i, transfers in enumerate(job.per_layer):
            if job.cancelled.is_set():
                break
            try:
                self._get(job.reqs, transfers)
            except Exception as exc:  # fail this layer's blocks, keep the engine going
                logger.exception("kvpool layer-wise load crashed")
                for t in transfers:
                    job.reqs[t.req_id].failed_chunks.add(t.chunk)
                    job.reqs[t.req_id].error = type(exc).__name__
            for rid in job.reqs:
                self.reporter.transfer_progress(rid, "load", i + 1)
            job.done[i].set()
        if job.cancelled.is_set():
            for d in job.done:
                d.set()
            return
        if job.per_layer:
            self._finish(job.reqs.values())

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until layer ``layer_name`` of this step's layer-wise load landed (at once
        when there is none or the step already timed out).

        Raises:
            LayerLoadTimeout: not within ``layerwise_timeout_ms``; the step's blocks are
                marked failed first, and later layers of the step do not wait again.
            KeyError: ``layer_name`` is not a registered layer.
        """
        job = self._layerwise
        if job is None or job.timed_out:
            return
        if job.done[job.kv.layer_index(layer_name)].wait(self._timeout_ms / 1e3):
            return
        job.timed_out = True
        job.cancelled.set()
        with self._lock:
            self.counters.layer_timeouts += 1
        for load in job.reqs.values():
            load.failed_chunks.update(t.chunk for t in load.plan.transfers)
        self._finish(job.reqs.values(), timed_out=True)
        raise LayerLoadTimeout(
            f"layer-wise load of layer {layer_name!r} ({len(job.reqs)} requests) did not "
            f"finish within layerwise_timeout_ms={self._timeout_ms}; its blocks "
            "are reported as load errors and will be recomputed (check the pool's health)"
        )

    def fail_blocks(self, blocks: set[int]) -> None:
        """Record ``blocks`` as failed (reported by ``take_failed_blocks``)."""
        with self._lock:
            self._failed_blocks |= blocks
            self.counters.load_failed_blocks += len(blocks)

    def take_failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        with self._lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def take_finished(self) -> set[str]:
        """Requests whose ``load_async`` load ended since the last call."""
        with self._lock:
            out, self._finished = self._finished, set()
        return out

    def futures_of(self, req_ids: set[str]) -> list[Future[None]]:
        """The background loads of ``req_ids`` still tracked."""
        with self._lock:
            return [f for r, f in self._async.items() if r in req_ids]

    def shutdown(self) -> None:
        """Cancel a running layer-wise load and stop the load thread."""
        if self._layerwise is not None:
            self._layerwise.cancelled.set()
        self.executor.shutdown(wait=True, cancel_futures=True)


@dataclass
class _LayerSaveAcc:
    """A request's layer-wise save of one step so far: bytes stored, chunks that failed."""

    nbytes: int = 0
    bad_chunks: set[int] = field(default_factory=set)
    error: str | None = None


class SaveQueue:
    """A worker's background saves (see the module docstring).

    Args:
        backend, reporter, counters: where bytes go, events go to, totals add up.
        lock: guards ``counters`` (shared with ``LoadRunner``) and this queue's state.
        blocks_per_chunk: vLLM blocks per chunk (reports count blocks).
    """

    def __init__(self, backend: Backend, reporter: Reporter, counters: WorkerCounters,
                 lock: threading.Lock, *, blocks_per_chunk: int) -> None:
        self.backend, self.reporter, self.counters = backend, reporter, counters
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save")
        self._lock = lock
        self._blocks_per_chunk = blocks_per_chunk
        self._futures: list[Future[None]] = []
        self._pending: dict[str, int] = {}
        self._pool_full: set[str] = set()
        # Save thread only: per request, layer-wise bytes/failed keys/error of this step.
        self._layer_acc: dict[str, _LayerSaveAcc] = {}

    def submit(self, per_req: list[tuple[ReqMeta, list[Transfer]]], device: DeviceSync,
               layer: int | None = None, n_layers: int = 0) -> None:
        """Save each request's ``transfers`` once the device finished its work so far.

        ``layer``: the layer index of a layer-wise save (``n_layers`` layers in all), ``None``
        for whole-chunk keys.
        """
        marker = device.record()
        with self._lock:
            for req, _ in per_req:
                self._pending[req.req_id] = self._pending.get(req.req_id, 0) + 1
        if layer in (None, 0):
            for req, ts in per_req:
                self.reporter.transfer_started(
                    req.req_id, "save", len({t.chunk for t in ts}) * self._blocks_per_chunk,
                    sum(t.nbytes for t in ts) * (n_layers or 1), layers_total=n_layers,
                )
        fut = self.executor.submit(self._run, per_req, device, marker, layer, n_layers)
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(fut)

    def _run(self, per_req: list[tuple[ReqMeta, list[Transfer]]], device: DeviceSync,
             marker: Any, layer: int | None, n_layers: int) -> None:
        try:
            device.wait(marker)
            self._save(per_req, layer, n_layers)
        except Exception as exc:  # a failed save never reaches the engine: it is reported
            logger.exception("kvpool save crashed")
            for req, _ in per_req:
                self.reporter.transfer_finished(req.req_id, "save", ok=False,
                                                error_name=type(exc).__name__)
        finally:
            with self._lock:
                for req, _ in per_req:
                    left = self._pending.get(req.req_id, 1) - 1
                    if left <= 0:
                        self._pending.pop(req.req_id, None)
                    else:
                        self._pending[req.req_id] = left

    def _put_new(self, transfers: list[Transfer]) -> dict[str, int]:
        """Put the keys the pool does not hold yet (one ``batch_exists`` first, so chunks
        another engine stored are not sent again); per key put, its result code."""
        if not transfers:
            return {}
        try:
            exists = self.backend.batch_exists([t.key for t in transfers])
        except BackendError:  # unknown: the put decides
            exists = [0] * len(transfers)
        todo = [t for t, e in zip(transfers, exists, strict=True) if e != 1]
        if not todo:
            return {}
        try:
            codes = self.backend.batch_put_from(
                [t.key for t in todo], [t.addrs for t in todo], [t.sizes for t in todo]
            )
        except BackendError as exc:
            logger.error("kvpool save of %d keys failed: %s", len(todo), exc)
            codes = [exc.code if exc.code is not None else ErrorCode.INTERNAL_ERROR] * len(todo)
        return {t.key: c for t, c in zip(todo, codes, strict=True)}

    def _save(self, per_req: list[tuple[ReqMeta, list[Transfer]]], layer: int | None,
              n_layers: int) -> None:
        skipped = {req.req_id: len(ts) for req, ts in per_req if req.req_id in self._pool_full}
        results = self._put_new([t for req, ts in per_req if req.req_id not in skipped
                                 for t in ts])
        last_layer = layer is None or layer == n_layers - 1
        for req, transfers in per_req:
            rid = req.req_id
            if rid in skipped:
                self._count_skip(rid, skipped[rid], n_layers)
                continue
            nbytes, error, failed, full = 0, None, 0, 0
            bad_chunks: set[int] = set()
            for t in transfers:
                code = results.get(t.key, 0)
                if code in _STORED:
                    if t.key in results and code == 0:
                        nbytes += t.nbytes
                    continue
                bad_chunks.add(t.chunk)
                if code == _FULL:
                    full += 1
                else:
                    failed += 1
                    error = error or error_name(code)
            with self._lock:
                self.counters.saved_bytes += nbytes
                self.counters.saved_keys += sum(1 for t in transfers if results.get(t.key) == 0)
                self.counters.save_failed_keys += failed
            if full:
                # Pool full: this request's later saves are skipped, other requests retry.
                with self._lock:
                    self._pool_full.add(rid)
                self._count_skip(rid, full, n_layers)
            if layer is not None:
                # Layer-wise: one finished event per request and step, summing its layers.
                acc = self._layer_acc.setdefault(rid, _LayerSaveAcc())
                acc.nbytes += nbytes
                acc.bad_chunks |= bad_chunks
                acc.error = acc.error or error
                nbytes, bad_chunks, error = acc.nbytes, acc.bad_chunks, acc.error
                if not full:
                    self.reporter.transfer_progress(rid, "save", layer + 1)
                if last_layer or full:
                    self._layer_acc.pop(rid, None)
            if last_layer or full:
                self.reporter.transfer_finished(
                    rid, "save", ok=not bad_chunks, nbytes=nbytes,
                    error_name=_FULL.name if full else error,
                    failed_blocks=len(bad_chunks) * self._blocks_per_chunk,
                )

    def _count_skip(self, req_id: str, keys: int, n_layers: int = 0) -> None:
        """Count ``keys`` keys skipped because the pool is full; the report is in blocks (a
        layer-wise key holds one layer of its blocks, so ``n_layers`` of them make whole
        blocks)."""
        with self._lock:
            self.counters.save_skipped_keys += keys
        blocks = keys * self._blocks_per_chunk
        self.reporter.save_skipped(req_id, blocks // n_layers if n_layers else blocks,
                                   _FULL.name)

    def pending(self, req_ids: Iterable[str]) -> set[str]:
        """Those of ``req_ids`` with saves submitted and not finished."""
        with self._lock:
            return {r for r in req_ids if r in self._pending}

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the pool-full mark of finished requests."""
        with self._lock:
            self._pool_full.difference_update(req_ids)

    def futures(self) -> list[Future[None]]:
        """Every save batch submitted so far and still tracked."""
        with self._lock:
            return list(self._futures)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted save has finished; True if all did within
        ``timeout_s`` seconds (``None``: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for f in self.futures():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(timeout=left)
            except TimeoutError:
                return False
        return True

    @property
    def inflight(self) -> int:
        """Save batches submitted and not finished yet."""
        with self._lock:
            return sum(1 for f in self._futures if not f.done())

    def shutdown(self) -> None:
        """Stop the save thread (queued saves are cancelled; call ``drain`` first)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
