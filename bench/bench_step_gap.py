"""Step time of a real vLLM engine while its KV saves run, against the same engine without a
connector (issue 38's benchmark; goal: within 5%).

Two engines of the tests' launcher (``tests/vllm/_engine.py``: each its own process, the engine
core in it), vLLM CPU, ``enforce_eager``, bfloat16, block 32, prefix caching off, on the random
tiny model with Llama-3-8B's KV shape (``build_tiny_model(shape="llama3-8b-kv")``: 32 layers x
8 KV heads x 128, 128 KiB per token):

* ``none``: no KV connector (vLLM alone, the baseline);
* ``pool``: ``KVPoolConnector`` (``kv_both``, Mooncake backend) saving every whole chunk of
  every prompt to a pool held by a separate ``mooncake_client`` store process, TCP on
  127.0.0.1 (a real ``mooncake_master``); it looks every prompt up too (a fresh
  ``cache_salt`` per round and engine: nothing is found, everything is saved).

Each round serves the same ``--prompts`` fresh random prompts of ``--prompt-tokens`` tokens
(``--max-tokens`` decoded each, at most ``--max-num-seqs`` at once) on both engines, one after
the other (the order alternates by round), stepping the engine and timing every step
(``Engine.timed_steps``); the pool engine's saves run while later requests prefill and decode.
Between rounds the saves are drained (untimed) and the pool is cleared. Round 0 warms up and
is not counted. Prints per engine the time of its forward steps (steps that scheduled tokens:
median, p90, mean over all counted rounds; the pool engine also has idle steps while its
lookups run, vLLM's "ask later"), the round's wall time (all steps: median, min-max), the
ratio pool / none of each, the values saved per round, each engine's CPU seconds per round
(its process, steps and the saves' drain) and the store process's while it ran, so the pool's
extra CPU shows next to the engine's own, and the load average. ``--reserve-cpus N`` puts
each engine's worker in a process of its own (vLLM's MP executor, which binds its OpenMP threads
and keeps N cores back, ``VLLM_CPU_NUM_OF_RESERVED_CPU``); ``--transfer-cpus`` is then the pool
engine's ``transfer_cpus``. Without it the workers run unbound in the engines' processes
(``--engine-threads N``: their torch threads). ``--save-nice N`` runs the pool engine's save
threads N nice levels below it (``save_nice``). Timing is for an idle machine:

    .venv/bin/python bench/bench_step_gap.py [--rounds 11] [--prompts 8] [--prompt-tokens 448]
        [--reserve-cpus 1 [--transfer-cpus inherit]] [--engine-threads 1] [--save-nice 19]

``--rounds 1`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The one engine launcher, ``tests/vllm/_engine.py``.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ["PATH"] = os.path.join(sys.prefix, "bin") + os.pathsep + os.environ.get("PATH", "")

from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import ALL_KEYS_PATTERN
from kvpool_replay import LocalMooncakeMaster, LocalPoolStore, build_tiny_model
from kvpool_replay._forkserver import stop_fork_server

from _engine import Engine  # isort: skip

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[1]

BLOCK = 32  # vLLM's CPU attention: blocks of a multiple of 32 tokens
PER_TOKEN = 32 * 2 * 8 * 128 * 2
"""KV bytes per token of the model (Llama-3-8B's: 128 KiB)."""


def _spec(model: Path, ktc: dict[str, Any] | None, max_num_seqs: int, threads: int,
          mp: bool) -> dict[str, Any]:
    """``_engine``'s spec of one engine; its KV cache holds every running request;
    ``threads``: its torch threads (0: torch's default, one per core); ``mp``: its worker in
    a process of its own (vLLM's MP executor, which binds the worker's OpenMP threads)."""
    return {"model": str(model), "kv_transfer_config": ktc, "prefix_caching": False,
            "num_gpu_blocks": 4 * max_num_seqs * 512 // BLOCK, "dtype": "bfloat16",
            "block_size": BLOCK, "max_num_seqs": max_num_seqs, "torch_threads": threads,
            "executor": "mp" if mp else None}


def _pooled(name: str, save_nice: int, transfer_cpus: str) -> dict[str, Any]:
    return {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            # A cold engine's first lookups on a busy host can miss the default 50 ms.
            "kv_connector_extra_config": {"backend": "mooncake", "engine_id": name,
                                          "lookup_timeout_ms": 2000, "save_nice": save_nice,
                                          "transfer_cpus": transfer_cpus}}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` and its live children (an MP
    executor's workers) used so far."""
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


Step = tuple[float, int]
"""One engine step: its wall time (s) and the tokens it scheduled (0: no forward pass)."""


def _summary(rounds: list[list[Step]]) -> dict[str, float]:
    """Forward steps' times (ms) over every counted round, steps per round, and the rounds'
    wall times (s: all steps, the idle ones too)."""
    fwd = sorted(t for r in rounds for t, n in r if n)
    walls = [sum(t for t, _ in r) for r in rounds]
    return {"median": statistics.median(fwd) * 1e3, "p90": fwd[int(0.9 * (len(fwd) - 1))] * 1e3,
            "mean": statistics.fmean(fwd) * 1e3, "fwd": len(fwd) / len(rounds),
            "idle": sum(1 for r in rounds for _, n in r if not n) / len(rounds),
            "wall": statistics.median(walls), "wall_min": min(walls), "wall_max": max(walls)}


def main(argv: list[str] | None = None) -> None:
    """Run both engines' rounds and print the comparison."""
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--rounds", type=int, default=11, help="counted rounds (one warm-up more)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per round")
    ap.add_argument("--prompt-tokens", type=int, default=448, help="tokens per prompt (< 500)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens decoded per prompt")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="vLLM's batch size")
    ap.add_argument("--engine-threads", type=int, default=0, metavar="N",
                    help="both engines' torch threads (default 0: one per core). Fewer than "
                         "the cores leaves cores to the pool's threads, as vLLM's CPU backend "
                         "reserves a core per rank for a KV connector")
    ap.add_argument("--reserve-cpus", type=int, default=0, metavar="N",
                    help="both engines' worker in its own process (vLLM's MP executor) with N "
                         "cores kept back from its OpenMP threads (VLLM_CPU_NUM_OF_RESERVED_CPU)"
                         "; default 0: the worker in the engine's process, unbound")
    ap.add_argument("--transfer-cpus", default="auto",
                    help="the pool engine's transfer_cpus (default auto; inherit: the "
                         "forward pass's cores)")
    ap.add_argument("--save-nice", type=int, default=0, choices=range(20), metavar="0-19",
                    help="the pool engine's save_nice (nice levels its save threads run below "
                         "the engine; default 0)")
    args = ap.parse_args(argv)
    if args.prompt_tokens + args.max_tokens > 512:
        ap.error("--prompt-tokens + --max-tokens must fit the engines' 512 positions")
    if not 0 <= args.reserve_cpus < (os.cpu_count() or 1):
        ap.error(f"--reserve-cpus {args.reserve_cpus}: keep at least one of the "
                 f"{os.cpu_count()} cores for the forward pass, e.g. 1")
    try:  # the connector's own check, before minutes of engine start
        KVPoolConfig.from_dicts({"transfer_cpus": args.transfer_cpus}, kv_role="kv_both",
                                block_size=BLOCK, model="m")
    except ValueError as exc:
        ap.error(f"--transfer-cpus: {exc}")
    if args.transfer_cpus != "auto" and not args.reserve_cpus:
        ap.error("--transfer-cpus acts on vLLM's CPU binding: add --reserve-cpus 1")
    load_start = os.getloadavg()[0]
    if load_start > 1.0:
        print(f"warning: load average {load_start:.2f} at start: the timings are for an idle "
              "machine", file=sys.stderr)
    model = build_tiny_model(REPO / ".cache" / "tiny-llama3-8b-kv", shape="llama3-8b-kv")
    tmp = tempfile.TemporaryDirectory(prefix="kvpool-step-gap-")
    workdir = Path(tmp.name)
    per_round = args.prompts * args.prompt_tokens * PER_TOKEN
    rng = random.Random(38)
    steps: dict[str, list[list[Step]]] = {"none": [], "pool": []}
    saved: list[int] = []
    # CPU seconds per counted round, steps and the saves' drain: each engine's process, and
    # the store's process while that engine ran.
    cpu: dict[str, list[float]] = {"none": [], "pool": []}
    store_cpu: dict[str, list[float]] = {"none": [], "pool": []}
    with LocalMooncakeMaster(eviction_high_watermark_ratio=0.95) as master, \
            LocalPoolStore(master, max(256 << 20, 2 * per_round)) as store:
        config = workdir / "mooncake.json"
        config.write_text(json.dumps({
            "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp", "master_server_address": master.address,
            "global_segment_size": 0, "local_buffer_size": "64MB",
            "store_mode": "standalone", "master_admin_url": master.admin_url}))
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false",
               "KVPOOL_RUNTIME_DIR": str(workdir), "MOONCAKE_CONFIG_PATH": str(config)}
        admin = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": master.address, "global_segment_size": 0,
            "master_admin_url": master.admin_url, "local_buffer_size": "16MB"}}))
        if args.reserve_cpus:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserve_cpus)
        pooled = _pooled("pool", args.save_nice, args.transfer_cpus)
        engines = {name: Engine(name, _spec(model, ktc, args.max_num_seqs, args.engine_threads,
                                            args.reserve_cpus > 0), env, workdir / f"{name}.log")
                   for name, ktc in (("none", None), ("pool", pooled))}
        assert store.proc is not None
        try:
            for rnd in range(args.rounds + 1):
                prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_tokens)]
                           for _ in range(args.prompts)]
                order = ["none", "pool"] if rnd % 2 else ["pool", "none"]
                for name in order:
                    pid = engines[name].proc.pid
                    assert pid is not None
                    before, store_before = _cpu_s(pid), _cpu_s(store.proc.pid)
                    got = engines[name].timed_steps(prompts, args.max_tokens,
                                                    salt=f"{name}-{rnd}-{os.getpid()}")
                    engines[name].settle()  # the saves drained, untimed
                    if rnd:
                        steps[name].append(got)
                        cpu[name].append(_cpu_s(pid) - before)
                        store_cpu[name].append(_cpu_s(store.proc.pid) - store_before)
                removed = admin.remove_by_scope(ALL_KEYS_PATTERN, dry_run=False, force=True)
                if rnd:
                    saved.append(removed.removed)
        finally:
            for engine in engines.values():
                engine.close()
            admin.close()
            stop_fork_server()
            tmp.cleanup()
    _print(args, steps, saved, load_start, cpu, store_cpu)


def _print(args: argparse.Namespace, steps: dict[str, list[list[Step]]], saved: list[int],
           load_start: float, cpu: dict[str, list[float]], store_cpu: dict[str, list[float]]
           ) -> None:
    s = {name: _summary(v) for name, v in steps.items()}
    print(f"\nStep time while saves run: vLLM CPU, 1 engine at a time, tiny model with "
          f"Llama-3-8B's KV shape (32 x 8 x 128, bf16, 128 KiB per token), block {BLOCK}; "
          f"{args.prompts} prompts of {args.prompt_tokens} tokens + {args.max_tokens} decoded "
          f"per round, batch {args.max_num_seqs}, {args.rounds} round(s); pool: a separate "
          f"mooncake_client over TCP on 127.0.0.1; load average {load_start:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at the end\n")
    print(f"{'engine':<8}{'fwd steps':>10}{'idle':>6}{'median ms':>11}{'p90 ms':>9}"
          f"{'mean ms':>9}{'round s':>9}{'min-max s':>13}   (per round; ms: forward steps)")
    for name, v in s.items():
        spread = f"{v['wall_min']:.2f}-{v['wall_max']:.2f}"
        print(f"{name:<8}{v['fwd']:>10.1f}{v['idle']:>6.1f}{v['median']:>11.2f}{v['p90']:>9.2f}"
              f"{v['mean']:>9.2f}{v['wall']:>9.2f}{spread:>13}")
    print(f"\npool / none: forward step median {s['pool']['median'] / s['none']['median']:.3f}, "
          f"p90 {s['pool']['p90'] / s['none']['p90']:.3f}, mean "
          f"{s['pool']['mean'] / s['none']['mean']:.3f}; round (all steps) "
          f"{s['pool']['wall'] / s['none']['wall']:.3f}")
    print(f"values saved per round (8 per chunk: one per KV head): "
          f"{statistics.median(saved):.0f} (min {min(saved)}, max {max(saved)}); expected "
          f"{args.prompts * (args.prompt_tokens // BLOCK) * 8}; pool engine's save_nice "
          f"{args.save_nice}; {os.cpu_count()} cores; "
          + (f"workers in processes of their own, OpenMP bound by vLLM with "
             f"{args.reserve_cpus} core(s) kept back (VLLM_CPU_NUM_OF_RESERVED_CPU), the pool "
             f"engine's transfer_cpus {args.transfer_cpus}" if args.reserve_cpus else
             f"workers in the engines' processes, torch threads "
             f"{args.engine_threads or 'one per core'}"))
    none_cpu, pool_cpu = statistics.median(cpu["none"]), statistics.median(cpu["pool"])
    extra = pool_cpu + statistics.median(store_cpu["pool"]) - none_cpu \
        - statistics.median(store_cpu["none"])
    print(f"CPU s per round (steps and the saves' drain, median): engine none {none_cpu:.2f} "
          f"({none_cpu / s['none']['wall']:.2f} cores over its round), engine pool "
          f"{pool_cpu:.2f}, store process {statistics.median(store_cpu['pool']):.2f} while "
          f"pool ran, {statistics.median(store_cpu['none']):.2f} while none ran; the pool's "
          f"extra CPU {extra:.2f} s = {extra / none_cpu:.0%} of the engine's own")
    ratio = s["pool"]["wall"] / s["none"]["wall"]
    print(f"goal (issue 38): the pool engine's step time within 5% of no connector: "
          f"{'met' if ratio <= 1.05 else 'not met'} (a round {ratio:.3f}x)")


if __name__ == "__main__":
    main()
