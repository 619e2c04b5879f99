"""Data-path benchmark, ``--cross-process`` mode (issue 38), for ``bench/bench_datapath.py``.

Holds that mode's code, moved out of ``bench_datapath.py`` to keep both modules under 600
lines: the model shapes (``SHAPES``), one engine's rounds of one shape (``_cross_shape``), N
engines at once, each in its own spawned process (``_engines_at_once``, ``_engine_process``),
the table (``cross_process``) and the ``--caller-nice`` / ``--stage-below-kib`` backend
wrapper (``_BenchCalls``); also ``_Settings``, the worker settings both modes use.
``bench_datapath.py`` (its module docstring describes the mode, its ``main`` parses the
options) imports this module; this module imports nothing from it. Not run on its own:

    .venv/bin/python bench/bench_datapath.py --cross-process [--rounds 11] [--chunks 2] \\
        [--engines 1 2 4] [--caller-nice 19] [--stage-below-kib 128]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from kvpool_agent.protocol import HealthCheck, PoolStats
from kvpool_agent.reporter import Reporter
from kvpool_connector._layout import ranges_for_blocks
from kvpool_connector.backends.base import Backend, RemoveResult
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.keys import (
    ALL_KEYS_PATTERN,
    ParallelLayout,
    chunk_hashes,
    chunk_keys,
    shard_prefix,
)
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadSpec, ReqMeta
from kvpool_connector.staging import TransportLimits
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster, LocalPoolStore

__all__ = ["SHAPES", "cross_process"]


@dataclass(frozen=True)
class _Settings:
    block_size: int
    chunk_size: int
    use_layerwise: bool = False
    load_async: bool = False
    layerwise_timeout_ms: int = 30_000
    save_budget_bytes: int = 1 << 30
    checksum: bool = False
    hash_algo: str = "sha256"
    staging_buffer_bytes: int | None = None  # the connector's default: auto


class _BenchCalls(Backend):
    """Delegates to a real backend with two ``--cross-process`` experiments, raw and worker
    paths alike (their ratio stays like for like):

    * ``nice`` (``--caller-nice``): batch puts and gets made from one thread of its own at
      that nice value (the calling thread waits for each, blocked). Mooncake's store client
      (mooncake-transfer-engine 0.3.13.post1, built without ``USE_EVENT_DRIVEN_COMPLETION``)
      polls a batch call's completion in the calling thread
      (``TransferEngineOperationState::wait_for_completion``: ``clock_gettime`` and
      ``getTransferStatus`` under a mutex, no sleep), a core for the whole call; niced, the
      poll yields to the threads doing the work (the client's TCP thread, the staging copies,
      the store's process). 0: the calling thread, as the worker does;
    * ``stage_below`` (``--stage-below-kib``): the transport's ``stage_below`` (bytes) in place
      of ``TCP_LIMITS``' (``None``: unchanged), e.g. to move MLA's 144 KiB ranges of 128-token
      blocks zero-copy.
    """

    name = "bench"

    def __init__(self, inner: Backend, nice: int, stage_below: int | None) -> None:
        self.inner = inner
        self.limits = inner.transport_limits()
        if stage_below is not None:
            self.limits = dataclasses.replace(self.limits, stage_below=stage_below)
        self.caller = ThreadPoolExecutor(
            1, thread_name_prefix="bench-call",
            initializer=lambda: os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice))

    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        return self.inner.batch_exists(keys)

    def register_buffer(self, addr: int, size: int) -> None:
        self.inner.register_buffer(addr, size)

    def lease_ttl_ms(self) -> int:
        return self.inner.lease_ttl_ms()

    def transfer_timeout_ms(self) -> int:
        return self.inner.transfer_timeout_ms()

    def transport_limits(self) -> TransportLimits:
        return self.limits

    def batch_put_from(self, keys: Sequence[str], addrs: Sequence[Sequence[int]],
                       sizes: Sequence[Sequence[int]]) -> list[int]:
        return self.caller.submit(self.inner.batch_put_from, keys, addrs, sizes).result()

    def batch_get_into(self, keys: Sequence[str], addrs: Sequence[Sequence[int]],
                       sizes: Sequence[Sequence[int]]) -> list[int]:
        return self.caller.submit(self.inner.batch_get_into, keys, addrs, sizes).result()

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        return self.inner.batch_remove(keys)

    def remove_by_scope(self, pattern: str, *, dry_run: bool, force: bool = False) -> RemoveResult:
        return self.inner.remove_by_scope(pattern, dry_run=dry_run, force=force)

    def health(self) -> list[HealthCheck]:
        return self.inner.health()

    def stats(self) -> PoolStats:
        return self.inner.stats()

    def close(self) -> None:
        self.caller.shutdown(wait=True)
        self.inner.close()


SHAPES: dict[str, tuple[int, int, int]] = {
    "llama3-8b": (32, 8, 128),
    "llama3-70b": (80, 8, 128),
    # MLA's 576-element latent as the CPU layout's K and V halves of one head (same bytes).
    "deepseek-v3-mla": (61, 1, 288),
}
"""``--cross-process`` shapes: (layers, KV heads, head size), bf16."""


def _shape_caches(layers: int, heads: int, head: int, block: int, num_blocks: int,
                  fill: bool) -> dict[str, torch.Tensor]:
    shape = (num_blocks, heads, block, 2 * head)
    make = torch.randn if fill else torch.zeros
    return {f"model.layers.{i}.self_attn.attn": make(shape, dtype=torch.bfloat16)
            for i in range(layers)}


Span = tuple[float, float, float, float]
"""One timed operation: ``time.monotonic()`` at its start and end (one clock for every process
on the host, so the spans of engines running at once can be laid over each other), the CPU
seconds its process used meanwhile (``time.process_time()``, every thread of it) and those the
store's ``mooncake_client`` process used meanwhile (all engines' work on it)."""


def _cpu_s(proc: psutil.Process) -> float:
    """CPU seconds (user + system, every thread) ``proc`` has used so far."""
    t = proc.cpu_times()
    return t.user + t.system


def _no_sync() -> None:
    """One engine: nothing to wait for."""


def _cross_shape(name: str, block: int, args: argparse.Namespace, master: tuple[str, str],
                 store_pid: int, engine: int = 0, sync: Callable[[], object] = _no_sync
                 ) -> dict[str, list[Span]]:
    """One engine's rounds of one shape: the span of each operation of each path.

    ``master``: the ``mooncake_master``'s address and admin URL; ``store_pid``: the pool's
    ``mooncake_client`` process (its CPU time is read around each operation); ``engine``:
    this engine's index (engine 0 clears the pool between rounds); ``sync``: waits for every
    engine before each operation (a barrier), so N engines run each path at once."""
    layers, heads, head = SHAPES[name]
    store = psutil.Process(store_pid)
    bpc = args.chunk_tokens // block
    n_chunks = args.chunks
    n_blocks = n_chunks * bpc
    src = _shape_caches(layers, heads, head, block, 2 * n_blocks + 2, fill=True)
    dst = _shape_caches(layers, heads, head, block, 2 * n_blocks + 2, fill=False)
    src_ids = list(range(0, 2 * n_blocks, 2))  # every other block: unmerged ranges
    dst_ids = list(range(1, 2 * n_blocks, 2))
    value = bpc * layers * heads * block * 2 * head * 2
    flat_src = torch.randint(-128, 127, (n_chunks * value,), dtype=torch.int8)
    flat_dst = torch.zeros_like(flat_src)
    settings = _Settings(block_size=block, chunk_size=args.chunk_tokens,
                         staging_buffer_bytes=None if args.staging_mib is None
                         else args.staging_mib << 20)
    cfg = {"master_server_address": master[0], "global_segment_size": 0,
           "local_buffer_size": "16MB", "master_admin_url": master[1]}
    # A client per shape: Mooncake keeps a registration for the client's life, and the next
    # shape's tensors may reuse this one's addresses.
    backend: Backend = MooncakeBackend(MooncakeConfig.load({"mooncake": cfg}))
    if args.caller_nice or args.stage_below_kib is not None:
        backend = _BenchCalls(backend, args.caller_nice, None if args.stage_below_kib is None
                              else args.stage_below_kib << 10)
    spans: dict[str, list[Span]] = {k: [] for k in (
        "raw contig put", "raw 1-key put", "worker save", "stage copy", "raw contig get",
        "raw 1-key get", "worker load",
        "copy")}
    try:
        for t in (flat_src, flat_dst):
            backend.register_buffer(t.data_ptr(), t.numel())
        writer = KVPoolWorker(settings, ParallelLayout(), "bench", backend, Reporter())
        writer.register_kv_caches(src)
        reader = KVPoolWorker(settings, ParallelLayout(), "bench", backend, Reporter())
        reader.register_kv_caches(dst)
        s_idx, d_idx = torch.tensor(src_ids), torch.tensor(dst_ids)
        # What staging copies on a save, alone: every chunk's ranges into one contiguous
        # value each (ctypes.memmove, as kvpool_connector.staging), no pool call.
        assert writer.kv is not None  # registered above
        gather = [ranges_for_blocks(writer.kv.layers, src_ids[c * bpc:(c + 1) * bpc])
                  for c in range(n_chunks)]
        for rnd in range(args.rounds + 1):
            tag = f"{engine}-{uuid.uuid4().hex}"
            hashes = chunk_hashes([rnd] * (n_chunks * args.chunk_tokens), args.chunk_tokens,
                                  extra=tag.encode())
            raw_keys = chunk_keys([shard_prefix("bench-raw", "0" * 12, ParallelLayout())],
                                  hashes)
            raw1_keys = chunk_keys([shard_prefix("bench-raw1", "0" * 12, ParallelLayout())],
                                   hashes)
            save_meta = KVPoolConnectorMetadata(requests=[ReqMeta(
                req_id=f"s{rnd}", block_ids=src_ids, chunk_hashes=hashes, save_from_chunk=0,
                save_to_chunk=n_chunks, is_last_save=True)])
            load_meta = KVPoolConnectorMetadata(requests=[ReqMeta(
                req_id=f"l{rnd}", block_ids=dst_ids, chunk_hashes=hashes,
                load=LoadSpec(0, n_chunks * args.chunk_tokens, can_load=True))])

            def raw_put(keys: list[str] = raw_keys) -> None:
                res = backend.batch_put_from(
                    keys, [[flat_src.data_ptr() + i * value] for i in range(n_chunks)],
                    [[value]] * n_chunks)
                assert res == [0] * n_chunks, res

            def raw_get(keys: list[str] = raw_keys) -> None:
                res = backend.batch_get_into(
                    keys, [[flat_dst.data_ptr() + i * value] for i in range(n_chunks)],
                    [[value]] * n_chunks)
                assert res == [value] * n_chunks, res

            def raw_put1(keys: list[str] = raw1_keys) -> None:
                for i, key in enumerate(keys):  # one call per key, as a staged worker makes
                    res = backend.batch_put_from([key], [[flat_src.data_ptr() + i * value]],
                                                 [[value]])
                    assert res == [0], res

            def raw_get1(keys: list[str] = raw1_keys) -> None:
                for i, key in enumerate(keys):
                    res = backend.batch_get_into([key], [[flat_dst.data_ptr() + i * value]],
                                                 [[value]])
                    assert res == [value], res

            def save(meta: KVPoolConnectorMetadata = save_meta) -> None:
                writer.start_load_kv(KVPoolConnectorMetadata())
                writer.wait_for_save(meta)
                assert writer.drain_saves(120)
                assert writer.counters.save_failed_keys == 0

            def load(meta: KVPoolConnectorMetadata = load_meta) -> None:
                reader.start_load_kv(meta)
                assert not reader.get_block_ids_with_load_errors()

            def copy() -> None:
                for lname, t in src.items():
                    dst[lname].index_copy_(0, d_idx, t.index_select(0, s_idx))

            def stage_copy() -> None:
                at = flat_dst.data_ptr()
                for addrs, sizes in gather:
                    for a, n in zip(addrs, sizes, strict=True):
                        ctypes.memmove(at, a, n)
                        at += n

            groups: list[list[tuple[str, Callable[[], None]]]] = [
                [("raw contig put", raw_put), ("raw 1-key put", raw_put1), ("worker save", save),
                 ("stage copy", stage_copy)],
                [("raw contig get", raw_get), ("raw 1-key get", raw_get1), ("worker load", load),
                 ("copy", copy)]]
            for group in groups:
                for pname, fn in (reversed(group) if rnd % 2 else group):
                    if fn is load:  # the copy may have filled them: the load must write them
                        for t in dst.values():
                            t.index_fill_(0, d_idx, 0)
                    sync()
                    t0, c0, s0 = time.monotonic(), time.process_time(), _cpu_s(store)
                    fn()
                    if rnd:  # round 0 warms the segment's pages up
                        spans[pname].append((t0, time.monotonic(), time.process_time() - c0,
                                             _cpu_s(store) - s0))
                    if fn is load:
                        for lname in src:
                            assert torch.equal(src[lname].index_select(0, s_idx),
                                               dst[lname].index_select(0, d_idx)), \
                                f"load not bit-exact ({lname})"
            sync()  # every engine done with this round's keys
            if engine == 0:
                backend.remove_by_scope(ALL_KEYS_PATTERN, dry_run=False, force=True)
        writer.shutdown()
        reader.shutdown()
    finally:
        backend.close()
    return spans


def _engine_process(name: str, block: int, args: argparse.Namespace, master: tuple[str, str],
                    store_pid: int, engine: int, barrier: Any, out: Any) -> None:
    """One of ``--engines`` N engines: its own process and store client; its spans to
    ``out``."""
    try:
        out.put((engine, _cross_shape(name, block, args, master, store_pid, engine,
                                      barrier.wait)))
    except BaseException as e:
        barrier.abort()  # the others stop waiting for this one
        out.put((engine, repr(e)))
        raise


def _engines_at_once(name: str, block: int, args: argparse.Namespace, master: tuple[str, str],
                     store_pid: int, n: int) -> list[dict[str, list[Span]]]:
    """``n`` engines' spans of one shape, each engine its own process, each path at once."""
    if n == 1:
        return [_cross_shape(name, block, args, master, store_pid)]
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(n, timeout=600), ctx.Queue()
    procs = [ctx.Process(target=_engine_process, args=(name, block, args, master, store_pid, i,
                                                       barrier, out)) for i in range(n)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(60)
    failed = {i: r for i, r in got.items() if isinstance(r, str)}
    if failed:
        raise RuntimeError(f"{name} block {block}, {n} engines: {failed}")
    return [got[i] for i in range(n)]


def cross_process(args: argparse.Namespace) -> None:
    """``--cross-process``: the table per shape and number of engines (GB/s = 1e9 bytes/s of
    KV moved). Per engine: each engine's own operation (median and min-max over engines and
    rounds); aggregate: every engine's bytes over the round's wall time, from the first
    engine's start to the last one's end (median and min-max over rounds)."""
    load_start = os.getloadavg()[0]
    rows = [(s, b, n) for n in args.engines for s in args.shapes for b in args.block_sizes]
    per_token = {s: layers * heads * 2 * head * 2 for s, (layers, heads, head) in SHAPES.items()}
    need = max(n * 2 * args.chunks * args.chunk_tokens * per_token[s]
               for s in args.shapes for n in args.engines)
    with LocalMooncakeMaster(eviction_high_watermark_ratio=0.95) as master, \
            LocalPoolStore(master, max(64 << 20, 2 * need)) as store:
        addr = (master.address, master.admin_url)
        assert store.proc is not None  # started by the with
        results = {row: _engines_at_once(row[0], row[1], args, addr, store.proc.pid, row[2])
                   for row in rows}
    print(f"\nKV data path across processes: the pool in its own mooncake_client, TCP on "
          f"127.0.0.1, {'/'.join(map(str, args.engines))} engines at once (each its own "
          f"process and client), {args.chunks} chunks of {args.chunk_tokens} tokens per "
          f"operation per engine, {args.rounds} rounds, backend calls at nice "
          f"{args.caller_nice}, staged below "
          f"{'the default' if args.stage_below_kib is None else f'{args.stage_below_kib} KiB'}"
          f"; load average {load_start:.2f} at "
          f"start, {os.getloadavg()[0]:.2f} at the end\n")
    print(f"{'shape':<16}{'block':>6}{'eng':>4}{'path':>16}{'engine GB/s':>12}{'min-max':>12}"
          f"{'aggr. GB/s':>11}{'min-max':>12}{'vs raw':>8}{'CPU ms':>8}{'store ms':>9}"
          f"{'cores':>6}")
    ref = {"worker save": "raw contig put", "worker load": "raw contig get",
           "raw 1-key put": "raw contig put", "raw 1-key get": "raw contig get",
           "stage copy": "raw contig put", "copy": "raw contig get"}
    for (s, b, n), engines in results.items():
        total = args.chunks * args.chunk_tokens * per_token[s]
        aggr: dict[str, list[float]] = {}
        for path in engines[0]:
            own = [total / (end - start) / 1e9 for e in engines for start, end, _, _ in e[path]]
            cpu_ms = statistics.median(c * 1e3 for e in engines for _, _, c, _ in e[path])
            store_ms = statistics.median(sc * 1e3 for _, _, _, sc in engines[0][path])
            # Cores busy: every engine's CPU and the store's over the round's wall time.
            cores = statistics.median(
                (sum(sp[2] for sp in rnd) + rnd[0][3])
                / (max(sp[1] for sp in rnd) - min(sp[0] for sp in rnd))
                for rnd in zip(*(e[path] for e in engines), strict=True))
            aggr[path] = [n * total / (max(sp[1] for sp in rnd) - min(sp[0] for sp in rnd)) / 1e9
                          for rnd in zip(*(e[path] for e in engines), strict=True)]
            vs = (f"{statistics.median(aggr[path]) / statistics.median(aggr[ref[path]]):.2f}x"
                  if path in ref else "")
            print(f"{s:<16}{b:>6}{n:>4}{path:>16}{statistics.median(own):>12.2f}"
                  f"{f'{min(own):.2f}-{max(own):.2f}':>12}{statistics.median(aggr[path]):>11.2f}"
                  f"{f'{min(aggr[path]):.2f}-{max(aggr[path]):.2f}':>12}{vs:>8}{cpu_ms:>8.1f}"
                  f"{store_ms:>9.1f}{cores:>6.2f}")
    print("\n'vs raw': aggregate median over raw contiguous's of the same engines and rounds "
          "(copy: a tensor copy of the same bytes in each engine, against raw get; raw 1-key: "
          "the same contiguous values one key per call, as a staged worker moves values larger "
          "than half its buffer; stage "
          "copy: what staging copies on a save, alone, against raw put); 'CPU ms': median "
          "CPU time of the engine's process per operation (every thread); 'store ms': the "
          "store's mooncake_client process's meanwhile (engine 0's operations: with several "
          "engines, all engines' work on it); 'cores': every engine's CPU and the store's "
          f"over the round's wall time (median), of {os.cpu_count()} CPUs")
    print("goal (issue 38): worker >= 0.9x raw contiguous at every shape and number of engines")
