"""Running transfer plans against the backend: the worker's load and save threads.

``LoadRunner`` moves a step's ``LoadPlan``s into the KV caches: inline before the forward pass,
per layer on a background thread (layer-wise; ``wait_for_layer`` waits for one layer), or
wholly in the background (``load_async``, finished through ``take_finished``). Every block of
a chunk whose key failed or came back short is kept for ``take_failed_blocks`` (vLLM
recomputes it), and every request's outcome (tokens accepted, tokens really loaded) for
``take_outcomes``. A layer-wise wait that times out never raises into the forward pass: the
step's load blocks are reported failed, the loader stops after its current layer, and the next
step waits for it before any block can be recomputed or handed to another request. An inline
load whose values are all staged waits ``layerwise_timeout_ms`` at most, then fails (recompute)
and its late bytes are never scattered. A get that lasted the pool's lease or longer
(``Backend.lease_ttl_ms``) fails its keys as ``LEASE_EXPIRED``: a read holds a lease, not a
reference, so once the lease lapsed mid-transfer a remove (connector eviction, an unforced
flush, another engine's) may have freed the bytes being copied and a put reused them; what
lands is doubtful, and doubtful KV is recomputed, never used (issue 39).

``SaveQueue`` stores chunks on a background thread once the device finished writing them:
keys the pool already holds are not sent again, and a request whose save hit
``NO_AVAILABLE_HANDLE`` (pool full) skips its remaining saves (later requests try again). The
bytes of saves submitted and not finished are bounded by ``save_budget_bytes``: a request whose
save would pass it is skipped and counted (``SAVE_BUDGET``), so submitting never blocks the
engine thread and a finished request waits for at most one budget of saves before its blocks
are freed. A preempted request's queued saves are dropped (``PREEMPTED``) and only its running
one is waited for. Backend calls are sized to the transport (``staging.SizedCalls``). A batch
whose values are all staged and fit the staging buffer at once releases its requests (they leave
the pending set: ``get_finished`` reports them, vLLM frees their blocks) once the values are
copied, before the put (with KV events off: events are recorded when the put ends), so a store
that does not answer holds no engine block and a preempted request waits for the copy only.
With ``eviction: connector`` the same thread removes the keys the scheduler's LRU evicted
(``SaveQueue.remove``) before it runs the saves submitted after them, so the pool has room for
them; a key under a reader's lease is removed with a later batch (``_removals``).

Both report every transfer to the agent and add to one ``WorkerCounters``. ``KVPoolWorker``
owns them and calls them from vLLM's hooks.

Why this module is long (over 600 lines): it holds two concepts, the load thread
(``LoadRunner``) and the save thread (``SaveQueue``), that share ``WorkerCounters``, one lock and
the checksum buffers; each would make a module of its own, a split left for when the data-path
changes now in progress have landed.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from kvpool_agent.reporter import Reporter
from kvpool_agent.vocabulary import ErrorCode, error_name
from kvpool_connector._checksum import CHECKSUM_BYTES, DigestSlots, digest_of
from kvpool_connector._counters import WorkerCounters
from kvpool_connector._cpus import pin_this_thread
from kvpool_connector._device import DeviceSync
from kvpool_connector._layout import KVLayout
from kvpool_connector._planning import KeyTransfer, LoadPlan, by_layer, loaded_tokens
from kvpool_connector._removals import LeasedKeys, grace_s_of
from kvpool_connector.backends.base import Backend, BackendError
from kvpool_connector.metadata import ReqMeta
from kvpool_connector.staging import SizedCalls

__all__ = ["LoadRunner", "SaveQueue", "WorkerCounters"]

logger = logging.getLogger(__name__)

_STORED = (0, ErrorCode.OBJECT_ALREADY_EXISTS)
"""Per-key put results after which the key holds the chunk (another engine may have won)."""

_FULL = ErrorCode.NO_AVAILABLE_HANDLE

SAVE_BUDGET = "SAVE_BUDGET"
"""``SaveSkipped.reason`` of a save skipped because ``save_budget_bytes`` were in flight."""

PREEMPTED = "PREEMPTED"
"""``SaveSkipped.reason`` of a queued save dropped because its request was preempted."""


def _lowered_by(steps: int) -> int | None:
    """The nice value ``steps`` levels below the calling thread's (capped at 19); ``None``
    when ``steps`` is 0 or this OS keeps no nice value per thread (only Linux does: there,
    ``PRIO_PROCESS`` with a thread's native id names that thread; elsewhere a process)."""
    if steps <= 0:
        return None
    if sys.platform != "linux":
        logger.warning("save_nice %d: per-thread priority needs Linux; saves keep the "
                       "engine's", steps)
        return None
    return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + steps)


