"""Transfer planning without a pool: the keys, addresses and lengths a worker moves for whole
chunks, layer-wise chunks, partly cached and short last chunks, and multi-rank lookups.

The KV layout is written out by hand so every address is known: layer 0 is FlashAttention-like
(a K and a V region of 256-byte blocks, packed), layer 1 has 128-byte blocks 512 bytes apart
(no two blocks touch, so nothing merges).
"""

from __future__ import annotations

import pytest

from kvpool_connector._layout import LayerLayout, Region
from kvpool_connector._planning import (
    KeyTransfer,
    TransferPlanner,
    blocks_per_chunk,
    by_layer,
    leading_hits,
    load_block_ids,
    loaded_tokens,
    lookup_layouts,
)
from kvpool_connector.keys import ParallelLayout, chunk_keys, shard_prefix
from kvpool_connector.metadata import LoadSpec, ReqMeta

K, V, L1, SCRATCH = 0x10000, 0x20000, 0x30000, 0xF000
LAYERS = [
    LayerLayout("layers.0", 0, (Region(K, 256, 256, 32), Region(V, 256, 256, 32))),
    LayerLayout("layers.1", 1, (Region(L1, 512, 128, 32),)),
]
DIGEST = "0123456789ab"
PREFIX = shard_prefix("m", DIGEST, ParallelLayout())
H = ["a" * 32, "b" * 32, "c" * 32]


def planner(layerwise: bool = False, prefix: str = PREFIX) -> TransferPlanner:
    return TransferPlanner(LAYERS, prefix, block_size=16, chunk_size=32, layerwise=layerwise,
                           scratch=SCRATCH)


def fields(t: KeyTransfer) -> tuple[object, ...]:
    return t.key, t.chunk, t.layer, t.addrs, t.sizes, t.block_ids, t.nbytes


def test_whole_chunk_save_is_one_key_per_chunk_over_all_layers() -> None:
    req = ReqMeta("r", block_ids=[4, 5, 9, 10, 11], chunk_hashes=H[:2], save_from_chunk=0,
                  save_to_chunk=2)
    rows = planner().save(req)
    assert [[fields(t) for t in row] for row in rows] == [
        # Layer 0: blocks 4-5 touch, one range per region; layer 1: one range per block.
        [(PREFIX + H[0], 0, None,
          [K + 4 * 256, V + 4 * 256, L1 + 4 * 512, L1 + 5 * 512], [512, 512, 128, 128],
          [4, 5], 1280)],
        [(PREFIX + H[1], 1, None,
          [K + 9 * 256, V + 9 * 256, L1 + 9 * 512, L1 + 10 * 512], [512, 512, 128, 128],
          [9, 10], 1280)],
    ]
    assert all(t.req_id == "r" for row in rows for t in row)
    assert planner().save(ReqMeta("r", [4, 5], H[:1], save_from_chunk=1, save_to_chunk=1)) == []


def test_layerwise_save_is_one_key_per_chunk_and_layer() -> None:
    req = ReqMeta("r", block_ids=[4, 5, 9, 10], chunk_hashes=H[:2], save_from_chunk=1,
                  save_to_chunk=2)
    (row,) = planner(layerwise=True).save(req)
    assert [fields(t) for t in row] == [
        (PREFIX + H[1] + "@L0", 1, 0, [K + 9 * 256, V + 9 * 256], [512, 512], [9, 10], 1024),
        (PREFIX + H[1] + "@L1", 1, 1, [L1 + 9 * 512, L1 + 10 * 512], [128, 128], [9, 10], 256),
    ]
    grouped = by_layer(row, 2)
    assert [[t.key for t in g] for g in grouped] == [[PREFIX + H[1] + "@L0"],
                                                     [PREFIX + H[1] + "@L1"]]
    with pytest.raises(ValueError, match="whole-chunk key"):
        by_layer(planner().save(req)[0], 2)


def test_load_routes_blocks_vllm_holds_to_scratch() -> None:
    # vLLM holds the first 16 tokens (block 4); the pool holds 3 chunks.
    req = ReqMeta("r", block_ids=[4, 5, 6, 7, 8, 9, 3], chunk_hashes=H,
                  load=LoadSpec(vllm_cached_tokens=16, kvpool_cached_tokens=96))
    plan = planner().load(req)
    assert plan is not None and plan.first_chunk == 0 and plan.req is req
    first = plan.transfers[0]
    assert fields(first) == (
        PREFIX + H[0], 0, None,
        [SCRATCH, K + 5 * 256, SCRATCH, V + 5 * 256, SCRATCH, L1 + 5 * 512],
        [256, 256, 256, 256, 128, 128], [5], 1280)
    # Blocks 6-7 and 8-9 touch: one range per region in layer 0.
    assert [t.addrs[:2] for t in plan.transfers[1:]] == [[K + 6 * 256, V + 6 * 256],
                                                       [K + 8 * 256, V + 8 * 256]]
    assert [t.block_ids for t in plan.transfers] == [[5], [6, 7], [8, 9]]
    assert plan.blocks_of({1, 2}) == {6, 7, 8, 9}
    assert load_block_ids(req, 16) == {5, 6, 7, 8, 9}


