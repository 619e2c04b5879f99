"""Trace replay benchmark: the Mooncake paper's axes on this project's connector and a real pool.

1. Hit rate against pool capacity in tokens (the paper's Figure 9 axis), replayed through
   ``KVPoolConnector`` + ``mooncake_master``, next to an exact LRU of the same capacity and the
   unbounded prefix-reuse ceiling.
2. Several engines sharing one pool vs each engine with a private pool of the same total size
   (the paper's global vs local cache, Figure 10).
3. KV bytes saved/loaded per second in the replay vs the raw ``MooncakeBackend`` batch calls on
   the same chunk size and address-range shape.
4. Peak RSS of engines, master, store, the policy service and the console process (hub +
   Textual console attached to a ``DemoCluster``, as ``kvpool-console --demo`` runs it).

Admission: ``kvpool-replay``'s default (``kvpool_replay._replay.default_admission``): the
pool-wide policy service (``admission: service``, ``kvpool-policy serve`` beside the master)
for every run on one shared bounded pool (the Figure 9 runs and Figure 10's shared runs), the
best measured policy for a pool shared by several engines (docs/policy.md); ``all`` (every chunk
saved, the master evicting) for Figure 10's private pools, where no one service can sit. The
tables say which ran. ``--admission all`` runs every row as before this default (the figures
in docs/benchmarks.md measured before it). The baselines (exact LRU of the same capacity, the
prefix-reuse ceiling, the raw backend calls) do not depend on it.

Run (under 5 minutes on 2 shared cores)::

    .venv/bin/python bench/bench_replay.py

Whole traces (README's tables; about 25 minutes here)::

    .venv/bin/python bench/bench_replay.py --limit 0 --fig10-limit 0 --fig10-engines 4,8

Prints tables, then says where connector and LRU differ and why.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpool_replay import (
    DemoCluster,
    LocalMooncakeMaster,
    LocalPoolStore,
    ModelShape,
    ReplayConfig,
    ReplayReport,
    default_trace_path,
    engine_env,
    load_trace,
    mooncake_extra_config,
    reference_for,
    run_replay,
)
from kvpool_replay._replay import default_admission

MIB = 1 << 20


def _row(cols: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))


def with_admission(cfg: ReplayConfig, admission: str | None) -> ReplayConfig:
    """``cfg`` with ``admission`` (``all``, ``adaptive``, ``service``), or ``None``:
    ``kvpool-replay``'s default for its pool (``default_admission``)."""
    cfg.admission = admission or default_admission(cfg)  # type: ignore[assignment]
    return cfg


def fig9(trace: str, limit: int | None, capacities: list[int],
         shape: ModelShape, admission: str | None = None) -> list[ReplayReport]:
    """Hit rate vs capacity: one replay per capacity (one engine and a fresh pool each), two at
    a time (the engines' vLLM imports overlap with the other run's replay); ``admission`` as
    ``with_admission``."""

    def one(cap: int) -> ReplayReport:
        t0 = time.monotonic()
        # Two replays run at once: their per-capacity lines below are the progress.
        r = run_replay(with_admission(ReplayConfig(trace_path=trace, limit=limit,
                                                   pool_tokens=cap, shape=shape), admission))
        print(f"  capacity {cap:>9,} tokens: hit {r.hit_rate:.2%}, LRU {r.lru_hit_rate:.2%} "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        return r

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, capacities))


