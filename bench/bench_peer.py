"""Peer benchmark: ``KVPoolConnector`` next to vLLM's own ``MooncakeStoreConnector``.

One vLLM CPU build, one local ``mooncake_master`` (plus a ``mooncake_client`` holding the pool
memory, so the pool outlives either engine), one workload, three runs:

* ``none``: no connector (the baseline every output is compared with);
* ``peer``: vLLM's ``MooncakeStoreConnector`` (``kv_connector="MooncakeStoreConnector"``,
  ``load_async: true``, Mooncake ``standalone-store`` mode), both engines with
  ``PYTHONHASHSEED=0`` (its keys are vLLM block hashes, whose seed comes from
  ``PYTHONHASHSEED`` when set; see ``EXTRA_RUNS`` for the peer without it);
* ``ours``: ``KVPoolConnector`` as the README recommends (``backend: mooncake``, ``kv_both``,
  ``kv_load_failure_policy: recompute``, defaults otherwise), ``PYTHONHASHSEED`` unset, so each
  engine process hashes Python objects with its own random seed: its keys do not depend on it.

Workload: a slice of the conversation trace (``--start``, ``--requests``); each request's
``hash_ids`` become token runs (``kvpool_replay._tokens.request_tokens``: equal ids give equal
512-token runs), truncated to ``MAX_PROMPT`` tokens. Engine A serves the first ``--warm``
requests one at a time (it computes and saves), engine B then serves the same prompts (it reads),
then A and B together serve the rest of the slice, alternating, each ``--concurrency`` requests
in flight. vLLM's own prefix cache is off in every run, so every prompt token an engine did not
compute came from the pool (``num_cached_tokens``).

The model is a Llama with random (seeded) weights built locally with the tiny model's tokenizer
(``--layers``, ``--hidden``...): by default 6 layers, hidden 384. Measured on the project's
2-core machine at load average ~2: a 2,000-token prefill takes 340-530 ms, the 7 decode steps
after it 50-130 ms in all, so prefill dominates a request.

Figures per run: pool hit tokens, prompt tokens, TTFT p50/p99 over every request, request
throughput and output tokens/s of the mixed phase, KV bytes saved and loaded and GB/s over the
time spent in the store's transfer calls (vLLM's per-RPC records for the peer; the backend's
``batch_put_from``/``batch_get_into`` wall time for ours), scheduler lookup p50 (time in
``get_num_new_matched_tokens``, measured the same way for both), load errors, and whether
every greedy output equals the ``none`` run. Then ours/peer for each.

Run (about 3 minutes on 2 cores at load average 2-4; 12 minutes when the machine is loaded)::

    .venv/bin/python bench/bench_peer.py
    .venv/bin/python bench/bench_peer.py --requests 64 --layers 12 --hidden 512 --heads 8

``--engine SPEC.json`` is the engine process this script starts for itself.

One file over 600 lines, on purpose: the script re-executes itself as its own engine and P/D
server processes (``--engine``, ``--pd-serve``), so the engine side, the one-engine-pair run
and the P/D run share its entry point and its configuration builders.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from kvpool_replay import LocalMooncakeMaster, LocalPoolStore, build_tiny_model
from kvpool_replay._pd import LocalPdPair, ProxyReplay
from kvpool_replay._processes import engine_env
from kvpool_replay._tiny_model import VOCAB_SIZE
from kvpool_replay._tokens import request_tokens
from kvpool_replay._trace import TRACE_BLOCK_TOKENS, TraceRequest, default_trace_path, load_trace

REPO = Path(__file__).resolve().parents[1]
MAX_PROMPT = 2000
"""Prompt tokens kept per request (the model has 2048 positions)."""
BLOCK = 32
"""vLLM block size (its CPU attention needs a multiple of 32); also both connectors' chunk."""
RUNS = ("none", "peer", "ours")
EXTRA_RUNS = ("peer-noseed",)
"""``peer-noseed``: the peer without a common ``PYTHONHASHSEED``. With vLLM 0.32's default
``sha256`` block hash the seed of its first block hash is a fixed default when
``PYTHONHASHSEED`` is unset (``vllm.v1.core.kv_cache_utils.resolve_none_hash_seed``), so B still
finds A's blocks; a common seed is needed only with ``prefix_caching_hash_algo`` ``xxhash`` or
``xxhash_cbor`` (random per process otherwise)."""


# ----------------------------------------------------------------------------- workload


