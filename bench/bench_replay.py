"""Trace replay benchmark: the Mooncake paper's axes on this project's connector and a real pool.

1. Hit rate against pool capacity in tokens (the paper's Figure 9 axis), replayed through
   ``KVPoolConnector`` + ``mooncake_master``, next to an exact LRU of the same capacity and the
   unbounded prefix-reuse ceiling.
2. Several engines sharing one pool vs each engine with a private pool of the same total size
   (the paper's global vs local cache, Figure 10).
3. KV bytes saved/loaded per second in the replay vs the raw ``MooncakeBackend`` batch calls on
   the same chunk size and address-range shape.
4. Peak RSS of engines, master, store and the console process (hub + Textual console attached to
   a ``DemoCluster``, as ``kvpool-console --demo`` runs it).

Run (about 4 minutes on 2 cores)::

    .venv/bin/python bench/bench_replay.py --limit 300

Prints tables, then says where connector and LRU differ and why.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpool_connector.services import LocalMooncakeMaster
from kvpool_console.demo.cluster import DemoCluster
from kvpool_console.demo.engine import ModelShape
from kvpool_console.demo.replay import (
    LocalPoolStore,
    ReplayConfig,
    ReplayReport,
    engine_env,
    mooncake_extra_config,
    reference_for,
    run_replay,
)
from kvpool_console.demo.trace import default_trace_path, load_trace

MIB = 1 << 20


def _row(cols: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))


def fig9(trace: str, limit: int, capacities: list[int], shape: ModelShape) -> list[ReplayReport]:
    """Hit rate vs capacity: one replay per capacity (one engine, fresh pool each)."""
    out = []
    for cap in capacities:
        t0 = time.monotonic()
        r = run_replay(ReplayConfig(trace_path=trace, limit=limit, pool_tokens=cap, shape=shape))
        print(f"  capacity {cap:>9,} tokens: hit {r.hit_rate:.2%}, LRU {r.lru_hit_rate:.2%} "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        out.append(r)
    return out


def raw_backend(shape: ModelShape, chunk_size: int, keys: int, batch: int) -> tuple[float, float]:
    """Bytes/s of ``MooncakeBackend.batch_put_from`` / ``batch_get_into`` on chunk-sized values
    laid out like the connector's (one address range per layer per chunk)."""
    from kvpool_connector.backends.mooncake import MooncakeBackend

    chunk_tokens_bytes = chunk_size * shape.bytes_per_token // shape.layers
    with LocalMooncakeMaster() as m, LocalPoolStore(
        m, keys * chunk_size * shape.bytes_per_token * 2 + 64 * MIB
    ):
        backend = MooncakeBackend.from_config(mooncake_extra_config(m.address, m.admin_url))
        try:
            bufs = [torch.randint(0, 255, (keys * chunk_tokens_bytes,), dtype=torch.uint8)
                    for _ in range(shape.layers)]
            for b in bufs:
                backend.register_buffer(b.data_ptr(), b.numel())
            names = [f"kvpool@bench-raw@tp0.pcp0.dcp0.pp0.g0@{i:032x}" for i in range(keys)]

            def ranges(i: int) -> tuple[list[int], list[int]]:
                return ([b.data_ptr() + i * chunk_tokens_bytes for b in bufs],
                        [chunk_tokens_bytes] * len(bufs))

            total = keys * chunk_tokens_bytes * len(bufs)
            t0 = time.perf_counter()
            for s in range(0, keys, batch):
                idx = range(s, min(keys, s + batch))
                rs = [ranges(i) for i in idx]
                codes = backend.batch_put_from([names[i] for i in idx], [r[0] for r in rs],
                                               [r[1] for r in rs])
                assert all(c == 0 for c in codes), codes[:5]
            put_s = time.perf_counter() - t0
            for b in bufs:
                b.zero_()
            t0 = time.perf_counter()
            for s in range(0, keys, batch):
                idx = range(s, min(keys, s + batch))
                rs = [ranges(i) for i in idx]
                got = backend.batch_get_into([names[i] for i in idx], [r[0] for r in rs],
                                             [r[1] for r in rs])
                assert all(g == chunk_tokens_bytes * len(bufs) for g in got), got[:5]
            get_s = time.perf_counter() - t0
        finally:
            backend.close()
    return total / put_s, total / get_s


