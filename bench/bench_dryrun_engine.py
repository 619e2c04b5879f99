"""Engine-side cost of a viewer's dry-run flood through a keyed hub (issue 42, attack 3).

Issue 42 measured, with no budget: a viewer's ``flush --dry-run`` naming every worker, 64 in
flight, made each serving process list every pool key (Mooncake ``/get_all_keys``): engine CPU
from 6% to 134%, the master's from 1% to 22%, scheduler lookup p99 from 12-13 to 15-18 ms. The
hub now lists a pool once per pool and 2 s, for a read-only key once per 10 s, by the pool's
store agent for a dry run of scope ``all`` (``Source.lists_pool``) when one is live
(``kvpool_agent._hub_listings``); ``tests/agent/test_hub_listings.py`` counts the listings.
This bench measures what the engine pays, as the issue asks: within 10% of idle. It runs a
store agent (in the hub's process, the master node's side) unless ``--no-store-agent``, when
one of the engine's workers lists, as on a pool deployed without one.

Real parts: a real ``mooncake_master``; an "engine" process of its own holding a real Mooncake
client (its embedded segment holds ``--keys`` values of 1 KiB of one model), four real worker
agents over it (``start_agent`` with ``BackendOperations``, as the connector starts them in
every worker) and a lookup thread calling ``batch_exists`` on 32 of the keys every 5 ms (the
scheduler's lookup, under the same GIL as the agents' listings); a keyed ``FleetHub`` in this
process; the flood in processes of its own: ``--viewers`` viewer connections each keeping 16
dry runs naming the four workers in flight on P+2.

Per round, an ``idle`` and a ``flood`` window of ``--window`` seconds, interleaved (order
rotated): the engine process's and the master's CPU (% of one core, ``psutil`` user+system over
the window), the lookup's p50 and p99 (ms), the dry runs answered per second (a listing's
answer, shared or ``hub busy``) and the listings the engine ran. The table shows the median
over rounds and the spread (min-max), the flood next to the idle baseline of the same run.

    .venv/bin/python bench/bench_dryrun_engine.py [--rounds 5] [--window 10] [--keys 20000]
        [--hub-elsewhere | --split-cores] [--no-store-agent] [--control]

On a 2-core machine the hub and the flood's senders share the engine's cores: ``--hub-elsewhere``
runs them at nice 19 (a deployment runs the hub on the master node), so that the engine's
figures show the work the flood makes it do, not the CPU it lost to the hub. Niceness does not
reach the kernel's loopback work for the flood's packets; ``--split-cores`` pins the engine and
the master to the first CPU and the hub and the flood to the others (every thread, by
``sched_setaffinity``): the nearest this machine comes to a hub on a host of its own (what is
still shared: the kernel, memory bandwidth and the last-level cache).
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from kvpool_agent import FleetHub, local_fleet_keys, start_agent
from kvpool_agent._store_agent import store_source
from kvpool_agent.protocol import Source
from kvpool_replay import LocalMooncakeMaster, free_port_block

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event

__all__ = ["main"]

_WORKERS = 4
_MODEL = "bench/dryrun-model"
_DIGEST = "0123456789ab"
_VALUE = 1024
_IN_FLIGHT = 16
_LOOKUP_KEYS = 32
_LOOKUP_EVERY_S = 0.005


def _source(i: int, master: str) -> Source:
    return Source(agent_id=f"eng-d{i}/dp0.tp0.pp0", engine_id=f"eng-d{i}",
                  instance_role="mixed", kv_role="kv_both", process_role="worker",
                  pid=os.getpid(), backend="mooncake", model=_MODEL, master=master,
                  layout_digest=_DIGEST)


def _engine(master: str, admin_url: str, hub: str, n_keys: int, cmds: Queue[str],
            out: Queue[Any]) -> None:
    """The engine process: the pool client, ``_WORKERS`` agents, the lookup thread; answers
    ``mark`` with the lookup latencies (s) and the listings run since the last mark."""
    import threading

    from kvpool_agent import start_agent
    from kvpool_agent.protocol import FlushArgs, FlushResult
    from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
    from kvpool_connector.keys import ParallelLayout, PoolKey
    from kvpool_connector.operations import BackendOperations

    backend = MooncakeBackend(MooncakeConfig(
        master_server_address=master, master_admin_url=admin_url,
        global_segment_size=max(64 << 20, 2 * n_keys * _VALUE), local_buffer_size=16 << 20))
    buf = ctypes.create_string_buffer(1 << 20)
    backend.register_buffer(ctypes.addressof(buf), 1 << 20)
    keys = [str(PoolKey(_MODEL, _DIGEST, ParallelLayout(), f"{i:032x}")) for i in range(n_keys)]
    for i in range(0, n_keys, 512):
        batch = keys[i:i + 512]
        backend.batch_put_from(batch, [[ctypes.addressof(buf)]] * len(batch),
                               [[_VALUE]] * len(batch))
    listings = [0]

    class Counting(BackendOperations):
        def flush(self, args: FlushArgs) -> FlushResult:
            listings[0] += 1
            return super().flush(args)

    agents = [start_agent(src, address=hub, pool_admin_url=admin_url,
                          operations=Counting(backend, src, key_scope=(
                              _MODEL, _DIGEST, (ParallelLayout(),))))
              for src in (_source(i, master) for i in range(_WORKERS))]
    took: list[float] = []
    stop = threading.Event()

    def lookups() -> None:
        sample = keys[:: max(1, n_keys // _LOOKUP_KEYS)][:_LOOKUP_KEYS]
        while not stop.wait(_LOOKUP_EVERY_S):
            t0 = time.perf_counter()
            backend.batch_exists(sample)
            took.append(time.perf_counter() - t0)

    thread = threading.Thread(target=lookups, daemon=True)
    thread.start()
    out.put("ready")
    while cmds.get() == "mark":
        out.put((took[:], listings[0]))
        took.clear()
        listings[0] = 0
    stop.set()
    thread.join()
    for a in agents:
        a.stop()
    backend.close()


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus`` (``sched_setaffinity`` is per thread;
    threads made later inherit their creator's)."""
    for thread in psutil.Process(pid).threads():
        os.sched_setaffinity(thread.id, cpus)