def build_workload(trace: list[TraceRequest], start: int, count: int,
                   vocab: int = VOCAB_SIZE, max_prompt: int = MAX_PROMPT) -> list[list[int]]:
    """Prompts (token id lists, ``<= max_prompt`` tokens, ids ``< vocab``) of
    ``trace[start:start + count]``: requests sharing leading ``hash_ids`` share leading tokens.

    Raises:
        ValueError: the slice is empty.
    """
    reqs = trace[start:start + count]
    if not reqs:
        raise ValueError(f"trace slice [{start}:{start + count}] is empty ({len(trace)} requests)")
    return [request_tokens(r, vocab)[:max_prompt] for r in reqs]


# ----------------------------------------------------------------------------- model


def build_bench_model(layers: int, hidden: int, heads: int, kv_heads: int,
                      intermediate: int) -> Path:
    """A Llama with random seeded weights and the tiny model's tokenizer, cached in
    ``.cache/bench-llama-...``; returns its directory (what vLLM loads as ``model``)."""
    name = f"bench-llama-l{layers}-h{hidden}-a{heads}-kv{kv_heads}-i{intermediate}"
    target = REPO / ".cache" / name
    if (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = build_tiny_model(REPO / ".cache" / "tiny-llama")
    tmp = Path(tempfile.mkdtemp(prefix=name + ".", dir=target.parent))
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        # Peaked logits (as in the tiny model): greedy tokens then depend on the KV, not on
        # float noise, so "equal outputs" is a meaningful check.
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    tmp.rename(target)
    return target


# ----------------------------------------------------------------------------- engine process


def _shim_cuda_event() -> None:
    """Benchmark-only: vLLM's MooncakeStoreConnector records a ``torch.cuda.Event`` per save
    step and its sender thread waits on it; a CPU build has no CUDA, and CPU kernels have
    finished when the step returns, so a no-op event keeps its semantics. Never in the product."""
    import torch

    class _NoOpEvent:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record(self, stream: Any = None) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def wait(self, stream: Any = None) -> None:
            pass

        def query(self) -> bool:
            return True

    torch.cuda.Event = _NoOpEvent  # type: ignore[misc,assignment]


def _timed(obj: Any, name: str, sink: list[float]) -> None:
    """Wrap ``obj.name`` so each call's wall time (seconds) is appended to ``sink``."""
    fn = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def _wait_files(paths: list[str], timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {paths}")
        time.sleep(0.05)


def _serve(llm: Any, prompts: list[tuple[str, list[int]]], concurrency: int,
           max_tokens: int) -> list[dict[str, Any]]:
    """Serve ``prompts`` through vLLM's engine loop with at most ``concurrency`` in flight;
    per request: id, prompt tokens, TTFT (ms, from submission), output tokens, cached tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    todo = list(prompts)
    lens = dict(prompts)
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    done: list[dict[str, Any]] = []
    while todo or submitted:
        while todo and len(submitted) < concurrency:
            rid, toks = todo.pop(0)
            submitted[rid] = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": toks}, params)
        for out in engine.step():
            rid = out.request_id
            now = time.perf_counter()
            if rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = now
            if out.finished:
                t_sub = submitted.pop(rid)
                done.append({
                    "id": rid, "prompt": len(lens[rid]), "ttft_ms": (first[rid] - t_sub) * 1e3,
                    "e2e_ms": (now - t_sub) * 1e3,
                    "tokens": list(out.outputs[0].token_ids),
                    "cached": int(out.num_cached_tokens or 0), "end": time.time(),
                })
    return done


def engine_main(spec_path: str) -> int:
    """One engine process: build ``vllm.LLM`` from the spec, run its phases (each waits for
    its ``wait`` files and creates its ``done`` file), write the results JSON."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["connector"] == "peer":
        _shim_cuda_event()
    from vllm import LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    kwargs: dict[str, Any] = {}
    if spec["kv_transfer_config"]:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=2048, block_size=BLOCK,
              dtype="float32", enable_prefix_caching=False, max_num_seqs=8,
              max_num_batched_tokens=2048, seed=0, **kwargs)
    lookups: list[float] = []
    save_s: list[float] = []
    load_s: list[float] = []
    peer_records: dict[str, list[dict[str, Any]]] = {}
    worker: Any = None
    if spec["kv_transfer_config"]:
        # In-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): the scheduler's connector
        # and the worker's connector are both reachable from here.
        inproc: Any = llm.llm_engine.engine_core  # vLLM's InprocClient here
        sched = inproc.engine_core.scheduler.connector
        _timed(sched, "get_num_new_matched_tokens", lookups)
        worker = get_kv_transfer_group()
        if spec["connector"] == "ours":
            _timed(worker._backend, "batch_put_from", save_s)
            _timed(worker._backend, "batch_get_into", load_s)
        else:
            inner = worker.get_kv_connector_stats

            def keep_stats() -> Any:
                stats = inner()
                if stats is not None:
                    for op, recs in stats.data.items():
                        peer_records.setdefault(op, []).extend(recs)
                return stats

            worker.get_kv_connector_stats = keep_stats
    Path(spec["ready"]).touch()
    phases = []
    for ph in spec["phases"]:
        _wait_files(ph["wait"])
        t0 = time.time()
        reqs = _serve(llm, [(r, p) for r, p in ph["prompts"]], ph["concurrency"],
                      spec["max_tokens"])
        phases.append({"name": ph["name"], "start": t0, "end": time.time(), "requests": reqs})
        Path(ph["done"]).touch()
    result: dict[str, Any] = {"phases": phases, "lookup_s": lookups}
    if spec["connector"] == "ours" and worker is not None:
        c = worker._work().counters
        result.update(saved_bytes=c.saved_bytes, loaded_bytes=c.loaded_bytes,
                      load_errors=c.load_failed_keys, save_s=sum(save_s), load_s=sum(load_s))
    elif spec["connector"] == "peer" and worker is not None:
        time.sleep(1.0)  # let the sender thread finish the last saves' records
        worker.get_kv_connector_stats()
        saves = peer_records.get("save_put", [])
        loads = peer_records.get("load_get", [])
        result.update(
            saved_bytes=sum(int(r["num_bytes"]) for r in saves),
            loaded_bytes=sum(int(r["num_bytes"]) for r in loads),
            load_errors=sum(int(r["num_failed_keys"]) for r in loads)
            + sum(1 for r in loads if r["status"] == "error" and not r["num_failed_keys"]),
            save_s=sum(float(r["duration_seconds"]) for r in saves),
            load_s=sum(float(r["duration_seconds"]) for r in loads),
        )
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------- orchestration


def _mooncake_config(kind: str, workdir: Path, master: LocalMooncakeMaster) -> Path:
    """The ``mooncake.json`` of the ``peer`` or ``ours`` engines (``MOONCAKE_CONFIG_PATH``)."""
    if kind == "peer":
        cfg = workdir / "peer-mooncake.json"
        cfg.write_text(json.dumps({
            "metadata_server": "P2PHANDSHAKE", "master_server_address": master.address,
            "protocol": "tcp", "device_name": "", "mode": "standalone-store",
            "global_segment_size": 0, "local_buffer_size": "256MB",
        }))
        return cfg
    cfg = workdir / "ours-mooncake.json"
    cfg.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
        "master_server_address": master.address, "global_segment_size": "256MB",
        "local_buffer_size": "256MB", "store_mode": "standalone",
        "master_admin_url": master.admin_url,
    }))
    return cfg


