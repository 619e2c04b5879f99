"""Stored layer ranges (``_stages``): which ranges a pipeline stage holds, and values written by
the stages of one PP split read by an engine of another split (PP=2 uneven -> PP=1 and back),
bit for bit, against a real mooncake_master."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from kvpool_connector._layout_digest import ModelFacts
from kvpool_connector._stages import LayerRanges, plan_ranges
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster

from test_worker_mooncake import (  # isort: skip
    _ALIVE, NUM_BLOCKS, BLOCK, Settings, fill_random, load_meta, make_backend, save_request,
    tokens, uniq,
)

LAYERS = 6
PARTITION = (2, 4)


def test_each_stage_holds_the_ranges_between_its_boundaries() -> None:
    assert plan_ranges(range(6), 6, PARTITION) == LayerRanges(PARTITION, first=0, count=2)
    assert plan_ranges([0, 1], 6, PARTITION) == LayerRanges(PARTITION, first=0, count=1)
    stage1 = plan_ranges([2, 3, 4, 5], 6, PARTITION)
    assert stage1 == LayerRanges(PARTITION, first=1, count=1)
    assert isinstance(stage1, LayerRanges) and stage1.local_slices() == [(1, slice(0, 4))]
    # A finer partition: a PP=1 engine holds three ranges, cut where the others' stages are.
    whole = plan_ranges(range(6), 6, (2, 1, 3))
    assert isinstance(whole, LayerRanges) and whole.describe() == "2+1+3"
    assert whole.local_slices() == [(0, slice(0, 2)), (1, slice(2, 3)), (2, slice(3, 6))]
    assert list(whole.held) == [0, 1, 2] and whole.store_size == 3
    assert plan_ranges(range(6), 6, None) == ""


@pytest.mark.parametrize(("ids", "total", "partition", "groups", "uniform", "why"), [
    (range(6), 7, PARTITION, 1, True, "sums to 6 layers, the model has 7"),
    ([0, 1, 2], 6, PARTITION, 1, True, r"\[0, 3\) do not start and end on .*\[0, 2, 6\]"),
    ([3, 4, 5], 6, PARTITION, 1, True, r"\[3, 6\) do not start"),
    ([0, 2], 6, PARTITION, 1, True, "not one contiguous run"),
    ([], 6, PARTITION, 1, True, "names hold no layer index"),
    (range(6), 6, PARTITION, 2, True, "2 KV-cache groups"),
    (range(6), 6, PARTITION, 1, False, "differ in shape"),
])
def test_stages_that_do_not_fit_keep_per_stage_values_and_say_why(
        ids: list[int], total: int, partition: tuple[int, ...], groups: int, uniform: bool,
        why: str) -> None:
    got = plan_ranges(ids, total, partition, groups=groups, uniform=uniform)
    assert isinstance(got, str) and got.startswith("per-stage: ")
    assert re.search(why, got), got


def test_store_pp_layer_partition_is_a_connector_field() -> None:
    def parse(extra: dict[str, object]) -> KVPoolConfig:
        return KVPoolConfig.from_dicts(extra, kv_role="kv_both", block_size=16, model="m")

    assert parse({}).store_pp_layer_partition is None
    assert parse({"store_pp_layer_partition": [10, 22]}).store_pp_layer_partition == (10, 22)
    for bad in ([10, 0], [], "10,22"):
        with pytest.raises(ValueError,
                           match=r"^kv_connector_extra_config\.store_pp_layer_partition"):
            parse({"store_pp_layer_partition": bad})


def _cpu() -> torch.Tensor:
    """vLLM's CPU backend: (num_blocks, kv_heads, block_size, 2 * head_size)."""
    return torch.zeros(NUM_BLOCKS, 2, BLOCK, 16, dtype=torch.float32)


def _caches(layers: range) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": _cpu() for i in layers}


@pytest.fixture(scope="module")
def backends(mooncake_master: LocalMooncakeMaster) -> Iterator[list[MooncakeBackend]]:
    pair = [make_backend(mooncake_master), make_backend(mooncake_master, segment="0")]
    yield pair
    for b in pair:
        b.close()


def _stage(backend: MooncakeBackend, kv: dict[str, torch.Tensor], model: str, layers: range,
           rank: int, pp: int, partition: tuple[int, ...] | None = PARTITION,
           **settings: object) -> KVPoolWorker:
    """One pipeline stage's worker holding ``layers`` of a ``LAYERS``-layer model."""
    w = KVPoolWorker(Settings(**settings), ParallelLayout(pp_rank=rank), model,  # type: ignore[arg-type]
                     backend, pp_size=pp, pp_partition=partition, total_layers=LAYERS)
    w.register_kv_caches(kv, ModelFacts(kv_heads=2, head_size=8), layer_ids=list(layers))
    _ALIVE.append((kv, w))
    return w


def _load(w: KVPoolWorker, req: str, blocks: list[int], hashes: list[str], tokens: int) -> None:
    w.start_load_kv(load_meta(req, blocks, hashes, pool_tokens=tokens))
    for layer in w.kv.layers if w.kv else []:
        w.wait_for_layer_load(layer.name)
    assert w.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("layerwise", [False, True])
