"""Never another model's KV (issue 39): engines share pool values by what their weights are,
not where they are, in real vLLM (CPU, tiny Llama, greedy, float32) over a real
``mooncake_master`` and the module's segment holder; each engine is its own process.

The tiny model is copied into ``a/cur`` (v1). Three engines, prefix caching off (every
token not computed came from the pool, and vLLM's ``num_cached_tokens`` counts them):

* ``writer``: ``a/cur`` holds v1; saves prompt set S. The pool held none of S, so it computes
  every token: its outputs are v1's own run without a pool.
* ``copy``: v1 copied to ``b/cur`` (another path, the same directory name, hence the same
  model name): the same fingerprint and layout digest, so it loads every whole chunk of S
  and equals the writer's outputs. It runs with vLLM's LoRA on and stays up for the LoRA
  test below (S without an adapter, T with one).
* ``new_weights``: ``a/cur`` then holds v2 (the same config, other weights), as after an
  in-place rolling deploy: another fingerprint and digest, so it loads none of v1's KV; its
  tokens differ from v1's (the weights really differ) and equal its own run without the pool
  (a round with a fresh ``cache_salt`` first).

LoRA (adapters on k_proj/v_proj, which shape the cached K and V), on v1 at ``b/cur`` (the
``copy`` engine), three runs over prompt set T:

* adapter 1 under the name ``sql``; saves T, computing every token.
* adapter 1 (a copy at another path) under the name ``chat``: the same adapter by content,
  so it loads every whole chunk and equals the first run.
* the name ``sql`` now points at adapter 2 (as after a reload of the adapter under its name):
  loads nothing, its tokens differ from adapter 1's and equal its own run without the pool
  (a fresh ``cache_salt``).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool_agent.hub import FleetHub
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, normalize_model_name

from _engine import Engine  # isort: skip
from _harness import (  # isort: skip
    BLOCK,
    MAX_TOKENS,
    Engines,
    Pool,
    fresh_salt,
    kvpool,
    worker_state,
)

pytestmark = pytest.mark.vllm

_rng = random.Random(39)
S = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (150, 97, 230)]
T = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (140, 200)]
LORA_RANK = 8


def _loadable(prompt: list[int]) -> int:
    """Tokens the pool can supply: whole chunks, never the last prompt token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def _write_new_weights(model_dir: Path) -> None:
    """Overwrite ``model_dir``'s weights in place with others of the same names, shapes and
    dtypes (and so the same safetensors header): v2 of the same model."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    gen = torch.Generator().manual_seed(2)
    tensors = {name: (t + 0.5 * t.float().std() * torch.randn(t.shape, generator=gen)).to(t.dtype)
               if t.numel() > 1 else t
               for name, t in load_file(path).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _adapter(root: Path, seed: int) -> Path:
    """A PEFT LoRA adapter of rank ``LORA_RANK`` on every layer's k_proj and v_proj of the tiny
    model (hidden 128, 2 KV heads of 32), weights drawn from ``seed``."""
    import json

    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
        "target_modules": ["k_proj", "v_proj"], "bias": "none", "lora_dropout": 0.0,
        "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}))
    gen = torch.Generator().manual_seed(seed)
    save_file({f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight":
               torch.randn(shape, generator=gen) * 0.3
               for i in range(2) for m in ("k_proj", "v_proj")
               for ab, shape in (("A", (LORA_RANK, 128)), ("B", (64, LORA_RANK)))},
              str(root / "adapter_model.safetensors"))
    return root


@pytest.fixture(scope="module")
def models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The module's copies of the tiny model (``a/cur`` gets new weights in place) and its
    LoRA adapters."""
    tiny = tiny_model
    root = tmp_path_factory.mktemp("identity")
    cur = root / "a" / "cur"
    shutil.copytree(tiny, cur)
    copy = root / "b" / "cur"
    shutil.copytree(tiny, copy)
    one = _adapter(root / "adapters" / "one", 1)
    one_copy = root / "adapters" / "one-copy"
    shutil.copytree(one, one_copy)
    return {"cur": cur, "copy": copy, "one": one, "one_copy": one_copy,
            "two": _adapter(root / "adapters" / "two", 2)}