def _kv_config(run: str, engine: str, workdir: Path, master: LocalMooncakeMaster
               ) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """``kv_transfer_config`` and extra environment of engine ``engine`` in run ``run``."""
    if run == "none":
        return None, {}
    if run.startswith("peer"):
        cfg = _mooncake_config("peer", workdir, master)
        # Its lookup socket is named by lookup_rpc_port and host only: one per engine.
        return ({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                 "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"load_async": True,
                                               "lookup_rpc_port": 1 if engine == "A" else 2}},
                {"MOONCAKE_CONFIG_PATH": str(cfg),
                 **({"PYTHONHASHSEED": "0"} if run == "peer" else {})})
    cfg = _mooncake_config("ours", workdir, master)
    return ({"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
             "kv_connector_extra_config": {"backend": "mooncake", "engine_id": f"bench-{engine}",
                                           "mooncake_config_path": str(cfg)}},
            {})


def run_once(run: str, args: argparse.Namespace, model: Path, prompts: list[list[int]]
             ) -> dict[str, Any]:
    """One run: a fresh master and pool store, engines A and B; returns both engines'
    results, or ``{"error": ...}`` with the failing engine's log tail."""
    workdir = Path(tempfile.mkdtemp(prefix=f"kvp-{run}-"))
    master = LocalMooncakeMaster(log_dir=workdir).start()
    store = (LocalPoolStore(master, args.segment_mb << 20, log_dir=workdir).start()
             if run != "none" else None)
    warm = [(f"w{i}", p) for i, p in enumerate(prompts[:args.warm])]
    mixed = [(f"m{i}", p) for i, p in enumerate(prompts[args.warm:])]
    f = {k: str(workdir / k) for k in ("A.ready", "B.ready", "warm.done", "read.done",
                                       "A.mixed.done", "B.mixed.done")}
    phases = {
        "A": [{"name": "warm", "prompts": warm, "concurrency": 1,
               "wait": [f["A.ready"], f["B.ready"]], "done": f["warm.done"]},
              {"name": "mixed", "prompts": mixed[0::2], "concurrency": args.concurrency,
               "wait": [f["read.done"]], "done": f["A.mixed.done"]}],
        "B": [{"name": "read", "prompts": [("r" + r[1:], p) for r, p in warm],
               "concurrency": 1, "wait": [f["warm.done"]], "done": f["read.done"]},
              {"name": "mixed", "prompts": mixed[1::2], "concurrency": args.concurrency,
               "wait": [f["read.done"]], "done": f["B.mixed.done"]}],
    }
    procs = {}
    try:
        for eng in ("A", "B"):
            ktc, extra_env = _kv_config(run, eng, workdir, master)
            spec = {"model": str(model), "kv_transfer_config": ktc,
                    "connector": "peer" if run.startswith("peer") else run,
                    "max_tokens": args.max_tokens, "ready": f[f"{eng}.ready"],
                    "phases": phases[eng], "out": str(workdir / f"{eng}.out.json")}
            (workdir / f"{eng}.spec.json").write_text(json.dumps(spec))
            env = {**engine_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1",
                   "KVPOOL_RUNTIME_DIR": str(workdir), "TOKENIZERS_PARALLELISM": "false",
                   **extra_env}
            if "PYTHONHASHSEED" not in extra_env:
                env.pop("PYTHONHASHSEED", None)
            log = open(workdir / f"{eng}.log", "w")  # noqa: SIM115 - closed with the process
            procs[eng] = (subprocess.Popen(
                [sys.executable, __file__, "--engine", str(workdir / f"{eng}.spec.json")],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), log)
        out: dict[str, Any] = {}
        deadline = time.monotonic() + args.timeout
        for eng, (proc, log) in procs.items():
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            log.close()
            if rc != 0:
                return {"error": f"engine {eng} {'timed out' if rc is None else f'exited {rc}'}",
                        "log": _error_lines(workdir / f"{eng}.log")}
            out[eng] = json.loads((workdir / f"{eng}.out.json").read_text())
        return out
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.close()
        if store is not None:
            store.stop()
        master.stop()


