"""The layout digest: it changes with every fact that decides a value's bytes, stays the same for
what does not (block count, addresses), and is the same in every process and on every host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kvpool_agent.protocol import Source
from kvpool_connector._checksum import CHECKSUM_NAME
from kvpool_connector._layout_digest import (
    LAYOUT_SCHEME,
    LayoutFacts,
    ModelFacts,
    cache_signature,
    describe_layout,
)

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 40

BASE: dict[str, Any] = {
    "layers": 2, "heads": 4, "block": 32, "head": 64, "dtype": torch.bfloat16, "blocks": NUM_BLOCKS,
    "chunk": 64, "sizes": {}, "facts": {"revision": "main", "dtype": "bfloat16",
                                        "kv_cache_dtype": "auto", "attn_backend": "CPU_ATTN",
                                        "kv_heads": 4, "head_size": 64},
    "model": "org/tiny",
}
"""A vLLM-CPU-shaped engine; every test changes one thing."""


def _facts(**change: Any) -> LayoutFacts:
    p = {**BASE, **change}
    # Meta tensors: shapes and strides without memory.
    kv = {f"model.layers.{i}.self_attn.attn": torch.empty(
        p["blocks"], p["heads"], p["block"], 2 * p["head"], dtype=p["dtype"], device="meta")
        for i in range(p["layers"])}
    return describe_layout(kv, p["blocks"], model=p["model"], facts=ModelFacts(**p["facts"]),
                           block_size=p["block"], chunk_size=p["chunk"], **p["sizes"])


DIGEST = _facts().digest

GOLDEN = "b47ebd8c81c1"
"""``_facts().digest`` as computed once; the same on every host and interpreter. A change means
every engine's keys change: bump ``LAYOUT_SCHEME`` on purpose, then update this value."""


@pytest.mark.parametrize("change", [
    {"dtype": torch.float16},                                    # same bytes per element
    {"block": 64, "chunk": 128},                                 # block size
    {"block": 64},                                               # block size, same chunk
    {"layers": 3},
    {"heads": 2, "facts": {**BASE["facts"], "kv_heads": 2}},     # KV heads
    {"head": 128, "facts": {**BASE["facts"], "head_size": 128}},  # head size
    {"facts": {**BASE["facts"], "kv_heads": 8}},                 # config alone
    {"facts": {**BASE["facts"], "head_size": 32}},
    {"sizes": {"tp_size": 2}},
    {"sizes": {"pcp_size": 2}},
    {"sizes": {"dcp_size": 2}},
    {"sizes": {"pp_size": 2}},
    {"chunk": 128},
    {"facts": {**BASE["facts"], "revision": "0123abcd"}},
    {"facts": {**BASE["facts"], "quantization": "fp8"}},
    {"facts": {**BASE["facts"], "dtype": "float16"}},            # model dtype
    {"facts": {**BASE["facts"], "kv_cache_dtype": "fp8_e4m3"}},
    {"facts": {**BASE["facts"], "attn_backend": "FLASH_ATTN"}},
    # Other weights (issue 39): the content fingerprint, an operator's, or a private one.
    {"facts": {**BASE["facts"], "fingerprint": "safetensors:" + "0" * 32}},
    {"facts": {**BASE["facts"], "fingerprint": "configured:" + "0" * 32}},
    {"model": "org/tiny-2"},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())[:60])
def test_every_fact_changes_the_digest(change: dict[str, Any]) -> None:
    digest = _facts(**change).digest
    assert len(digest) == 12 and int(digest, 16) >= 0
    assert digest != DIGEST


def test_what_does_not_change_the_bytes_keeps_the_digest() -> None:
    # Another block count (engines with different memory) and another allocation.
    assert _facts(blocks=NUM_BLOCKS * 3).digest == DIGEST
    real = {f"model.layers.{i}.self_attn.attn": torch.zeros(NUM_BLOCKS, 4, 32, 128,
                                                            dtype=torch.bfloat16)
            for i in range(2)}
    again = describe_layout(real, NUM_BLOCKS, model="org/tiny", facts=ModelFacts(**BASE["facts"]),
                            block_size=32, chunk_size=64)
    assert again.digest == DIGEST


