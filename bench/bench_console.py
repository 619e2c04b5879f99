"""Console at fleet scale: 256 engines x (1 scheduler + 8 workers) reporting several times a
second through real agent sockets, watched by the real console.

Topology, all on 127.0.0.1 and all real sockets:

- the hub is its own process (``kvpool-agent hub``), as on a master node;
- ``--procs`` driver processes each own a share of the 2,304 agents: one ZMQ DEALER socket per
  agent (agent identity, the agent's wire protocol: versioned ``Report`` frames with per-agent
  sequence numbers, a snapshot first, then deltas) sending at ``--rate`` Hz with counters,
  in-flight layer-wise loads and errors that change every report;
- this process runs ``KVPoolConsole`` headless (Textual's test driver) on ``ClientSource``
  with its own refresh (``--refresh``): it subscribes to the hub's update tier for that
  refresh and redraws when a batch is in, at most once per refresh interval.

Measured in the console process (terminal ``--size``), on every frame the app runs itself:
frame time (one refresh: take the alerts and view the feed thread built as the batch arrived,
or, without a batch, sample the client, evaluate the alerts and build the view; update the
table, then Textual's render, which is forced at once; ms, median / p95 / max); the feed
thread's time building each batch's alerts and view (printed beside it); the UI
thread's CPU time per frame (wall time on a shared machine also counts the time other processes
and the console's feed thread held the cores); the age of what the screen shows (for each
agent whose report changed since the previous frame: the time the frame is on screen minus
the report's send time ``EngineState.ts_ms``; includes the hub's tier interval, the decode and
the frame); the whole console process's CPU (% of one core: UI and feed thread) and peak
RSS. Hub and driver CPU are printed too, with the machine's load average
(shared machines skew all of it). Each figure is printed next to its goal (issue 13 item 2).

``--accounting on`` makes the agents report what issue 41's accounting needs, as real agents
do: each scheduler its lookups' chunk ids (``Report.accesses``: ``--lookups`` a second per
engine, prompts of ``--chunks`` chunks drawn from a shared set of conversations, so chunks
recur), its miss tokens by reason (``LookupStats.miss_tokens``), each worker the chunk ids its
saves left stored (``Report.saves``, under its layout digest); the hub then feeds its reuse
window, its saved-chunk memory and the miss split with every report. ``--accounting off``
sends none of it (agents before issue 41; the hub's 7 MiB saved-chunk table is allocated
either way). ``--accounting both`` (the default) runs off, then on, each with a hub of its
own, and prints hub CPU and RSS and the console's frame p50 side by side.

    .venv/bin/python bench/bench_console.py [--engines 256] [--workers 8] [--rate 4]
        [--procs 4] [--seconds 30] [--refresh 1.0] [--accounting both|on|off]
        [--lookups 8] [--chunks 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpool_agent.auth import KeyPaths
from kvpool_agent.protocol import (
    MAX_REPORT_ACCESSES,
    MAX_REPORT_SAVES,
    PROTOCOL_VERSION,
    Access,
    EngineState,
    ErrorRecord,
    LookupStats,
    PoolStats,
    Report,
    SegmentUsage,
    Source,
    Transfer,
    TransferStats,
    encode,
)
from kvpool_replay import free_port_block

__all__ = ["main"]

_ROOT = Path(__file__).resolve().parents[1]

GOAL_FRAME_MS = 50.0
"""Frame p50 goal (issue 13 item 2) at 256 engines x 8 workers, 4 reports/s."""
GOAL_AGE_MS = 1_000.0
"""Data age (report -> screen) p50 goal, ms."""
GOAL_RSS_MB = 300.0
"""Console peak RSS goal, MiB."""


def _vs(value: float, goal: float) -> str:
    return f"goal <= {goal:g}: {'met' if value <= goal else 'MISSED'}"


CHUNK = 256
"""Tokens a chunk holds in the accounting's reports."""
CONVERSATIONS = 20_000
"""Conversations the engines' prompts come from (a prompt: a conversation's leading chunks)."""


@dataclass
class Accounting:
    """What issue 41's accounting adds to the agents' reports (module docstring): ``lookups``
    a second per engine, prompts of up to ``chunks`` chunks."""

    lookups: float
    chunks: int

    def prompt(self, rnd: random.Random) -> list[int]:
        """One prompt's chunk ids: a conversation (skewed: a few are hot) up to a turn."""
        conv = min(int(rnd.paretovariate(1.2)) - 1, CONVERSATIONS - 1)
        turn = rnd.randint(1, self.chunks)
        return [conv * 1_000_003 + i for i in range(turn)]