def _error_lines(log: Path, n: int = 12) -> str:
    """The log's lines from its last traceback (or its last ``n`` lines)."""
    lines = log.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    tail = lines[starts[-1]:] if starts else lines[-n:]
    return "\n".join(tail[-40:])


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Per-run figures from engines A and B's results (see the module docstring)."""
    reqs = [r for eng in ("A", "B") for ph in res[eng]["phases"] for r in ph["requests"]]
    mixed = [ph for eng in ("A", "B") for ph in res[eng]["phases"] if ph["name"] == "mixed"]
    wall = max(ph["end"] for ph in mixed) - min(ph["start"] for ph in mixed)
    n_mixed = sum(len(ph["requests"]) for ph in mixed)
    ttft = sorted(r["ttft_ms"] for r in reqs)
    lookups = [x * 1e3 for eng in ("A", "B") for x in res[eng]["lookup_s"]]
    def phase_ttft(name: str) -> float:
        return statistics.median(r["ttft_ms"] for eng in ("A", "B") for ph in res[eng]["phases"]
                                 if ph["name"] == name for r in ph["requests"])

    s: dict[str, Any] = {
        "hit_tokens": sum(r["cached"] for r in reqs),
        "warm_ttft_p50_ms": phase_ttft("warm"),
        "read_ttft_p50_ms": phase_ttft("read"),
        "mixed_ttft_p50_ms": phase_ttft("mixed"),
        "prompt_tokens": sum(r["prompt"] for r in reqs),
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "req_per_s": n_mixed / wall,
        "out_tok_per_s": sum(len(r["tokens"]) for ph in mixed for r in ph["requests"]) / wall,
        "read_hit_tokens": sum(r["cached"] for ph in res["B"]["phases"] if ph["name"] == "read"
                               for r in ph["requests"]),
        "tokens": {r["id"]: r["tokens"] for r in reqs},
    }
    if lookups:
        s["lookup_p50_ms"] = statistics.median(lookups)
    if "saved_bytes" in res["A"]:
        for k in ("saved_bytes", "loaded_bytes", "load_errors", "save_s", "load_s"):
            s[k] = res["A"][k] + res["B"][k]
        s["save_gbps"] = s["saved_bytes"] / s["save_s"] / 1e9 if s["save_s"] else None
        s["load_gbps"] = s["loaded_bytes"] / s["load_s"] / 1e9 if s["load_s"] else None
    return s