def test_stages_of_an_uneven_split_and_one_whole_engine_share_values(
        backends: list[MooncakeBackend], layerwise: bool) -> None:
    model = uniq("stages")
    full = _caches(range(LAYERS))
    fill_random(full, seed=41)  # type: ignore[arg-type]
    names = list(full)
    # PP=2 writer, uneven split 2/4 (VLLM_PP_LAYER_PARTITION=2,4): each stage its own layers.
    cuts = [range(0, 2), range(2, 6)]
    writers = []
    for rank, layers in enumerate(cuts):
        kv = {n: _cpu() for n in names[layers.start:layers.stop]}
        for n in kv:
            kv[n].copy_(full[n])
        writers.append(_stage(backends[0], kv, model, layers, rank, 2, use_layerwise=layerwise))
    hashes = chunk_hashes(tokens(3 * 32 + 7, seed=42), 32)
    blocks = list(range(2, 8))
    for r, w in enumerate(writers):
        save_request(w, f"w-{r}", blocks, hashes)
    assert [w.counters.saved_keys for w in writers] == (
        [3 * 2, 3 * 4] if layerwise else [3, 3])  # one value per chunk and range (or layer)
    # PP=1 reader: both ranges into its one cache, under the writer stages' digest.
    dst = _caches(range(LAYERS))
    reader = _stage(backends[1], dst, model, range(LAYERS), 0, 1, use_layerwise=layerwise)
    assert reader.layout_digest == writers[0].layout_digest == writers[1].layout_digest
    assert reader.layout_facts is not None and reader.layout_facts.pp_split == "2+4"
    assert reader.layout_facts.layers == LAYERS and reader.layout_facts.pp == 1
    assert reader.own_shards == ["tp0.pcp0.dcp0.pp0.g0", "tp0.pcp0.dcp0.pp1.g0"]
    assert reader.lookup_chunks(hashes) == 3
    digest = reader.layout_digest
    for h in hashes:  # two values per chunk: ranges 0 and 1, no third
        keys = [str(PoolKey(reader.model, digest, ParallelLayout(pp_rank=r), h))
                for r in range(3)]
        if layerwise:
            keys = [f"{k}@L1" for k in keys]
        assert backends[0].batch_exists(keys) == [1, 1, 0]
    dst_blocks = list(range(10, 16))
    _load(reader, "r", dst_blocks, hashes, 96)
    for n in names:
        assert torch.equal(dst[n][dst_blocks].view(torch.uint8), full[n][blocks].view(torch.uint8))
    assert not any(dst[n][[b for b in range(NUM_BLOCKS) if b not in dst_blocks]].any()
                   for n in names)
    # The reverse: the PP=1 engine's saves read by a PP=2 engine's second stage (its 4 layers).
    again = chunk_hashes(tokens(2 * 32, seed=43), 32)
    save_request(reader, "r-save", dst_blocks[:4], again)
    assert reader.counters.saved_keys == 2 * (LAYERS if layerwise else 2)
    stage1 = _caches(range(2, 6))
    late = _stage(backends[0], stage1, model, range(2, 6), 1, 2, use_layerwise=layerwise)
    assert late.lookup_chunks(again) == 2
    _load(late, "r2", [20, 21, 22, 23], again, 64)
    for n in names[2:]:
        assert torch.equal(stage1[n][[20, 21, 22, 23]].view(torch.uint8),
                           full[n][blocks[:4]].view(torch.uint8))
    # One range of a chunk in the pool is no hit: a lookup needs every range.
    half = chunk_hashes(tokens(32, seed=44), 32)
    save_request(writers[0], "w-half", blocks[:2], half)
    assert reader.lookup_chunks(half) == 0
    for w in (*writers, reader, late):
        w.shutdown()


def test_splits_off_the_boundaries_and_engines_without_a_partition_never_share(
        backends: list[MooncakeBackend]) -> None:
    model = uniq("stages-apart")
    full = _caches(range(LAYERS))
    fill_random(full, seed=51)  # type: ignore[arg-type]
    writer = _stage(backends[0], full, model, range(LAYERS), 0, 1)
    hashes = chunk_hashes(tokens(2 * 32, seed=52), 32)
    save_request(writer, "w", list(range(2, 6)), hashes)
    # A stage of a 3/3 split does not end on the partition's boundary 2: per-stage values.
    odd = _stage(backends[1], _caches(range(0, 3)), model, range(0, 3), 0, 2)
    assert odd.layout_facts is not None and odd.layout_facts.pp_split.startswith("per-stage")
    assert odd.layout_digest != writer.layout_digest and odd.lookup_chunks(hashes) == 0
    # Without store_pp_layer_partition a stage keeps today's per-stage namespace (PP size in
    # the digest): it neither reads the ranges nor is read by a PP=1 engine.
    plain = _stage(backends[1], _caches(range(0, 2)), model, range(0, 2), 0, 2, partition=None)
    assert plain.layout_facts is not None and plain.layout_facts.pp == 2
    assert plain.layout_facts.pp_split == "" and plain.lookup_chunks(hashes) == 0
    for w in (writer, odd, plain):
        w.shutdown()
