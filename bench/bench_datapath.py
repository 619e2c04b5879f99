"""Data-path throughput: KVPoolWorker save/load vs the raw Mooncake batch call vs a tensor copy.

All three move the same vLLM-shaped paged KV blocks (vLLM CPU layout ``(num_blocks, kv_heads,
block_size, 2 * head_size)``, bf16, one tensor per layer) in the same run, against a real
``mooncake_master`` on 127.0.0.1:

* ``raw``: ``MooncakeBackend.batch_put_from`` / ``batch_get_into`` with address lists built
  once beforehand (the floor any connector pays);
* ``worker``: ``KVPoolWorker`` driven exactly as vLLM drives it (``start_load_kv``,
  ``wait_for_save`` + waiting for the background save; a synchronous load), including its
  planning, the existence check before puts and the Reporter calls;
* ``copy``: ``torch.index_select`` of the same blocks into another cache (no pool at all);
* ``... +stats``: the ``worker`` rows with the connector's vLLM stats on (reporter wrapped in
  ``StatsTap``, ``StatsCollector.take`` after every operation, as vLLM calls
  ``get_kv_connector_stats`` every step) and, on the save, its KV events too
  (``enable_kv_events``, ``take_written_chunks`` after every save, as vLLM calls
  ``get_kv_connector_kv_cache_events`` every step), on keys of their own: the cost of the
  metrics and events.
* ``... +checksum``: the worker with ``checksum`` on (an XXH3-64 digest computed over every
  value on save and verified on load), through a second store client (with its own segment)
  on the same caches.

Goal (issue 13): worker >= 0.9x raw on the median of rounds; the checksum rows show what the
integrity check costs. Rounds alternate the paths; the table shows the median, best and
spread (min-max) of the rounds, then the goal with the per-round ratio of worker to raw (the
two run back to back in each round) and the load average. This default mode moves blocks into
a segment the benchmark's own client holds: a local copy, not the network.

``--cross-process`` (issue 38) runs real models' KV shapes (``--shapes``: Llama-3-8B 128 KiB,
Llama-3-70B 320 KiB, DeepSeek-V3 MLA 68.6 KiB per token; ``--block-sizes`` 16 and 128) with the
pool in a separate ``mooncake_client`` process and no segment in the engines' clients, TCP on
127.0.0.1, ``--engines`` N at once (default 1; e.g. ``1 2 4``: each engine its own process and
store client, every path run by all N at once after a barrier): ``worker`` save/load (sized
calls and staging, ``kvpool_connector.staging``) against ``raw contig`` (``batch_put_from`` /
``batch_get_into`` of the same bytes as one contiguous range per key; ``raw 1-key``: the same,
one key per call, as a staged worker moves values larger than half its staging buffer) and
``copy`` (``index_select`` into another cache); per-engine and aggregate GB/s, median and
min-max of the rounds; ``stage copy`` (what staging copies on a save, alone: ``ctypes.memmove``
of every range into one contiguous value, no pool call) and each path's CPU time per
operation, which together say where the worker's time over raw goes. ``--caller-nice N`` makes
every batch put and get, raw and worker alike, from a thread at nice N (``_BenchCalls``:
Mooncake's client busy-polls a call's completion in the calling thread, a core per call in
flight); ``--stage-below-kib K`` stages values whose mean range is below K KiB instead of 256.
Every round checks every loaded block against its source (the blocks are zeroed before each
worker load, so the load has written them). Goal: worker >= 0.9x raw contiguous at every shape
and number of engines. That mode's code is in ``bench/_datapath_cross.py``.

    .venv/bin/python bench/bench_datapath.py [--rounds 41] [--blocks 128] [--layers 16]
    .venv/bin/python bench/bench_datapath.py --cross-process [--rounds 11] [--chunks 2] \\
        [--engines 1 2 4] [--caller-nice 19] [--stage-below-kib 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# This script's own directory (there already when run as a script): _datapath_cross.
sys.path.insert(1, str(Path(__file__).resolve().parent))
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ["PATH"] = os.path.join(sys.prefix, "bin") + os.pathsep + os.environ.get("PATH", "")

from _datapath_cross import SHAPES, _Settings, cross_process

from kvpool_agent.protocol import HealthCheck, PoolStats
from kvpool_agent.reporter import Reporter
from kvpool_connector._layout import ranges_for_blocks
from kvpool_connector._stats import StatsCollector, StatsTap
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
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster

__all__ = ["main"]

BLOCK_SIZE = 16
KV_HEADS = 8
HEAD_SIZE = 128


def _caches(layers: int, num_blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    make = torch.randn if fill else torch.zeros
    return {f"model.layers.{i}.self_attn.attn": make(shape, dtype=torch.bfloat16)
            for i in range(layers)}


class _TimedBackend(Backend):
    """Delegates to a real backend and adds up the seconds spent inside its calls, so the
    worker's own overhead (planning, threads, bookkeeping) can be told apart from machine
    noise in the transfer itself."""

    name = "timed"

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.busy = 0.0

    def _t(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy += time.perf_counter() - t0

    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        return cast(list[int], self._t(self.inner.batch_exists, keys))

    def register_buffer(self, addr: int, size: int) -> None:
        self.inner.register_buffer(addr, size)

    def batch_put_from(self, keys: Sequence[str], addrs: Sequence[Sequence[int]],
                       sizes: Sequence[Sequence[int]]) -> list[int]:
        return cast(list[int], self._t(self.inner.batch_put_from, keys, addrs, sizes))

    def batch_get_into(self, keys: Sequence[str], addrs: Sequence[Sequence[int]],
                       sizes: Sequence[Sequence[int]]) -> list[int]:
        return cast(list[int], self._t(self.inner.batch_get_into, keys, addrs, sizes))

    def remove_by_scope(self, pattern: str, *, dry_run: bool, force: bool = False) -> RemoveResult:
        return self.inner.remove_by_scope(pattern, dry_run=dry_run, force=force)

    def health(self) -> list[HealthCheck]:
        return self.inner.health()

    def stats(self) -> PoolStats:
        return self.inner.stats()


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0



def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the table (throughput in GB/s = 1e9 bytes/s)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=41,
                    help="timed rounds (one warm-up round more); the median needs many on a "
                    "busy machine")
    ap.add_argument("--blocks", type=int, default=128, help="blocks moved per operation")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--blocks-per-chunk", type=int, default=4)
    ap.add_argument("--cross-process", action="store_true",
                    help="real shapes, the pool in its own mooncake_client (see above)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--block-sizes", nargs="+", type=int, default=[16, 128])
    ap.add_argument("--chunk-tokens", type=int, default=512, help="--cross-process chunk")
    ap.add_argument("--chunks", type=int, default=2, help="--cross-process keys per operation")
    ap.add_argument("--staging-mib", type=int, default=None,
                    help="--cross-process workers' staging buffer (MiB; default: the "
                    "connector's staging_buffer: auto, four values, 64 MiB-1 GiB)")
    ap.add_argument("--caller-nice", type=int, default=0,
                    help="--cross-process: make every batch put and get (raw and worker) from "
                    "a thread at this nice value (0: the calling thread, as the worker does); "
                    "Mooncake's client busy-polls a call's completion in its caller")
    ap.add_argument("--stage-below-kib", type=int, default=None,
                    help="--cross-process: stage values whose mean range is below this many "
                    "KiB (default: the transport's, 256 over TCP); 0 moves all zero-copy")
    ap.add_argument("--engines", nargs="+", type=int, default=[1],
                    help="--cross-process engines saving and loading at once (e.g. 1 2 4), "
                    "each its own process and store client")
    args = ap.parse_args(argv)
    if args.cross_process:
        cross_process(args)
        return
    load_start = os.getloadavg()[0]
    bpc = args.blocks_per_chunk
    n_chunks = args.blocks // bpc
    n_blocks = n_chunks * bpc
    num_blocks = 2 * n_blocks + 8
    src = _caches(args.layers, num_blocks, fill=True)
    dst = _caches(args.layers, num_blocks, fill=False)
    src_ids = list(range(0, 2 * n_blocks, 2))  # every other block: realistic, unmerged ranges
    dst_ids = list(range(1, 2 * n_blocks, 2))
    settings = _Settings(block_size=BLOCK_SIZE, chunk_size=BLOCK_SIZE * bpc)

    with LocalMooncakeMaster(eviction_high_watermark_ratio=0.95) as master:
        total = n_blocks * args.layers * KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2
        # raw, worker (+stats) and checksum-worker copies of the blocks, with room to spare.
        segment = max(64 << 20, 5 * total)
        cfg = {"master_server_address": master.address, "global_segment_size": segment,
               "local_buffer_size": "16MB", "master_admin_url": master.admin_url}
        backend = MooncakeBackend(MooncakeConfig.load({"mooncake": cfg}))
        # A client registers a memory range once: the checksum workers get their own, with a
        # segment of its own too, so its values move by local copy like the others'.
        ck_backend = MooncakeBackend(MooncakeConfig.load({"mooncake": cfg}))
        try:
            timed = _TimedBackend(backend)
            writer = KVPoolWorker(settings, ParallelLayout(), "bench", timed, Reporter())
            writer.register_kv_caches(src)
            reader = KVPoolWorker(settings, ParallelLayout(), "bench", timed, Reporter())
            reader.register_kv_caches(dst)
            # Caches of their own: a buffer is registered with the Mooncake client once.
            src_s = {k: v.clone() for k, v in src.items()}
            dst_s = _caches(args.layers, num_blocks, fill=False)
            w_tap, r_tap = StatsTap(Reporter()), StatsTap(Reporter())
            writer_s = KVPoolWorker(settings, ParallelLayout(), "bench", timed, w_tap)
            writer_s.register_kv_caches(src_s)
            writer_s.enable_kv_events()
            reader_s = KVPoolWorker(settings, ParallelLayout(), "bench", timed, r_tap)
            reader_s.register_kv_caches(dst_s)
            w_stats = StatsCollector(lambda: writer_s.counters, w_tap, worker=True)
            r_stats = StatsCollector(lambda: reader_s.counters, r_tap, worker=True)
            ck_settings = _Settings(block_size=BLOCK_SIZE, chunk_size=BLOCK_SIZE * bpc,
                                    checksum=True)
            ck_writer = KVPoolWorker(ck_settings, ParallelLayout(), "bench", ck_backend,
                                     Reporter())
            ck_writer.register_kv_caches(src)
            ck_reader = KVPoolWorker(ck_settings, ParallelLayout(), "bench", ck_backend,
                                     Reporter())
            ck_reader.register_kv_caches(dst)
            assert writer.kv is not None and reader.kv is not None
            chunk_src = [src_ids[i * bpc:(i + 1) * bpc] for i in range(n_chunks)]
            chunk_dst = [dst_ids[i * bpc:(i + 1) * bpc] for i in range(n_chunks)]
            raw_src = [ranges_for_blocks(writer.kv.layers, ids) for ids in chunk_src]
            raw_dst = [ranges_for_blocks(reader.kv.layers, ids) for ids in chunk_dst]
            times: dict[str, list[float]] = {k: [] for k in (
                "raw put", "worker save", "save +stats", "save +checksum", "raw get",
                "worker load", "load +stats", "load +checksum", "copy")}
            overhead: dict[str, list[float]] = {
                "worker save": [], "save +stats": [], "worker load": [], "load +stats": []}

            s_idx, d_idx = torch.tensor(src_ids), torch.tensor(dst_ids)

            def copy() -> None:
                for name, t in src.items():
                    dst[name].index_copy_(0, d_idx, t.index_select(0, s_idx))

            # Round 0 is a warm-up (first touch of the segment's pages), not reported.
            for rnd in range(args.rounds + 1):
                tag = uuid.uuid4().hex
                hashes = chunk_hashes([rnd] * (n_chunks * settings.chunk_size), settings.chunk_size,
                                      extra=tag.encode())
                raw_keys = chunk_keys([shard_prefix("bench-raw", "0" * 12, ParallelLayout())],
                                      hashes)
                save_meta = KVPoolConnectorMetadata(requests=[ReqMeta(
                    req_id=f"s{rnd}", block_ids=src_ids, chunk_hashes=hashes,
                    save_from_chunk=0, save_to_chunk=n_chunks, is_last_save=True)])
                load_meta = KVPoolConnectorMetadata(requests=[ReqMeta(
                    req_id=f"l{rnd}", block_ids=dst_ids, chunk_hashes=hashes,
                    load=LoadSpec(0, n_chunks * settings.chunk_size, can_load=True))])
                # The +stats rows write and read keys of their own (a put of a present key
                # would be skipped).
                hashes_s = chunk_hashes([rnd] * (n_chunks * settings.chunk_size),
                                        settings.chunk_size, extra=(tag + "s").encode())
                save_meta_s = KVPoolConnectorMetadata(requests=[ReqMeta(
                    req_id=f"ss{rnd}", block_ids=src_ids, chunk_hashes=hashes_s,
                    save_from_chunk=0, save_to_chunk=n_chunks, is_last_save=True)])
                load_meta_s = KVPoolConnectorMetadata(requests=[ReqMeta(
                    req_id=f"ls{rnd}", block_ids=dst_ids, chunk_hashes=hashes_s,
                    load=LoadSpec(0, n_chunks * settings.chunk_size, can_load=True))])

                def raw_put(keys: list[str] = raw_keys) -> None:
                    res = backend.batch_put_from(keys, [a for a, _ in raw_src],
                                                 [s for _, s in raw_src])
                    assert res == [0] * n_chunks, res

                def worker_save(meta: KVPoolConnectorMetadata = save_meta) -> None:
                    writer.start_load_kv(KVPoolConnectorMetadata())
                    writer.wait_for_save(meta)
                    assert writer.drain_saves(60)

                def save_stats(meta: KVPoolConnectorMetadata = save_meta_s) -> None:
                    writer_s.start_load_kv(KVPoolConnectorMetadata())
                    writer_s.wait_for_save(meta)
                    assert writer_s.drain_saves(60)
                    taken = w_stats.take()
                    assert taken is not None and taken.data["counters"]["saved_bytes"] == total
                    assert len(writer_s.take_written_chunks()) == n_chunks

                def load_stats(meta: KVPoolConnectorMetadata = load_meta_s) -> None:
                    reader_s.start_load_kv(meta)
                    assert not reader_s.get_block_ids_with_load_errors()
                    taken = r_stats.take()
                    assert taken is not None and taken.data["counters"]["loaded_bytes"] == total

                def raw_get(keys: list[str] = raw_keys) -> None:
                    res = backend.batch_get_into(keys, [a for a, _ in raw_dst],
                                                 [s for _, s in raw_dst])
                    assert all(r > 0 for r in res), res

                def worker_load(meta: KVPoolConnectorMetadata = load_meta) -> None:
                    reader.start_load_kv(meta)
                    assert not reader.get_block_ids_with_load_errors()

                def ck_save(meta: KVPoolConnectorMetadata = save_meta) -> None:
                    ck_writer.start_load_kv(KVPoolConnectorMetadata())
                    ck_writer.wait_for_save(meta)
                    assert ck_writer.drain_saves(60)

                def ck_load(meta: KVPoolConnectorMetadata = load_meta) -> None:
                    ck_reader.start_load_kv(meta)
                    assert not ck_reader.get_block_ids_with_load_errors()
                    assert ck_reader.counters.checksum_failures == 0

                order: list[tuple[str, Callable[[], None]]] = [
                    ("raw put", raw_put), ("worker save", worker_save),
                    ("save +stats", save_stats), ("save +checksum", ck_save)]
                if rnd % 2:
                    order.reverse()
                for name, fn in order:
                    busy0 = timed.busy
                    elapsed = _timed(fn)
                    if rnd:
                        times[name].append(elapsed)
                        if name in overhead:
                            overhead[name].append(elapsed - (timed.busy - busy0))
                order = [("raw get", raw_get), ("worker load", worker_load),
                         ("load +stats", load_stats), ("load +checksum", ck_load),
                         ("copy", copy)]
                if rnd % 2:
                    order.reverse()
                for name, fn in order:
                    busy0 = timed.busy
                    elapsed = _timed(fn)
                    if rnd:
                        times[name].append(elapsed)
                        if name in overhead:
                            overhead[name].append(elapsed - (timed.busy - busy0))
                for s_b, d_b in zip(src_ids[:4], dst_ids[:4], strict=True):
                    for name in src:
                        assert torch.equal(src[name][s_b], dst[name][d_b]), "load not bit-exact"
                backend.remove_by_scope(ALL_KEYS_PATTERN, dry_run=False, force=True)

            for w in (writer, reader, writer_s, reader_s, ck_writer, ck_reader):
                w.shutdown()
        finally:
            ck_backend.close()
            backend.close()

    def gbps(t: float) -> float:
        return total / t / 1e9

    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(f"\nKV data path: {n_blocks} blocks x {args.layers} layers "
          f"({total / 2**20:.0f} MiB per operation, {n_chunks} keys of {bpc} blocks), "
          f"{args.rounds} rounds, real mooncake_master over TCP on 127.0.0.1; load average "
          f"{load_start:.2f} at start, {os.getloadavg()[0]:.2f} at the end\n")
    print(f"{'path':<15}{'median GB/s':>13}{'best GB/s':>11}{'median ms':>11}"
          f"{'min-max ms':>14}{'vs raw (median)':>17}{'vs raw (best)':>15}")
    ref = {"raw put": "raw put", "worker save": "raw put", "save +stats": "raw put",
           "save +checksum": "raw put", "raw get": "raw get", "worker load": "raw get",
           "load +stats": "raw get", "load +checksum": "raw get",
           "copy": "raw get"}
    for k in times:
        spread = f"{min(times[k]) * 1e3:.0f}-{max(times[k]) * 1e3:.0f}"
        print(f"{k:<15}{gbps(med[k]):>13.2f}{gbps(best[k]):>11.2f}{med[k] * 1e3:>11.1f}"
              f"{spread:>14}{med[ref[k]] / med[k]:>16.2f}x{best[ref[k]] / best[k]:>14.2f}x")
    print("\n'vs raw' = raw time / this path's time on the same blocks. On a busy shared "
          "machine the best rounds are the steadier figure.")
    print("goal (issue 13): worker >= 0.9x raw on the median of rounds")
    for path, raw in (("worker save", "raw put"), ("worker load", "raw get")):
        # Raw and worker run back to back in each round: their ratio per round cancels
        # most of the machine's slow and fast phases.
        paired = sorted(r / w for r, w in zip(times[raw], times[path], strict=True))
        ratio = med[raw] / med[path]
        print(f"  {path}: median {ratio:.2f}x raw, best {best[raw] / best[path]:.2f}x; per "
              f"round {statistics.median(paired):.2f}x (min {paired[0]:.2f}, max "
              f"{paired[-1]:.2f}): {'met' if ratio >= 0.9 else 'NOT met'}")
    for plain, tapped in (("worker save", "save +stats"), ("worker load", "load +stats")):
        print(f"vLLM stats on: {tapped} / {plain} = {med[tapped] / med[plain]:.3f} (median), "
              f"{best[tapped] / best[plain]:.3f} (best)")
    print("\nworker time outside the backend calls (planning, threads, bookkeeping), median:")
    for k, v in overhead.items():
        own = statistics.median(v)
        print(f"  {k:<12} {own * 1e3:7.2f} ms per operation = {own / med[k] * 100:5.1f}% of "
              f"its median time; backend-bound ratio {1 - own / med[k]:.2f}")


if __name__ == "__main__":
    main()
