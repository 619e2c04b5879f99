"""Lookup latency: one scheduler lookup of a 32k-token prompt vs the raw ``batch_is_exist``.

Starts a real ``mooncake_master`` on 127.0.0.1, fills the pool with every chunk key of the
prompt (small values: only existence matters), then measures, per chunk size:

* ``async: scheduler thread``: what vLLM's scheduler thread spends on one lookup of a new
  prompt since issue 38 (``lookup_async``, ``kvpool_connector._async_lookup``): the time inside
  every ``get_num_new_matched_tokens`` call of the request, summed, from the first (which
  starts the lookup on the lookup thread and answers "later") to the one that takes the
  answer, one call per simulated engine step (``--step-ms`` apart, not timed); the goal of
  issue 38 is p50 <= 0.1 ms;
* ``async: until answered``: wall time from the first call to the answer (the request's own
  wait, on which the step interval puts a floor). ``--spin``: the steps between asks busy-loop in
  Python instead of sleeping, as an idle vLLM engine core steps while its only request waits
  (the lookup thread then waits for the GIL between its C and socket calls);
* ``scheduler``: the synchronous path (``lookup_async=False``, issue 38's baseline: all of it
  on the scheduler thread): ``KVPoolScheduler.get_num_new_matched_tokens`` for a new request
  with a prompt the scheduler has not seen (its ``hash_cache`` is cleared at the start of each timed
  lookup, which frees the previous prompt's entry as a full cache frees its oldest): chained
  chunk hashes of the prompt (``hash_algo``: SHA-256 by default, XXH3-128 opt-in; each is
  timed), the hand-off to the ``LookupServer`` (its local thread, as when vLLM's ``uni``
  executor runs worker rank 0 in the scheduler's process at TP = 1; ``--socket``: the ZMQ IPC
  round trip a worker rank 0 in another process takes, with the server's thread still in this
  process) and the worker's ``lookup_chunks``
  (``batch_is_exist`` on the chunk keys);
* ``prompt seen before``: the same for a new request whose prompt the scheduler hashed
  recently (a repeated prompt; a later conversation turn or a shared system prompt reuses its
  common prefix the same way): the hashes come from ``hash_cache``;
* ``hash only``: ``keys.chunk_hashes`` of the prompt;
* ``asked again``: vLLM asking again for a request still waiting (answered from the request's
  cached lookup);
* ``raw batch_is_exist``: the Mooncake client call on the same keys, nothing else;
* ``  with vLLM stats``: ``scheduler`` with the connector's vLLM stats on (its reporter wrapped
  in ``StatsTap``, ``StatsCollector.take`` after every lookup, as vLLM calls
  ``get_kv_connector_stats`` every step): the cost of the metrics.

Every variant is timed interleaved with the others, call by call, so the load of a shared
machine falls on all of them alike.

Prints p50/p99 in ms, the load average, and per chunk size the goal of issues 11 and 13
(scheduler p50 at most 1.5 x raw p50 + 0.2 ms) with whether this run met it, for a new prompt
and for a prompt seen before, and issue 38's (async scheduler-thread p50 <= 0.1 ms). Run:
``.venv/bin/python bench/bench_lookup.py [--tokens 32768] [--iters 200] [--step-ms 1]
[--spin]``;
issue 38's row alone: ``--chunk-sizes 256 --hash-algos sha256``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import cast

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch
from vllm import SamplingParams
from vllm.v1.request import Request

from kvpool_agent.reporter import NullReporter
from kvpool_connector._stats import StatsCollector, StatsTap
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import HASH_ALGOS, HashAlgo, ParallelLayout, PoolKey, chunk_hashes
from kvpool_connector.lookup import LookupClient, LookupServer
from kvpool_connector.scheduler import KVPoolScheduler
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster, free_port

_ALIVE: list[object] = []
"""Caches and workers (their scratch buffers) registered with the Mooncake client stay
allocated until it closes (a new registration overlapping a freed one would fail)."""


def _pct(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def _time_interleaved(fns: list[Callable[[], object]], iters: int) -> list[list[float]]:
    """Latencies (ms) of each of ``fns``, called in turn (the order rotating every round), so
    the machine's busy and quiet moments fall on every variant alike."""
    for fn in fns:
        fn()  # warm up (connections, caches)
    out: list[list[float]] = [[] for _ in fns]
    for i in range(iters):
        for j in range(len(fns)):
            k = (i + j) % len(fns)
            t = time.perf_counter()
            fns[k]()
            out[k].append((time.perf_counter() - t) * 1e3)
    return out


