"""What a flood of refused CURVE handshakes costs a keyed hub (issue 42, leftover 1).

A real ``kvpool-agent hub --keys`` in its own process, one real agent (the ``health`` target)
and an operator in this process, and ``--procs`` flood processes, each holding
``--sockets`` DEALER sockets with a CURVE key the hub does not list (made here, never
authorized), half of them on the agent port P, half on the operator port P+3. Each socket
connects again as soon as its refusal is reported (libzmq itself does not reconnect after a
ZAP refusal), so every socket is refused, reconnects and is refused again until the round
ends.

Per phase (``idle``, then ``flood``, alternated ``--rounds`` times) it reports: the hub
process's CPU (s of CPU per s of wall, 1.0 = one core), its RSS at the end (MiB), the refused
handshakes the hub counted per second (``refused_connections``, both ports), and the
operator's ``health`` round trip p50 / p99 (ms) over ``--commands`` commands sent one after
the other on P+3, and the machine's load average. The flood processes' own CPU is the
attacker's (each refusal costs the client a CURVE handshake too), reported beside it.

    .venv/bin/python bench/bench_refused_handshakes.py [--rounds 3] [--procs 2] [--sockets 16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import zmq
import zmq.auth
from bench_hub_flood import percentile, timed_health

from kvpool_agent import FleetClient, local_fleet_keys, start_agent
from kvpool_agent.protocol import Source
from kvpool_replay import free_port_block

if TYPE_CHECKING:
    from multiprocessing.synchronize import Event

__all__ = ["main"]


def _flood(server_public: bytes, endpoints: list[str], sockets: int, ready: Event,
           stop: Event) -> None:
    """``sockets`` DEALERs with a key the hub does not list, spread over ``endpoints``, each
    connecting again as soon as its monitor reports the refusal, until ``stop``. (libzmq does
    not reconnect a connection refused by ZAP by itself: an attacker connects again.) Sets
    ``ready`` at its first refusal."""
    from zmq.utils.monitor import recv_monitor_message

    public, secret = zmq.curve_keypair()
    ctx = zmq.Context()
    poller = zmq.Poller()
    socks = {}
    for i in range(sockets):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_public, public, secret
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                   | zmq.EVENT_DISCONNECTED)
        ep = endpoints[i % len(endpoints)]
        s.connect(ep)
        socks[mon] = (s, ep)
        poller.register(mon, zmq.POLLIN)
    while not stop.is_set():
        for mon, _ in poller.poll(100):
            ev = recv_monitor_message(mon)
            if ev["event"] & zmq.EVENT_DISCONNECTED:
                ready.set()
                s, ep = socks[mon]
                s.disconnect(ep)
                s.connect(ep)
    ctx.destroy(linger=0)


def _threads(hub: psutil.Process) -> dict[str, float]:
    """The hub's CPU s by thread kind: libzmq's I/O threads (``ZMQbg/IO/*``: CURVE's crypto,
    TCP) and the rest (``python``: the hub's loop, the ZAP handler, its other threads)."""
    out: dict[str, float] = {}
    for t in hub.threads():
        try:
            comm = Path(f"/proc/{hub.pid}/task/{t.id}/comm").read_text().strip()
        except OSError:
            continue
        kind = "zmq_io" if comm.startswith("ZMQbg/IO") else "python"
        out[kind] = out.get(kind, 0.0) + t.user_time + t.system_time
    return out


def _refused(c: FleetClient) -> int:
    """The hub's refused handshakes on every port, from its newest update to ``c``."""
    c.updates(0)
    return sum(c.refused_connections.values())


def _phase(hub: psutil.Process, op: FleetClient, target: str, commands: int,
           flooders: list[psutil.Process]) -> dict[str, float]:
    cpu0, t0, th0 = hub.cpu_times(), time.monotonic(), _threads(hub)
    f0 = sum(p.cpu_times().user + p.cpu_times().system for p in flooders)
    r0 = _refused(op)
    took = timed_health(op, target, commands)
    # The refused count comes with the hub's updates (every second): wait for a fresh one.
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        op.updates(100)
    span = time.monotonic() - t0
    cpu1, th1 = hub.cpu_times(), _threads(hub)
    f1 = sum(p.cpu_times().user + p.cpu_times().system for p in flooders)
    return {
        "hub_cpu": (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / span,
        "zmq_io_cpu": (th1.get("zmq_io", 0) - th0.get("zmq_io", 0)) / span,
        "python_cpu": (th1.get("python", 0) - th0.get("python", 0)) / span,
        "flood_cpu": (f1 - f0) / span,
        "rss": hub.memory_info().rss / 2**20,
        "refused_s": (_refused(op) - r0) / span,
        "p50": statistics.median(took) * 1e3,
        "p99": percentile(took, 0.99) * 1e3,
        "load": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="idle/flood pairs")
    ap.add_argument("--commands", type=int, default=200, help="operator health commands a phase")
    ap.add_argument("--procs", type=int, default=2, help="flood processes")
    ap.add_argument("--sockets", type=int, default=16, help="refused sockets per flood process")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        keys = local_fleet_keys(Path(tmp) / "keys")
        port = free_port_block()
        address = f"tcp://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool_agent.cli", "hub", "--address", address, "--keys",
             str(keys["hub"].root), "--state-file", str(Path(tmp) / "state.json")],
            stdout=subprocess.DEVNULL, stderr=(Path(tmp) / "hub.log").open("wb"))
        hub = psutil.Process(proc.pid)
        os.environ["KVPOOL_AGENT_KEYS"] = str(keys["agent"].root)
        agent = start_agent(Source(agent_id="eng-target/scheduler", engine_id="eng-target",
                                   instance_role="mixed", kv_role="kv_both",
                                   process_role="scheduler", pid=os.getpid(),
                                   backend="mooncake"), address=address)
        server_public = zmq.auth.load_certificate(str(keys["hub"].hub_public))[0]
        endpoints = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 3}"]
        spawn = mp.get_context("spawn")
        rows: dict[str, list[dict[str, float]]] = {"idle": [], "flood": []}
        try:
            with FleetClient(address, keys_dir=keys["operator"].root) as op:
                op.wait_for(1, 30)
                for _ in range(args.rounds):
                    rows["idle"].append(_phase(hub, op, agent.source.agent_id,
                                               args.commands, []))
                    stop = spawn.Event()
                    ready = [spawn.Event() for _ in range(args.procs)]
                    procs = [spawn.Process(target=_flood, args=(
                        server_public, endpoints, args.sockets, r, stop)) for r in ready]
                    for p in procs:
                        p.start()
                    try:
                        # Spawned processes take seconds to start on a loaded machine: the
                        # phase starts once every one is being refused, at full rate.
                        for r in ready:
                            if not r.wait(120):
                                raise RuntimeError("a flood process was not refused in 120 s")
                        time.sleep(1.0)
                        rows["flood"].append(_phase(
                            hub, op, agent.source.agent_id, args.commands,
                            [psutil.Process(p.pid) for p in procs if p.pid is not None]))
                    finally:
                        stop.set()
                        for p in procs:
                            p.join(10)
        finally:
            agent.stop()
            proc.terminate()
            proc.wait(10)
    print(f"== refused CURVE handshakes: {args.procs} x {args.sockets} sockets with an unlisted "
          f"key, each connecting again at once, half on P, half on P+3; "
          f"{os.cpu_count()} cores; median (min-max) of {args.rounds} rounds ==")
    cols = ("hub_cpu", "zmq_io_cpu", "python_cpu", "flood_cpu", "rss", "refused_s", "p50",
            "p99", "load")
    print(f"{'phase':<6} " + " ".join(f"{c:>22}" for c in cols))
    for phase, rs in rows.items():
        cells = []
        for c in cols:
            xs = [r[c] for r in rs]
            cells.append(f"{statistics.median(xs):>9.2f} ({min(xs):.2f}-{max(xs):.2f})"
                         .rjust(22))
        print(f"{phase:<6} " + " ".join(cells))
    print("(hub_cpu, flood_cpu: CPU s per s (hub_cpu = zmq_io_cpu, libzmq's I/O thread, + "
          "python_cpu, the hub's loop and ZAP handler); rss: hub MiB at the phase's end; "
          "refused_s: handshakes refused per s; p50/p99: operator health round trip, ms; "
          "load: 1-min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
