"""The one launcher of real vLLM engines for the tests: each engine in its own process, forked
from a server process that imported vLLM once (``multiprocessing``'s forkserver, vLLM and the
connector preloaded), and kept running between calls.

Why a fork server: importing vLLM is most of a cold engine's start (~6 s of ~14 s on an idle
2-core host, ~20 s of ~30 s on a loaded one); forked from a process that has imported it, an
engine pays only vLLM's own start. The server holds no engine, no thread of vLLM's and no
OpenMP pool (importing starts none), so forking it is as safe as vLLM's own forks. Processes
vLLM starts itself (the engine core in multiprocess mode, TP ranks) are spawned by vLLM as
ever (its CPU platform asks for ``spawn``): those still import vLLM.

Why kept running: one engine serves several calls (``Engine.generate``), so a test can take
its own no-pool baseline in the engine under test (a request with a fresh ``cache_salt``: the
connector mixes the salt into every chunk hash, so nothing of the pool matches) and one engine
can write in one phase and read in another.

SPEC (``Engine``'s ``spec``): ``model`` (dir), ``kv_transfer_config`` (dict or null),
``prefix_caching`` (bool), ``num_gpu_blocks`` (optional), ``dtype`` (default ``float32``),
``block_size`` (default 32), ``log_stats`` (vLLM's stat loggers, Prometheus included, on;
default off), ``kv_events_config`` (vLLM's, optional), ``tensor_parallel_size`` (default 1),
``max_num_seqs`` (default 8), ``hma`` (true: vLLM's hybrid KV-cache manager on, false: off;
default: vLLM's choice), ``attention_backend`` (vLLM's ``attention_config.backend``) and
``lora_rank`` (vLLM's LoRA on, adapters up to this rank).

``Engine.timed_steps`` serves prompts by stepping the engine itself and returns each step's
seconds and scheduled tokens (``bench/bench_step_gap.py``: step time while saves run).

An output (``Engine.generate``), per prompt: the greedy ``tokens``, the ``logprobs`` of those
tokens and vLLM's ``num_cached_tokens`` (prompt tokens not computed: local prefix cache plus
connector loads).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvpool_replay._forkserver import fork_context

# What the fork server imports before its first fork: everything an engine imports that is
# not tied to one engine (vLLM's engine, executor and model modules import at engine start).
# Not ``mooncake.store``: ``kvpool_replay._forkserver.ENGINE_PRELOAD`` says why.
PRELOAD = [
    "vllm", "vllm.inputs", "vllm.lora.request", "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core", "vllm.v1.executor.abstract", "vllm.v1.worker.cpu_worker",
    "vllm.model_executor.models.llama", "prometheus_client", "kvpool_connector.connector",
    "_engine",
]


class EngineFailed(Exception):
    """The engine process died, timed out or raised; the message carries its log's tail."""


class Engine:
    """One running engine: ``generate`` calls answered in order, ``close`` ends it.

    ``env``: the engine's whole environment (set before vLLM reads any of it); ``log``: its
    stdout and stderr."""

    def __init__(self, name: str, spec: dict[str, Any], env: dict[str, str], log: Path,
                 timeout_s: float = 300.0) -> None:
        ctx = fork_context(PRELOAD)
        self.name, self.log, self.timeout_s = name, log, timeout_s
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, spec, env, str(log)),
                                name=f"engine-{name}")
        self.proc.start()
        child.close()
        self.closed = False
        self.startup_s: float = self._reply()

    def _reply(self) -> Any:
        """The engine's answer to the last call, or ``EngineFailed`` once it died or timed out
        (it is then killed)."""
        deadline = time.monotonic() + self.timeout_s
        while not self._conn.poll(0.2):
            if not self.proc.is_alive():
                self.closed = True
                raise EngineFailed(f"engine {self.name} exited {self.proc.exitcode}; "
                                   f"log tail:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise EngineFailed(f"engine {self.name}: no answer in {self.timeout_s} s; "
                                   f"log tail:\n{self.tail()}")
        kind, value = self._conn.recv()
        if kind == "error":
            raise EngineFailed(f"engine {self.name}: {value}\nlog tail:\n{self.tail()}")
        return value

    def _call(self, cmd: str, **args: Any) -> Any:
        if self.closed:
            raise EngineFailed(f"engine {self.name} is closed")
        self._conn.send((cmd, args))
        return self._reply()

    def generate(self, prompts: list[list[int]], max_tokens: int, *,
                 salt: str | None = None, lora: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
        """One batch of ``prompts`` (greedy, ``max_tokens`` each, end of sequence ignored);
        ``salt``: every request's ``cache_salt``; ``lora``: ``{"name", "id", "path"}``, every
        prompt through that adapter."""
        out: list[dict[str, Any]] = self._call("generate", prompts=prompts,
                                               max_tokens=max_tokens, salt=salt, lora=lora)
        return out

    def timed_steps(self, prompts: list[list[int]], max_tokens: int, *, salt: str
                    ) -> list[tuple[float, int]]:
        """Serve ``prompts`` (greedy, ``max_tokens`` each, every request's ``cache_salt``
        ``salt``) by stepping the engine until none is unfinished; per step its wall time (s)
        and the tokens it scheduled (0: no forward pass). The engine core must run in this
        process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
        out: list[tuple[float, int]] = self._call("timed_steps", prompts=prompts,
                                                  max_tokens=max_tokens, salt=salt)
        return out

    def settle(self) -> None:
        """Step the in-process engine core until no finished request waits for its saves."""
        self._call("settle")

    def reset(self) -> bool:
        """``LLM.reset_prefix_cache(reset_connector=True)``'s answer."""
        return bool(self._call("reset"))

    def prometheus(self) -> str:
        """vLLM's Prometheus text (``log_stats``)."""
        return str(self._call("prometheus"))

    def close(self) -> None:
        """Shut the engine down as a finished process does (its connector's shutdown, its
        agent's last report) and wait for the process to end."""
        if self.closed:
            return
        self._call("close")
        self.closed = True
        self.proc.join(self.timeout_s)
        if self.proc.is_alive():
            self.kill()
            raise EngineFailed(f"engine {self.name} did not exit; log tail:\n{self.tail()}")
        if self.proc.exitcode != 0:
            raise EngineFailed(f"engine {self.name} exited {self.proc.exitcode}; "
                               f"log tail:\n{self.tail()}")

    def kill(self) -> None:
        """End the engine process (only this one: vLLM's own children die with their
        parent's pipes)."""
        self.closed = True
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(30)

    def tail(self, lines: int = 40) -> str:
        if not self.log.exists():
            return ""
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-lines:])


