"""Trace input and the reference figures (no pool): fast checks of the rules the replay is
measured against."""

from __future__ import annotations

import hashlib
import lzma
from pathlib import Path

import pytest

from kvpool_connector.keys import chunk_hashes
from kvpool_replay import (
    ModelShape,
    TraceError,
    TraceRequest,
    _trace,
    default_trace_path,
    load_trace,
    lru_hits,
    prefix_ceiling,
    request_tokens,
)
from kvpool_replay._reference import claimable_chunks
from kvpool_replay._tokens import block_tokens
from kvpool_replay._trace import EMBEDDED_TRACES, TRACES_DIR_ENV


def test_shared_traces_load_with_limit() -> None:
    conv = load_trace(default_trace_path("conversation_trace.jsonl"), limit=50)
    assert len(conv) == 50
    assert conv[0].input_length == 6758 and conv[0].hash_ids[:3] == [0, 1, 2]
    synth = load_trace(default_trace_path("synthetic_trace.jsonl"))
    assert len(synth) == 3993


# The originals' size and sha256 (kvcache-ai/Mooncake, FAST25-release/traces), as in
# kvpool_replay/traces/README.md.
EMBEDDED = {
    "conversation_trace.jsonl": (12_031, 3_029_533,
                                 "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"),
    "synthetic_trace.jsonl": (3_993, 1_136_313,
                              "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"),
}


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_embedded_trace_is_the_original(name: str) -> None:
    requests, size, digest = EMBEDDED[name]
    path = EMBEDDED_TRACES / f"{name}.xz"
    raw = lzma.decompress(path.read_bytes())
    assert (len(raw), hashlib.sha256(raw).hexdigest()) == (size, digest)
    assert len(load_trace(path)) == requests == raw.count(b"\n")


def test_default_trace_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    beside = tmp_path / "shared" / "traces"
    monkeypatch.setattr(_trace, "_BESIDE_REPO", beside)
    monkeypatch.delenv(TRACES_DIR_ENV, raising=False)
    # A bare clone: nothing beside the checkout, so the embedded copy.
    assert default_trace_path() == EMBEDDED_TRACES / "conversation_trace.jsonl.xz"
    assert default_trace_path("synthetic_trace.jsonl") == (
        EMBEDDED_TRACES / "synthetic_trace.jsonl.xz")
    beside.mkdir(parents=True)
    (beside / "synthetic_trace.jsonl").write_text("")
    assert default_trace_path("synthetic_trace.jsonl") == beside / "synthetic_trace.jsonl"
    assert default_trace_path() == EMBEDDED_TRACES / "conversation_trace.jsonl.xz"
    # The variable wins, even where it holds no such file (then loading says it is missing).
    mine = tmp_path / "mine"
    monkeypatch.setenv(TRACES_DIR_ENV, str(mine))
    assert default_trace_path("synthetic_trace.jsonl") == mine / "synthetic_trace.jsonl"


def test_xz_trace_reads_like_plain_and_a_cut_one_is_an_error(tmp_path: Path) -> None:
    lines = ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}\n'
             '{"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]}\n')
    plain = tmp_path / "t.jsonl"
    plain.write_text(lines)
    packed = tmp_path / "t.jsonl.xz"
    packed.write_bytes(lzma.compress(lines.encode()))
    assert load_trace(packed) == load_trace(plain)
    assert len(load_trace(plain)) == 2
    cut = tmp_path / "cut.jsonl.xz"
    cut.write_bytes(packed.read_bytes()[:-20])
    with pytest.raises(TraceError) as info:
        load_trace(cut)
    assert str(info.value).startswith(f"{cut}: not a complete xz file (")


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
