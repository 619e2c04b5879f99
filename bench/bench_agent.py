"""Agent overhead on the engine: cost per recorded event, and save/load throughput with the
agent off vs on (no listener, a slow listener, a normal hub with a console) in the same run.

The data path is the connector's own ``KVPoolWorker`` and ``MooncakeBackend`` against a real
``mooncake_master``, moving vLLM-shaped paged KV (FlashAttention layout, bf16) by address; the
worker makes its own Reporter calls (started/finished/loaded), plus the scheduler's lookup
call. Configurations are interleaved round by round (order rotated) so machine noise hits all
of them alike; the table shows medians and best rounds.
Goal: throughput with the agent on within 2% of off.

    .venv/bin/python bench/bench_agent.py [--rounds 9] [--requests 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
_BIN = os.path.join(sys.prefix, "bin")
os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

from kvpool_agent import (  # noqa: E402
    AgentHandle,
    FleetClient,
    FleetHub,
    NullReporter,
    Reporter,
    start_agent,
)
from kvpool_agent.protocol import Source  # noqa: E402
from kvpool_replay import LocalMooncakeMaster, free_port, free_port_block  # noqa: E402

__all__ = ["main"]

LAYERS = 16
KV_HEADS = 8
HEAD_SIZE = 128
BLOCK_BYTES_PER_LAYER = 2 * 16 * KV_HEADS * HEAD_SIZE * 2  # K+V, 16 tokens, bf16
CHUNKS_PER_REQ = 4


def _source(name: str) -> Source:
    return Source(
        agent_id=f"{name}/dp0.tp0.pp0",
        engine_id=name,
        instance_role="mixed",
        kv_role="kv_both",
        process_role="worker",
        pid=os.getpid(),
        backend="mooncake",
        model="bench/model",
    )


class _SlowListener:
    """A hub stand-in that reads one message every 100 ms: the agent's queue fills up."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(100):
                self.sock.recv_multipart()
            time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


class _Console:
    """A console reading every FleetUpdate in a thread, as kvpool-console does."""

    def __init__(self, address: str) -> None:
        self.client = FleetClient(address)
        self.stop = threading.Event()
        self.updates = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.updates += len(self.client.updates(100))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.client.close()