def console_rss(trace: str, seconds: float) -> tuple[dict[str, int], str]:
    """Run a DemoCluster with the Textual console attached (headless) in this process; return
    peak RSS per process kind and the console's last screen as text."""
    from kvpool_console.app import KVPoolConsole
    from kvpool_console.source import ClientSource

    peaks: dict[str, int] = {}
    screen = ""

    def sample(cluster: DemoCluster) -> None:
        groups = {"console (hub + TUI)": [os.getpid()]}
        groups["engine"] = [p.pid for p in cluster.processes.values()]
        if cluster.master and cluster.master.proc:
            groups["master"] = [cluster.master.proc.pid]
        if cluster.store and cluster.store.proc:
            groups["store"] = [cluster.store.proc.pid]
        for g, pids in groups.items():
            for pid in pids:
                try:
                    peaks[g] = max(peaks.get(g, 0), psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    continue

    with DemoCluster(trace, engines=4, speedup=20.0, limit=400, pool_tokens=600_000) as cluster:
        src = ClientSource(cluster.hub_address, keys_dir=str(cluster.keys_dir))
        src.wait_ready(5)

        async def drive() -> str:
            app = KVPoolConsole(src, refresh_s=0.5)
            async with app.run_test(size=(120, 30)) as pilot:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    await pilot.pause(0.5)
                    sample(cluster)
                return _screen_text(app)

        try:
            screen = asyncio.run(drive())
        finally:
            src.close()
    return peaks, screen


def _screen_text(app: object) -> str:
    """The app's current screen as plain text (what a terminal would show)."""
    from rich.console import Console

    lines = app.screen._compositor.render_update(full=True)  # type: ignore[attr-defined]
    console = Console(width=120, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(lines)
    return console.export_text()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(default_trace_path()))
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--capacities", default="150000,300000,600000,1200000",
                   help="pool capacities in tokens for the Figure 9 sweep")
    p.add_argument("--console-seconds", type=float, default=15.0)
    args = p.parse_args()
    os.environ.update({k: v for k, v in engine_env().items() if k in ("PATH", "PYTHONPATH")})
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    # 128 B/token: the smallest Figure 9 pool (150k tokens) is above Mooncake's 16 MiB minimum.
    shape = ModelShape(layers=2, kv_heads=1, head_size=16, block_size=16, dtype="float16")
    caps = [int(c) for c in args.capacities.split(",")]
    started = time.monotonic()
    trace = args.trace
    reqs = load_trace(trace, limit=args.limit)
    ceiling, _ = reference_for(reqs, 512, None)
    full, _ = reference_for(load_trace(trace), 512, None)
    print(f"trace {Path(trace).name}: first {len(reqs)} requests, "
          f"{ceiling.input_tokens:,} input tokens; model shape {shape.bytes_per_token} B/token, "
          f"chunk 512 tokens, vLLM block {shape.block_size}")
    print(f"prefix-reuse ceiling: {ceiling.hit_rate:.2%} of the slice; whole trace "
          f"({full.input_tokens:,} tokens): {full.hit_rate:.2%}\n", flush=True)

    print("== hit rate vs pool capacity (paper Figure 9 axis) ==", flush=True)
    runs = fig9(trace, args.limit, caps, shape)
    w = [12, 10, 10, 10, 10, 10, 9, 12]
    print(_row(["capacity tok", "pool MiB", "connector", "exact LRU", "ceiling", "diff pp",
                "evicted", "load errors"], w))
    for cap, r in zip(caps, runs, strict=True):
        print(_row([f"{cap:,}", f"{r.pool_bytes / MIB:.0f}", f"{r.hit_rate:.2%}",
                    f"{r.lru_hit_rate:.2%}", f"{r.ceiling_hit_rate:.2%}",
                    f"{(r.hit_rate - r.lru_hit_rate) * 100:+.2f}", f"{r.pool_evicted_keys:,}",
                    str(r.load_errors)], w))

    print(f"\n== {args.engines} engines: shared pool vs private pools of the same total "
          "(paper Figure 10) ==", flush=True)
    total = caps[len(caps) // 2]
    fig10 = {}
    for mode in ("shared", "private"):
        fig10[mode] = run_replay(ReplayConfig(trace_path=trace, limit=args.limit,
                                              engines=args.engines, pool_tokens=total,
                                              mode=mode, shape=shape))  # type: ignore[arg-type]
    w2 = [8, 12, 10, 10, 10, 12, 12]
    print(_row(["mode", "total tok", "connector", "exact LRU", "ceiling", "engine RSS",
                "master RSS"], w2))
    for mode, r in fig10.items():
        print(_row([mode, f"{total:,}", f"{r.hit_rate:.2%}", f"{r.lru_hit_rate:.2%}",
                    f"{r.ceiling_hit_rate:.2%}", f"{r.peak_rss_engine_bytes / MIB:.0f} MiB",
                    f"{r.peak_rss_master_bytes / MIB:.0f} MiB"], w2))

    print("\n== KV throughput: replay (connector) vs raw backend batch calls ==", flush=True)
    big = runs[-1]
    chunks_per_req = max(1, round(ceiling.input_tokens / len(reqs) / 512))
    raw_put, raw_get = raw_backend(shape, 512, keys=2000, batch=chunks_per_req)
    w3 = [34, 12, 12]
    print(_row(["path", "save MiB/s", "load MiB/s"], w3))
    print(_row([f"replay, connector (cap {caps[-1]:,})", f"{big.save_bytes_per_s / MIB:.1f}",
                f"{big.load_bytes_per_s / MIB:.1f}"], w3))
    print(_row([f"raw batch_put/get ({chunks_per_req} keys)", f"{raw_put / MIB:.1f}",
                f"{raw_get / MIB:.1f}"], w3))
    print(f"(chunk value {512 * shape.bytes_per_token // 1024} KiB in {shape.layers} ranges; "
          "replay times run from submission to the worker reporting completion, including "
          "the exists check before puts and per-request scheduling)")

    print("\n== peak RSS with the console attached (DemoCluster, 4 engines) ==", flush=True)
    peaks, screen = console_rss(trace, args.console_seconds)
    for g, v in peaks.items():
        print(f"  {g:<22} {v / MIB:8.0f} MiB")
    print("\nconsole screen at the end of the run:\n" + screen)

    print("== where connector and LRU differ, and why ==")
    for cap, r in zip(caps, runs, strict=True):
        d = (r.hit_rate - r.lru_hit_rate) * 100
        print(f"  {cap:>9,} tokens: connector {d:+.2f} pp vs LRU")
    print(
        "  The connector's pool is Mooncake's: it evicts when usage crosses "
        "eviction_high_watermark_ratio (0.9), removing eviction_ratio (5%) of objects at a time "
        "in lease/insertion order, not strictly the least recently used chunk; so it holds "
        "about 0.9x the capacity and drops chunks in batches. Objects under a lease (granted "
        "on every exists/get, default_kv_lease_ttl) cannot be evicted, and a put that finds "
        "no space returns NO_AVAILABLE_HANDLE: the connector then skips the rest of that "
        "request's saves (store pressure), where the LRU always inserts. The LRU also "
        "refreshes a chunk on every hit, Mooncake only extends its lease."
    )
    print(f"\ntotal bench time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
