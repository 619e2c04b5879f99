"""Soak: several replaying engines on one small HA pool (constant eviction) for N minutes, with
random engine kills and restarts, one leader failover and one store-agent restart; every block
an engine loads is checked against what was saved (``EngineResult.corrupt_blocks``).

Real parts: an etcd and two ``mooncake_master`` with ``--enable_ha --enable_oplog``
(``kvpool_replay._ha``), a ``mooncake_client`` store, a fleet hub and a store agent as
``kvpool-agent`` processes, a console (``kvpool-console status --observe``: the TUI's alert
model fed from the hub every 0.25 s for the whole soak), simulated engines driving the real
connector (``kvpool_replay._engine_proc``). Prints progress, then one JSON line: engine runs
finished and killed, bytes loaded by finished runs, corrupt blocks, the longest request of a
finished run (``max_request_s``), errors, the failover, the hub's, store agent's and
console's RSS at start and end, and the pool once every engine stopped: keys and allocated
bytes just after, once two reads 0.5 s apart agree (``pool_stopped``), and once the lease TTL
has passed and two reads agree (``pool_end``), the clients registered with the leader at start
and end (``master_active_clients``), and ``covered_s``: seconds until every event above had
happened at least once. With ``--until-covered`` the soak ends there instead of running the whole
``--minutes`` (then only a cap), and the failover and the store-agent restart come as soon as
they can (the pool holds a key; the failover is over) instead of at 40% and 60% of the run:
the test's mode, the same facts in the least time. Exit 1 when a block was corrupt, an engine
run failed or none finished, or the failover did not complete (its error is in ``errors``).
Figures depend on the machine: measure on a quiet one.

    .venv/bin/python bench/soak.py [--minutes 10] [--engines 3] [--seed 1] [--until-covered]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import psutil
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from kvpool_agent.masters import leader_admin_url
from kvpool_agent.pool import fetch_mooncake_stats
from kvpool_agent.protocol import PoolStats
from kvpool_replay import EngineResult, EngineSpec, ModelShape, default_trace_path
from kvpool_replay._ha import FailoverDrill, LocalHaPool, all_keys
from kvpool_replay._pool import MIN_SEGMENT_BYTES, mooncake_extra_config
from kvpool_replay._processes import (
    engine_env,
    free_port,
    free_port_block,
    stop_process_tree,
    use_local_pool_env,
)
from kvpool_replay._replay import spawn_engine
from kvpool_replay._services import LocalPoolStore
from kvpool_replay._trace import load_trace

SHAPE = ModelShape(layers=2, kv_heads=1, head_size=8, block_size=16, dtype="float16")
SHARE = 6
"""Trace requests per engine run: short runs, so engines finish and restart often (a run also
spends ~15 s starting and ~30 s closing its HA pool client)."""
LEASE_TTL_MS = 5_000
"""The masters' ``--default_kv_lease_ttl``: short, so leases of killed engines expire soon."""
KILL_EVERY_S = (15.0, 30.0)
"""An engine is SIGKILLed every so many seconds (uniformly drawn)."""


def _rss(proc: subprocess.Popen[bytes]) -> int:
    try:
        return int(psutil.Process(proc.pid).memory_info().rss)
    except psutil.Error:
        return 0


def _agent(args: list[str], log: Path, module: str = "kvpool_agent.cli",
           ) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # noqa: SIM115 - the child holds it; closed when the soak ends
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out,
                            stderr=out, env=engine_env(), start_new_session=True)


def _active_clients(admin_urls: str) -> int | None:
    """``master_active_clients`` of the serving leader (clients whose heartbeat is younger
    than the master's ``--client_ttl``); ``None`` when it cannot be read."""
    try:
        url = leader_admin_url(admin_urls)
        text = httpx.get(f"{url}/metrics", timeout=2.0).raise_for_status().text
        for family in text_string_to_metric_families(text):
            if family.name == "master_active_clients":
                return int(family.samples[0].value)
    except (httpx.HTTPError, ValueError, IndexError):
        return None
    return None


def _steady_stats(admin_urls: str, timeout_s: float = 10.0) -> PoolStats:
    """The pool's stats once two reads 0.5 s apart agree on keys and allocated bytes (at most
    ``timeout_s``): the master still applies the batch puts a killed engine sent just before
    its kill (a burner run read 219 keys at once, 242 once settled)."""
    deadline = time.monotonic() + timeout_s
    prev = fetch_mooncake_stats(admin_urls)
    while True:
        time.sleep(0.5)
        cur = fetch_mooncake_stats(admin_urls)
        if (cur.keys, cur.used_bytes) == (prev.keys, prev.used_bytes) or \
                time.monotonic() > deadline:
            return cur
        prev = cur


