"""What the real-vLLM tests share: the pool they use, engine runs in their own processes
(``_engine.py``), the connector's config and the fleet hub's view of an engine."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool_agent.hub import FleetHub
from kvpool_agent.protocol import EngineState
from kvpool_replay import LocalMooncakeMaster

from _engine import Engine, EngineFailed  # isort: skip

REPO = Path(__file__).resolve().parents[2]
BLOCK = 32  # vLLM's CPU attention needs block sizes that are multiples of 32
MAX_TOKENS = 8


class Pool:
    """The test's view of the pool: master, segment-holding client, engine config file."""

    def __init__(self, master: LocalMooncakeMaster, workdir: Path) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.master = master
        self.workdir = workdir
        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 64 << 20, "tcp", "",
                              master.address)
        assert rc == 0, f"segment holder setup failed: {rc}"
        self.config_path = workdir / "mooncake.json"
        self.config_path.write_text(json.dumps({
            "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp", "master_server_address": master.address,
            "global_segment_size": "256MB", "local_buffer_size": "64MB",
            "store_mode": "standalone", "master_admin_url": master.admin_url,
        }))

    def truncate(self, keys: list[str]) -> int:
        """Replace each present key's value with its first half: a load of it cannot be
        complete. Returns how many keys were rewritten."""
        done = 0
        for key in keys:
            raw = self.store.get(key)
            if not raw:
                continue
            assert self.store.upsert(key, raw[: len(raw) // 2]) == 0
            done += 1
        return done

    def corrupt(self, keys: list[str]) -> int:
        """Overwrite each present key's value with its float32 values reversed: same size,
        plausible numbers, wrong KV. Returns how many keys were rewritten."""
        done = 0
        for key in keys:
            raw = self.store.get(key)
            if not raw:
                continue
            vals = np.frombuffer(raw, dtype=np.float32)[::-1].copy()
            assert self.store.upsert(key, vals.tobytes()) == 0
            assert self.store.get(key) != raw
            done += 1
        return done


def agent_states(hub: FleetHub, engine_id: str, role: str) -> list[EngineState]:
    """States of engine ``engine_id``'s ``role`` agents, waiting up to 30 s for one."""
    deadline = time.monotonic() + 30
    while True:
        states = [st for st, _ in hub.fleet().values()
                  if (st.source.engine_id, st.source.process_role) == (engine_id, role)]
        if states or time.monotonic() > deadline:
            return states
        time.sleep(0.1)


def worker_state(hub: FleetHub, engine_id: str) -> EngineState:
    """The state of engine ``engine_id``'s one worker, once its layout digest is in."""
    deadline = time.monotonic() + 30
    while True:
        (st,) = agent_states(hub, engine_id, "worker")
        if st.source.layout_digest or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


LOOKUP_TIMEOUT_MS = 5_000
"""The engines' ``lookup_timeout_ms``: these tests count what each lookup found and loaded, not
how fast; the product's 50 ms default failed a scheduler's lookup across processes (IPC to
worker rank 0) once in CI (``lookup_errors`` 1, its 96 tokens computed, as designed)."""


def kvpool(role: str, port: int | None, name: str, hub: FleetHub, **extra: Any
            ) -> dict[str, Any]:
    """KVPoolConnector's config for the engine run ``name``, reporting to ``hub`` as
    ``engine_id`` ``name``; ``port=None`` leaves ``lookup_rpc_port`` unset (the lookup socket is
    then named from vLLM's instance id). ``lookup_timeout_ms`` defaults to
    ``LOOKUP_TIMEOUT_MS``."""
    if port is not None:
        extra["lookup_rpc_port"] = port
    extra.setdefault("lookup_timeout_ms", LOOKUP_TIMEOUT_MS)
    return {
        "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
        "kv_role": role, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": "mooncake", "engine_id": name,
                                      "agent_address": hub.address, **extra},
    }


class Engines:
    """Starts engines (``_engine.Engine``) for one module, caches one-shot runs by name, and
    ends every engine still running when the module is done (``close_all``).

    ``model``: the module's model; ``pool``: the pool its engines' connectors use (their
    ``MOONCAKE_CONFIG_PATH``), ``None`` for none; ``workdir``: specs, logs, runtime sockets."""

    def __init__(self, model: Path, pool: Pool | None, workdir: Path) -> None:
        self.model, self.pool, self.workdir = model, pool, workdir
        self.results: dict[str, dict[str, Any]] = {}
        self.running: list[Engine] = []

    def start(self, name: str, ktc: dict[str, Any] | None = None, *,
              prefix_caching: bool = False, multiprocess: bool = False,
              dtype: str = "float32", block_size: int = BLOCK, model: Path | None = None,
              tp: int = 1, hma: bool | None = None, max_num_seqs: int = 8,
              env: dict[str, str] | None = None, attention_backend: str | None = None,
              lora_rank: int | None = None, num_gpu_blocks: int | None = None,
              log_stats: bool = False, kv_events_config: dict[str, Any] | None = None
              ) -> Engine:
        """A running engine ``name`` (close it, or the module's teardown does).

        ``ktc``: its kv_transfer_config, ``None``: no connector; ``multiprocess``: vLLM's
        engine core in its own process (lookups cross the IPC socket); ``model``: another model
        than the harness's; ``tp``: vLLM's tensor_parallel_size (TP=2 on this 2-core host binds
        one OpenMP thread per rank); ``hma``: vLLM's hybrid KV-cache manager on (True) or off
        (False), ``None``: vLLM's choice; ``max_num_seqs``: vLLM's batch size; ``env``: more
        environment; ``attention_backend``: vLLM's ``attention_config.backend`` (e.g.
        ``CPU_MLA``), ``None``: vLLM's choice; ``lora_rank``: vLLM's LoRA on;
        ``num_gpu_blocks``: default 96 blocks of 32 tokens; ``log_stats``: vLLM's stat loggers
        (Prometheus) on; ``kv_events_config``: vLLM's KV-event publisher."""
        spec = {"model": str(model or self.model), "kv_transfer_config": ktc,
                "prefix_caching": prefix_caching,
                "num_gpu_blocks": num_gpu_blocks or 96 * BLOCK // block_size, "dtype": dtype,
                "block_size": block_size, "tensor_parallel_size": tp, "hma": hma,
                "max_num_seqs": max_num_seqs, "attention_backend": attention_backend,
                "lora_rank": lora_rank, "log_stats": log_stats,
                "kv_events_config": kv_events_config}
        (self.workdir / f"{name}.spec.json").write_text(json.dumps(spec))
        full_env = {
            **os.environ, "PYTHONPATH": str(REPO),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
            "VLLM_CPU_KVCACHE_SPACE": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
            "KVPOOL_RUNTIME_DIR": str(self.workdir), "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        if self.pool is not None:
            full_env["MOONCAKE_CONFIG_PATH"] = str(self.pool.config_path)
        try:
            engine = Engine(name, spec, full_env, self.workdir / f"{name}.log")
        except EngineFailed as e:
            pytest.fail(str(e))
        self.running.append(engine)
        return engine

    def run(self, name: str, prompts: list[list[int]], ktc: dict[str, Any] | None = None,
            *, rounds: int = 1, baseline: bool = False, lora: dict[str, Any] | None = None,
            max_tokens: int = MAX_TOKENS, one_at_a_time: bool = False,
            **start: Any) -> list[dict[str, Any]]:
        """Run engine ``name`` once (cached by name) over ``prompts`` and end it; the outputs
        of its first unsalted round.

        ``rounds``: the prompts are generated this many times (``self.results[name]
        ["rounds"]`` holds every round's outputs); ``baseline``: first a round with a fresh
        ``cache_salt`` (``self.results[name]["baseline"]``), the engine's own run without the
        pool; ``lora``: every prompt through this adapter (``Engine.generate``);
        ``one_at_a_time``: each prompt its own batch (a request's numbers then do not depend on
        which others shared its steps, which lookup timing decides); ``start``:
        ``Engines.start``'s options."""
        if name not in self.results:
            engine = self.start(name, ktc, **start)
            result: dict[str, Any] = {}

            def generate(salt: str | None) -> list[dict[str, Any]]:
                batches = [[p] for p in prompts] if one_at_a_time else [prompts]
                return [o for b in batches
                        for o in engine.generate(b, max_tokens, salt=salt, lora=lora)]

            try:
                if baseline:
                    result["baseline"] = generate(fresh_salt())
                result["rounds"] = [generate(None) for _ in range(rounds)]
                engine.close()
            except EngineFailed as e:
                engine.kill()
                pytest.fail(str(e))
            finally:
                self.running.remove(engine)
            self.results[name] = result
        rounds_out: list[dict[str, Any]] = self.results[name]["rounds"][0]
        return rounds_out

    def baseline(self, name: str) -> list[dict[str, Any]]:
        """Run ``name``'s salted round (``run(..., baseline=True)``), checked to have loaded
        nothing: vLLM computed every prompt token (the engines' own prefix caches are off)."""
        own: list[dict[str, Any]] = self.results[name]["baseline"]
        assert [o["num_cached_tokens"] for o in own] == [0] * len(own), name
        return own

    def close_all(self) -> None:
        """End every engine still running (a test failed with one open)."""
        for engine in self.running:
            engine.kill()
        self.running.clear()


_salts = itertools.count()


def fresh_salt() -> str:
    """A ``cache_salt`` no request used before in this test process: the connector mixes it
    into every chunk hash (``kvpool_connector.scheduler.request_extra``), vLLM into its own
    prefix-cache hashes, so a salted request finds nothing any other request saved."""
    return f"baseline-{os.getpid()}-{next(_salts)}"
