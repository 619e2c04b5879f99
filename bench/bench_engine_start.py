"""Engine start time with and without the model fingerprint (issue 39's benchmark).

Starts a real ``mooncake_master`` and a separate ``mooncake_client`` store on 127.0.0.1, then
``--repeat`` times each, interleaved, one vLLM engine (``vllm.LLM``, CPU, ``enforce_eager``) in
a fresh process, in three modes:

* ``none``: no KV connector (vLLM alone);
* ``configured``: ``KVPoolConnector`` with ``model_fingerprint`` set, so the weights are not
  read for the identity (``kvpool_connector.fingerprint``: ``configured:`` source);
* ``fingerprint``: ``KVPoolConnector`` as deployed by default: the weights' content
  fingerprint (headers, ``config.json``, three samples per tensor) in ``register_kv_caches``.

Each start is timed in the child from before ``import vllm`` to the return of ``LLM(...)``
(the engine is ready), and the worker's own log line ``KVPoolConnector: model fingerprint ...
in X ms`` gives the fingerprint's share. ``fingerprint - configured`` is what the fingerprint
adds to a start; ``configured - none`` what the connector adds. With ``--cold`` every file of
the model is dropped from the page cache (``posix_fadvise DONTNEED``) before each start: the
weights' load then reads from disk too, as a first start on a node does. Prints median and
min-max per mode (s) and the fingerprint's median (ms).

``--model`` is any local safetensors model vLLM runs on CPU (default: the tiny Llama the tests
use, built under ``.cache/tiny-llama``: its fingerprint is a floor; a 7-8B model shows the real
cost). Run on an idle machine:
``.venv/bin/python bench/bench_engine_start.py [--model DIR] [--repeat 5] [--cold]``;
``--repeat 1`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("none", "configured", "fingerprint")
_READY = "kvpool-bench-engine-start "
_FP_LINE = re.compile(r"KVPoolConnector: model fingerprint \S+ \(.*?\) in ([0-9.]+) ms")
REPO = Path(__file__).resolve().parents[1]
_LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(name)s %(levelname)s %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain",
                            "stream": "ext://sys.stderr"}},
    "loggers": {name: {"handlers": ["stderr"], "level": "INFO", "propagate": False}
                for name in ("vllm", "kvpool_connector")},
}
"""vLLM's loggers as usual and the connector's at INFO (``VLLM_LOGGING_CONFIG_PATH``)."""


def _child(spec_path: str) -> None:
    """One engine start (run in a fresh process): print the seconds to import vLLM and to
    construct the engine."""
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.monotonic()
    from vllm import LLM

    t1 = time.monotonic()
    kwargs: dict[str, Any] = {}
    if spec["kv_transfer_config"]:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=512, dtype="float32",
              max_num_seqs=8, max_num_batched_tokens=512, seed=0, **kwargs)
    t2 = time.monotonic()
    print(_READY + json.dumps({"import_s": t1 - t0, "construct_s": t2 - t1}), flush=True)
    del llm


def drop_cache(model: Path) -> None:
    """Drop the model directory's clean pages from the page cache (best effort)."""
    for p in model.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _ktc(mode: str, master: Any, name: str) -> dict[str, Any] | None:
    if mode == "none":
        return None
    extra: dict[str, Any] = {
        "backend": "mooncake", "engine_id": name,
        "mooncake": {"master_server_address": master.address,
                     "master_admin_url": master.admin_url, "global_segment_size": 0,
                     "local_buffer_size": "16MB", "protocol": "tcp"},
    }
    if mode == "configured":
        extra["model_fingerprint"] = "bench-engine-start"
    return {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def start_once(mode: str, model: Path, master: Any, work: Path, n: int,
               env: dict[str, str]) -> tuple[float, float | None]:
    """One engine start in a child process: ``(seconds to a ready engine, fingerprint ms or
    None)``.

    Raises:
        RuntimeError: the engine did not start (the message has its output's tail).
    """
    spec = work / f"{mode}-{n}.json"
    spec.write_text(json.dumps({"model": str(model),
                                "kv_transfer_config": _ktc(mode, master, f"start-{mode}-{n}")}))
    proc = subprocess.run([sys.executable, __file__, "--child", str(spec)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    out = proc.stdout + proc.stderr
    ready = [line for line in proc.stdout.splitlines() if line.startswith(_READY)]
    if proc.returncode != 0 or not ready:
        # vLLM's root cause is an "...Error:" line of a worker, far above the output's tail.
        causes = [line for line in out.splitlines() if re.search(r"\w+Error: ", line)]
        raise RuntimeError(f"{mode} engine failed (exit {proc.returncode}):\n"
                           + "\n".join(causes[-5:]) + "\n" + out[-2000:])
    times = json.loads(ready[-1][len(_READY):])
    fp = [float(m.group(1)) for m in _FP_LINE.finditer(out)]
    return times["import_s"] + times["construct_s"], (max(fp) if fp else None)


def _s(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a local safetensors model dir (default: the tiny Llama)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cold", action="store_true",
                    help="drop the model's pages from the page cache before each start")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child)
        return
    sys.path.insert(0, str(REPO))
    from kvpool_replay import LocalMooncakeMaster, LocalPoolStore, build_tiny_model
    from kvpool_replay._processes import engine_env

    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: pick from {', '.join(MODES)}")
    model = (Path(args.model) if args.model
             else build_tiny_model(REPO / ".cache" / "tiny-llama")).resolve()
    # As the tests' engines run (tests/vllm/_harness.py): 1 GiB of KV cache on CPU, one
    # lookup socket directory per run.
    env = {**engine_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    times: dict[str, list[float]] = {m: [] for m in modes}
    fps: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-start-") as tmp, \
            LocalMooncakeMaster() as master, LocalPoolStore(master, 64 << 20):
        env["KVPOOL_RUNTIME_DIR"] = tmp
        # The connector logs its fingerprint time at INFO, which Python drops by default:
        # vLLM applies this logging config in every process it starts (workers too).
        log_config = Path(tmp) / "logging.json"
        log_config.write_text(json.dumps(_LOGGING))
        env["VLLM_LOGGING_CONFIG_PATH"] = str(log_config)
        for n in range(args.repeat):
            for mode in modes:  # interleaved: drift on the machine hits every mode alike
                if args.cold:
                    drop_cache(model)
                took, fp = start_once(mode, model, master, Path(tmp), n, env)
                times[mode].append(took)
                if mode == "fingerprint" and fp is not None:
                    fps.append(fp)
                print(f"  {mode:<12} run {n + 1}: {took:.2f} s"
                      + (f" (fingerprint {fp:.1f} ms)" if fp is not None else ""), flush=True)
    print(f"engine start, {model} ({'cold' if args.cold else 'warm'} page cache), "
          f"{args.repeat} runs, median (min-max):")
    for mode in modes:
        print(f"  {mode:<12} {_s(times[mode])}")
    if fps:
        print(f"  fingerprint's own time in the worker: {statistics.median(fps):.1f} ms "
              f"(median; {min(fps):.1f}-{max(fps):.1f})")
    if "fingerprint" in times and "configured" in times:
        diff = statistics.median(times["fingerprint"]) - statistics.median(times["configured"])
        print(f"  fingerprint - configured: {diff:+.2f} s (medians; noise is the min-max above)")


if __name__ == "__main__":
    main()
