"""``DemoCluster``: a whole local fleet for ``kvpool-console --demo``, tests and screenshots.

Started with no other setup: a ``mooncake_master`` on 127.0.0.1 with a ``mooncake_client`` store
holding the pool memory, a ``FleetHub`` (in this process) with freshly generated operator keys,
the pool-wide policy service (``kvpool-policy serve``, ``LocalPolicyService``) beside the master
with the fleet's keys, and several engine processes, each running ``KVPoolConnector`` (scheduler
and worker roles, ``admission: service``) and their agents, replaying a share of a trace at a
chosen speed-up:

* engine 0 is a prefill engine (``kv_producer``): it loads what the pool holds and saves its
  prompts;
* engine 1 is its decode engine (``kv_consumer`` with ``consumer_is_to_load``): it replays every
  request engine 0 finished and loads the prompt's KV from the pool (P/D disaggregation);
* further engines are ``kv_both`` and replay their round-robin share of the trace.

``engine_kind="vllm"`` runs real vLLM engines (``vllm.LLM`` with the tiny local model of
``_tiny_model`` and ``KVPoolConnector``) instead of simulated ones. ``engine_kind="pd"`` runs
the real P/D topology instead: a prefill and a decode ``vllm serve`` engine behind the
``mooncake-transfer-engine`` wheel's P/D proxy, the pool as the hand-over
(``_pd.LocalPdPair``), the trace sent through the proxy (``_pd.ProxyReplay``); ``engines`` is
then ignored, and the pair runs without the service (``policy_service=False``: its one saving
engine hands every prompt to the decode engine, the master evicts).

The service is the best measured policy for a pool shared by several engines (docs/policy.md):
it admits and evicts for every engine at once, filling ``POLICY_FILL`` of the pool below the
master's watermark; while it is away the engines save every chunk and the master's watermark
evicts. It starts while the engines start (they take tens of seconds to import vLLM), so it
adds nothing to the demo's start; the console shows it in charge (``policy: service`` per
engine in ``kvpool-console status --json``, the Pool tab's ``policy:`` line).

Leaving the context (or ``stop()``, also on Ctrl-C) stops every process it started: each runs in
its own process group, which is terminated and then killed; ``leftover_pids()`` checks with
psutil that none is left. Should this process die without stopping them (``kill -9``), its
tether (``_tether``, a watcher started first) stops them instead, releases the engines' lookup
sockets and removes the work directory it created.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Literal

import msgspec
import psutil

from kvpool_connector.lookup import release_if_dead
from kvpool_replay._pd import LocalPdPair, ProxyReplay
from kvpool_replay._policy_service import LocalPolicyService
from kvpool_replay._pool import mooncake_extra_config, pool_bytes_for_tokens
from kvpool_replay._processes import (
    free_port,
    free_port_block,
    stop_process_tree,
    use_local_pool_env,
    wait_until,
)
from kvpool_replay._replay import spawn_engine, wait_engines_ready
from kvpool_replay._services import LocalMooncakeMaster, LocalPoolStore
from kvpool_replay._spec import EngineResult, EngineSpec, ModelShape
from kvpool_replay._tether import Tether
from kvpool_replay._tiny_model import build_tiny_model
from kvpool_replay._trace import TraceRequest, default_trace_path, load_trace

__all__ = ["DEMO_SHAPE", "POLICY_FILL", "TINY_VLLM_SHAPE", "DemoCluster"]

DEMO_SHAPE = ModelShape(layers=2, kv_heads=1, head_size=4, block_size=16, dtype="float16")
"""Demo model shape: 32 bytes of KV per token (a 512-token chunk is 16 KiB), so that a 512 MiB
pool holds 16M tokens: about the conversation trace's first 90 s of new prefixes at the demo's
speed-up (see ``DemoCluster``)."""

POLICY_FILL: float | Literal["auto"] = "auto"
"""What the demo's policy service fills (``kvpool-policy serve --fill``, its default):
``auto``, from 0.8 of the pool up to 2% below the master's watermark (0.9) as the master's
used bytes show room; the room left holds saves in flight and keys waiting out a reader's
lease. At the default 16M tokens and speed-up 5 the conversation trace brings about 8M
tokens of new prefixes a minute (``DemoCluster``'s ``pool_tokens``): the service starts
evicting after about a minute and a half (docs/getting-started.md)."""

DEMO_MODEL = "kvpool-demo"
"""The simulated engines' model name (one name every run: the pool, its keys and the console
are the demo's own, so nothing else can share it)."""

TINY_VLLM_SHAPE = ModelShape(layers=2, kv_heads=2, head_size=32, block_size=32, dtype="float32")
"""KV shape of ``tiny_model`` in vLLM (``engine_kind="vllm"``): 1 KiB per token."""


def _tiny_model_dir() -> Path:
    root = os.environ.get("KVPOOL_CACHE_DIR") or str(Path.home() / ".cache" / "kvpool")
    return Path(root) / "tiny-llama"


_ROLE_NAMES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "engine"}