def event_cost(handle_factory: Callable[[], AgentHandle], n: int = 200_000) -> dict[str, float]:
    """ns per Reporter call on the calling thread, per call kind, with the agent running:
    the median over slices of 2,000 calls (a slice the OS preempted does not skew it)."""
    h = handle_factory()
    rep = h.reporter
    out: dict[str, float] = {}
    try:
        calls: dict[str, Callable[[int], None]] = {
            "lookup": lambda i: rep.lookup("req", 4096, 0, 2048, 0.5),
            "transfer_progress": lambda i: rep.transfer_progress("req", "load", i & 31),
            "transfer_finished": lambda i: rep.transfer_finished("req", "save", True, 1 << 20),
        }
        for name, fn in calls.items():
            # Pace in slices so the agent keeps draining (a full buffer would measure drops).
            per_call: list[float] = []
            for _ in range(n // 2_000):
                t0 = time.perf_counter_ns()
                for i in range(2_000):
                    fn(i)
                per_call.append((time.perf_counter_ns() - t0) / 2_000)
                time.sleep(0.005)
            out[name] = statistics.median(per_call)
        out["events_dropped"] = float(rep.dropped)
    finally:
        h.stop()
    return out


class _Settings:
    """The connector settings ``KVPoolWorker`` reads: one 16-token block per pool key."""

    block_size = 16
    chunk_size = 16
    use_layerwise = False
    load_async = False
    layerwise_timeout_ms = 5_000
    save_budget_bytes = 1 << 30
    checksum = False
    hash_algo = "sha256"


class _DataPath:
    """Real saves and loads of vLLM-shaped paged KV through the connector's ``KVPoolWorker``
    and ``MooncakeBackend`` (a real ``MooncakeDistributedStore`` client)."""

    def __init__(self, master: LocalMooncakeMaster, requests: int) -> None:
        import torch

        from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
        from kvpool_connector.keys import ParallelLayout
        from kvpool_connector.worker import KVPoolWorker

        self.backend = MooncakeBackend(
            MooncakeConfig(
                master_server_address=master.address,
                master_admin_url=master.admin_url,
                global_segment_size=1 << 30,
                local_buffer_size=64 << 20,
            )
        )
        self.requests = requests
        self.blocks = requests * CHUNKS_PER_REQ
        # FlashAttention layout per layer: (2, num_blocks, block_size, kv_heads, head_size).
        shape = (2, self.blocks, 16, KV_HEADS, HEAD_SIZE)
        self.src = {f"layers.{i}": torch.ones(shape, dtype=torch.bfloat16) for i in range(LAYERS)}
        self.dst = {f"layers.{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(LAYERS)}
        self.model = "bench/agent-model"
        self.saver = KVPoolWorker(_Settings(), ParallelLayout(), self.model, self.backend, None)
        self.loader = KVPoolWorker(_Settings(), ParallelLayout(), self.model, self.backend, None)
        self.saver.register_kv_caches(self.src)
        self.loader.register_kv_caches(self.dst)
        self.total = self.blocks * LAYERS * BLOCK_BYTES_PER_LAYER
        self.round = 0

    def run(self, rep: Reporter) -> tuple[float, float, float]:
        """Save then load every request once with ``rep`` as both workers' reporter; returns
        (save, load) bytes/s and the process CPU seconds meanwhile (all threads)."""
        from kvpool_connector.keys import chunk_hashes, model_pattern
        from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadSpec, ReqMeta

        self.round += 1
        self.saver.reporter = self.loader.reporter = rep
        reqs = []
        for r in range(self.requests):
            toks = [self.round * 1_000_003 + r * 7_919 + i for i in range(CHUNKS_PER_REQ * 16 + 1)]
            blocks = list(range(r * CHUNKS_PER_REQ, (r + 1) * CHUNKS_PER_REQ))
            reqs.append((f"r{self.round}-{r}", blocks, chunk_hashes(toks, 16)))
        save_meta = KVPoolConnectorMetadata(requests=[
            ReqMeta(req_id=rid, block_ids=blocks, chunk_hashes=hashes, save_from_chunk=0,
                    save_to_chunk=CHUNKS_PER_REQ, is_last_save=True)
            for rid, blocks, hashes in reqs
        ])
        pool_tokens = CHUNKS_PER_REQ * 16
        load_meta = KVPoolConnectorMetadata(requests=[
            ReqMeta(req_id=rid, block_ids=blocks, chunk_hashes=hashes,
                    load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=pool_tokens,
                                  can_load=True))
            for rid, blocks, hashes in reqs
        ])
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        self.saver.start_load_kv(KVPoolConnectorMetadata(requests=[]))
        self.saver.wait_for_save(save_meta)
        if not self.saver.drain_saves(60):
            raise RuntimeError("saves did not finish in 60 s")
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        for rid, _, _ in reqs:
            # What the scheduler records for each lookup (the lookup itself is not timed here).
            rep.lookup(rid, pool_tokens + 1, 0, pool_tokens, 0.3)
        self.loader.start_load_kv(load_meta)
        t_load = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        if self.loader.get_block_ids_with_load_errors():
            raise RuntimeError("loads failed")
        self.backend.remove_by_scope(model_pattern(self.model), dry_run=False, force=True)
        return self.total / t_save, self.total / t_load, cpu

    def close(self) -> None:
        self.saver.shutdown()
        self.loader.shutdown()
        self.backend.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds per configuration")
    ap.add_argument("--requests", type=int, default=64, help="requests per round (4 chunks each)")
    args = ap.parse_args(argv)

    hub_address = f"tcp://127.0.0.1:{free_port_block()}"
    nobody = f"tcp://127.0.0.1:{free_port()}"
    slow = _SlowListener()
    hub = FleetHub(hub_address).start()
    console = _Console(hub_address)
    configs: dict[str, Callable[[], AgentHandle]] = {
        "off": lambda: AgentHandle(NullReporter(), _source("off")),
        "on, no listener": lambda: start_agent(_source("nobody"), address=nobody),
        "on, slow listener": lambda: start_agent(
            _source("slow"), address=f"tcp://127.0.0.1:{slow.port}"
        ),
        "on, hub + console": lambda: start_agent(_source("normal"), address=hub_address),
    }
    try:
        print("== cost per recorded event on the engine thread (ns/event, median of slices) ==")
        print(f"{'configuration':<20} {'lookup':>8} {'progress':>9} {'finished':>9} {'dropped':>8}")
        for name, factory in configs.items():
            ev = event_cost(factory)
            print(
                f"{name:<20} {ev['lookup']:>8.0f} {ev['transfer_progress']:>9.0f} "
                f"{ev['transfer_finished']:>9.0f} {ev['events_dropped']:>8.0f}"
            )

        with LocalMooncakeMaster(eviction_high_watermark_ratio=0.95) as master:
            dp = _DataPath(master, args.requests)
            try:
                dp.run(NullReporter())  # warm-up: connections, page faults
                save: dict[str, list[float]] = {k: [] for k in configs}
                load: dict[str, list[float]] = {k: [] for k in configs}
                cpu: dict[str, list[float]] = {k: [] for k in configs}
                dropped: dict[str, int] = dict.fromkeys(configs, 0)
                names = list(configs)
                for rnd in range(args.rounds):
                    # Rotate the order each round: no configuration always runs first.
                    for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                        h = configs[name]()
                        time.sleep(0.2)  # agent start-up (thread, first snapshot) is not measured
                        try:
                            s, lo, c = dp.run(h.reporter)
                        finally:
                            dropped[name] += h.counters.get("reports_dropped", 0)
                            h.stop()
                        save[name].append(s)
                        load[name].append(lo)
                        cpu[name].append(c)
            finally:
                dp.close()
        mib = dp.total / (1 << 20)
        print(
            f"\n== save/load throughput, {args.requests} requests x {CHUNKS_PER_REQ} chunks x "
            f"{LAYERS} layers ({mib:.0f} MiB per direction), median of {args.rounds} rounds =="
        )
        print(
            f"{'configuration':<20} {'save MB/s':>10} {'vs off':>8} {'best':>8} "
            f"{'load MB/s':>10} {'vs off':>8} {'best':>8} {'CPU ms':>7} {'vs off':>8} "
            f"{'dropped':>8}"
        )
        base_c = statistics.median(cpu["off"])
        base_s, base_l = statistics.median(save["off"]), statistics.median(load["off"])
        best_s, best_l = max(save["off"]), max(load["off"])
        for name in configs:
            s, lo = statistics.median(save[name]), statistics.median(load[name])
            print(
                f"{name:<20} {s / 1e6:>10.0f} {100 * (s / base_s - 1):>+7.1f}% "
                f"{100 * (max(save[name]) / best_s - 1):>+7.1f}% "
                f"{lo / 1e6:>10.0f} {100 * (lo / base_l - 1):>+7.1f}% "
                f"{100 * (max(load[name]) / best_l - 1):>+7.1f}% "
                f"{statistics.median(cpu[name]) * 1e3:>7.0f} "
                f"{100 * (statistics.median(cpu[name]) / base_c - 1):>+7.1f}% {dropped[name]:>8}"
            )
        print(
            f"(console received {console.updates} fleet updates; 'vs off' compares medians, "
            "'best' the fastest round of each; CPU = process CPU time of a round, all threads; "
            "dropped = agent reports dropped; goal: within 2% of off)"
        )
    finally:
        console.close()
        hub.stop()
        slow.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