def _sources(engines: range, workers: int, accounting: bool = False) -> list[Source]:
    out = []
    for e in engines:
        eid = f"{'prefill' if e % 2 == 0 else 'decode'}-{e:03d}"
        role = "prefill" if e % 2 == 0 else "decode"
        kv = "kv_producer" if role == "prefill" else "kv_consumer"
        common = dict(engine_id=eid, instance_role=role, kv_role=kv, host="bench",
                      backend="mooncake", model="llama-70b", pid=10_000 + e)
        out.append(Source(agent_id=f"{eid}/scheduler", process_role="scheduler",
                          **common))  # type: ignore[arg-type]
        for w in range(workers):
            # The saved-chunk memory keys saves by layout digest (one per engine's layout).
            out.append(Source(agent_id=f"{eid}/dp0.tp{w}.pp0", process_role="worker",
                              tp_rank=w, layout_digest="0123456789ab" if accounting else "",
                              **common))  # type: ignore[arg-type]
    return out


def _state(src: Source, n: int, started_ms: float, now_ms: float, pool: PoolStats,
           rnd: random.Random, accounting: bool = False) -> EngineState:
    sched = src.process_role == "scheduler"
    prompt = 4096 * n
    # With the accounting the 40% not loaded is split by reason, as an agent attributes it.
    misses = {"not_in_pool": prompt * 3 // 10, "tail": prompt // 20,
              "not_loaded": prompt - prompt * 6 // 10 - prompt * 3 // 10 - prompt // 20} \
        if accounting else {}
    lookup = LookupStats(lookups=n, prompt_tokens=prompt, loaded_tokens=prompt * 6 // 10,
                         hit_rate=0.6,
                         hit_rate_1m=0.5 + 0.3 * rnd.random(), latency_ms_p50=0.7,
                         latency_ms_p99=2.1, miss_tokens=misses) if sched else LookupStats()
    transfers = TransferStats() if sched else TransferStats(
        loads_finished=n, saves_finished=n, loaded_bytes=n << 22, saved_bytes=n << 22,
        load_bytes_per_s=float(rnd.randint(1, 64) << 20), save_bytes_per_s=float(1 << 24),
        max_load_ms=40.0 + rnd.random() * 20, loads_failed=n // 500,
        errors_by_name={"OBJECT_NOT_FOUND": n // 500} if n >= 500 else {})
    in_flight = [] if sched else [
        Transfer(req_id=f"req-{n}-{i}", kind="load", blocks=8, bytes=8 << 22,
                 started_ms=now_ms - 30, layers_done=rnd.randint(0, 80), layers_total=80,
                 lease_expires_ms=now_ms + 5_000) for i in range(2)]
    errors = [ErrorRecord(ts_ms=now_ms, where="load", name="OBJECT_NOT_FOUND",
                          message="block evicted between lookup and load")] \
        if (not sched and n % 500 == 0) else []
    return EngineState(source=src, started_ms=started_ms, ts_ms=now_ms, lookup=lookup,
                       transfers=transfers, in_flight=in_flight, pool=pool,
                       recent_errors=errors)


def _accounted(src: Source, acc: Accounting, period_s: float, now_ms: float,
               rnd: random.Random, prompts: dict[str, list[list[int]]]
               ) -> tuple[list[Access], list[int]]:
    """One report's accounting (``Report.accesses``, ``Report.saves``): the engine's lookups
    of the last ``period_s`` s (drawn by its scheduler, kept in ``prompts`` for its workers),
    every worker saving what its engine's lookups missed (one key per rank: the same ids)."""
    eid = src.engine_id
    if src.process_role == "scheduler":
        k = int(acc.lookups * period_s) + (rnd.random() < acc.lookups * period_s % 1)
        drawn = [acc.prompt(rnd) for _ in range(k)][:MAX_REPORT_ACCESSES]
        prompts[eid] = drawn
        return [Access(tokens=len(p) * CHUNK + CHUNK // 2, chunk_size=CHUNK, chunks=p,
                       ts_ms=now_ms, served=len(p) * CHUNK * 6 // 10) for p in drawn], []
    saves = [c for p in prompts.get(eid, []) for c in p[len(p) * 6 // 10:]]
    return [], saves[:MAX_REPORT_SAVES]


def _drive(address: str, engines: list[int], workers: int, rate: float, seconds: float,
           ready: mp.synchronize.Event, start: mp.synchronize.Event,
           keys_dir: str | None = None, accounting: Accounting | None = None) -> None:
    """One driver process: a DEALER socket per agent, a report per agent every 1/rate s; with
    ``keys_dir`` (``hub.key``, ``agent.key_secret``) each socket is a CURVE client; with
    ``accounting`` the reports carry issue 41's accounting (module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    srcs = _sources(range(engines[0], engines[-1] + 1), workers, accounting is not None)
    # One socket per agent: past ZMQ's default of 1,023 sockets per context when a driver
    # holds more than ~113 engines (bench_auth at full size with 2 drivers).
    ctx.set(zmq.MAX_SOCKETS, len(srcs) + 64)
    keys = KeyPaths.of(keys_dir).client("agent") if keys_dir else None
    socks = []
    for s in srcs:
        sock = ctx.socket(zmq.DEALER)
        if keys is not None:
            keys.apply(sock)
        sock.setsockopt(zmq.IDENTITY, s.agent_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.connect(address)
        socks.append(sock)
    rnd = random.Random(engines[0])
    started = time.time() * 1e3
    segs = [SegmentUsage(name=f"10.0.0.{i}:15000", used_bytes=(24 + i) << 30,
                         total_bytes=32 << 30) for i in range(8)]
    pool = PoolStats(backend="mooncake", keys=1_200_000, used_bytes=sum(s.used_bytes for s in segs),
                     total_bytes=sum(s.total_bytes for s in segs), evicted_keys=1_000,
                     high_watermark=0.9, lease_ttl_ms=5_000, healthy=True, segments=segs)
    ready.set()
    start.wait()
    period = 1.0 / rate
    t_end = time.monotonic() + seconds
    n = 0
    next_t = time.monotonic()
    prompts: dict[str, list[list[int]]] = {}
    while time.monotonic() < t_end:
        n += 1
        now = time.time() * 1e3
        for i, (src, sock) in enumerate(zip(srcs, socks, strict=True)):
            accesses, saves = ([], []) if accounting is None else _accounted(
                src, accounting, period, now, rnd, prompts)
            rep = Report(v=PROTOCOL_VERSION, seq=n, kind="snapshot" if n == 1 else "delta",
                         state=_state(src, n + i % 7, started, now, pool, rnd,
                                      accounting is not None),
                         accesses=accesses, saves=saves)
            with contextlib.suppress(zmq.Again):  # a slow hub: drop, as a real agent does
                sock.send(encode(rep), zmq.NOBLOCK)
        next_t += period
        time.sleep(max(0.0, next_t - time.monotonic()))
    for sock in socks:
        sock.close(0)
    ctx.term()


async def _watch(address: str, seconds: float, refresh_s: float, agents: int,
                 size: tuple[int, int], keys_dir: str | None = None) -> dict[str, float]:
    from kvpool_console.app import KVPoolConsole
    from kvpool_console.source import ClientSource

    proc = psutil.Process()
    # keys_dir "" is a console without keys even when KVPOOL_KEYS_DIR is set.
    src = ClientSource(address, keys_dir=keys_dir or "", pump=True, refresh_s=refresh_s)
    app = KVPoolConsole(src, refresh_s=refresh_s)
    frames: list[float] = []
    frame_cpu: list[float] = []
    ticks: list[float] = []
    samples: list[float] = []
    lags: list[float] = []
    seen_ts: dict[str, float] = {}
    rss_peak = 0
    measuring = False
    tasks: set[asyncio.Task[None]] = set()
    app_tick = app.tick

    async def rendered(f0: float, c0: float) -> None:
        nonlocal rss_peak
        # Let the widgets process the updates, then composite and render the screen now
        # (what Textual does on its next screen timer); pilot.pause() would also wait for
        # the machine's CPU to go idle, which is not the console's cost.
        await pilot._wait_for_screen()
        app.screen._on_timer_update()
        f1 = time.perf_counter()
        frames.append((f1 - f0) * 1e3)
        frame_cpu.append((time.thread_time() - c0) * 1e3)
        ticks.append(app.last_tick_ms)
        samples.append(app.last_sample_ms)
        now = time.time() * 1e3
        for aid, st in app.states.items():
            if st.ts_ms > seen_ts.get(aid, 0.0):
                if aid in seen_ts:
                    lags.append(now - st.ts_ms)
                seen_ts[aid] = st.ts_ms
        rss_peak = max(rss_peak, proc.memory_info().rss)

    def timed_tick() -> None:
        # Every frame the app decides to run (a batch arrived, or the hub went silent) is
        # timed from its tick to its rendered screen.
        f0 = time.perf_counter()
        c0 = time.thread_time()
        app_tick()
        if measuring:
            task = asyncio.get_running_loop().create_task(rendered(f0, c0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    app.tick = timed_tick  # type: ignore[method-assign]
    async with app.run_test(size=size) as pilot:
        # Wait for the whole fleet, then measure a steady state.
        deadline = time.monotonic() + 20
        while len(src.fleet()[0]) < agents and time.monotonic() < deadline:
            await pilot.pause(0.2)
        known = len(src.fleet()[0])
        cpu0 = proc.cpu_times()
        t0 = time.monotonic()
        shown0 = app.batches_shown
        measuring = True
        await asyncio.sleep(seconds)
        measuring = False
        batches = app.batches_shown - shown0
        wall = time.monotonic() - t0
        cpu1 = proc.cpu_times()
        await asyncio.gather(*tasks)
        rows = len(app.view.engines) if app.view else 0
    frames.sort()
    frame_cpu.sort()
    ticks.sort()
    samples.sort()
    lags.sort()
    cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / wall * 100

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {"agents_seen": known, "engine_rows": rows, "frames": len(frames), "batches": batches,
            "frame_ms_p50": statistics.median(frames), "frame_ms_p95": pct(frames, 0.95),
            "frame_ms_max": frames[-1], "frame_cpu_ms_p50": statistics.median(frame_cpu),
            "frame_cpu_ms_p95": pct(frame_cpu, 0.95), "tick_ms_p50": statistics.median(ticks),
            "tick_ms_p95": pct(ticks, 0.95), "sample_ms_p50": statistics.median(samples),
            "sample_ms_p95": pct(samples, 0.95), "lag_ms_p50": pct(lags, 0.5),
            "lag_ms_p95": pct(lags, 0.95), "lag_samples": len(lags), "cpu_pct": cpu,
            "rss_mb": rss_peak / 2**20}


def _run(args: argparse.Namespace, accounting: Accounting | None
         ) -> tuple[dict[str, float], float, float, float, int]:
    """One round with a hub of its own: the console's figures, hub CPU (cores), hub RSS
    (MiB) at the end, the drivers' CPU (cores), driver processes."""
    agents = args.engines * (args.workers + 1)
    port = free_port_block()
    address = f"tcp://127.0.0.1:{port}"
    hub = subprocess.Popen([sys.executable, "-m", "kvpool_agent.cli", "--log-level", "WARNING",
                            "hub", "--address", address], cwd=_ROOT)
    drivers: list[mp.process.BaseProcess] = []
    try:
        time.sleep(1.0)
        if hub.poll() is not None:
            raise RuntimeError(f"hub exited with {hub.returncode}")
        ctx = mp.get_context("spawn")
        start = ctx.Event()
        per = -(-args.engines // args.procs)
        readies = []
        for p in range(args.procs):
            lo, hi = p * per, min(args.engines, (p + 1) * per)
            if lo >= hi:
                continue
            ready = ctx.Event()
            readies.append(ready)
            d = ctx.Process(target=_drive, args=(address, list(range(lo, hi)), args.workers,
                                                 args.rate, args.seconds + 25, ready, start,
                                                 None, accounting))
            d.start()
            drivers.append(d)
        for r in readies:
            r.wait(60)
        start.set()
        hub_ps = psutil.Process(hub.pid)
        driver_ps = [psutil.Process(d.pid) for d in drivers if d.pid is not None]
        hub_cpu0 = hub_ps.cpu_times()
        drv_cpu0 = [p.cpu_times() for p in driver_ps]
        t0 = time.monotonic()
        w, h = (int(x) for x in args.size.lower().split("x"))
        res = asyncio.run(_watch(address, args.seconds, args.refresh, agents, (w, h)))
        wall = time.monotonic() - t0
        hub_cpu1 = hub_ps.cpu_times()
        drv_cpu1 = [p.cpu_times() for p in driver_ps]
        hub_cpu = (hub_cpu1.user + hub_cpu1.system - hub_cpu0.user - hub_cpu0.system) / wall
        drv_cpu = sum(b.user + b.system - a.user - a.system
                      for a, b in zip(drv_cpu0, drv_cpu1, strict=True)) / wall
        hub_rss = hub_ps.memory_info().rss / 2**20
    finally:
        for proc in drivers:
            proc.terminate()
            proc.join(5)
        hub.terminate()
        hub.wait(10)
    return res, hub_cpu, hub_rss, drv_cpu, len(drivers)


def _print(args: argparse.Namespace, res: dict[str, float], hub_cpu: float, hub_rss: float,
           drv_cpu: float, drivers: int, label: str) -> None:
    agents = args.engines * (args.workers + 1)
    print(f"fleet{label}: {args.engines} engines x ({args.workers} workers + scheduler) = "
          f"{agents} agents, {args.rate:g} reports/s each ({agents * args.rate:.0f} reports/s) "
          f"from {drivers} processes; console {args.size} refresh {args.refresh:g} s for "
          f"{args.seconds:g} s")
    print(f"console saw {res['agents_seen']}/{agents} agents, {res['engine_rows']} engine rows, "
          f"{res['frames']} frames ({res['batches']} showing a batch sampled on the feed thread, "
          "the rest sampled in the frame)")
    frame = res["frame_ms_p50"]
    print(f"frame time ms: p50 {frame:.1f} ({_vs(frame, GOAL_FRAME_MS)})"
          f"  p95 {res['frame_ms_p95']:.1f}  max {res['frame_ms_max']:.1f}  (of which data+table "
          f"update p50 {res['tick_ms_p50']:.1f} p95 {res['tick_ms_p95']:.1f})")
    print(f"frame CPU of the UI thread ms (what a busy machine does not stretch): p50 "
          f"{res['frame_cpu_ms_p50']:.1f}  p95 {res['frame_cpu_ms_p95']:.1f}")
    print(f"alerts + view built on the feed thread per batch, before the frame (wall ms, in "
          f"the console CPU below): p50 {res['sample_ms_p50']:.1f}  "
          f"p95 {res['sample_ms_p95']:.1f}")
    print(f"lag report->screen (age of data shown) ms: p50 {res['lag_ms_p50']:.0f} "
          f"({_vs(res['lag_ms_p50'], GOAL_AGE_MS)})  p95 {res['lag_ms_p95']:.0f}  "
          f"({res['lag_samples']} samples)")
    print(f"console CPU {res['cpu_pct']:.0f}% of one core, peak RSS {res['rss_mb']:.0f} MiB "
          f"({_vs(res['rss_mb'], GOAL_RSS_MB)})")
    print(f"hub CPU {hub_cpu * 100:.0f}%, RSS {hub_rss:.0f} MiB; drivers CPU "
          f"{drv_cpu * 100:.0f}% (machine: {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f})")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8, help="worker agents per engine")
    ap.add_argument("--rate", type=float, default=4.0, help="reports per agent per second")
    ap.add_argument("--procs", type=int, default=4, help="driver processes")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured steady state")
    ap.add_argument("--refresh", type=float, default=1.0, help="console refresh interval (s)")
    ap.add_argument("--size", default="160x48",
                    help="terminal WIDTHxHEIGHT; Textual redraws every visible cell each frame, "
                         "so frame time grows with the terminal, not with the fleet")
    ap.add_argument("--accounting", choices=("both", "on", "off"), default="both",
                    help="issue 41's accounting in the agents' reports (module docstring)")
    ap.add_argument("--lookups", type=float, default=8.0,
                    help="lookups per engine per second the accounting reports")
    ap.add_argument("--chunks", type=int, default=16,
                    help="chunks of the longest prompt the accounting reports")
    args = ap.parse_args(argv)
    agents = args.engines * (args.workers + 1)
    modes = ["off", "on"] if args.accounting == "both" else [args.accounting]
    rounds = {}
    for mode in modes:
        acc = Accounting(args.lookups, args.chunks) if mode == "on" else None
        res, hub_cpu, hub_rss, drv_cpu, drivers = _run(args, acc)
        rounds[mode] = (res, hub_cpu, hub_rss)
        _print(args, res, hub_cpu, hub_rss, drv_cpu, drivers, f" (accounting {mode})")
        if res["agents_seen"] < agents:
            print(f"NOT KEEPING UP: only {res['agents_seen']} of {agents} agents reached the "
                  "console within 20 s; the pipeline (hub, or CPU shared with other work) is "
                  "saturated")
            return 1
    if len(rounds) == 2:
        (off, cpu0, rss0), (on, cpu1, rss1) = rounds["off"], rounds["on"]
        print(f"accounting off -> on: hub CPU {cpu0 * 100:.0f}% -> {cpu1 * 100:.0f}%, hub RSS "
              f"{rss0:.0f} -> {rss1:.0f} MiB, console frame p50 {off['frame_ms_p50']:.1f} -> "
              f"{on['frame_ms_p50']:.1f} ms ({_vs(on['frame_ms_p50'], GOAL_FRAME_MS)}); "
              f"{args.lookups:g} lookups/s per engine of <= {args.chunks} chunks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