def _busy(stop: Event, nice: int) -> None:
    """``--control``: one process spinning at niceness ``nice`` until ``stop``, no hub traffic."""
    os.nice(nice)
    while not stop.is_set():
        pass


def _viewer_flood(keys_dir: str, endpoint: str, targets: list[str], stop: Event,
                  nice: int) -> None:
    """One viewer connection keeping ``_IN_FLIGHT`` dry runs naming ``targets`` in flight, at
    niceness ``nice``."""
    import zmq

    os.nice(nice)

    from kvpool_agent import KeyPaths
    from kvpool_agent.protocol import PROTOCOL_VERSION, CommandRequest, FlushArgs, encode

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    KeyPaths.of(keys_dir).client("viewer").apply(s)
    s.connect(endpoint)
    n = 0

    def send() -> None:
        nonlocal n
        n += 1
        s.send(encode(CommandRequest(v=PROTOCOL_VERSION, seq=n, request_id=f"d{os.getpid()}-{n}",
                                     command="flush", targets=targets, timeout_ms=10_000,
                                     flush=FlushArgs(scope="all", dry_run=True))))

    for _ in range(_IN_FLIGHT):
        send()
    while not stop.is_set():
        if s.poll(100):
            s.recv()
            send()  # one answer in, one more out: always _IN_FLIGHT in flight
    ctx.destroy(linger=0)


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved idle/flood rounds")
    ap.add_argument("--window", type=float, default=10.0, help="seconds measured per window")
    ap.add_argument("--keys", type=int, default=20_000, help="1 KiB values in the pool")
    ap.add_argument("--viewers", type=int, default=4,
                    help=f"viewer connections, {_IN_FLIGHT} dry runs in flight each")
    ap.add_argument("--hub-elsewhere", action="store_true",
                    help="run the hub and the flood at nice 19, as if on another host (the "
                         "hub runs on the master node): the engine gets the CPU it asks for, "
                         "so what is left is work the flood makes the engine do")
    ap.add_argument("--control", action="store_true",
                    help="the flood windows run busy loops instead (one per viewer and one "
                         "for the hub, at the same niceness) and send the hub nothing: the "
                         "lookup tail a saturated CPU alone gives")
    ap.add_argument("--no-store-agent", action="store_true",
                    help="run no store agent beside the master: the pool's listings then run in "
                         "one of the engine's workers, as on a pool deployed without one")
    ap.add_argument("--split-cores", action="store_true",
                    help="pin the engine and the master to CPU 0 and the hub and the flood "
                         "to the other CPUs: a hub on a host of its own, as near as one "
                         "machine comes")
    args = ap.parse_args(argv)
    if args.split_cores and args.hub_elsewhere:
        print("bench_dryrun_engine: --split-cores and --hub-elsewhere are two ways to keep the "
              "hub off the engine's CPU; give one", file=sys.stderr)
        return 2
    cpus = sorted(os.sched_getaffinity(0))
    if args.split_cores and len(cpus) < 2:
        print(f"bench_dryrun_engine: --split-cores needs 2 CPUs, this process may use {cpus}",
              file=sys.stderr)
        return 2
    for name in ("rounds", "window", "keys", "viewers"):
        if getattr(args, name) <= 0:
            print(f"bench_dryrun_engine: --{name} must be above 0", file=sys.stderr)
            return 2
    spawn = mp.get_context("spawn")
    rows: dict[str, dict[str, list[float]]] = {
        p: {k: [] for k in ("engine", "master", "p50", "p99", "answers", "listings")}
        for p in ("idle", "flood")}
    with tempfile.TemporaryDirectory() as tmp, LocalMooncakeMaster() as master:
        dirs = local_fleet_keys(tmp)
        address = f"tcp://127.0.0.1:{free_port_block()}"
        os.environ["KVPOOL_AGENT_KEYS"] = str(dirs["agent"].root)
        hub = FleetHub(address, authorized_keys_dir=dirs["hub"].authorized_dir,
                       secret_key_file=dirs["hub"].hub_secret,
                       audit_file=Path(tmp) / "audit.jsonl").start()
        store = None if args.no_store_agent else start_agent(
            store_source("store@bench", master.address), address=address,
            pool_admin_url=master.admin_url)
        cmds: Queue[str] = spawn.Queue()
        out: Queue[Any] = spawn.Queue()
        engine = spawn.Process(target=_engine, args=(master.address, master.admin_url, address,
                                                     args.keys, cmds, out))
        engine.start()
        nice = 19 if args.hub_elsewhere else 0
        os.nice(nice)  # this process runs the hub; the engine started at the usual priority
        try:
            if out.get(timeout=300) != "ready":
                raise RuntimeError("the engine process did not start")
            targets = [_source(i, master.address).agent_id for i in range(_WORKERS)]
            deadline = time.monotonic() + 60
            while not all(t in hub.fleet() and hub.fleet()[t][0].pool is not None
                          for t in targets):
                if time.monotonic() > deadline:
                    raise RuntimeError("the engine's agents did not report their pool in 60 s")
                time.sleep(0.2)
            assert engine.pid is not None and master.proc is not None
            eng_p, mst_p = psutil.Process(engine.pid), psutil.Process(master.proc.pid)
            if args.split_cores:  # the floods, spawned later, inherit this process's CPUs
                for pid in (engine.pid, master.proc.pid):
                    _pin(pid, {cpus[0]})
                _pin(os.getpid(), set(cpus[1:]))
            for rnd in range(args.rounds):
                for phase in ("idle", "flood")[rnd % 2:] + ("idle", "flood")[:rnd % 2]:
                    stop = spawn.Event()
                    n = args.viewers if phase == "flood" else 0
                    floods = ([spawn.Process(target=_busy, args=(stop, nice))
                               for _ in range(n + 1)] if args.control else
                              [spawn.Process(target=_viewer_flood, args=(
                                  str(dirs["viewer"].root), hub.ports.commands, targets,
                                  stop, nice)) for _ in range(n)])
                    for p in floods:
                        p.start()
                    time.sleep(2.0 if floods else 0.5)  # the flood's connections settle
                    cmds.put("mark")
                    out.get(timeout=30)
                    e0, m0, c0, t0 = _cpu_s(eng_p), _cpu_s(mst_p), hub.commands, time.monotonic()
                    time.sleep(args.window)
                    cmds.put("mark")
                    took, listed = out.get(timeout=30)
                    span = time.monotonic() - t0
                    row = rows[phase]
                    row["engine"].append((_cpu_s(eng_p) - e0) / span * 100)
                    row["master"].append((_cpu_s(mst_p) - m0) / span * 100)
                    row["p50"].append(_percentile(took, 0.5) * 1e3)
                    row["p99"].append(_percentile(took, 0.99) * 1e3)
                    row["answers"].append((hub.commands - c0) / span)
                    row["listings"].append(listed / span)
                    stop.set()
                    for p in floods:
                        p.join(10)
                        if p.is_alive():
                            p.kill()
        finally:
            cmds.put("stop")
            engine.join(30)
            if engine.is_alive():
                engine.kill()
            if store is not None:
                store.stop()
            hub.stop()
    split = (f"; engine and master on CPU {cpus[0]}, hub and flood on {cpus[1:]}"
             if args.split_cores else "")
    print(f"== engine-side cost of a viewer's dry-run flood ({args.viewers} connections x "
          f"{_IN_FLIGHT} in flight, {_WORKERS} workers named, {args.keys} keys), median "
          f"(min-max) of {args.rounds} windows of {args.window:g} s; hub and flood at nice "
          f"{nice}{split}; {'no store agent' if store is None else 'a store agent lists'}"
          f"{'; CONTROL: busy loops, no flood' if args.control else ''} ==")
    cols = (("engine", "engine CPU %"), ("master", "master CPU %"), ("p50", "lookup p50 ms"),
            ("p99", "lookup p99 ms"), ("answers", "dry runs/s"), ("listings", "listings/s"))
    print(f"{'window':<7}" + "".join(f" {title:>24}" for _, title in cols))
    for phase, row in rows.items():
        print(f"{phase:<7}" + "".join(
            f" {statistics.median(row[k]):>9.2f} ({min(row[k]):>5.2f}-{max(row[k]):<6.2f})"
            for k, _ in cols))
    idle, flood = rows["idle"], rows["flood"]
    print("flood / idle (medians): " + ", ".join(
        f"{title} {statistics.median(flood[k]) / max(statistics.median(idle[k]), 1e-9):.2f}x"
        for k, title in cols[:4]) + " (goal: CPU and lookup p99 within 10% of idle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