def _nice_this_thread(nice: int | None) -> None:
    """Run the calling thread at nice value ``nice`` (``None``: leave it; raising one's own
    needs no privilege). A thread a thread starts inherits its value, so this sets it, never
    adds to it. If the kernel refuses, a warning says so and the thread keeps its priority:
    a save then competes with the engine's forward pass for the CPU as without
    ``save_nice``."""
    if nice is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        logger.warning("save_nice: nice %d not applied to %s: %s", nice,
                       threading.current_thread().name, exc)


def _start_save_thread(nice: int | None, cpus: frozenset[int] | None) -> None:
    """A save thread's (or its copy helper's) first step: its priority and its CPUs."""
    _nice_this_thread(nice)
    pin_this_thread(cpus)


def _hybrid_only(by_group: dict[int, int]) -> dict[int, int] | None:
    """``by_group`` when some bytes are of a group other than 0 (a hybrid model), else
    ``None``: a one-group engine reports no per-group figures."""
    return by_group if any(by_group) else None


@dataclass(frozen=True)
class ChecksumBuffers:
    """Host buffers of the integrity check (``_checksum``), registered with the backend.

    ``slots``: one digest range per key of a batch call. ``staging`` (``staging_bytes``
    bytes, at least one value): where a value with ranges routed to ``scratch`` (blocks
    vLLM already holds) lands whole, so its digest can be checked before its kept blocks are
    copied into the caches.
    """

    slots: DigestSlots
    staging: int = 0
    staging_bytes: int = 0
    scratch: int = 0


@dataclass
class _ReqLoad:
    """One request's load of this step: its plan and what happened to it so far."""

    plan: LoadPlan
    failed_chunks: set[int] = field(default_factory=set)
    error: str | None = None
    nbytes: int = 0
    # Bytes loaded by KV-cache group (hybrid models).
    by_group: dict[int, int] = field(default_factory=dict)


@dataclass
class _LayerwiseLoad:
    """A step's layer-wise load: per layer an event set when its keys have landed."""

    kv: KVLayout
    per_layer: list[list[KeyTransfer]]
    reqs: dict[str, _ReqLoad]
    done: list[threading.Event]
    cancelled: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False
    future: Future[None] | None = None
    # Set by whichever of the loader and a timed-out wait reports the step first.
    finished: bool = False