def _step(step_ms: float, spin: bool) -> None:
    """One engine step between two asks: asleep, or a Python busy loop (``spin``)."""
    if not spin:
        time.sleep(step_ms / 1e3)
        return
    end = time.perf_counter() + step_ms / 1e3
    while time.perf_counter() < end:
        pass


def _bench_chunk(backend: MooncakeBackend, prompt: list[int], chunk: int, iters: int,
                 algo: HashAlgo, in_process: bool, step_ms: float, spin: bool
                 ) -> list[tuple[str, int, list[float]]]:
    """(variant, keys, latencies in ms) for one chunk size and chunk-hash function."""
    model = f"bench/lookup-{uuid.uuid4().hex[:6]}"
    port = free_port()
    cfg = KVPoolConfig.from_dicts({"lookup_rpc_port": port, "hash_algo": algo},
                                  kv_role="kv_both", block_size=chunk, model=model)
    hashes = chunk_hashes(prompt, chunk, algo=algo)
    worker = KVPoolWorker(cfg, ParallelLayout(), model, backend)
    # A small cache in vLLM's CPU layout: it gives the keys their layout digest, once.
    kv = {"layers.0": torch.zeros(4, 1, chunk, 8)}
    worker.register_kv_caches(kv)
    _ALIVE.append((kv, worker))
    keys = [str(PoolKey(cfg.model, worker.layout_digest, ParallelLayout(), h)) for h in hashes]
    for k in keys:
        backend.store.put(k, b"x")
    server = LookupServer(worker.lookup_chunks, lookup_rpc_port=port)
    sched = KVPoolScheduler(cfg, LookupClient(lookup_rpc_port=port, in_process=in_process),
                            NullReporter(), lookup_async=False)
    lazy = KVPoolScheduler(cfg, LookupClient(lookup_rpc_port=port, in_process=in_process),
                           NullReporter())
    tap = StatsTap(NullReporter())
    tapped = KVPoolScheduler(cfg, LookupClient(lookup_rpc_port=port, in_process=in_process),
                             tap, lookup_async=False)
    stats = StatsCollector(lambda: tapped.counters, tap, worker=False)
    params = SamplingParams(max_tokens=1)
    # New requests (no cached hashes), built outside the timed region.
    reqs = iter([Request(f"r{i}", prompt, params, None) for i in range(4 * iters + 4)])
    want = (len(prompt) - 1) // chunk * chunk

    def lookup(s: KVPoolScheduler = sched, seen: bool = False) -> None:
        req = next(reqs)
        if not seen:
            s.hash_cache.clear()
        got, _ = s.get_num_new_matched_tokens(req, 0)
        if got != want:
            raise RuntimeError(f"lookup found {got} tokens, expected {want}")
        s.request_finished(req, [])

    def lookup_with_stats() -> None:
        lookup(tapped)
        if stats.take() is None:
            raise RuntimeError("a lookup left no stats")

    answered_ms: list[float] = []

    def lookup_async() -> float:
        """One new prompt's lookup through the lookup thread; returns the scheduler thread's
        time (ms), keeps the time until answered."""
        req = next(reqs)
        lazy.hash_cache.clear()  # the previous lookup was answered: the thread is idle
        first = time.perf_counter()
        got, _ = lazy.get_num_new_matched_tokens(req, 0)
        spent = time.perf_counter() - first
        while got is None:
            _step(step_ms, spin)  # the engine's step between two asks
            t = time.perf_counter()
            got, _ = lazy.get_num_new_matched_tokens(req, 0)
            spent += time.perf_counter() - t
        answered_ms.append((time.perf_counter() - first) * 1e3)
        if got != want:
            raise RuntimeError(f"async lookup found {got} tokens, expected {want}")
        lazy.request_finished(req, [])
        return spent * 1e3

    thread_ms: list[float] = []
    waiting = Request("waiting", prompt, params, None)

    def ask_again() -> None:
        got, _ = sched.get_num_new_matched_tokens(waiting, 0)
        if got != want:
            raise RuntimeError(f"lookup found {got} tokens, expected {want}")

    try:
        names = ["scheduler lookup", "  with vLLM stats", "  prompt seen before",
                 "  hash only", "  asked again", "raw batch_is_exist"]
        samples = _time_interleaved([
            lookup, lookup_with_stats, lambda: lookup(seen=True),
            lambda: chunk_hashes(prompt, chunk, algo=algo), ask_again,
            lambda: backend.store.batch_is_exist(keys),
            lambda: thread_ms.append(lookup_async())], iters)
        # The interleaved timing of lookup_async is its sleeps: its own sums are the figures.
        rows = [(name, len(keys), s) for name, s in zip(names, samples, strict=False)]
        return [("async: scheduler thread", len(keys), thread_ms[1:]),
                ("async: until answered", len(keys), answered_ms[1:]), *rows]
    finally:
        lazy.close()
        sched.close()
        tapped.close()
        server.close()
        worker.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="prompt length in tokens")
    ap.add_argument("--iters", type=int, default=200, help="timed lookups per variant")
    ap.add_argument("--chunk-sizes", default="16,128,512",
                    help="comma-separated chunk sizes in tokens (block_size = chunk size)")
    ap.add_argument("--hash-algos", default=",".join(HASH_ALGOS),
                    help="comma-separated chunk-hash functions (hash_algo), each timed")
    ap.add_argument("--step-ms", type=float, default=1.0,
                    help="ms between two asks of a waiting request (an engine step)")
    ap.add_argument("--spin", action="store_true",
                    help="busy-loop the steps between asks (an idle engine core) instead of "
                         "sleeping")
    ap.add_argument("--socket", action="store_true",
                    help="scheduler asks over the IPC socket, as it does a worker rank 0 in "
                         "another process (the server's thread stays in this one)")
    args = ap.parse_args()
    os.environ.setdefault("KVPOOL_RUNTIME_DIR", tempfile.mkdtemp(prefix="kvpool-bench-"))
    prompt = [(i * 7919) % 30000 + 3 for i in range(args.tokens)]
    server = "over the IPC socket" if args.socket else "in process"
    with LocalMooncakeMaster() as master:
        backend = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": master.address, "global_segment_size": "64MB",
            "local_buffer_size": "16MB"}}))
        # After the client connected: Mooncake's start-up log lines come before the table.
        print(f"prompt: {args.tokens} tokens; {args.iters} timed lookups per variant; "
              f"all chunks present; lookup server {server}; "
              f"load average {os.getloadavg()[0]:.2f} at start")
        print(f"{'chunk':>6} {'keys':>6}  {'variant':<22} {'p50 ms':>8} {'p99 ms':>8}")
        try:
            for chunk in (int(c) for c in args.chunk_sizes.split(",")):
                for algo in cast(list[HashAlgo], args.hash_algos.split(",")):
                    rows = _bench_chunk(backend, prompt, chunk, args.iters, algo,
                                        not args.socket, args.step_ms, args.spin)
                    print(f"{chunk:>6} {'':>6}  hash_algo {algo}")
                    for name, nkeys, s in rows:
                        print(f"{chunk:>6} {nkeys:>6}  {name:<22} {_pct(s, 50):>8.3f} "
                              f"{_pct(s, 99):>8.3f}", flush=True)
                    p50 = {name.strip(): _pct(s, 50) for name, _, s in rows}
                    goal = 1.5 * p50["raw batch_is_exist"] + 0.2
                    for row, what in (("scheduler lookup", "new prompt"),
                                      ("prompt seen before", "prompt seen before")):
                        met = "met" if p50[row] <= goal else (
                            f"NOT met by {p50[row] - goal:.3f} ms")
                        print(f"{chunk:>6} {'':>6}  goal: scheduler p50 <= {goal:.3f} ms "
                              f"(1.5 x raw + 0.2), {what}: {met}", flush=True)
                    lazy = p50["async: scheduler thread"]
                    met = "met" if lazy <= 0.1 else f"NOT met by {lazy - 0.1:.3f} ms"
                    print(f"{chunk:>6} {'':>6}  goal (issue 38): async scheduler-thread p50 "
                          f"<= 0.100 ms (synchronous {p50['scheduler lookup']:.3f} ms): {met}",
                          flush=True)
        finally:
            backend.close()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
