"""What the real-vLLM tests share: the pool they use, engine runs in their own processes
(``_engine.py``), the connector's config and the fleet hub's view of an engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool_agent.hub import FleetHub
from kvpool_agent.protocol import EngineState
from kvpool_replay import LocalMooncakeMaster

REPO = Path(__file__).resolve().parents[2]
ENGINE = Path(__file__).with_name("_engine.py")
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
    """States of engine ``engine_id``'s ``role`` agents, waiting up to 5 s for one."""
    deadline = time.monotonic() + 5
    while True:
        states = [st for st, _ in hub.fleet().values()
                  if (st.source.engine_id, st.source.process_role) == (engine_id, role)]
        if states or time.monotonic() > deadline:
            return states
        time.sleep(0.1)


def worker_state(hub: FleetHub, engine_id: str) -> EngineState:
    """The state of engine ``engine_id``'s one worker, once its layout digest is in."""
    deadline = time.monotonic() + 5
    while True:
        (st,) = agent_states(hub, engine_id, "worker")
        if st.source.layout_digest or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def kvpool(role: str, port: int | None, name: str, hub: FleetHub, **extra: Any
            ) -> dict[str, Any]:
    """KVPoolConnector's config for the engine run ``name``, reporting to ``hub`` as
    ``engine_id`` ``name``; ``port=None`` leaves ``lookup_rpc_port`` unset (the lookup socket is
    then named from vLLM's instance id)."""
    if port is not None:
        extra["lookup_rpc_port"] = port
    return {
        "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
        "kv_role": role, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": "mooncake", "engine_id": name,
                                      "agent_address": hub.address, **extra},
    }


class Engines:
    """Runs ``_engine.py`` processes and caches their outputs by name."""

    def __init__(self, model: Path, pool: Pool | None, workdir: Path) -> None:
        self.model, self.pool, self.workdir = model, pool, workdir
        self.results: dict[str, dict[str, Any]] = {}

    def run(self, name: str, prompts: list[list[int]], ktc: dict[str, Any] | None = None,
            *, prefix_caching: bool = False, multiprocess: bool = False,
            dtype: str = "float32", block_size: int = BLOCK, model: Path | None = None,
            tp: int = 1, hma: bool | None = None, max_num_seqs: int = 8,
            env: dict[str, str] | None = None, attention_backend: str | None = None,
            rounds: int = 1, lora: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run engine ``name`` once (cached) over ``prompts``; its first round's outputs.

        ``model``: another model than the harness's; ``tp``: vLLM's tensor_parallel_size
        (TP=2 on this 2-core host binds one OpenMP thread per rank); ``hma``: vLLM's hybrid
        KV-cache manager on (True) or off (False), ``None``: vLLM's choice; ``max_num_seqs``:
        vLLM's batch size; ``env``: more environment; ``attention_backend``: vLLM's
        ``attention_config.backend`` (e.g. ``CPU_MLA``), ``None``: vLLM's choice; ``rounds``:
        the prompts are generated this many times in one engine (``self.results[name]
        ["rounds"]`` holds every round's outputs); ``lora``: every prompt through this LoRA
        adapter (``_engine.py``'s ``lora``)."""
        if name not in self.results:
            spec = {"model": str(model or self.model), "prompts": prompts,
                    "max_tokens": MAX_TOKENS, "kv_transfer_config": ktc,
                    "prefix_caching": prefix_caching,
                    "num_gpu_blocks": 96 * BLOCK // block_size, "dtype": dtype,
                    "block_size": block_size, "tensor_parallel_size": tp, "hma": hma,
                    "max_num_seqs": max_num_seqs, "attention_backend": attention_backend,
                    "rounds": rounds, "lora": lora}
            spec_path = self.workdir / f"{name}.spec.json"
            out_path = self.workdir / f"{name}.out.json"
            log_path = self.workdir / f"{name}.log"
            spec_path.write_text(json.dumps(spec))
            env = {
                **os.environ, "PYTHONPATH": str(REPO),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
                "VLLM_CPU_KVCACHE_SPACE": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
                "KVPOOL_RUNTIME_DIR": str(self.workdir), "TOKENIZERS_PARALLELISM": "false",
                **(env or {}),
            }
            if self.pool is not None:
                env["MOONCAKE_CONFIG_PATH"] = str(self.pool.config_path)
            with open(log_path, "w") as log:
                proc = subprocess.run([sys.executable, str(ENGINE), str(spec_path),
                                       str(out_path)], stdout=log, stderr=subprocess.STDOUT,
                                      env=env, timeout=300, check=False)
            if proc.returncode != 0:
                tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
                pytest.fail(f"engine {name} exited {proc.returncode}; log tail:\n{tail}")
            self.results[name] = json.loads(out_path.read_text())
        return self.results[name]["rounds"][0]