def _settled_pool(admin_urls: str, stopped_at: float, lease_ttl_s: float,
                  clients: int | None, timeout_s: float = 60.0) -> dict[str, object]:
    """Poll the leader until the lease TTL has passed since ``stopped_at`` (every lease a
    lookup took has expired), the active clients are back to ``clients`` (a killed engine's
    stays until ``--client_ttl``, 10 s) and two reads of keys and allocated bytes agree;
    returns the last read (``settled`` False when ``timeout_s`` ran out first)."""
    deadline = time.monotonic() + timeout_s
    prev: tuple[int, int] | None = None
    while True:
        st = fetch_mooncake_stats(admin_urls)
        now_clients = _active_clients(admin_urls)
        cur = (st.keys, st.used_bytes) if st.healthy else None
        settled = (cur is not None and cur == prev and now_clients == clients
                   and time.monotonic() - stopped_at >= lease_ttl_s)
        if settled or time.monotonic() > deadline:
            return {"keys": st.keys, "used_bytes": st.used_bytes,
                    "active_clients": now_clients, "settled": settled}
        prev = cur
        time.sleep(0.5)


def soak(minutes: float, engines: int, seed: int,
         until_covered: bool = False) -> dict[str, object]:
    """Run the soak; returns its summary (see the module docstring)."""
    rng = random.Random(seed)
    duration = minutes * 60
    trace_path = default_trace_path("conversation_trace.jsonl")
    n_trace = len(load_trace(trace_path))
    work = Path(tempfile.mkdtemp(prefix="kvpool-soak-"))
    use_local_pool_env()
    pool = LocalHaPool(2, log_dir=work / "pool", default_kv_lease_ttl_ms=LEASE_TTL_MS)
    procs: dict[int, tuple[EngineSpec, subprocess.Popen[bytes]]] = {}
    summary: dict[str, object] = {}
    finished = killed = corrupt = loaded = 0
    max_request_s = 0.0
    errors: list[str] = []
    hub = store_agent = console = None
    try:
        print(f"soak: starting etcd, 2 HA masters and a {MIN_SEGMENT_BYTES >> 20} MiB store",
              flush=True)
        pool.start()
        store = LocalPoolStore(pool.address, MIN_SEGMENT_BYTES, log_dir=work).start()
        base = free_port_block()
        hub_address = f"tcp://127.0.0.1:{base}"
        hub = _agent(["hub", "--address", hub_address, "--metrics-port", "0"], work / "hub.log")
        store_args = ["store", "--hub", hub_address, "--admin-url", pool.admin_urls,
                      "--master-server-address", pool.address,
                      "--engine-id", "soak-store"]
        store_agent = _agent(store_args, work / "store-agent.log")
        # Past the soak's end: it is stopped once its end RSS is read.
        console = _agent(["--hub", hub_address, "status", "--json", "--observe",
                          f"{duration + 600:.0f}"], work / "console.log", "kvpool_console.cli")
        clients_start = _active_clients(pool.admin_urls)
        model = f"soak-{os.getpid()}"
        runs = 0

        def spawn(slot: int) -> None:
            nonlocal runs
            runs += 1
            first = rng.randrange(0, max(1, n_trace - SHARE))
            spec = EngineSpec(
                engine_id=f"engine-{slot}-run{runs}", master_address=pool.address,
                model=model, shape=SHAPE, trace_path=str(trace_path),
                indices=list(range(first, first + SHARE)), agent_address=hub_address,
                lookup_rpc_port=free_port(),
                result_path=str(work / f"engine-{slot}-run{runs}.result.json"),
                extra_config=mooncake_extra_config(pool.address, pool.admin_urls,
                                                   lease_ttl_ms=LEASE_TTL_MS),
            )
            with open(work / f"{spec.engine_id}.log", "wb") as log:
                procs[slot] = (spec, spawn_engine(spec, work, log=log))

        for slot in range(engines):
            spawn(slot)
        start = time.monotonic()
        rss_start = {"hub": 0, "store_agent": 0, "console": 0}
        drill: FailoverDrill | None = None
        agent_restarted = False
        covered_s: float | None = None
        next_kill = start + rng.uniform(*KILL_EVERY_S)
        last_report = start
        while time.monotonic() - start < duration:
            now = time.monotonic()
            if not rss_start["hub"] and now - start > 3:  # both agents are up by then
                rss_start = {"hub": _rss(hub), "store_agent": _rss(store_agent),
                             "console": _rss(console)}
            for slot, (spec, proc) in list(procs.items()):
                if proc.poll() is None:
                    continue
                rp = Path(spec.result_path)
                res = (msgspec.json.decode(rp.read_bytes(), type=EngineResult) if rp.exists()
                       else EngineResult(engine_id=spec.engine_id,
                                         error=f"exited {proc.returncode} without a result"))
                finished += 1
                corrupt += res.corrupt_blocks
                max_request_s = max(max_request_s, res.max_request_s)
                loaded += res.loaded_bytes
                if res.error:
                    errors.append(f"{spec.engine_id}: {res.error}")
                spawn(slot)
            if now >= next_kill:
                victim = rng.randrange(engines)
                spec, proc = procs[victim]
                stop_process_tree(proc, timeout_s=0)  # SIGTERM then SIGKILL: a crash
                killed += 1
                print(f"soak: killed {spec.engine_id}", flush=True)
                spawn(victim)
                next_kill = now + rng.uniform(*KILL_EVERY_S)
            # Late enough that engines have saved (start-up takes ~15 s, longer on a loaded
            # machine: the pool must hold keys), early enough that they save and load again.
            if (drill is None and (until_covered or now - start > duration * 0.4)
                    and fetch_mooncake_stats(pool.admin_urls).keys > 0):
                print("soak: SIGKILL of the leader master", flush=True)
                drill = FailoverDrill(pool, 0.0, on_status=lambda m: print(f"soak: {m}",
                                                                           flush=True)).start()
            # keys_kept is the drill's last result: set, the failover is over.
            drill_done = drill is not None and (drill.keys_kept is not None or bool(drill.error))
            if not agent_restarted and (drill_done if until_covered
                                        else now - start > duration * 0.6):
                stop_process_tree(store_agent, timeout_s=5)
                store_agent = _agent(store_args, work / "store-agent.log")
                agent_restarted = True
                print("soak: restarted the store agent", flush=True)
            if covered_s is None and finished and loaded and killed and drill_done \
                    and agent_restarted:
                covered_s = now - start
                if until_covered:
                    print(f"soak: every event happened once in {covered_s:.0f} s; ending",
                          flush=True)
                    break
            if now - last_report > 15:
                last_report = now
                print(f"soak: {now - start:.0f}/{duration:.0f} s, {finished} engine runs "
                      f"finished, {killed} killed, corrupt blocks {corrupt}", flush=True)
            time.sleep(0.2)
        if drill is None:
            errors.append("failover: the pool held no key by the end; no leader was killed")
        else:
            drill.join()
            summary["failover_s"] = drill.failover_s
            summary["keys_kept"] = drill.keys_kept
            summary["keys_at_kill"] = drill.keys_at_kill
            if drill.error or drill.failover_s is None:
                errors.append(f"failover: {drill.error or 'not finished'}")
        summary["covered_s"] = covered_s
        summary["rss_start"] = rss_start
        summary["rss_end"] = {"hub": _rss(hub), "store_agent": _rss(store_agent),
                              "console": _rss(console)}
        print("soak: stopping the engines; waiting for the pool to settle", flush=True)
        for _spec, proc in procs.values():
            stop_process_tree(proc, timeout_s=0)  # a crash: the harder case, and no 30 s close
        stopped_at = time.monotonic()
        stopped = _steady_stats(pool.admin_urls)
        summary["pool_stopped"] = {"keys": stopped.keys, "used_bytes": stopped.used_bytes}
        summary["pool_end"] = _settled_pool(pool.admin_urls, stopped_at, LEASE_TTL_MS / 1e3,
                                            clients_start)
        summary["master_active_clients_start"] = clients_start
        leader = pool.leader()
        summary["pool_keys_end"] = len(all_keys(leader.admin_url)) if leader else None
        summary["store_alive"] = store.proc is not None and store.proc.poll() is None
        store.stop()
    finally:
        for _spec, proc in procs.values():
            stop_process_tree(proc, timeout_s=5)
        for p in (console, store_agent, hub):
            if p is not None:
                stop_process_tree(p, timeout_s=5)
        pool.stop()
        if errors or corrupt:
            print(f"soak: logs kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return {"finished": finished, "killed": killed, "corrupt_blocks": corrupt,
            "loaded_bytes": loaded, "max_request_s": max_request_s,
            "errors": errors, **summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--until-covered", action="store_true",
                   help="end once every event happened at least once (--minutes is the cap)")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.engines < 1:
        print("soak: --minutes must be > 0 and --engines >= 1", file=sys.stderr)
        return 2
    summary = soak(args.minutes, args.engines, args.seed, args.until_covered)
    print(json.dumps(summary))
    bad = summary["corrupt_blocks"] or summary["errors"] or not summary["finished"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
