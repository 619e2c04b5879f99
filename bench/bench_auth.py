"""Authentication's cost at fleet scale: the same fleet with CURVE keys on every hub port and
without, in one run, rounds interleaved (off, on, off, on, ...).

Each round starts a fresh hub process (``FleetHub`` in a child process, with or without
``local_fleet_keys``), ``--procs`` driver processes holding one DEALER per agent (with keys:
each a CURVE client with the agent key, as a real agent) reporting at ``--rate`` Hz, and the
real console (``KVPoolConsole`` headless on ``ClientSource``; with keys: the viewer key) from
``bench_console``. Measured per round over ``--seconds`` of steady state:

- report rate achieved: reports the hub accepted per second (``FleetHub.reports``), against
  the offered ``agents x rate``;
- console frame time (ms, one refresh end to end, as ``bench_console`` measures it).

Printed per mode: median and spread (min..max over rounds) of both, then the ratio on/off of
the medians; the goal is within 10% (ratio of rates >= 0.9, of frame times <= 1.1).

    .venv/bin/python bench/bench_auth.py                      # short: 64 engines, ~1.5 min
    .venv/bin/python bench/bench_auth.py --engines 256 --rounds 3 --seconds 20   # full size
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_console import _drive, _watch

from kvpool_agent import FleetHub, local_fleet_keys
from kvpool_replay import free_port_block

__all__ = ["main"]


def _hub(address: str, keys_root: str | None, conn: Connection) -> None:
    """The hub process: answers ``"count"`` with (reports accepted, refused connections,
    agents registered) until ``"stop"``."""
    kw = {}
    if keys_root:
        hub_dir = Path(keys_root) / "hub"
        kw = {"authorized_keys_dir": hub_dir / "authorized_keys",
              "secret_key_file": hub_dir / "hub.key_secret"}
    with FleetHub(address, **kw) as hub:  # type: ignore[arg-type]
        conn.send("ready")
        while (msg := conn.recv()) != "stop":
            assert msg == "count"
            conn.send((hub.reports, sum(hub.refused_connections.values()), len(hub.fleet())))


def _round(args: argparse.Namespace, keys_root: str | None) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    agents = args.engines * (args.workers + 1)
    address = f"tcp://127.0.0.1:{free_port_block()}"
    parent, child = ctx.Pipe()
    hub = ctx.Process(target=_hub, args=(address, keys_root, child))
    hub.start()
    drivers: list[mp.process.BaseProcess] = []
    try:
        assert parent.poll(30) and parent.recv() == "ready"
        start = ctx.Event()
        per = -(-args.engines // args.procs)
        readies = []
        agent_keys = str(Path(keys_root) / "agent") if keys_root else None
        for p in range(args.procs):
            lo, hi = p * per, min(args.engines, (p + 1) * per)
            if lo >= hi:
                continue
            ready = ctx.Event()
            readies.append(ready)
            d = ctx.Process(target=_drive, args=(address, list(range(lo, hi)), args.workers,
                                                 # Until terminated below: the fleet may take
                                                 # a while to register on a busy machine.
                                                 args.rate, 3600.0, ready, start,
                                                 agent_keys))
            d.start()
            drivers.append(d)
        for r in readies:
            r.wait(60)
        start.set()
        # Measure the steady state: every agent registered (with keys, each connection's
        # handshake goes through the hub's ZAP handler first).
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            parent.send("count")
            if parent.recv()[2] >= agents:
                break
            time.sleep(0.5)

        samples: list[tuple[float, int, int]] = []
        done = threading.Event()

        def sample() -> None:
            # The hub's count every 0.25 s; the console's window is the run's last --seconds.
            while not done.wait(0.25):
                parent.send("count")
                n, refused, _ = parent.recv()
                samples.append((time.monotonic(), n, refused))

        viewer = str(Path(keys_root) / "viewer") if keys_root else None
        w, h = (int(x) for x in args.size.lower().split("x"))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            res = asyncio.run(_watch(address, args.seconds, args.refresh, agents, (w, h),
                                     viewer))
        finally:
            done.set()
            sampler.join()
        end_t = samples[-1][0]
        window = [s for s in samples if s[0] >= end_t - args.seconds]
        (t0, n0, _), (t1, n1, refused) = window[0], window[-1]
        res["rate"] = (n1 - n0) / max(1e-9, t1 - t0)
        res["refused"] = refused
        return res
    finally:
        for proc in drivers:
            proc.terminate()
            proc.join(5)
        parent.send("stop")
        hub.join(10)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures; returns 1 when a mode lost agents."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--workers", type=int, default=8, help="worker agents per engine")
    ap.add_argument("--rate", type=float, default=4.0, help="reports per agent per second")
    ap.add_argument("--procs", type=int, default=2, help="driver processes")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode, interleaved")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured steady state per round")
    ap.add_argument("--refresh", type=float, default=1.0, help="console refresh interval (s)")
    ap.add_argument("--size", default="160x48", help="console terminal WIDTHxHEIGHT")
    args = ap.parse_args(argv)
    agents = args.engines * (args.workers + 1)
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-auth-") as tmp:
        local_fleet_keys(tmp)
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                results[mode].append(_round(args, tmp if mode == "on" else None))
    print(f"fleet: {args.engines} engines x ({args.workers} workers + scheduler) = {agents} "
          f"agents at {args.rate:g} reports/s ({agents * args.rate:.0f} offered/s), "
          f"{args.rounds} rounds per mode of {args.seconds:g} s; machine: {os.cpu_count()} "
          f"cores, load average {os.getloadavg()[0]:.1f}")
    med: dict[str, dict[str, float]] = {}
    lost = False
    for mode, rs in results.items():
        rates = [r["rate"] for r in rs]
        frames = [r["frame_ms_p50"] for r in rs]
        seen = min(r["agents_seen"] for r in rs)
        lost |= seen < agents
        med[mode] = {"rate": statistics.median(rates), "frame": statistics.median(frames)}
        print(f"auth {mode:3}: reports/s median {med[mode]['rate']:.0f} "
              f"(spread {min(rates):.0f}..{max(rates):.0f}); console frame ms median "
              f"{med[mode]['frame']:.1f} (spread {min(frames):.1f}..{max(frames):.1f}); "
              f"agents seen {seen}/{agents}; refused handshakes "
              f"{max(int(r['refused']) for r in rs)}")
    rate_ratio = med["on"]["rate"] / med["off"]["rate"]
    frame_ratio = med["on"]["frame"] / med["off"]["frame"]
    ok = rate_ratio >= 0.9 and frame_ratio <= 1.1
    print(f"on/off: report rate x{rate_ratio:.3f}, console frame time x{frame_ratio:.3f} "
          f"({'within' if ok else 'NOT within'} 10%)")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