def test_load_skips_chunks_vllm_holds_whole() -> None:
    req = ReqMeta("r", block_ids=[4, 5, 6, 7, 8, 9], chunk_hashes=H,
                  load=LoadSpec(vllm_cached_tokens=64, kvpool_cached_tokens=96))
    plan = planner(layerwise=True).load(req)
    assert plan is not None and plan.first_chunk == 2
    assert [(t.key, t.chunk, t.layer, t.block_ids) for t in plan.transfers] == [
        (PREFIX + H[2] + "@L0", 2, 0, [8, 9]), (PREFIX + H[2] + "@L1", 2, 1, [8, 9])]
    nothing = ReqMeta("r", [4, 5], H[:1], load=LoadSpec(32, 32))
    assert planner().load(nothing) is None
    assert planner().load(ReqMeta("r", [4, 5], H[:1])) is None


def test_short_last_chunk_or_missing_hash_is_refused() -> None:
    # Three chunks to load but block ids for two and a half.
    short = ReqMeta("r", block_ids=[1, 2, 3, 4, 5], chunk_hashes=H,
                    load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=96))
    with pytest.raises(ValueError, match=r"chunk 2 needs blocks \[4, 6\) but only 5 block ids"):
        planner().load(short)
    assert load_block_ids(short, 16) == {1, 2, 3, 4, 5}
    no_hash = ReqMeta("r", block_ids=[1, 2, 3, 4], chunk_hashes=H[:1], save_to_chunk=2)
    with pytest.raises(ValueError, match=r"chunk 1 has no hash \(1 chunk hashes"):
        planner().save(no_hash)
    assert load_block_ids(no_hash, 16) == set()


def test_loaded_tokens_stop_at_the_first_failed_chunk() -> None:
    spec = LoadSpec(vllm_cached_tokens=16, kvpool_cached_tokens=96)
    assert loaded_tokens(spec, set(), 32) == 80
    assert loaded_tokens(spec, {2}, 32) == 48
    assert loaded_tokens(spec, {2, 1}, 32) == 16
    assert loaded_tokens(spec, {0}, 32) == 0


def test_chunk_geometry_is_checked() -> None:
    assert blocks_per_chunk(16, 64) == 4
    for block, chunk in [(16, 24), (0, 16), (16, 0)]:
        with pytest.raises(ValueError, match="must be a positive multiple of block_size"):
            blocks_per_chunk(block, chunk)
    with pytest.raises(ValueError, match=r"chunk_size \(24\)"):
        TransferPlanner(LAYERS, PREFIX, block_size=16, chunk_size=24, layerwise=False)


def test_multi_rank_lookup_keys_cover_every_split_dimension() -> None:
    own = ParallelLayout(tp_rank=1, pcp_rank=0, dcp_rank=1, pp_rank=1, group=2)
    layouts = lookup_layouts(own, tp_size=2, dcp_size=2)
    # tp and dcp are split: all their ranks; pcp and pp are not: this worker's own rank.
    assert [str(lay) for lay in layouts] == [
        "tp0.pcp0.dcp0.pp1.g2", "tp0.pcp0.dcp1.pp1.g2",
        "tp1.pcp0.dcp0.pp1.g2", "tp1.pcp0.dcp1.pp1.g2",
    ]
    assert lookup_layouts(own) == [own]
    keys = chunk_keys([shard_prefix("m", DIGEST, lay) for lay in layouts], H[:2])
    assert keys[:4] == [f"kvpool@m@{DIGEST}@{lay}@{H[0]}" for lay in layouts]
    assert keys[4:] == [f"kvpool@m@{DIGEST}@{lay}@{H[1]}" for lay in layouts]
    # A planner for another rank writes that rank's keys.
    rank3 = planner(prefix=shard_prefix("m", DIGEST, layouts[3]))
    (row,) = rank3.save(ReqMeta("r", [0, 1], H[:1], save_to_chunk=1))
    assert row[0].key == keys[3]


@pytest.mark.parametrize(("results", "per_chunk", "expected"), [
    ([1, 1, 1, 1], 2, (2, None)),
    ([1, 1, 1, 0], 2, (1, None)),
    ([0, 1, 1, 1], 2, (0, None)),
    ([1, -900, 1, 1], 2, (0, -900)),      # a store error is never a miss
    ([1, 1, 0, -704], 2, (1, -704)),      # the error is in the first incomplete chunk
    ([1, 1, 0, 1, -900, 1], 2, (1, None)),  # chunks past the first miss do not matter
    ([], 1, (0, None)),
])
def test_leading_hits(results: list[int], per_chunk: int,
                      expected: tuple[int, int | None]) -> None:
    assert leading_hits(results, per_chunk) == expected