@pytest.fixture(scope="module")
def engines(models: dict[str, Path], pool: Pool, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Engines]:
    e = Engines(models["cur"], pool, tmp_path_factory.mktemp("engines"))
    yield e
    e.close_all()


@pytest.fixture(scope="module")
def copy(engines: Engines, models: dict[str, Path], hub: FleetHub) -> Iterator[Engine]:
    """The engine on v1 at ``b/cur``, LoRA on, shared by both tests (each its own prompts:
    S without an adapter, T through adapters)."""
    engine = engines.start("copy", kvpool("kv_both", None, "copy", hub), model=models["copy"],
                           lora_rank=LORA_RANK)
    yield engine
    engine.close()


def _layout(hub: FleetHub, name: str) -> tuple[str, dict[str, Any]]:
    src = worker_state(hub, name).source
    return src.layout_digest, dict(src.layout)


def test_same_weights_share_new_weights_at_the_same_path_never_do(
    engines: Engines, models: dict[str, Path], pool: Pool, hub: FleetHub, copy: Engine,
) -> None:
    writer = engines.run("writer", S, kvpool("kv_both", None, "writer", hub))
    assert [o["num_cached_tokens"] for o in writer] == [0, 0, 0]
    digest, facts = _layout(hub, "writer")
    assert facts["model"] == "cur"
    assert facts["fingerprint"].startswith("safetensors:")
    name = normalize_model_name(str(models["cur"]))
    assert name == "cur"
    for p in S:
        for h in chunk_hashes(p, BLOCK):
            assert pool.store.is_exist(str(PoolKey(name, digest, ParallelLayout(), h))) == 1

    # The same weights at another path: the same identity, every whole chunk loaded.
    copied = copy.generate(S, MAX_TOKENS)
    assert _layout(hub, "copy") == (digest, facts)
    assert [o["num_cached_tokens"] for o in copied] == [_loadable(p) for p in S]
    for got, want in zip(copied, writer, strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)

    # New weights in the same directory: another identity, nothing of v1's KV loaded.
    _write_new_weights(models["cur"])
    new = engines.run("new_weights", S, kvpool("kv_both", None, "new_weights", hub),
                      baseline=True)
    new_digest, new_facts = _layout(hub, "new_weights")
    assert new_facts["model"] == "cur"
    assert new_facts["fingerprint"] != facts["fingerprint"]
    assert new_digest != digest
    assert [o["num_cached_tokens"] for o in new] == [0, 0, 0]
    # v2 computes other tokens than v1 for these prompts: had it read v1's KV, it could
    # have followed v1 (as the issue saw); it equals its own run without the pool.
    assert [o["tokens"] for o in new] != [o["tokens"] for o in writer]
    for got, want in zip(new, engines.baseline("new_weights"), strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)


def test_a_lora_name_over_two_adapters_never_shares_one_adapter_under_two_names_does(
    models: dict[str, Path], copy: Engine,
) -> None:
    def run(lora_id: int, lora: str, adapter: str, salt: str | None = None
            ) -> list[dict[str, Any]]:
        return copy.generate(T, MAX_TOKENS, salt=salt, lora={"name": lora, "id": lora_id,
                                                              "path": str(models[adapter])})

    writer = run(1, "sql", "one")
    assert [o["num_cached_tokens"] for o in writer] == [0, 0]
    renamed = run(2, "chat", "one_copy")
    assert [o["num_cached_tokens"] for o in renamed] == [_loadable(p) for p in T]
    for got, want in zip(renamed, writer, strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
    # The name over another adapter: its own run without the pool first (a fresh cache_salt).
    own = run(3, "sql", "two", salt=fresh_salt())
    assert [o["num_cached_tokens"] for o in own] == [0, 0]
    new = run(3, "sql", "two")
    assert [o["num_cached_tokens"] for o in new] == [0, 0]
    assert [o["tokens"] for o in new] != [o["tokens"] for o in writer]
    for got, want in zip(new, own, strict=True):
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
