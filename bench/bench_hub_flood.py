"""Operator ``health`` latency through a keyed hub while lesser keys flood it (issue 27).

A real ``FleetHub`` with CURVE keys on every port (in this process), one real agent (the health
target), and floods run in their own processes, as attackers would:

- ``none``: no flood;
- ``viewer``: a viewer key pipelining read-only ``snapshot`` commands on P+2 from several
  connections, each naming ``MAX_TARGETS`` unknown 256-character ids (the heaviest read-only
  command the hub accepts), 16 in flight per connection;
- ``agent``: an agent key's connections reporting as fast as they can on P;
- ``both``;
- ``reporter`` (issue 42): an agent key reporting at its engine budget (64 agents of ~240 KiB
  every 0.25 s), no attack on the subscribers: the baseline of the two below;
- ``stalled`` (issue 42): that reporter while ``--stalled`` connections of one viewer key
  subscribe and never read (default 12: the key's cap of ``MAX_SUBSCRIBERS_PER_KEY``, 8,
  holds, the rest are refused, counted in the ``refused`` column);
- ``suspended`` (issue 42): the same reporter while a console that watched the fleet is stopped
  with SIGSTOP (Ctrl-Z).

The hub runs in this process (with the target agent and the operator's client): the table's
RSS column is this process's peak growth during a round (MB), sampled every 50 ms; the bound
the hub promises for the connections of each flood is ``kvpool_agent._hub_memory``'s.

Per round and configuration the operator sends ``--commands`` health commands one after the
other on P+3; the table shows the median over rounds of each round's p50 and p99 (ms) and
their spread (min-max over rounds), and what the floods got through (commands and reports per
second the hub handled). Configurations are interleaved round by round (order rotated).
Goal: operator p99 under 1 s under every flood.

    .venv/bin/python bench/bench_hub_flood.py [--rounds 5] [--commands 50] [--configs none,stalled]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from kvpool_agent import FleetClient, FleetHub, local_fleet_keys, start_agent
from kvpool_agent.hub import MAX_TARGETS
from kvpool_agent.protocol import (
    FULL_RATE_TOPICS,
    MAX_TEXT_CHARS,
    PROTOCOL_VERSION,
    CommandRequest,
    EngineState,
    Report,
    Source,
    encode,
)
from kvpool_replay import free_port_block

if TYPE_CHECKING:
    from multiprocessing.synchronize import Event

__all__ = ["main"]

CONFIGS = ("none", "viewer", "agent", "both", "reporter", "stalled", "suspended")
_BUDGETED = ("reporter", "stalled", "suspended")
_BUDGET_AGENTS = 64
_BUDGET_STATE_BYTES = 240 * 1024


def _source(engine: str, role: str = "worker") -> Source:
    return Source(agent_id=f"{engine}/{'scheduler' if role == 'scheduler' else 'dp0.tp0.pp0'}",
                  engine_id=engine, instance_role="mixed", kv_role="kv_both",
                  process_role=role, pid=os.getpid(), backend="mooncake")  # type: ignore[arg-type]


def _viewer_flood(keys_dir: str, endpoint: str, stop: Event) -> None:
    """One viewer connection keeping 16 heavy snapshots in flight until ``stop``."""
    import zmq

    from kvpool_agent import KeyPaths

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    KeyPaths.of(keys_dir).client("viewer").apply(s)
    s.connect(endpoint)
    ids = [f"x{i:08d}".ljust(256, "z") for i in range(MAX_TARGETS)]
    body = encode(CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="flood",
                                 command="snapshot", targets=ids))
    out = 0
    while not stop.is_set():
        while out < 16:
            s.send(body)
            out += 1
        if s.poll(50):
            s.recv_multipart()
            out -= 1
    ctx.destroy(linger=0)


def _agent_flood(keys_dir: str, endpoint: str, engine: str, stop: Event) -> None:
    """One agent connection sending reports as fast as its socket takes them until ``stop``."""
    import zmq

    from kvpool_agent import KeyPaths

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    KeyPaths.of(keys_dir).client("agent").apply(s)
    s.connect(endpoint)
    src = _source(engine)
    seq = 0
    while not stop.is_set():
        for _ in range(100):
            seq += 1
            st = EngineState(source=src, started_ms=0.0, ts_ms=time.time() * 1e3)
            s.send(encode(Report(v=PROTOCOL_VERSION, seq=seq, kind="snapshot", state=st)))
    ctx.destroy(linger=0)


def _budget_reporter(keys_dir: str, endpoint: str, engine: str, stop: Event) -> None:
    """One agent connection reporting ``_BUDGET_AGENTS`` agents of ``engine`` of about
    ``_BUDGET_STATE_BYTES`` each every 0.25 s (text in their layout: ~15 MiB, inside the
    engine's 16 MiB) until ``stop``."""
    import msgspec
    import zmq

    from kvpool_agent import KeyPaths

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    KeyPaths.of(keys_dir).client("agent").apply(s)
    s.connect(endpoint)
    pad = _BUDGET_STATE_BYTES
    layout = {f"k{i:02d}": "A" * min(MAX_TEXT_CHARS, pad - i * MAX_TEXT_CHARS)
              for i in range(64) if pad > i * MAX_TEXT_CHARS}
    srcs = [msgspec.structs.replace(_source(engine), agent_id=f"{engine}/a{i:02d}",
                                    layout=layout) for i in range(_BUDGET_AGENTS)]
    seq = 0
    while not stop.wait(0.25):
        for src in srcs:
            seq += 1
            st = EngineState(source=src, started_ms=0.0, ts_ms=time.time() * 1e3)
            s.send(encode(Report(v=PROTOCOL_VERSION, seq=seq, kind="snapshot", state=st)))
    ctx.destroy(linger=0)


def _stalled_viewer(keys_dir: str, endpoint: str, stop: Event) -> None:
    """A viewer that subscribes like a console and never reads (one frame on its side, a 4 KiB
    kernel buffer) until ``stop``."""
    import zmq

    from kvpool_agent import KeyPaths

    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    KeyPaths.of(keys_dir).client("viewer").apply(s)
    for topic in FULL_RATE_TOPICS:
        s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(endpoint)
    stop.wait()
    ctx.destroy(linger=0)


def _console(keys_dir: str, address: str, ready: Event, stop: Event) -> None:
    """A console reading the fleet's updates until ``stop`` (the parent stops it with SIGSTOP
    once ``ready``: its first update came)."""
    with FleetClient(address, keys_dir=keys_dir) as c:
        while not c.updates(100) and not stop.is_set():
            pass
        ready.set()
        while not stop.is_set():
            c.updates(100)


class _PeakRss:
    """This process's peak RSS (bytes) sampled every 50 ms while in the ``with`` block."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _as_the_hub_process() -> None:
    """Hand freed blocks of 256 KiB and more back to the system, as ``kvpool-agent hub`` does
    for its own process (glibc ``M_MMAP_THRESHOLD``, -3 in malloc.h): without it this process
    measures the heap glibc keeps (a stalled round read +1,665 MB where the hub held ~335)."""
    name = ctypes.util.find_library("c")
    if name is not None:
        ctypes.CDLL(name).mallopt(-3, 256 * 1024)


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def timed_health(op: FleetClient, target: str, commands: int, label: str = "") -> list[float]:
    """``commands`` operator ``health`` commands of ``target``, one after the other: each
    one's round trip (s); a failed one is printed (``label`` names the phase)."""
    took = []
    for _ in range(commands):
        start = time.monotonic()
        (r,) = op.command("health", targets=[target], timeout_ms=30_000)
        took.append(time.monotonic() - start)
        if not r.ok:
            print(f"  ({label}health failed: {r.error})")
    return took


def run_round(config: str, tag: str, hub: FleetHub, keys: dict[str, Path], target: str,
              commands: int, viewers: int, agents: int,
              stalled: int) -> tuple[list[float], float, float, float, int]:
    """Operator health latencies (s) under ``config``'s flood, the read-only commands and
    reports per second the hub handled meanwhile, this process's peak RSS growth (MB) and the
    connections the hub refused for their key's cap.
    The agent floods report engines named after ``tag`` (new ids each round: an id the
    previous round's connection held is refused for ``TAKEOVER_AFTER_S``)."""
    spawn = mp.get_context("spawn")
    stop = spawn.Event()
    procs = []
    console = None
    over_cap = hub.counters.connections_over_cap
    if config in _BUDGETED:
        procs.append(spawn.Process(target=_budget_reporter, args=(
            str(keys["agent"]), hub.ports.agents, f"budget-{tag}", stop)))
    if config == "stalled":
        procs += [spawn.Process(target=_stalled_viewer, args=(str(keys["viewer"]),
                                                              hub.ports.pub, stop))
                  for _ in range(stalled)]
    if config == "suspended":
        ready = spawn.Event()
        console = spawn.Process(target=_console, args=(str(keys["viewer"]), hub.address,
                                                       ready, stop))
        console.start()
        if not ready.wait(30):
            raise RuntimeError("the console got no update in 30 s")
        assert console.pid is not None
        os.kill(console.pid, signal.SIGSTOP)
    if config in ("viewer", "both"):
        procs += [spawn.Process(target=_viewer_flood, args=(str(keys["viewer"]),
                                                            hub.ports.commands, stop))
                  for _ in range(viewers)]
    if config in ("agent", "both"):
        procs += [spawn.Process(target=_agent_flood, args=(str(keys["agent"]), hub.ports.agents,
                                                           f"flood-{tag}-{i}", stop))
                  for i in range(agents)]
    for p in procs:
        p.start()
    took: list[float] = []
    try:
        with _PeakRss() as rss, FleetClient(hub.address, keys_dir=keys["operator"]) as op:
            op.wait_for(1, 10)
            if config in _BUDGETED:
                # The reporter's agents are in the fleet (spawned processes start in seconds on
                # a loaded machine), then the stalled queues fill.
                deadline = time.monotonic() + 60
                while (sum(1 for a in hub.fleet() if a.startswith(f"budget-{tag}/"))
                       < _BUDGET_AGENTS and time.monotonic() < deadline):
                    time.sleep(0.1)
            time.sleep(2.0 if config in _BUDGETED else 1.0 if procs else 0.0)
            c0, r0, t0 = hub.commands, hub.reports, time.monotonic()
            took = timed_health(op, target, commands, f"{config}: ")
            span = time.monotonic() - t0
            rates = ((hub.commands - c0 - commands) / span, (hub.reports - r0) / span)
    finally:
        stop.set()
        if console is not None and console.pid is not None:
            os.kill(console.pid, signal.SIGCONT)
            procs.append(console)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return (took, rates[0], rates[1], (rss.peak - rss.base) / 1e6,
            hub.counters.connections_over_cap - over_cap)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per configuration")
    ap.add_argument("--commands", type=int, default=50, help="operator health commands a round")
    ap.add_argument("--viewers", type=int, default=2, help="viewer flood connections")
    ap.add_argument("--agents", type=int, default=2, help="agent flood connections")
    ap.add_argument("--stalled", type=int, default=12,
                    help="subscriptions of one viewer key that never read, in the stalled "
                    "configuration (more than the key's cap of 8: the rest are refused)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"configurations to run, comma-separated (of {', '.join(CONFIGS)})")
    args = ap.parse_args(argv)
    configs = tuple(c for c in CONFIGS if c in args.configs.split(","))
    if not configs or set(args.configs.split(",")) - set(CONFIGS):
        ap.error(f"--configs: {args.configs!r}: choose from {', '.join(CONFIGS)}")

    _as_the_hub_process()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = local_fleet_keys(tmp)
        keys: dict[str, Path] = {str(role): kp.root for role, kp in dirs.items()}
        address = f"tcp://127.0.0.1:{free_port_block()}"
        os.environ["KVPOOL_AGENT_KEYS"] = str(keys["agent"])
        hub = FleetHub(address, authorized_keys_dir=dirs["hub"].authorized_dir,
                       secret_key_file=dirs["hub"].hub_secret,
                       audit_file=Path(tmp) / "audit.jsonl").start()
        agent = start_agent(_source("eng-target", "scheduler"), address=address)
        p50: dict[str, list[float]] = {c: [] for c in configs}
        p99: dict[str, list[float]] = {c: [] for c in configs}
        cmd_rate: dict[str, list[float]] = {c: [] for c in configs}
        rep_rate: dict[str, list[float]] = {c: [] for c in configs}
        grown: dict[str, list[float]] = {c: [] for c in configs}
        refused: dict[str, list[int]] = {c: [] for c in configs}
        try:
            for rnd in range(args.rounds):
                for config in configs[rnd % len(configs):] + configs[:rnd % len(configs)]:
                    took, cr, rr, mb, over = run_round(config, f"{config}-{rnd}", hub, keys,
                                                 agent.source.agent_id, args.commands,
                                                 args.viewers, args.agents, args.stalled)
                    p50[config].append(statistics.median(took) * 1e3)
                    p99[config].append(percentile(took, 0.99) * 1e3)
                    cmd_rate[config].append(cr)
                    rep_rate[config].append(rr)
                    grown[config].append(mb)
                    refused[config].append(over)
        finally:
            agent.stop()
            hub.stop()
    print(f"== operator health latency (ms) through a keyed hub, {args.commands} commands a "
          f"round, median (min-max) of {args.rounds} rounds ==")
    print(f"{'flood':<10} {'p50':>8} {'p50 spread':>16} {'p99':>8} {'p99 spread':>16} "
          f"{'flood cmds/s':>13} {'reports/s':>10} {'RSS +MB':>8} {'RSS spread':>14} "
          f"{'refused':>8}")
    for c in configs:
        print(f"{c:<10} {statistics.median(p50[c]):>8.1f} "
              f"{min(p50[c]):>7.1f}-{max(p50[c]):<8.1f} {statistics.median(p99[c]):>8.1f} "
              f"{min(p99[c]):>7.1f}-{max(p99[c]):<8.1f} "
              f"{statistics.median(cmd_rate[c]):>13.0f} {statistics.median(rep_rate[c]):>10.0f} "
              f"{statistics.median(grown[c]):>8.0f} {min(grown[c]):>6.0f}-{max(grown[c]):<7.0f} "
              f"{statistics.median(refused[c]):>8.0f}")
    for c, base in (("stalled", "reporter"), ("suspended", "reporter"), ("viewer", "none"),
                    ("agent", "none"), ("both", "none")):
        if c in configs and base in configs:
            print(f"{c} vs {base} (same run): p99 x"
                  f"{statistics.median(p99[c]) / statistics.median(p99[base]):.2f}, RSS "
                  f"{statistics.median(grown[c]) - statistics.median(grown[base]):+.0f} MB")
    print(f"(viewer flood: {args.viewers} connections x 16 snapshots of {MAX_TARGETS} unknown ids "
          f"in flight; agent flood: {args.agents} connections reporting flat out; reporter: "
          f"one key reporting {_BUDGET_AGENTS} x {_BUDGET_STATE_BYTES >> 10} KiB every 0.25 s; "
          f"stalled: that reporter and {args.stalled} subscriptions of one viewer key that "
          "never read; suspended: that reporter and a SIGSTOPped console; refused: "
          "connections refused for their key's cap; goal: p99 < 1000 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