class DemoCluster:
    """A local master + store, fleet hub, operator keys and engine processes.

    Args:
        trace_path: Mooncake JSON-lines trace, plain or ``.xz`` (default
            ``default_trace_path()``: the conversation trace).
        engines: engine processes (>= 1); with >= 2, engines 0 and 1 are a prefill/decode pair.
        speedup: trace time / wall time (``0`` = as fast as possible).
        engine_kind: ``"sim"`` (connector driven exactly as vLLM calls it, real KV bytes),
            ``"vllm"`` (real vLLM engines with the tiny local model) or ``"pd"`` (a real
            prefill/decode pair of ``vllm serve`` engines behind the P/D proxy).
        limit: replay only the first ``limit`` requests.
        pool_tokens: pool capacity in tokens of KV (``shape.bytes_per_token`` each).
        shape: simulated model shape (``engine_kind="vllm"`` uses the tiny model's,
            ``TINY_VLLM_SHAPE``; the model is built once under ``$KVPOOL_CACHE_DIR`` or
            ``~/.cache/kvpool``).
        chunk_size: tokens per pool key.
        eviction_high_watermark_ratio: the master's eviction watermark.
        default_kv_lease_ttl_ms: the master's lease TTL.
        log_dir: where engine/master/store logs go (a temp dir by default).
        policy_service: start the pool-wide policy service beside the master and configure
            the engines ``admission: service`` (default); ``False``: every chunk saved, the
            master's watermark evicts. The P/D pair (``engine_kind="pd"``) runs without it.
        progress: called with one line per start-up phase (master, hub, engines, waiting), so
            a caller can show what the start-up is doing; ``None``: silent.

    Attributes (after ``start()``): ``hub_address`` (agents' and consoles' hub address),
    ``keys_root`` (every role's CURVE keys, one directory per role,
    ``kvpool_agent.local_fleet_keys``; the hub requires them on every port), ``keys_dir``
    (the operator's), ``viewer_keys_dir``, ``agent_keys_dir`` (the engines'), ``master``
    (``LocalMooncakeMaster``), ``store`` (``LocalPoolStore``), ``hub`` (``FleetHub``),
    ``processes`` (engine id -> ``subprocess.Popen``), ``policy`` (``LocalPolicyService``, or
    ``None`` without it).

    Raises:
        ValueError: bad arguments (named).
        FileNotFoundError: trace or Mooncake binaries missing.
        RuntimeError: an engine failed to start (its error in the message).
    """

    def __init__(
        self,
        trace_path: str | Path | None = None,
        *,
        engines: int = 4,
        speedup: float = 5.0,
        engine_kind: Literal["sim", "vllm", "pd"] = "sim",
        limit: int | None = None,
        # 512 MiB at DEMO_SHAPE. At speed-up 5 the conversation trace brings ~8M tokens of new
        # prefixes a minute: the hit rate climbs with the trace's reuse for about 90 s while
        # everything fits, then the pool crosses its watermark and evictions start while the
        # hit rate holds (the trace's reuse distance is short) - pressure without collapse.
        pool_tokens: int = 16_000_000,
        shape: ModelShape = DEMO_SHAPE,
        chunk_size: int = 512,
        eviction_high_watermark_ratio: float = 0.9,
        default_kv_lease_ttl_ms: int = 5_000,
        log_dir: str | Path | None = None,
        progress: Callable[[str], None] | None = None,
        policy_service: bool = True,
    ) -> None:
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        if engine_kind not in ("sim", "vllm", "pd"):
            raise ValueError(f"engine_kind must be 'sim', 'vllm' or 'pd', got {engine_kind!r}")
        if speedup < 0:
            raise ValueError(f"speedup must be >= 0, got {speedup}")
        self.trace_path = Path(trace_path) if trace_path else default_trace_path()
        self.engines = engines
        self.speedup = speedup
        self.engine_kind = engine_kind
        self.limit = limit
        self.pool_tokens = pool_tokens
        self.shape = shape
        self.chunk_size = chunk_size
        self.eviction_high_watermark_ratio = eviction_high_watermark_ratio
        self.default_kv_lease_ttl_ms = default_kv_lease_ttl_ms
        self.policy_service = policy_service and engine_kind != "pd"
        self._progress = progress
        self._own_tmp = log_dir is None
        self.workdir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="kvpool-demo-"))
        self.keys_root = self.workdir / "keys"
        self.keys_dir = self.keys_root / "operator"
        self.viewer_keys_dir = self.keys_root / "viewer"
        self.agent_keys_dir = self.keys_root / "agent"
        self.hub_address = ""
        self.master: LocalMooncakeMaster | None = None
        self.store: LocalPoolStore | None = None
        self.policy: LocalPolicyService | None = None
        self._policy_start: threading.Thread | None = None
        self._policy_error: BaseException | None = None
        self.hub: object | None = None
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.specs: dict[str, EngineSpec] = {}
        self._started_pids: set[int] = set()
        self._logs: list[object] = []
        self.pd_pair: LocalPdPair | None = None
        self.pd_replay: ProxyReplay | None = None
        self._tether: Tether | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, ready_timeout_s: float = 240.0) -> DemoCluster:
        """Start master, store, hub and engines; returns once every engine is replaying.

        On any failure everything started so far is stopped before the error propagates.
        """
        try:
            self._start(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, ready_timeout_s: float) -> None:
        from kvpool_agent import FleetHub, local_fleet_keys

        trace = load_trace(self.trace_path, limit=self.limit)
        use_local_pool_env()
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Before any child: each one started from now on dies with this process.
        self._tether = Tether.start()
        if self._own_tmp:
            self._tether.remove_on_death(self.workdir)
        keys = local_fleet_keys(self.keys_root)
        port = free_port_block(5)
        self.hub_address = f"tcp://127.0.0.1:{port}"
        self._say(f"starting fleet hub on {self.hub_address} (CURVE keys on every port; "
                  f"Prometheus metrics at http://127.0.0.1:{port + 4}/metrics)")
        self._say(f"keys in {self.keys_root}/: hub/ (the hub's, with authorized_keys/), "
                  f"operator/ (kvpool-console --keys {self.keys_dir}), viewer/, agent/ "
                  "(the engines')")
        # The console's own path: `make demo` installs it in .venv/bin, not on PATH.
        console = Path(sys.executable).with_name("kvpool-console")
        self._say(f"one-shot commands from another terminal: export KVPOOL_HUB="
                  f"{self.hub_address} KVPOOL_KEYS_DIR={self.keys_dir}; then e.g. "
                  f"{console if console.exists() else 'kvpool-console'} status --json")
        hub = FleetHub(self.hub_address, authorized_keys_dir=keys["hub"].authorized_dir,
                       secret_key_file=keys["hub"].hub_secret,
                       audit_file=self.workdir / "audit.jsonl", metrics_port=port + 4)
        hub.start()
        self.hub = hub
        self.master = LocalMooncakeMaster(
            eviction_high_watermark_ratio=self.eviction_high_watermark_ratio,
            default_kv_lease_ttl_ms=self.default_kv_lease_ttl_ms,
            log_dir=self.workdir / "master",
        )
        self._say("starting mooncake_master on 127.0.0.1")
        self.master.start()
        assert self.master.proc is not None
        self._started_pids.add(self.master.proc.pid)

        model = DEMO_MODEL
        if self.engine_kind in ("vllm", "pd"):
            model = str(build_tiny_model(_tiny_model_dir()))
            self.shape = TINY_VLLM_SHAPE
        self._say(f"starting mooncake_client pool store (master {self.master.address})")
        self.store = LocalPoolStore(self.master, pool_bytes_for_tokens(self.pool_tokens,
                                                                       self.shape),
                                    log_dir=self.workdir)
        self.store.start()
        assert self.store.proc is not None
        self._started_pids.add(self.store.proc.pid)
        if self.engine_kind == "pd":
            self._start_pd(Path(model), trace, ready_timeout_s)
            return
        n = self.engines
        both = list(range(2, n)) if n >= 2 else [0]
        sources = ([0] if n >= 2 else []) + both
        shares = {e: list(range(k, len(trace), len(sources))) for k, e in enumerate(sources)}
        pd_address = f"tcp://127.0.0.1:{free_port()}" if n >= 2 else ""
        extra = mooncake_extra_config(
            self.master.address, self.master.admin_url,
            lease_ttl_ms=self.default_kv_lease_ttl_ms,
            high_watermark=self.eviction_high_watermark_ratio,
        )
        extra["agent_keys"] = str(self.agent_keys_dir)
        if self.policy_service:
            self.policy = LocalPolicyService(self.master, keys["hub"].root, fill=POLICY_FILL,
                                             log_dir=self.workdir / "policy")
            extra |= {"admission": "service", "policy_service": self.policy.address}
            self._say(f"starting kvpool-policy serve on {self.policy.address} (the pool-wide "
                      "policy: it admits and evicts for every engine, filling up to 2% below "
                      "the master's watermark as its used bytes show room)")
            # Beside the engines, which take far longer to start: the service adds nothing to
            # the demo's start. The engines save every chunk until its first snapshot.
            self._policy_start = threading.Thread(target=self._start_policy, daemon=True,
                                                  name="demo-policy-start")
            self._policy_start.start()
        go = self.workdir / "go"
        go.unlink(missing_ok=True)
        self._say(f"starting {n} {self.engine_kind} engine(s) replaying {self.trace_path}")
        for e in range(n):
            kw: dict[str, str | int] = {}
            if n >= 2 and e == 0:
                role, indices, kw = "kv_producer", shares[0], {"forward_to": pd_address}
            elif n >= 2 and e == 1:
                role, indices = "kv_consumer", shares[0]
                kw = {"feed_from": pd_address, "feed_count": len(shares[0])}
            else:
                role, indices = "kv_both", shares[e]
            eid = f"{_ROLE_NAMES[role]}-{e}"
            spec = EngineSpec(
                engine_id=eid, kv_role=role,  # type: ignore[arg-type]
                master_address=self.master.address, model=model, shape=self.shape,
                chunk_size=self.chunk_size, trace_path=str(self.trace_path.resolve()),
                indices=indices, speedup=self.speedup, agent_address=self.hub_address,
                lookup_rpc_port=free_port(),
                result_path=str(self.workdir / f"{eid}.result.json"), go_path=str(go),
                ready_path=str(self.workdir / f"{eid}.ready"), extra_config=extra,
                hold_after=True,  # a finished trace: idle engines, not gone ones
                **kw,  # type: ignore[arg-type]
            )
            self.specs[eid] = spec
            self._tether.release_on_death(spec.lookup_rpc_port)
            proc = self._spawn(spec)
            self.processes[eid] = proc
            self._started_pids.add(proc.pid)
        self._say_logs(", ".join(f"{eid}.log" for eid in self.processes))
        self._say(f"waiting for engines to be ready (up to {ready_timeout_s:.0f} s)")
        wait_engines_ready([(self.specs[e], p) for e, p in self.processes.items()],
                           ready_timeout_s, on_status=self._say)
        self._wait_policy(extra)
        go.write_text(f"{time.time():.6f}")

    def _start_policy(self) -> None:
        """The policy service's start (on ``_policy_start``'s thread); its error is kept for
        ``_wait_policy``."""
        assert self.policy is not None
        try:
            self.policy.start()
        except BaseException as exc:  # handed to the starting thread
            self._policy_error = exc

    def _wait_policy(self, extra: dict[str, object]) -> None:
        """Wait for the policy service's start (begun beside the engines).

        Raises:
            RuntimeError: it did not start (its log's tail), or it had to take other ports
                than the engines were given (another process took one meanwhile).
        """
        if self._policy_start is None or self.policy is None:
            return
        self._policy_start.join()
        if self._policy_error is not None:
            raise RuntimeError(f"kvpool-policy serve did not start: {self._policy_error}")
        assert self.policy.proc is not None
        self._started_pids.add(self.policy.proc.pid)
        if self.policy.address != extra["policy_service"]:
            raise RuntimeError(f"kvpool-policy serve had to move to {self.policy.address} (a "
                               f"port of {extra['policy_service']} was taken): start the demo "
                               "again")
        self._say(f"policy service serving on {self.policy.address}")

    def _start_pd(self, model: Path, trace: list[TraceRequest], timeout_s: float) -> None:
        """The P/D pair over this cluster's pool and hub, and the trace through its proxy."""
        assert self.master is not None
        cfg = self.workdir / "pd-mooncake.json"
        # The engines hold no pool memory: the store does (as in config/local-pd/).
        cfg.write_text(json.dumps({
            "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp", "master_server_address": self.master.address,
            "master_admin_url": self.master.admin_url, "global_segment_size": "0",
            "local_buffer_size": "64MB"}))
        self._say(f"starting the P/D pair (vllm serve x2 and the proxy; up to {timeout_s:.0f} s)")
        self.pd_pair = LocalPdPair(model, cfg, self.workdir / "pd", hub_address=self.hub_address,
                                   agent_keys=self.agent_keys_dir, chunk_size=128,
                                   on_status=self._say).start(timeout_s)
        self._started_pids.update(self.pd_pair.pids)
        self._say_logs("pd/prefill.log, pd/decode.log, pd/proxy.log")
        self._say(f"replaying {self.trace_path} through the proxy at {self.pd_pair.proxy_url}")
        self.pd_replay = ProxyReplay(self.pd_pair.proxy_url, trace, self.speedup,
                                     on_status=self._say).start()

    def _say(self, line: str) -> None:
        if self._progress is not None:
            self._progress(line)

    def _say_logs(self, engine_logs: str) -> None:
        """Where the logs are: the engines' (``engine_logs``, in the work directory), which
        ``kvpool-console triage ENGINE`` reads, and the services' beside them."""
        services = [s.log_path.relative_to(self.workdir)
                    for s in (self.master, self.store, self.policy) if s is not None]
        gone = "; removed when the demo stops" if self._own_tmp else ""
        self._say(f"logs in {self.workdir}/: engines {engine_logs} (kvpool-console triage "
                  f"ENGINE shows its tail), {', '.join(map(str, services))}{gone}")

    def _spawn(self, spec: EngineSpec) -> subprocess.Popen[bytes]:
        # Engine output goes to a log file: the console owns the terminal.
        log = open(self.workdir / f"{spec.engine_id}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        module = ("kvpool_replay._engine_proc" if self.engine_kind == "sim"
                  else "kvpool_replay._vllm_engine")
        return spawn_engine(spec, self.workdir, log=log, module=module)

    def result(self, engine_id: str) -> EngineResult | None:
        """The engine's final ``EngineResult`` once it finished its share, else ``None``."""
        p = Path(self.specs[engine_id].result_path)
        if not p.exists():
            return None
        return msgspec.json.decode(p.read_bytes(), type=EngineResult)

    def running(self) -> list[str]:
        """Ids of engines still replaying (a finished one stays up, idle, until ``stop``)."""
        return [eid for eid, p in self.processes.items()
                if p.poll() is None and self.result(eid) is None]

    def wait(self, timeout_s: float) -> bool:
        """Wait until every engine finished its share; False on timeout."""
        return wait_until(lambda: not self.running(), timeout_s) is not None

    def stop(self) -> None:
        """Stop engines, store, master and hub (process groups: TERM, then KILL). Idempotent."""
        if self.pd_replay is not None:
            self.pd_replay.stop()
        if self.pd_pair is not None:
            self.pd_pair.stop()
        for proc in self.processes.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 15)
        deadline = time.monotonic() + 10  # one wait for all: each its own was 10 s apiece
        for proc in self.processes.values():
            stop_process_tree(proc, timeout_s=max(0.0, deadline - time.monotonic()))
        for spec in self.specs.values():
            release_if_dead(spec.lookup_rpc_port)  # what an engine killed before its close left
        if self.policy is not None:
            # Stopped before its master; a start still under way gives up at once and stops
            # what it started (a Ctrl-C while a loaded CI host started it waited it out).
            self.policy.cancel()
            self.policy.stop()
            if self._policy_start is not None:
                self._policy_start.join()
            if self.policy.proc is not None:
                self._started_pids.add(self.policy.proc.pid)
            self.policy.stop()
        if self.store is not None:
            self.store.stop()
        if self.master is not None:
            self.master.stop()
        if self.hub is not None:
            self.hub.stop()  # type: ignore[attr-defined]
            self.hub = None
        for log in self._logs:
            log.close()  # type: ignore[attr-defined]
        self._logs.clear()
        if self._tether is not None:
            self._tether.forget_sessions()  # stopped: their pids are free to be reused

    def leftover_pids(self) -> list[int]:
        """Processes this cluster started (or their children) that are still alive."""
        alive = []
        for pid in self._started_pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        return alive

    def cleanup(self) -> None:
        """Remove the work directory if this cluster created it, and release the tether
        (nothing is left for it to do)."""
        if self._own_tmp:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self._tether is not None:
            self._tether.close()
            self._tether = None

    def __enter__(self) -> DemoCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self.cleanup()