# -- the engine process ------------------------------------------------------------------------


def serve(conn: Connection, spec: dict[str, Any], env: dict[str, str], log: str) -> None:
    """The engine process: build the ``LLM``, answer calls until ``close``."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        t0 = time.time()
        llm = _build(spec)
        conn.send(("ok", time.time() - t0))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    while True:
        cmd, args = conn.recv()
        if cmd == "close":
            break
        try:
            if cmd == "generate":
                result: Any = _generate(llm, **args)
            elif cmd == "timed_steps":
                result = _timed_steps(llm, **args)
            elif cmd == "settle":
                settle(llm)
                result = None
            elif cmd == "reset":
                result = llm.reset_prefix_cache(reset_connector=True)
            elif cmd == "prometheus":
                from prometheus_client import generate_latest

                result = generate_latest().decode()
            else:
                raise ValueError(f"unknown call {cmd!r}")
        except Exception:
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", result))
    # What a finished process's exit did: the engine core's shutdown (the finaliser vLLM
    # registers runs just this), the connector's with it (its agent's last report, its store
    # client closed). Then exit without the interpreter's teardown: a full garbage collection
    # of vLLM's heap, seconds of CPU on a loaded host, that nothing needs.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(("ok", None))
    os._exit(0)


def _build(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    if spec.get("torch_threads"):
        # Before vLLM's CPU worker replaces torch.set_num_threads with a no-op. The fork
        # server's OpenMP runtime read OMP_NUM_THREADS at its import: the variable is too late.
        import torch

        torch.set_num_threads(spec["torch_threads"])
    kwargs: dict[str, Any] = {}
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("num_gpu_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    if spec.get("kv_events_config"):
        kwargs["kv_events_config"] = spec["kv_events_config"]
    if spec.get("hma") is not None:
        kwargs["disable_hybrid_kv_cache_manager"] = not spec["hma"]
    if spec.get("attention_backend"):
        kwargs["attention_config"] = {"backend": spec["attention_backend"]}
    if spec.get("lora_rank"):
        kwargs["enable_lora"] = True
        kwargs["max_lora_rank"] = spec["lora_rank"]
    if spec.get("tensor_parallel_size", 1) > 1:
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
        kwargs["distributed_executor_backend"] = "mp"
    if spec.get("executor"):  # "mp": workers in their own processes, vLLM's CPU binding
        kwargs["distributed_executor_backend"] = spec["executor"]
    return LLM(
        model=spec["model"], enforce_eager=True, max_model_len=512,
        block_size=spec.get("block_size", 32), dtype=spec.get("dtype", "float32"),
        enable_prefix_caching=spec.get("prefix_caching", False),
        max_num_seqs=spec.get("max_num_seqs", 8), max_num_batched_tokens=512, seed=0,
        disable_log_stats=not spec.get("log_stats", False), **kwargs,
    )


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int, salt: str | None,
              lora: dict[str, Any] | None) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    lora_request = None
    if lora is not None:
        from vllm.lora.request import LoRARequest

        lora_request = LoRARequest(lora["name"], lora["id"], lora["path"])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0,
                            ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    if salt is not None:
        for i in inputs:
            i["cache_salt"] = salt
    outs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora_request)
    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [lp[t].logprob for t, lp in
                         zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)],
            "num_cached_tokens": o.num_cached_tokens,
        }
        for o in outs
    ]


def _timed_steps(llm: Any, prompts: list[list[int]], max_tokens: int, salt: str
                 ) -> list[tuple[float, int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        prompt = TokensPrompt(prompt_token_ids=p)
        prompt["cache_salt"] = salt
        engine.add_request(f"timed-{salt}-{i}", prompt, params)
    # The tokens each step scheduled, read off the scheduler's output (0: a step that ran no
    # forward pass, e.g. while lookups run).
    scheduler = engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    scheduled: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        scheduled.append(out.total_num_scheduled_tokens)
        return out

    scheduler.schedule = counted
    steps: list[tuple[float, int]] = []
    try:
        while engine.has_unfinished_requests():
            before = len(scheduled)
            t0 = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t0, sum(scheduled[before:])))
    finally:
        del scheduler.schedule
    return steps


def settle(llm: Any, timeout_s: float = 60.0) -> None:
    """Step the in-process engine core until no finished request waits for its saves: their
    ``finished_sending`` (and the connector's KV events) reach the scheduler only in a step,
    and ``LLM.generate`` returns before."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests still held after {timeout_s} s")
        core.step()
        time.sleep(0.01)