ROWS = [
    ("pool hit tokens", "hit_tokens", "{:,.0f}"),
    ("  of which B's read phase", "read_hit_tokens", "{:,.0f}"),
    ("prompt tokens", "prompt_tokens", "{:,.0f}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
    ("  A warm: TTFT p50 (ms)", "warm_ttft_p50_ms", "{:.0f}"),
    ("  B read: TTFT p50 (ms)", "read_ttft_p50_ms", "{:.0f}"),
    ("  mixed: TTFT p50 (ms)", "mixed_ttft_p50_ms", "{:.0f}"),
    ("mixed: requests/s", "req_per_s", "{:.2f}"),
    ("mixed: output tokens/s", "out_tok_per_s", "{:.1f}"),
    ("KV bytes saved (MB)", "saved_mb", "{:.1f}"),
    ("KV bytes loaded (MB)", "loaded_mb", "{:.1f}"),
    ("save GB/s (in store calls)", "save_gbps", "{:.2f}"),
    ("load GB/s (in store calls)", "load_gbps", "{:.2f}"),
    ("lookup p50 (ms)", "lookup_p50_ms", "{:.2f}"),
    ("load errors", "load_errors", "{:.0f}"),
    ("outputs equal to none", "equal", "{}"),
]


def print_table(summ: dict[str, dict[str, Any] | str]) -> None:
    """The figures of every run, then ours/peer per figure."""
    ok = {k: v for k, v in summ.items() if isinstance(v, dict)}
    base = ok.get("none", {}).get("tokens")
    for s in ok.values():
        if "saved_bytes" in s:
            s["saved_mb"] = s["saved_bytes"] / 1e6
            s["loaded_mb"] = s["loaded_bytes"] / 1e6
        if base is not None:
            diff = sum(1 for k, v in s["tokens"].items() if base.get(k) != v)
            s["equal"] = "yes" if diff == 0 else f"no ({diff} of {len(base)} differ)"
    _print_rows(summ, [r for r in RUNS + EXTRA_RUNS if r in summ], ROWS)
    _print_not_run(summ)


def _print_rows(summ: dict[str, dict[str, Any] | str], names: list[str],
                rows: list[tuple[str, str, str]]) -> None:
    """A markdown table: a column per run of ``names``, a row per ``(label, key, format)``
    of ``rows``, then ours/peer."""
    print(f"| figure | {' | '.join(names)} | ours/peer |")
    print("|" + "---|" * (len(names) + 2))
    for label, key, fmt in rows:
        cells = []
        for n in names:
            run = summ[n]
            v = run.get(key) if isinstance(run, dict) else None
            cells.append("-" if v is None else fmt.format(v))
        ratio = "-"
        o, p = (summ.get(r) for r in ("ours", "peer"))
        if isinstance(o, dict) and isinstance(p, dict):
            ov, pv = o.get(key), p.get(key)
            if isinstance(ov, int | float) and isinstance(pv, int | float) and pv:
                ratio = f"{ov / pv:.2f}x"
        print(f"| {label} | {' | '.join(cells)} | {ratio} |")


def _print_not_run(summ: dict[str, dict[str, Any] | str]) -> None:
    """Why each run that did not finish did not."""
    for n, v in summ.items():
        if isinstance(v, str):
            print(f"\n{n} did not run: {v}")


# ----------------------------------------------------------------------------- P/D run

PD_RUNS = ("none", "peer", "ours")
"""``--pd``: one engine without a connector (the outputs' reference), then the peer pair, then
ours, each behind the Mooncake wheel's proxy over a fresh master and pool store."""
P2P_REASON = ("vLLM's MooncakeConnector (P2P) cannot start on a CPU build: "
              "torch.accelerator.current_device_index() raises 'Cannot access accelerator "
              "device when none is available'; the pool is the hand-over")


def pd_warmup(requests: list[TraceRequest]) -> list[TraceRequest]:
    """The P/D runs' warm-up request: a ``MAX_PROMPT``-token prompt of hash ids above every id
    of ``requests``, so it shares no chunk with the workload."""
    top = max(h for r in requests for h in r.hash_ids)
    n = -(-MAX_PROMPT // TRACE_BLOCK_TOKENS)
    return [TraceRequest(timestamp=0, input_length=MAX_PROMPT, output_length=8,
                         hash_ids=list(range(top + 1, top + 1 + n)))]


_PEER_PD = (
    # Prefill: saves every block; it also looks its prompt up (enable_lookup defaults to on).
    {"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": None,
     "kv_role": "kv_producer", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"load_async": True}},
    # Decode: a kv_consumer loads what the store holds when enable_lookup is on (its
    # default, spelt out); it saves nothing without save_decode_cache.
    {"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": None,
     "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"load_async": True, "enable_lookup": True}},
)


def pd_serve_main(argv: list[str]) -> None:
    """The peer pair's engine process: vLLM's OpenAI server (arguments ``argv``) with the
    benchmark-only CUDA event shim (``_shim_cuda_event``) applied first."""
    import runpy

    _shim_cuda_event()
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def engine_counters(url: str) -> dict[str, float]:
    """Sums of one engine's Prometheus counters (``url``/metrics) this benchmark reads:
    ``prompt`` (prompt tokens), ``pool_hit`` / ``computed`` (prompt tokens from the connector /
    computed, vLLM's ``prompt_tokens_by_source``), ``loaded_bytes`` / ``saved_bytes`` (ours:
    ``vllm:kvpool_*_bytes``; the peer: ``vllm:mooncake_store_operation_bytes`` of
    ``load_get`` / ``save_put``).

    Raises:
        httpx.HTTPError: the engine did not answer.
    """
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    out = dict.fromkeys(("prompt", "pool_hit", "computed", "loaded_bytes", "saved_bytes"), 0.0)
    sources = {"external_kv_transfer": "pool_hit", "local_compute": "computed"}
    operations = {"load_get": "loaded_bytes", "save_put": "saved_bytes"}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if not smp.name.endswith("_total"):
                continue  # a counter's _created sample
            key = None
            if fam.name == "vllm:prompt_tokens":
                key = "prompt"
            elif fam.name == "vllm:prompt_tokens_by_source":
                key = sources.get(smp.labels.get("source", ""))
            elif fam.name in ("vllm:kvpool_loaded_bytes", "vllm:kvpool_saved_bytes"):
                key = fam.name.removeprefix("vllm:kvpool_")
            elif fam.name == "vllm:mooncake_store_operation_bytes":
                key = operations.get(smp.labels.get("operation", ""))
            if key is not None:
                out[key] += smp.value
    return out


def _settled_counters(url: str, prompt_tokens: int, timeout_s: float = 60.0
                      ) -> dict[str, float]:
    """The engine's counters once it has counted ``prompt_tokens`` prompt tokens and two
    scrapes a second apart agree (the stats of a step reach Prometheus after its output)."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, float] | None = None
    while True:
        now = engine_counters(url)
        if now["prompt"] >= prompt_tokens and now == last:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: counters not settled in {timeout_s:.0f} s: {now}")
        last = now
        time.sleep(1.0)


def _sent_tokens(requests: list[TraceRequest]) -> int:
    """Prompt tokens ``ProxyReplay`` sends for ``requests`` (the same token runs and cut as
    ``build_workload``'s)."""
    return sum(len(request_tokens(r, VOCAB_SIZE)[:MAX_PROMPT]) for r in requests)


def run_pd(run: str, args: argparse.Namespace, model: Path, requests: list[TraceRequest],
           say: Any) -> dict[str, Any]:
    """One P/D run (``PD_RUNS``): its engines over a fresh master and pool store, the slice
    through the proxy one request at a time, streamed, after one warm-up request
    (``pd_warmup``); returns per-request TTFT (ms) and output token ids, the warm-up's TTFT and
    what the slice added to each engine's counters, or ``{"error": ...}``."""
    workdir = Path(tempfile.mkdtemp(prefix=f"kvp-pd-{run}-"))
    master = LocalMooncakeMaster(log_dir=workdir).start()
    store = (LocalPoolStore(master, args.segment_mb << 20, log_dir=workdir).start()
             if run != "none" else None)
    pair = LocalPdPair(
        model, _mooncake_config("peer" if run == "peer" else "ours", workdir, master),
        workdir / "pd", chunk_size=BLOCK, block_size=BLOCK,
        on_status=lambda m: say(f"[{run}] {m}"),
        kv_transfer_configs=_PEER_PD if run == "peer" else (None, None),
        engine_command=([sys.executable, __file__, "--pd-serve"] if run == "peer" else None),
        single_engine=run == "none")
    try:
        try:
            pair.start(timeout_s=args.timeout)
        except RuntimeError as exc:
            return {"error": str(exc)}
        engines = {"prefill": pair.prefill_url}
        if pair.decode_url:
            engines["decode"] = pair.decode_url
        # A warm-up request first, not counted (vllm bench serve's initial test run): each
        # engine's first forward pays one-time costs. Its prompt shares no chunk with the
        # workload, and the counters below are what the workload adds to its settled ones.
        warmup = pd_warmup(requests)
        warm = ProxyReplay(pair.proxy_url, warmup, speedup=0, max_tokens=args.max_tokens,
                           stream=True).start()
        if not warm.join(args.timeout) or warm.failed:
            warm.stop()
            return {"error": f"the warm-up request was not answered: {warm.error}"}
        before = {name: _settled_counters(url, _sent_tokens(warmup))
                  for name, url in engines.items()}
        say(f"[{run}] warm-up request: TTFT {warm.results[0].ttft_ms:.0f} ms (not counted)")
        t0 = time.monotonic()
        replay = ProxyReplay(pair.proxy_url, requests, speedup=0,
                             on_status=lambda m: say(f"[{run}] {m}"),
                             max_tokens=args.max_tokens, stream=True).start()
        if not replay.join(args.timeout):
            replay.stop()
            return {"error": f"{replay.done} of {len(requests)} requests answered in "
                             f"{args.timeout:.0f} s"}
        if replay.failed:
            return {"error": f"{replay.failed} requests failed: {replay.error}"}
        wall = time.monotonic() - t0
        counters = {}
        for name, url in engines.items():
            after = _settled_counters(url, int(before[name]["prompt"]) + _sent_tokens(requests))
            counters[name] = {k: v - before[name][k] for k, v in after.items()}
        return {"wall_s": wall, "ttft_ms": [r.ttft_ms for r in replay.results],
                "warmup_ttft_ms": warm.results[0].ttft_ms,
                "tokens": [r.token_ids for r in replay.results], "counters": counters}
    finally:
        pair.stop()
        if store is not None:
            store.stop()
        master.stop()


def summarize_pd(res: dict[str, Any], base: list[list[int]] | None) -> dict[str, Any]:
    """A P/D run's figures (see ``PD_ROWS``); ``base``: the ``none`` run's outputs."""
    ttft = sorted(res["ttft_ms"])
    pre = res["counters"]["prefill"]
    dec = res["counters"].get("decode")
    s: dict[str, Any] = {
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "ttft_min_ms": ttft[0], "ttft_max_ms": ttft[-1],
        "req_per_s": len(ttft) / res["wall_s"], "warmup_ttft_ms": res["warmup_ttft_ms"],
        "prefill_hit": pre["pool_hit"], "prefill_computed": pre["computed"],
    }
    if dec is not None:
        s.update(decode_hit=dec["pool_hit"], decode_computed=dec["computed"],
                 prefill_loaded_mb=pre["loaded_bytes"] / 1e6,
                 prefill_saved_mb=pre["saved_bytes"] / 1e6,
                 decode_loaded_mb=dec["loaded_bytes"] / 1e6, p2p_mb=0.0)
    if base is not None:
        diff = sum(1 for a, b in zip(res["tokens"], base, strict=True) if a != b)
        s["equal"] = "yes" if diff == 0 else f"no ({diff} of {len(base)} differ)"
    return s


PD_ROWS = [
    ("TTFT p50 (ms, at the proxy)", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 (ms, at the proxy)", "ttft_p99_ms", "{:.0f}"),
    ("TTFT min (ms)", "ttft_min_ms", "{:.0f}"),
    ("TTFT max (ms)", "ttft_max_ms", "{:.0f}"),
    ("requests/s (one at a time)", "req_per_s", "{:.2f}"),
    ("warm-up request TTFT (ms, not counted above)", "warmup_ttft_ms", "{:.0f}"),
    ("prefill: pool hit tokens", "prefill_hit", "{:,.0f}"),
    ("prefill: computed prompt tokens", "prefill_computed", "{:,.0f}"),
    ("decode: pool hit tokens", "decode_hit", "{:,.0f}"),
    ("decode: recomputed prompt tokens", "decode_computed", "{:,.0f}"),
    ("prefill: KV bytes saved to the pool (MB)", "prefill_saved_mb", "{:.1f}"),
    ("prefill: KV bytes loaded from the pool (MB)", "prefill_loaded_mb", "{:.1f}"),
    ("decode: KV bytes loaded from the pool (MB)", "decode_loaded_mb", "{:.1f}"),
    ("KV bytes over P2P (MB)", "p2p_mb", "{:.1f}"),
    ("outputs equal to none (token ids)", "equal", "{}"),
]


def print_pd_table(summ: dict[str, dict[str, Any] | str]) -> None:
    """The P/D figures of every run, then ours/peer per figure."""
    _print_rows(summ, [r for r in PD_RUNS if r in summ], PD_ROWS)
    print(f"\nKV bytes over P2P: 0 for both pairs. {P2P_REASON}. none: one engine, no proxy "
          "(its TTFT is the engine's own).")
    _print_not_run(summ)


def main_pd(args: argparse.Namespace) -> int:
    """``--pd``: the runs of ``PD_RUNS`` (or ``--runs``) over one trace slice; prints the
    table."""
    runs = [r.strip() for r in args.runs.split(",") if r.strip()] if args.runs else list(PD_RUNS)
    bad = [r for r in runs if r not in PD_RUNS]
    if bad:
        print(f"--runs with --pd must be a subset of {','.join(PD_RUNS)} (got {','.join(bad)})",
              file=sys.stderr)
        return 2
    trace = load_trace(args.trace or default_trace_path(), limit=args.start + args.requests)
    requests = trace[args.start:args.start + args.requests]
    if not requests:
        print(f"--start {args.start}: the trace has {len(trace)} requests", file=sys.stderr)
        return 2
    model = build_bench_model(args.layers, args.hidden, args.heads, args.kv_heads,
                              args.intermediate)
    print(f"P/D: model {args.layers} layers, hidden {args.hidden}, {args.kv_heads} KV heads; "
          f"workload trace[{args.start}:{args.start + len(requests)}], one request at a time "
          f"through the proxy, {args.max_tokens} greedy tokens each", flush=True)

    def say(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    summ: dict[str, dict[str, Any] | str] = {}
    base: list[list[int]] | None = None
    for run in runs:
        t0 = time.monotonic()
        res = run_pd(run, args, model, requests, say)
        if "error" in res:
            summ[run] = res["error"]
        else:
            if run == "none":
                base = res["tokens"]
            summ[run] = summarize_pd(res, base)
        say(f"run {run}: {time.monotonic() - t0:.0f} s, 1-min load average "
            f"{os.getloadavg()[0]:.1f}")
    print_pd_table(summ)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--pd-serve"]:
        pd_serve_main(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--pd", action="store_true",
                    help="the P/D run: prefill and decode engines behind a proxy, peer vs ours")
    ap.add_argument("--trace", default=None, help="trace JSONL (default: the conversation trace)")
    ap.add_argument("--start", type=int, default=5000, help="first trace request of the slice")
    ap.add_argument("--requests", type=int, default=16, help="requests in the slice")
    ap.add_argument("--warm", type=int, default=6, help="A warms, then B reads, these first")
    ap.add_argument("--concurrency", type=int, default=2, help="in flight per engine, mixed")
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy output tokens per request")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--segment-mb", type=int, default=1024, help="pool memory, MiB")
    ap.add_argument("--runs", default=None,
                    help="subset of none,peer,ours,peer-noseed (default: the first three; "
                         "with --pd a subset of none,peer,ours)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = ap.parse_args(argv)
    if args.engine:
        return engine_main(args.engine)
    if args.pd:
        return main_pd(args)
    runs = [r.strip() for r in (args.runs or ",".join(RUNS)).split(",") if r.strip()]
    bad = [r for r in runs if r not in RUNS + EXTRA_RUNS]
    if bad or not 0 < args.warm < args.requests:
        print(f"--runs must be a subset of {','.join(RUNS + EXTRA_RUNS)} and "
              "0 < --warm < --requests",
              file=sys.stderr)
        return 2
    trace = load_trace(args.trace or default_trace_path(), limit=args.start + args.requests)
    prompts = build_workload(trace, args.start, args.requests)
    model = build_bench_model(args.layers, args.hidden, args.heads, args.kv_heads,
                              args.intermediate)
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"{args.kv_heads} KV heads; workload: trace[{args.start}:{args.start + args.requests}]"
          f", {sum(map(len, prompts)):,} prompt tokens, A warms / B reads {args.warm}, "
          f"mixed {args.requests - args.warm} at concurrency {args.concurrency} per engine")
    summ: dict[str, dict[str, Any] | str] = {}
    for run in runs:
        t0 = time.monotonic()
        res = run_once(run, args, model, prompts)
        if "error" in res:
            summ[run] = f"{res['error']}\n{res['log']}"
        else:
            summ[run] = summarize(res)
        # Other jobs on a shared machine change every figure: show how busy it was.
        print(f"run {run}: {time.monotonic() - t0:.0f}s, 1-min load average at the end "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    print("PYTHONHASHSEED: peer engines 0 (its keys are vLLM block hashes; with the default "
          "sha256 they match without it too, see --runs peer-noseed); ours unset")
    print_table(summ)
    return 0


if __name__ == "__main__":
    sys.exit(main())