class LoadRunner:
    """A worker's loads (see the module docstring).

    Args:
        backend, reporter, counters: where bytes come from, events go to, totals add up.
        lock: guards ``counters`` (shared with ``SaveQueue``) and this runner's state.
        chunk_size, blocks_per_chunk: the connector's chunk geometry.
        layerwise_timeout_ms: how long ``wait_for_layer`` waits for one layer (and an inline
            load whose values are all staged, ``_get_inline``).
        cpus: the CPUs of the load thread and its copy helper (``transfer_cpus``); ``None``:
            the engine's thread's.
    """

    def __init__(self, backend: Backend, reporter: Reporter, counters: WorkerCounters,
                 lock: threading.Lock, *, chunk_size: int, blocks_per_chunk: int,
                 layerwise_timeout_ms: int, cpus: frozenset[int] | None = None) -> None:
        self.backend, self.reporter, self.counters = backend, reporter, counters
        place = functools.partial(pin_this_thread, cpus)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load",
                                           initializer=place)
        self._lock = lock
        self._chunk_size = chunk_size
        self._blocks_per_chunk = blocks_per_chunk
        self._timeout_ms = layerwise_timeout_ms
        self._layerwise: _LayerwiseLoad | None = None
        self._late: Future[None] | None = None  # an inline get that timed out (_get_inline)
        self._failed_blocks: set[int] = set()
        self._finished: set[str] = set()
        self._async: dict[str, Future[None]] = {}
        # Per request whose load ended: (tokens vLLM accepted, tokens really loaded).
        self._outcomes: dict[str, tuple[int, int]] = {}
        # Set by KVPoolWorker.register_kv_caches when the integrity check is on.
        self.checksum: ChecksumBuffers | None = None
        # Hybrid models: a load with a failed key fails its whole request (vLLM's
        # failed_recving; its block-level report cannot name a KV-cache group).
        self.fail_whole_requests = False
        self._failed_reqs: set[str] = set()
        self.calls = SizedCalls.for_backend(backend, place)  # staging: staging.attach_staging
        self.lease_ttl_ms = backend.lease_ttl_ms()

    def settle_stale(self) -> None:
        """Forget the previous step's layer-wise load. A timed-out one may still be writing
        its current layer (it stops before the next): wait for it, so that no late byte lands
        in a block this step recomputes or vLLM hands to another request. The wait is one
        layer's batch get at most, which the backend's own transfer timeout bounds."""
        stale, self._layerwise = self._layerwise, None
        if stale is not None and stale.future is not None and not stale.future.done():
            logger.warning("kvpool: waiting for a timed-out layer-wise load to stop")
            stale.future.result()

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
            self._get_inline(loads, [t for p in plans for t in p.transfers])

    def _get_inline(self, loads: dict[str, _ReqLoad], transfers: list[KeyTransfer]) -> None:
        """An inline load. When every value is staged (no byte lands in a block before its
        value is whole), the engine waits for it ``layerwise_timeout_ms`` at most: past it the
        load fails (``TIMEOUT``: recomputed) and its late bytes are never scattered; the load
        thread's copy of ``loads`` keeps it apart from the step's report. A get that timed out
        may still be writing into the staging buffer, which the next load reuses from its
        start: a load run here on the engine thread waits for it first (a staged one queues
        behind it on the load thread)."""
        if self.checksum is not None or not self.calls.stages_all(
                [t.addrs for t in transfers], [t.sizes for t in transfers]):
            if self._late is not None:
                wait([self._late])  # its outcome was reported as TIMEOUT already
                self._late = None
            self._get(loads, transfers)
            self._finish(loads.values())
            return
        cancel, shadow = threading.Event(), {r: _ReqLoad(ld.plan) for r, ld in loads.items()}
        fut = self.executor.submit(self._get, shadow, transfers, cancel)
        try:
            fut.result(timeout=self._timeout_ms / 1e3)
        except TimeoutError:
            self._late = fut
            cancel.set()
            logger.error("kvpool: inline load of %d keys did not finish within %d ms; its "
                         "blocks are recomputed", len(transfers), self._timeout_ms)
            for load in loads.values():
                load.failed_chunks.update(t.chunk for t in load.plan.transfers)
            self._finish(loads.values(), timed_out=True)
            return
        self._finish(shadow.values())

    def _get(self, loads: Mapping[str, _ReqLoad], transfers: list[KeyTransfer],
             cancel: threading.Event | None = None) -> None:
        """Backend batch gets of ``transfers``; records per-chunk failures in ``loads`` (by
        request id); nothing once ``cancel`` is set (``_get_inline``)."""
        if not transfers:
            return
        if self.checksum is not None:
            self._get_checked(loads, transfers, self.checksum)
            return
        results = self._call_get(loads, transfers, [t.addrs for t in transfers],
                                 [t.sizes for t in transfers], cancel)
        if cancel is not None and cancel.is_set():
            return
        for t, res in zip(transfers, results, strict=True):
            self._settle(loads[t.req_id], t, res == t.nbytes, res)

    def _call_get(self, loads: Mapping[str, _ReqLoad], transfers: list[KeyTransfer],
                  addrs: list[list[int]], sizes: list[list[int]],
                  cancel: threading.Event | None = None) -> list[int]:
        """One ``batch_get_into``; per key the bytes read or an error code (a failed call
        is the same error for every key; a call that outlasted the lease, ``LEASE_EXPIRED``
        for every key: see the module docstring)."""
        # Before the call: the leases are granted inside it, so this is a conservative start.
        began = time.monotonic()
        try:
            results = self.calls.get([t.key for t in transfers], addrs, sizes, cancel)
        except BackendError as exc:
            name = error_name(exc.code) if exc.code is not None else "BACKEND_ERROR"
            logger.error("kvpool load of %d keys failed: %s", len(transfers), exc)
            for t in transfers:
                loads[t.req_id].error = loads[t.req_id].error or name
            return [exc.code if exc.code is not None else ErrorCode.INTERNAL_ERROR] * len(
                transfers)
        took_ms = (time.monotonic() - began) * 1e3
        if self.lease_ttl_ms and took_ms >= self.lease_ttl_ms:
            logger.warning("kvpool load of %d keys took %.0f ms, not less than the pool's "
                           "%d ms lease (default_kv_lease_ttl): a remove may have reused the "
                           "bytes mid-copy, so they are recomputed; raise default_kv_lease_ttl "
                           "above load times", len(transfers), took_ms, self.lease_ttl_ms)
            return [ErrorCode.LEASE_EXPIRED] * len(transfers)
        return results

    def _settle(self, load: _ReqLoad, t: KeyTransfer, ok: bool, res: int,
                mismatch: bool = False) -> None:
        """Count one key's get: loaded, or its chunk failed (a short read is as bad as a
        missing key, a wrong digest as bad as both: the blocks hold untrusted bytes)."""
        if ok and not mismatch:
            load.nbytes += t.nbytes
            load.by_group[t.group] = load.by_group.get(t.group, 0) + t.nbytes
            with self._lock:
                self.counters.loaded_keys += 1
                self.counters.loaded_bytes += t.nbytes
            return
        load.failed_chunks.add(t.chunk)
        load.error = load.error or ("CHECKSUM_MISMATCH" if mismatch
                                    else error_name(res) if res < 0 else "PARTIAL_READ")
        with self._lock:
            self.counters.load_failed_keys += 1
            self.counters.checksum_failures += mismatch

    def _get_checked(self, loads: Mapping[str, _ReqLoad], transfers: list[KeyTransfer],
                     ck: ChecksumBuffers) -> None:
        """Gets with the integrity check: each value's digest lands in a slot and is compared
        with the digest of the bytes that landed. A value with ranges routed to the scratch
        buffer (whose bytes overwrite each other there) is fetched alone into ``staging`` and
        its kept blocks copied into the caches only once its digest matched."""
        want = CHECKSUM_BYTES
        direct = [t for t in transfers if ck.scratch not in t.addrs]
        cap = ck.slots.capacity
        for start in range(0, len(direct), cap):
            part = direct[start : start + cap]
            results = self._call_get(
                loads, part, [[*t.addrs, ck.slots.slot(j)] for j, t in enumerate(part)],
                [[*t.sizes, want] for t in part])
            for j, (t, res) in enumerate(zip(part, results, strict=True)):
                ok = res == t.nbytes + want
                bad = ok and digest_of(t.key, t.addrs, t.sizes) != ck.slots.read(j)
                self._settle(loads[t.req_id], t, ok, res, bad)
        for t in transfers:
            if ck.scratch not in t.addrs:
                continue
            (res,) = self._call_get(loads, [t], [[ck.staging, ck.slots.slot(0)]],
                                    [[t.nbytes, want]])
            ok = res == t.nbytes + want
            bad = ok and digest_of(t.key, [ck.staging], [t.nbytes]) != ck.slots.read(0)
            if ok and not bad:
                off = 0
                for addr, size in zip(t.addrs, t.sizes, strict=True):
                    if addr != ck.scratch:
                        ctypes.memmove(addr, ck.staging + off, size)
                    off += size
            self._settle(loads[t.req_id], t, ok, res, bad)

    def _finish(self, loads: Iterable[_ReqLoad], timed_out: bool = False) -> None:
        """Report each request's load, record its failed blocks and its outcome."""
        for load in loads:
            req = load.plan.req
            assert req.load is not None
            failed = load.plan.blocks_of(load.failed_chunks)
            if self.fail_whole_requests:
                tokens = 0 if failed else req.load.num_tokens_to_load
                if failed:
                    self.fail_request(req.req_id)
            else:
                self.fail_blocks(failed)
                tokens = loaded_tokens(req.load, load.failed_chunks, self._chunk_size)
            accepted = req.load.num_tokens_to_load
            with self._lock:
                self._outcomes[req.req_id] = (accepted, tokens)
                self.counters.load_failed_tokens += accepted - tokens
            error = "TIMEOUT" if timed_out else load.error
            self.reporter.transfer_finished(
                req.req_id, "load", ok=not failed and not timed_out, nbytes=load.nbytes,
                error_name=error if failed else None,
                failed_blocks=len(failed), after_hit=True, timed_out=timed_out,
                bytes_by_group=_hybrid_only(load.by_group),
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

    def _finish_job(self, job: _LayerwiseLoad, timed_out: bool) -> bool:
        """Report a layer-wise step's loads once (the loader and a timed-out wait race for
        it); False when it was already reported."""
        with self._lock:
            if job.finished:
                return False
            job.finished = True
        if timed_out:
            for load in job.reqs.values():
                load.failed_chunks.update(t.chunk for t in load.plan.transfers)
        self._finish(job.reqs.values(), timed_out=timed_out)
        return True

    def _run_layerwise(self, job: _LayerwiseLoad, device: DeviceSync, marker: Any) -> None:
        try:
            device.wait(marker)
            last = len(job.per_layer) - 1
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
                if i == last:
                    # Outcomes are recorded before the forward pass can pass its last layer
                    # and the step's results (failed blocks, outcomes) are collected.
                    self._finish_job(job, timed_out=False)
                job.done[i].set()
        finally:
            for d in job.done:
                d.set()

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until layer ``layer_name`` of this step's layer-wise load landed, or at most
        ``layerwise_timeout_ms`` (at once when there is none or the step already timed out).

        A timeout never raises into the forward pass (issue 11): every block of the step's
        loads is reported as a load error (vLLM recomputes it and drops this step's output
        for those requests), the loader is told to stop after its current layer, later
        layers of the step do not wait, and ``settle_stale`` makes the next step wait for the
        loader before its forward pass.

        Raises:
            KeyError: ``layer_name`` is not a registered layer.
        """
        job = self._layerwise
        if job is None or job.timed_out:
            return
        if job.done[job.kv.layer_index(layer_name)].wait(self._timeout_ms / 1e3):
            return
        job.timed_out = True
        job.cancelled.set()
        if not self._finish_job(job, timed_out=True):
            return  # the loader finished in the meantime: nothing failed
        with self._lock:
            self.counters.layer_timeouts += 1
        logger.error(
            "kvpool: layer-wise load of layer %r (%d requests) did not finish within "
            "layerwise_timeout_ms=%d; its blocks are reported as load errors and recomputed "
            "(check the pool's health)", layer_name, len(job.reqs), self._timeout_ms)

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

    def record_outcome(self, req_id: str, accepted: int, loaded: int, *,
                       finished: bool = False) -> None:
        """Record a request's load outcome that did not go through a plan (e.g. bad
        metadata: ``loaded`` 0); ``finished``: an async load, which must still end in
        ``take_finished`` (vLLM waits for it)."""
        with self._lock:
            self._outcomes[req_id] = (accepted, loaded)
            self.counters.load_failed_tokens += accepted - loaded
            if finished:
                self._finished.add(req_id)

    def fail_request(self, req_id: str) -> None:
        """Record ``req_id``'s whole load as failed (``take_failed_requests``)."""
        with self._lock:
            self._failed_reqs.add(req_id)

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed as a whole since the last call."""
        with self._lock:
            out, self._failed_reqs = self._failed_reqs, set()
        return out

    def take_outcomes(self) -> dict[str, tuple[int, int]]:
        """Per request whose load ended since the last call: (tokens vLLM accepted, tokens
        really loaded, i.e. up to the first failed chunk)."""
        with self._lock:
            out, self._outcomes = self._outcomes, {}
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
    # Chunks whose every layer key so far this save wrote (KV events); None before layer 0.
    written: set[tuple[int, int]] | None = None


class SaveQueue:
    """A worker's background saves (see the module docstring).

    Args:
        backend, reporter, counters: where bytes go, events go to, totals add up.
        lock: guards ``counters`` (shared with ``LoadRunner``) and this queue's state.
        blocks_per_chunk: vLLM blocks per chunk (reports count blocks).
        budget_bytes: bytes of saves in flight at most (``save_budget_bytes``).
        nice: nice levels the save thread and its copy helper run below the thread that
            builds this queue, the engine's (``save_nice``; 0: the engine's priority).
        cpus: their CPUs (``transfer_cpus``); ``None``: the engine's thread's.
    """

    def __init__(self, backend: Backend, reporter: Reporter, counters: WorkerCounters,
                 lock: threading.Lock, *, blocks_per_chunk: int,
                 budget_bytes: int = 256 << 20, nice: int = 0,
                 cpus: frozenset[int] | None = None) -> None:
        self.backend, self.reporter, self.counters = backend, reporter, counters
        lower = functools.partial(_start_save_thread, _lowered_by(nice), cpus)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-save",
                                           initializer=lower)
        self._lock = lock
        self._blocks_per_chunk = blocks_per_chunk
        self.budget_bytes = budget_bytes
        self._futures: list[Future[None]] = []
        self._pending: dict[str, int] = {}
        self._pool_full: set[str] = set()
        # Save thread only: per request, layer-wise bytes/failed keys/error of this step.
        self._layer_acc: dict[str, _LayerSaveAcc] = {}
        self._inflight_bytes = 0
        # Layer-wise: requests refused at layer 0 of the current step (later layers follow).
        self._step_refused: set[str] = set()
        # Batches by sequence number; the one the save thread runs (its number, request ids).
        self._seq = 0
        # Per batch, set once it reads engine blocks no more (copied to staging, or ended).
        self._copied: dict[int, threading.Event] = {}
        self._running: tuple[int, frozenset[str]] | None = None
        # Preempted request -> last batch number whose saves of it must not run.
        self._dropped: dict[str, int] = {}
        # Set by KVPoolWorker.register_kv_caches when the integrity check is on.
        self.checksum: DigestSlots | None = None
        # Save thread only: evicted keys a reader's lease kept (tried again with a batch once
        # the transfer timeout passed since the refusal: _removals).
        self._leased = LeasedKeys(grace_s_of(backend.transfer_timeout_ms()))
        # (request id, chunk) of every chunk a save wrote, when KV events are on
        # (KVPoolWorker.enable_kv_events); None = not recorded. Bounded: under vLLM's
        # MultiConnector nobody takes them (it does not forward connector KV events).
        self.written: deque[tuple[str, int, int]] | None = None
        self.calls = SizedCalls.for_backend(backend, lower)  # staging: staging.attach_staging

    def submit(self, per_req: list[tuple[ReqMeta, list[KeyTransfer]]], device: DeviceSync,
               layer: int | None = None, n_layers: int = 0) -> Future[None] | None:
        """Save each request's ``transfers`` once the device finished its work so far.

        ``layer``: the layer index of a layer-wise save (``n_layers`` layers in all), ``None``
        for whole-chunk keys. A request whose save would take the bytes in flight past
        ``budget_bytes`` is skipped (counted, reported as ``SAVE_BUDGET``); in layer-wise mode
        the decision of layer 0 holds for the step's other layers. Never blocks.

        Returns:
            The batch's future (done once every admitted save ended), ``None`` when none was
            admitted.
        """
        per_req = self._admit(per_req, layer, n_layers)
        if not per_req:
            return None
        nbytes = sum(t.nbytes for _, ts in per_req for t in ts)
        marker = device.record()
        with self._lock:
            for req, _ in per_req:
                self._pending[req.req_id] = self._pending.get(req.req_id, 0) + 1
            self._inflight_bytes += nbytes
            self._seq += 1
            seq = self._seq
            self._copied[seq] = threading.Event()
        if layer in (None, 0):
            for req, ts in per_req:
                self.reporter.transfer_started(
                    req.req_id, "save", len({t.chunk for t in ts}) * self._blocks_per_chunk,
                    sum(t.nbytes for t in ts) * (n_layers or 1), layers_total=n_layers,
                )
        fut = self.executor.submit(self._run, seq, per_req, device, marker, layer, n_layers,
                                   nbytes)
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(fut)
        return fut

    def remove(self, keys: Sequence[str], keep: Sequence[str] = (),
               pinned: Callable[[], AbstractSet[str]] | None = None) -> Future[None]:
        """Remove ``keys`` from the pool (``eviction: connector``) on the save thread, before
        any save submitted later; never by force (``Backend.batch_remove``). Never blocks.

        A key under a lease (Mooncake -706 OBJECT_HAS_LEASE) or still being written (-703
        REPLICA_IS_NOT_READY) waits and is tried again with a later batch (``_removals``:
        how often, how many at most). ``keep``: waiting keys
        whose chunk the scheduler took back (dropped from the wait). ``pinned``: the keys a
        pin holds, asked on the save thread before each batch (never removed). Removed keys
        and failed removes are counted (``evicted_keys``, ``evict_failed_keys``).
        """
        fut = self.executor.submit(self._remove, list(keys), list(keep), pinned)
        with self._lock:  # drain() and shutdown wait for removals too
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(fut)
        return fut

    def _remove(self, keys: list[str], keep: list[str],
                pinned: Callable[[], AbstractSet[str]] | None) -> None:
        todo = self._leased.batch(keys, keep, pinned)
        if not todo:
            return
        try:
            codes = self.backend.batch_remove(todo)
        except Exception as exc:  # an eviction never reaches the engine: it is reported
            code = exc.code if isinstance(exc, BackendError) else None
            logger.error("kvpool eviction of %d keys failed: %s", len(todo), exc)
            self.reporter.error("evict", error_name(code or ErrorCode.INTERNAL_ERROR), str(exc))
            with self._lock:
                self.counters.evict_failed_keys += len(todo)
            return
        removed, failed = self._leased.settle(todo, codes)
        with self._lock:
            self.counters.evicted_keys += removed
            self.counters.evict_failed_keys += failed

    def _admit(self, per_req: list[tuple[ReqMeta, list[KeyTransfer]]], layer: int | None,
               n_layers: int) -> list[tuple[ReqMeta, list[KeyTransfer]]]:
        """The requests of ``per_req`` within the save budget; the others are counted."""
        if layer not in (None, 0):
            return [(r, ts) for r, ts in per_req if r.req_id not in self._step_refused]
        self._step_refused = set()
        with self._lock:
            idle = self._inflight_bytes == 0
            free = self.budget_bytes - self._inflight_bytes
        out: list[tuple[ReqMeta, list[KeyTransfer]]] = []
        for req, ts in per_req:
            cost = sum(t.nbytes for t in ts) * (n_layers or 1)
            # With nothing in flight one save runs even if it exceeds the budget: a budget
            # smaller than a request's save then slows saves to one at a time instead of
            # skipping every request for ever.
            if cost <= free or (idle and not out):
                free -= cost
                out.append((req, ts))
                continue
            self._step_refused.add(req.req_id)
            self._count_skip(req.req_id, len({t.chunk for t in ts}) * (n_layers or 1),
                             n_layers, SAVE_BUDGET)
        return out

    def _run(self, seq: int, per_req: list[tuple[ReqMeta, list[KeyTransfer]]], device: DeviceSync,
             marker: Any, layer: int | None, n_layers: int, nbytes: int) -> None:
        with self._lock:
            self._running = (seq, frozenset(r.req_id for r, _ in per_req))
            dropped = {r.req_id for r, _ in per_req if self._dropped.get(r.req_id, 0) >= seq}
        for req, ts in per_req:
            if req.req_id in dropped:
                self._count_skip(req.req_id, len({t.chunk for t in ts}) * (n_layers or 1),
                                 n_layers, PREEMPTED)
        todo = [(r, ts) for r, ts in per_req if r.req_id not in dropped]

        def release() -> None:  # the engine may reuse the batch's blocks from now on
            with self._lock:
                if not self._copied[seq].is_set():
                    self._copied[seq].set()
                    for rid in (r.req_id for r, _ in per_req):
                        self._pending[rid] = self._pending.get(rid, 1) - 1
                        if self._pending[rid] <= 0:
                            del self._pending[rid]

        def copied() -> None:  # the operators' view: these saves hold no block, only staging
            release()
            # A layer-wise save's blocks are free once its last layer is copied (its earlier
            # layers ran before on this one thread); before, later layers still read them.
            if layer is None or layer == n_layers - 1:
                for req, _ in todo:
                    self.reporter.save_copied(req.req_id)
        try:
            device.wait(marker)
            # KV events promise a request in finished_sending has its chunks recorded: with
            # them on, blocks are released when the save ends, after the records.
            self._save(todo, layer, n_layers, copied if self.written is None else None)
        except Exception as exc:  # a failed save never reaches the engine: it is reported
            logger.exception("kvpool save crashed")
            for req, _ in todo:
                self.reporter.transfer_finished(req.req_id, "save", ok=False,
                                                error_name=type(exc).__name__)
        finally:
            release()
            with self._lock:
                self._running = None
                self._copied.pop(seq, None)
                self._inflight_bytes -= nbytes

    def _put_new(self, transfers: list[KeyTransfer], copied: Callable[[], None] | None = None
                 ) -> dict[str, int]:
        """Put the keys the pool does not hold yet (one ``batch_exists`` first, so chunks
        another engine stored are not sent again); per key put, its result code. ``copied``:
        called once no engine block is read any more (``SizedCalls.put``)."""
        if not transfers:
            return {}
        try:
            exists = self.backend.batch_exists([t.key for t in transfers])
        except BackendError:  # unknown: the put decides
            exists = [0] * len(transfers)
        todo = [t for t, e in zip(transfers, exists, strict=True) if e != 1]
        if not todo:
            return {}
        slots = self.checksum
        if slots is None:
            codes = self._call_put(todo, [t.addrs for t in todo], [t.sizes for t in todo],
                                   copied)
        else:
            # Each value carries the digest of its bytes (``_checksum``), computed here, after
            # the device finished writing them.
            codes = []
            for start in range(0, len(todo), slots.capacity):
                part = todo[start : start + slots.capacity]
                for j, t in enumerate(part):
                    slots.write(j, digest_of(t.key, t.addrs, t.sizes))
                codes += self._call_put(
                    part, [[*t.addrs, slots.slot(j)] for j, t in enumerate(part)],
                    [[*t.sizes, CHECKSUM_BYTES] for t in part],
                    copied if start + slots.capacity >= len(todo) else None)
        return {t.key: c for t, c in zip(todo, codes, strict=True)}

    def _call_put(self, todo: list[KeyTransfer], addrs: list[list[int]], sizes: list[list[int]],
                  copied: Callable[[], None] | None = None) -> list[int]:
        """One ``batch_put_from``; per key its result code."""
        try:
            return self.calls.put([t.key for t in todo], addrs, sizes, copied)
        except BackendError as exc:
            logger.error("kvpool save of %d keys failed: %s", len(todo), exc)
            return [exc.code if exc.code is not None else ErrorCode.INTERNAL_ERROR] * len(todo)

    def _save(self, per_req: list[tuple[ReqMeta, list[KeyTransfer]]], layer: int | None,
              n_layers: int, copied: Callable[[], None] | None = None) -> None:
        skipped = {req.req_id: len(ts) for req, ts in per_req if req.req_id in self._pool_full}
        results = self._put_new([t for req, ts in per_req if req.req_id not in skipped
                                 for t in ts], copied)
        last_layer = layer is None or layer == n_layers - 1
        for req, transfers in per_req:
            rid = req.req_id
            if rid in skipped:
                self._count_skip(rid, skipped[rid], n_layers, _FULL.name)
                continue
            nbytes, error, failed, full = 0, None, 0, 0
            bad_chunks: set[int] = set()
            by_group: dict[int, int] = {}
            for t in transfers:
                code = results.get(t.key, 0)
                if code in _STORED:
                    if t.key in results and code == 0:
                        nbytes += t.nbytes
                        by_group[t.group] = by_group.get(t.group, 0) + t.nbytes
                    continue
                bad_chunks.add(t.chunk)
                if code == _FULL:
                    full += 1
                else:
                    failed += 1
                    error = error or error_name(code)
            # A chunk (of a group) is written unless one of its keys (one per head share)
            # failed.
            written = ({(t.chunk, t.group) for t in transfers if results.get(t.key) == 0}
                       - {(t.chunk, t.group) for t in transfers
                          if results.get(t.key, 0) not in _STORED}
                       if self.written is not None else None)
            with self._lock:
                self.counters.saved_bytes += nbytes
                self.counters.saved_keys += sum(1 for t in transfers if results.get(t.key) == 0)
                self.counters.save_failed_keys += failed
            if full:
                # Pool full: this request's later saves are skipped, other requests retry.
                with self._lock:
                    self._pool_full.add(rid)
                self._count_skip(rid, full, n_layers, _FULL.name)
            if layer is not None:
                # Layer-wise: one finished event per request and step, summing its layers.
                acc = self._layer_acc.setdefault(rid, _LayerSaveAcc())
                acc.nbytes += nbytes
                acc.bad_chunks |= bad_chunks
                acc.error = acc.error or error
                if written is not None:
                    # A chunk is written once every one of its layer keys was.
                    acc.written = written if acc.written is None else acc.written & written
                    written = acc.written if last_layer and not full else None
                nbytes, bad_chunks, error = acc.nbytes, acc.bad_chunks, acc.error
                if not full:
                    self.reporter.transfer_progress(rid, "save", layer + 1)
                if last_layer or full:
                    self._layer_acc.pop(rid, None)
            if written:
                # Recorded before the save's pending count drops: a request reported in
                # finished_sending has every chunk of its saves in the events already.
                with self._lock:
                    if self.written is not None:
                        self.written.extend((rid, c, g) for c, g in sorted(written))
            if last_layer or full:
                # The chunks this save left stored, for the hub's saved-chunk memory (issue
                # 41: evicted vs never saved). A key is kvpool@model@digest@layout@hash[@L..].
                stored = {t.chunk: t.key for t in transfers if t.chunk not in bad_chunks}
                if stored:
                    self.reporter.saved([stored[c].split("@")[4] for c in sorted(stored)])
                self.reporter.transfer_finished(
                    rid, "save", ok=not bad_chunks, nbytes=nbytes,
                    error_name=_FULL.name if full else error,
                    failed_blocks=len(bad_chunks) * self._blocks_per_chunk,
                    # Layer-wise saves are never hybrid (the connector turns them off).
                    bytes_by_group=_hybrid_only(by_group) if layer is None else None,
                )

    def _count_skip(self, req_id: str, keys: int, n_layers: int, reason: str) -> None:
        """Count ``keys`` keys skipped for ``reason``; the report is in blocks (a layer-wise
        key holds one layer of its blocks, so ``n_layers`` of them make whole blocks)."""
        with self._lock:
            self.counters.save_skipped_keys += keys
        blocks = keys * self._blocks_per_chunk
        self.reporter.save_skipped(req_id, blocks // n_layers if n_layers else blocks, reason)

    def settle(self, req_ids: set[str]) -> None:
        """Preemption: drop the queued saves of ``req_ids`` (their blocks are about to be
        reused; counted as ``PREEMPTED``) and wait only for a running save of theirs to stop
        reading their blocks: once its values are in the staging buffer, not its put."""
        with self._lock:
            for rid in req_ids:
                self._dropped[rid] = self._seq
            running = self._running
            ev = (self._copied.get(running[0])
                  if running is not None and running[1] & req_ids else None)
        if ev is not None:
            ev.wait()

    def take_written(self) -> list[tuple[str, int, int]]:
        """``(request id, chunk, KV-cache group)`` of the chunks saves wrote since the last
        call (empty when not recorded)."""
        with self._lock:
            if not self.written:
                return []
            out = list(self.written)
            self.written.clear()
        return out

    @property
    def inflight_bytes(self) -> int:
        """Bytes of saves submitted and not finished (at most ``budget_bytes``)."""
        with self._lock:
            return self._inflight_bytes

    def pending(self, req_ids: Iterable[str]) -> set[str]:
        """Those of ``req_ids`` with saves submitted and not finished."""
        with self._lock:
            return {r for r in req_ids if r in self._pending}

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the pool-full and preemption marks of finished requests."""
        with self._lock:
            for rid in req_ids:
                self._pool_full.discard(rid)
                self._dropped.pop(rid, None)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted save has finished; True if all did within
        ``timeout_s`` seconds (``None``: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            futures = list(self._futures)
        for f in futures:
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
