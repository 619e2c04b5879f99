"""A real model's KV between two real vLLM engines (issue 38): a random-weight Llama with
Llama-3-8B's KV shape (32 layers x 8 KV heads x 128 head dim, bfloat16: 128 KiB per token, 4 MiB
per 32-token chunk; ``build_tiny_model(shape="llama3-8b-kv")``, hidden 128 so it runs on CPU),
over a real ``mooncake_master`` and the module's segment holder (this test process), TCP on
127.0.0.1. Writer and reader are each their own process, neither holds pool memory, so every
byte crosses between processes.

Two engine starts, prefix caching off (every token not computed came from the pool):

* ``writer``: saves prompt set S; the pool held none of S, so it computes every token.
* ``reader``: first S with a fresh ``cache_salt`` (nothing of the pool matches: its own run
  without the pool, checked to load 0 tokens), then S: it loads every whole chunk the writer
  saved and its greedy tokens and logprobs equal its own no-pool run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_agent.hub import FleetHub
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, normalize_model_name

from _harness import REPO, BLOCK, MAX_TOKENS, Engines, Pool, kvpool, worker_state  # isort: skip

pytestmark = pytest.mark.vllm

LAYERS, KV_HEADS, HEAD_DIM, BF16 = 32, 8, 128, 2
PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * BF16
"""Bytes of KV per token: K and V of every layer (128 KiB, Llama-3-8B's)."""
EXACT_ABS = 1e-6
"""Logprob tolerance of a reader against its own run when it computed two or more prompt
tokens: run one prompt at a time, both runs went through vLLM's prefill kernel and gave the
same bits (0.0 apart, measured twice); a wrong block moves them by about a bfloat16 step
(~0.008 near -2) or more."""
ONE_TOKEN_ABS = 5e-2
"""The same when the pool served every prompt token but the last: vLLM computes that one-token
query with its decode kernel, its own run with the prefill kernel (0.032 apart in one of 8
logprobs, measured twice; tokens equal)."""

_rng = random.Random(38)
# 3 prompts, 26 whole chunks of 4 MiB (104 MiB of the module's 256 MB segment).
S = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (300, 257, 310)]


def _loadable(prompt: list[int]) -> int:
    """Tokens the pool can supply: whole chunks, never the last prompt token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model() -> Path:
    from kvpool_replay import build_tiny_model

    return build_tiny_model(REPO / ".cache" / "tiny-llama3-8b-kv", shape="llama3-8b-kv").resolve()


@pytest.fixture(scope="module")
def engines(model: Path, pool: Pool, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Engines]:
    e = Engines(model, pool, tmp_path_factory.mktemp("engines"))
    yield e
    e.close_all()


def test_reader_of_a_real_kv_shape_loads_every_whole_chunk_and_equals_its_own_run(
    engines: Engines, pool: Pool, model: Path, hub: FleetHub,
) -> None:
    assert PER_TOKEN == 128 << 10
    # One prompt at a time (both engines): in bfloat16 a request's numbers depend on which
    # others share its steps (a batch of all three gave other tokens), and lookup timing
    # decides that.
    writer = engines.run("writer", S, kvpool("kv_both", None, "writer", hub),
                         dtype="bfloat16", one_at_a_time=True)
    assert [o["num_cached_tokens"] for o in writer] == [0] * len(S)
    w = worker_state(hub, "writer")
    # A chunk is stored as KV_HEADS values of one head each (``_heads``: any TP size reads it).
    assert w.source.layout["kv_share"] == f"{KV_HEADS}x1h"
    assert (w.source.layout["layers"], w.source.layout["head_size"]) == (LAYERS, HEAD_DIM)
    name = normalize_model_name(str(model))
    hashes = [h for p in S for h in chunk_hashes(p, BLOCK)]
    assert len(hashes) == sum(_loadable(p) for p in S) // BLOCK == 26
    keys = [str(PoolKey(name, w.source.layout_digest, ParallelLayout(tp_rank=share), h))
            for h in hashes for share in range(KV_HEADS)]
    # Every whole chunk is in the pool at its real size, 4 MiB in 8 values of 512 KiB (the
    # store process holds them, not the writer).
    assert [len(pool.store.get(k)) for k in keys] == [BLOCK * PER_TOKEN // KV_HEADS] * len(keys)
    assert w.transfers.saves_failed == 0
    assert w.transfers.saved_bytes == len(hashes) * BLOCK * PER_TOKEN

    got = engines.run("reader", S, kvpool("kv_both", None, "reader", hub),
                      dtype="bfloat16", baseline=True, one_at_a_time=True)
    own = engines.baseline("reader")  # checked: loaded nothing, computed every token
    assert [o["num_cached_tokens"] for o in got] == [_loadable(p) for p in S]
    r = worker_state(hub, "reader")
    assert r.transfers.loads_failed == 0
    assert r.transfers.loaded_bytes == sum(_loadable(p) for p in S) * PER_TOKEN
    for p, g, want in zip(S, got, own, strict=True):
        assert g["tokens"] == want["tokens"]
        computed = len(p) - _loadable(p)
        assert g["logprobs"] == pytest.approx(
            want["logprobs"], abs=EXACT_ABS if computed >= 2 else ONE_TOKEN_ABS), computed
    # The reader computed its tokens from its own KV, not the writer's outputs: both engines'
    # no-pool runs agree too (same weights, same prompts).
    assert [o["tokens"] for o in writer] == [o["tokens"] for o in own]
    assert len(own[0]["tokens"]) == MAX_TOKENS