def test_cache_signature_reads_the_layout_like_the_worker() -> None:
    cpu = torch.empty(NUM_BLOCKS, 4, 32, 128, dtype=torch.float32, device="meta")
    assert cache_signature(cpu, NUM_BLOCKS) == "float32(B,4,32,128)/(*,4096,128,1)"
    # FlashAttention: K/V axis before the blocks; its stride depends on the block count.
    fa = [torch.empty(2, n, 16, 2, 8, dtype=torch.bfloat16, device="meta") for n in (10, 30)]
    assert {cache_signature(t, t.shape[1]) for t in fa} == {"bfloat16(2,B,16,2,8)/(*,*,16,8,1)"}
    # Same shape, other element order (heads outside tokens vs inside): other bytes.
    nhd = torch.empty(NUM_BLOCKS, 32, 4, 128, dtype=torch.float32, device="meta").transpose(1, 2)
    assert nhd.shape == cpu.shape
    assert cache_signature(nhd, NUM_BLOCKS) == "float32(B,4,32,128)/(*,128,512,1)"
    # A size-1 dimension's stride is arbitrary in torch; it moves no byte.
    mla = torch.empty(NUM_BLOCKS, 16, 1, 32, dtype=torch.bfloat16, device="meta")
    assert cache_signature(mla, NUM_BLOCKS) == cache_signature(
        mla.as_strided(mla.shape, (512, 32, 7, 1)), NUM_BLOCKS) == "bfloat16(B,16,1,32)/(*,32,*,1)"
    with pytest.raises(ValueError, match="no dimension"):
        cache_signature(cpu, NUM_BLOCKS + 1)


def test_facts_list_what_is_hashed_run_length_coded() -> None:
    facts = _facts()
    assert facts.as_dict() == {
        "scheme": LAYOUT_SCHEME, "model": "org/tiny", "revision": "main", "quantization": "",
        "dtype": "bfloat16", "kv_cache_dtype": "auto", "attn_backend": "CPU_ATTN",
        "kv_heads": 4, "head_size": 64, "layers": 2,
        "cache": "2x bfloat16(B,4,32,128)/(*,4096,128,1)", "block_size": 32, "chunk_size": 64,
        "tp": 1, "pcp": 1, "dcp": 1, "pp": 1, "checksum": "", "hash_algo": "sha256", "groups": "",
        "kv_share": "", "pp_split": "", "fingerprint": "",
    }
    # Layers of other layouts keep their order; tuples (separate K/V) join with " + ".
    k = torch.empty(NUM_BLOCKS, 16, 2, 8, dtype=torch.float16, device="meta")
    mixed = describe_layout({"a": (k, k), "b": (k, k), "c": k}, NUM_BLOCKS, model="m",
                            facts=ModelFacts(), block_size=16, chunk_size=16)
    sig = "float16(B,16,2,8)/(*,16,8,1)"
    assert mixed.cache == f"2x {sig} + {sig} | 1x {sig}"
    # Values that carry a digest are another layout.
    checked = describe_layout({"a": (k, k), "b": (k, k), "c": k}, NUM_BLOCKS, model="m",
                              facts=ModelFacts(), block_size=16, chunk_size=16,
                              checksum=CHECKSUM_NAME)
    assert checked.as_dict()["checksum"] == CHECKSUM_NAME and checked.digest != mixed.digest
    # So are values named by another chunk-hash function.
    fast = describe_layout({"a": (k, k), "b": (k, k), "c": k}, NUM_BLOCKS, model="m",
                           facts=ModelFacts(), block_size=16, chunk_size=16,
                           hash_algo="xxh3_128")
    assert fast.as_dict()["hash_algo"] == "xxh3_128" and fast.digest != mixed.digest
    assert mixed.as_dict()["hash_algo"] == "sha256"  # the default, left out of the digest
    assert mixed.layers == 3
    # The agent carries them unchanged (Source.layout).
    src = Source(agent_id="e/dp0.tp0.pp0", engine_id="e", instance_role="mixed",
                 kv_role="kv_both", process_role="worker", layout_digest=facts.digest,
                 layout=facts.as_dict())
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(src), type=Source)
    assert back.layout == facts.as_dict() and back.layout_digest == DIGEST


def test_digest_is_the_same_in_every_process_and_host() -> None:
    assert DIGEST == GOLDEN
    code = ("import sys; sys.path.insert(0, 'tests/connector'); "
            "from test_layout_digest import _facts; print(_facts().digest)")
    # Another interpreter with another str hash seed than this one's.
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "2" else "2"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": seed,
                                          "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == DIGEST