def raw_backend(shape: ModelShape, chunk_size: int, keys: int, batch: int) -> tuple[float, float]:
    """Bytes/s of ``MooncakeBackend.batch_put_from`` / ``batch_get_into`` on chunk-sized values
    laid out like the connector's (one address range per layer per chunk)."""
    from kvpool_connector.backends.mooncake import MooncakeBackend
    from kvpool_connector.keys import ParallelLayout, chunk_keys, shard_prefix

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
            names = chunk_keys([shard_prefix("bench-raw", "0" * 12, ParallelLayout())],
                               [f"{i:032x}" for i in range(keys)])

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
        if cluster.policy and cluster.policy.proc:
            groups["policy service"] = [cluster.policy.proc.pid]
        for g, pids in groups.items():
            for pid in pids:
                try:
                    peaks[g] = max(peaks.get(g, 0), psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    continue

    with DemoCluster(trace, engines=4, speedup=20.0, limit=200, pool_tokens=600_000) as cluster:
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
    # The synthetic trace's first 200 requests reuse prefixes over a wider range of distances
    # than the conversation trace's cold start, so four capacities give four distinct points.
    p.add_argument("--trace", default=str(default_trace_path("synthetic_trace.jsonl")))
    p.add_argument("--limit", type=int, default=200, help="Figure 9 requests (0 = whole trace)")
    p.add_argument("--fig10-trace", default=None,
                   help="trace of the shared vs private runs (default: --trace)")
    p.add_argument("--fig10-limit", type=int, default=None,
                   help="shared vs private requests (0 = whole trace; default: --limit)")
    p.add_argument("--fig10-engines", default="4", help="engine counts, e.g. 4,8")
    p.add_argument("--fig10-tokens", type=int, default=None,
                   help="total pool tokens of the shared vs private runs (default: the largest "
                   "capacity; each private pool must stay >= 16 MiB)")
    p.add_argument("--capacities", default="300000,600000,1000000,2000000",
                   help="pool capacities in tokens for the Figure 9 sweep")
    p.add_argument("--console-seconds", type=float, default=10.0)
    p.add_argument("--admission", choices=["all", "adaptive", "service"], default=None,
                   help="every replay's admission (default: kvpool-replay's: the policy "
                   "service on a shared bounded pool, all on private pools); all: the "
                   "tables as measured before that default")
    args = p.parse_args()
    os.environ.update({k: v for k, v in engine_env().items() if k in ("PATH", "PYTHONPATH")})
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    # 64 B/token: the smallest Figure 9 pool (300k tokens) is above Mooncake's 16 MiB minimum.
    shape = ModelShape(layers=2, kv_heads=1, head_size=8, block_size=16, dtype="float16")
    caps = [int(c) for c in args.capacities.split(",")]
    started = time.monotonic()
    trace = args.trace
    limit = args.limit or None
    reqs = load_trace(trace, limit=limit)
    ceiling, _ = reference_for(reqs, 512, None)
    full, _ = reference_for(load_trace(trace), 512, None)
    print(f"trace {Path(trace).name}: {len(reqs)} requests, "
          f"{ceiling.input_tokens:,} input tokens; model shape {shape.bytes_per_token} B/token, "
          f"chunk 512 tokens, vLLM block {shape.block_size}")
    print(f"prefix-reuse ceiling: {ceiling.hit_rate:.2%} of the slice; whole trace "
          f"({full.input_tokens:,} tokens): {full.hit_rate:.2%}\n", flush=True)

    print("== hit rate vs pool capacity (paper Figure 9 axis) ==", flush=True)
    runs = fig9(trace, limit, caps, shape, args.admission)
    w = [12, 10, 10, 10, 10, 10, 9, 12, 9]
    print(_row(["capacity tok", "pool MiB", "connector", "exact LRU", "ceiling", "diff pp",
                "evicted", "load errors", "admission"], w))
    for cap, r in zip(caps, runs, strict=True):
        print(_row([f"{cap:,}", f"{r.pool_bytes / MIB:.0f}", f"{r.hit_rate:.2%}",
                    f"{r.lru_hit_rate:.2%}", f"{r.ceiling_hit_rate:.2%}",
                    f"{(r.hit_rate - r.lru_hit_rate) * 100:+.2f}",
                    f"{r.pool_evicted_keys + r.evicted_keys:,}", str(r.load_errors),
                    r.admission], w))

    total = args.fig10_tokens or caps[-1]
    f10_trace = args.fig10_trace or trace
    f10_limit = (args.limit if args.fig10_limit is None else args.fig10_limit) or None
    print(f"\n== shared pool vs private pools of the same total ({total:,} tokens; paper "
          f"Figure 10), {Path(f10_trace).name}, "
          f"{'whole trace' if f10_limit is None else f'first {f10_limit} requests'} ==",
          flush=True)
    w2 = [8, 8, 10, 10, 10, 12, 12, 8, 9]
    print(_row(["engines", "mode", "connector", "exact LRU", "ceiling", "engine RSS",
                "master RSS", "wall s", "admission"], w2), flush=True)
    fig10: dict[tuple[int, str], ReplayReport] = {}
    for n in [int(e) for e in args.fig10_engines.split(",")]:
        for mode in ("shared", "private"):
            cfg = ReplayConfig(trace_path=f10_trace, limit=f10_limit, engines=n,
                               pool_tokens=total, mode=mode,
                               shape=shape, show_progress=True)
            # A private pool takes no service (kvpool-replay refuses it): --admission service
            # applies to the shared runs, the private ones keep their default (all).
            own = None if mode == "private" and args.admission == "service" else args.admission
            fig10[n, mode] = r = run_replay(with_admission(cfg, own))
            print(_row([str(n), mode, f"{r.hit_rate:.2%}", f"{r.lru_hit_rate:.2%}",
                        f"{r.ceiling_hit_rate:.2%}", f"{r.peak_rss_engine_bytes / MIB:.0f} MiB",
                        f"{r.peak_rss_master_bytes / MIB:.0f} MiB", f"{r.wall_s:.0f}",
                        r.admission], w2),
                  flush=True)

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
        if r.admission == "service":
            why = ("the policy service admits and evicts for the pool (docs/policy.md): its "
                   "doorkeeper skips chunks never asked for before when that hits more, it "
                   "evicts in leaf-first LRU order and fills the pool up to 2% below the "
                   "master's watermark less what saves in flight take, so it can be above "
                   "LRU (admission) or below it (the room it leaves, evictions of chunks still "
                   f"being read); the master evicted {r.pool_evicted_keys:,} keys beside it")
        elif d > 0.005:
            why = ("above LRU: when the pool is full a put fails with NO_AVAILABLE_HANDLE and "
                   "the connector skips the rest of that request's saves, so one long prompt "
                   "cannot flush the whole cache as it does in the LRU, which inserts every "
                   "chunk (store pressure acts as admission control)")
        elif d < -0.005:
            why = ("below LRU: Mooncake evicts once usage crosses eviction_high_watermark_ratio "
                   "(0.9), eviction_ratio (5%) of objects at a time by lease order, so it holds "
                   "less than the capacity and drops chunks in batches; leased objects "
                   "(default_kv_lease_ttl, taken on every exists/get) cannot be evicted")
        else:
            why = "equal: the pool's evictions never removed a chunk the LRU kept"
        print(f"  {cap:>9,} tokens: connector {d:+.2f} pp vs LRU; {why}")
    for n in sorted({n for n, _ in fig10}):
        sh, pr = fig10[n, "shared"], fig10[n, "private"]
        print(f"  shared pool, {n} engines: {sh.hit_rate:.2%} vs ceiling "
              f"{sh.ceiling_hit_rate:.2%}: engines replay concurrently, so a request whose "
              "prefix another engine is still computing misses it (the ceiling assumes trace "
              f"order); private pools reach {pr.hit_rate:.2%}, each engine seeing only its own "
              "share (the paper's global vs local cache)")
    print(f"\ntotal bench time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
