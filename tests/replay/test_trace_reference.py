"""Trace input and the reference figures (no pool): fast checks of the rules the replay is
measured against."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool_connector.keys import chunk_hashes
from kvpool_replay import (
    ModelShape,
    TraceError,
    TraceRequest,
    default_trace_path,
    load_trace,
    lru_hits,
    prefix_ceiling,
    request_tokens,
)
from kvpool_replay._reference import claimable_chunks
from kvpool_replay._tokens import block_tokens


def test_shared_traces_load_with_limit() -> None:
    conv = load_trace(default_trace_path("conversation_trace.jsonl"), limit=50)
    assert len(conv) == 50
    assert conv[0].input_length == 6758 and conv[0].hash_ids[:3] == [0, 1, 2]
    synth = load_trace(default_trace_path("synthetic_trace.jsonl"))
    assert len(synth) == 3993


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
        ('{"timestamp": 0, "input_length": "ten", "output_length": 1, "hash_ids": [1]}',
         "$.input_length"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
         "needs 2"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}',
         "non-negative"),
        ("not json", "not a JSON object"),
    ],
)
def test_bad_line_names_line_and_field(tmp_path: Path, line: str, needle: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}'
    p = tmp_path / "t.jsonl"
    p.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TraceError) as info:
        load_trace(p)
    assert f"{p}:3:" in str(info.value)
    assert needle in str(info.value)


@pytest.mark.parametrize("text", ["", "\n \n\t\n"])
def test_trace_without_requests_is_an_error(tmp_path: Path, text: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    with pytest.raises(TraceError) as info:
        load_trace(p)
    assert str(info.value) == f"{p}: no requests (the file is empty or holds only blank lines)"


def test_model_shape_itemsize_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    for name, dtype in dtypes.items():
        shape = ModelShape(layers=3, kv_heads=2, head_size=8, dtype=name)
        assert shape.itemsize == torch.empty((), dtype=dtype).element_size()
        assert shape.bytes_per_token == 3 * 2 * 2 * 8 * shape.itemsize


def test_missing_trace_says_where_traces_live(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--trace"):
        load_trace(tmp_path / "nope.jsonl")


def test_equal_hash_ids_give_equal_blocks_and_chained_hashes() -> None:
    a = TraceRequest(timestamp=0, input_length=1300, output_length=1, hash_ids=[5, 9, 11])
    b = TraceRequest(timestamp=0, input_length=700, output_length=1, hash_ids=[5, 9])
    c = TraceRequest(timestamp=0, input_length=1024, output_length=1, hash_ids=[6, 9])
    ta, tb, tc = request_tokens(a), request_tokens(b), request_tokens(c)
    assert len(ta) == 1300 and len(tb) == 700
    assert ta[:700] == tb  # the partial last block is a prefix of the same id's block
    assert ta[:512] == block_tokens(5).tolist()
    ha, hb, hc = (chunk_hashes(t, 256) for t in (ta, tb, tc))
    assert ha[:2] == hb[:2]
    # Same block id 9 after a different first block: same tokens, different chained hash.
    assert tc[512:1024] == ta[512:1024] and hc[2] != ha[2]


def test_ceiling_and_lru_rules() -> None:
    # Chunk hashes named by letters; 4-token chunks.
    reqs = [
        (12, ["a", "b", "c"]),   # nothing seen
        (12, ["a", "b", "c"]),   # all 3 chunks seen, but the last token is never claimed: 2
        (9, ["a", "b"]),         # claimable (9-1)//4 = 2 chunks, both seen: 8
        (13, ["x", "b", "c"]),   # different first chunk: nothing
    ]
    assert [claimable_chunks(n, 4) for n, _ in reqs] == [2, 2, 2, 3]
    ceil = prefix_ceiling(reqs, 4)
    assert ceil.per_request == [0, 8, 8, 0]
    assert ceil.hit_tokens == 16 and ceil.input_tokens == 46
    # LRU of 3 chunks: request 4 inserts x, b, c, evicting c then a (least recently used);
    # the unbounded ceiling would still serve "a".
    lru = lru_hits([*reqs, (5, ["a"])], 4, capacity_tokens=12)
    assert lru.per_request == [0, 8, 8, 0, 0]
    assert lru.evicted_chunks == 2
    assert prefix_ceiling([*reqs, (5, ["a"])], 4).per_request[-1] == 4
    assert lru_hits(reqs, 4, capacity_tokens=10**6).per_request == ceil.per_request
    assert lru_hits(reqs, 4, capacity_tokens=0).hit_tokens == 0
