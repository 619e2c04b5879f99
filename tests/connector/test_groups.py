"""What each KV-cache group needs for a hit (``_groups``) and how a worker stripes MLA saves
over TP ranks (real ``mooncake_master``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool_connector._groups import KVGroup, hybrid_hit, kv_groups
from kvpool_connector._layout import LayerLayout, Region
from kvpool_connector._planning import TransferPlanner
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_connector.keys import chunk_hashes
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadOutcomes, LoadSpec, ReqMeta
from kvpool_connector.worker import KVPoolWorker, _ranges
from kvpool_replay import LocalMooncakeMaster

from test_worker_mooncake import (  # isort: skip
    _ALIVE, NUM_BLOCKS, TP0, Settings, block_bytes, fill_random, load_meta, make_backend,
    make_worker, save_request, tokens, uniq,
)

FULL = KVGroup(1, "full", "FullAttentionSpec", ("full",), 32)
SW64 = KVGroup(0, "sliding_window", "SlidingWindowSpec", ("sw",), 32, window=64)
SW200 = KVGroup(2, "sliding_window", "SlidingWindowSpec", ("sw2",), 32, window=200)


def test_a_sliding_window_group_needs_the_window_before_the_boundary() -> None:
    # Window 64, block 32: tokens [T - 63, T) are 2 blocks; of a 4-block chunk the last 2.
    assert SW64.window_blocks == 2 and SW64.tail_blocks(4) == 2
    assert list(SW64.needed_chunks(3, 4)) == [2]
    # A window longer than a chunk spans chunks, each stored whole.
    assert SW200.window_blocks == 7 and SW200.tail_blocks(4) == 4
    assert list(SW200.needed_chunks(3, 4)) == [1, 2]
    assert list(FULL.needed_chunks(3, 4)) == [0, 1, 2] and FULL.tail_blocks(4) == 4


def test_a_hit_is_the_longest_prefix_every_group_serves() -> None:
    t, f = True, False
    # Full attention holds chunks 0-3; the window group lost chunk 0 (not needed past it) and
    # chunk 3 (needed for a hit of 4): the hit is 3.
    assert hybrid_hit([FULL, SW64], [[t, t, t, t], [f, t, t, f]], 4) == 3
    # A full group's gap ends the hit there, whatever the window group holds.
    assert hybrid_hit([FULL, SW64], [[t, f, t, t], [t, t, t, t]], 4) == 1
    # Nothing usable: the window group lacks every chunk.
    assert hybrid_hit([FULL, SW64], [[t, t], [f, f]], 4) == 0
    assert hybrid_hit([FULL, SW200], [[t, t, t], [f, t, t]], 4) == 3
    assert hybrid_hit([FULL, SW200], [[t, t, t], [t, f, t]], 4) == 1


def test_vllm_groups_by_spec_class() -> None:
    class SlidingWindowSpec:
        block_size, sliding_window = 32, 64

    class FullAttentionSpec:
        block_size, sliding_window = 32, None

    class MambaSpec:
        block_size = 528

    cfg = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SlidingWindowSpec(), layer_names=["a"]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["b", "c"]),
        SimpleNamespace(kv_cache_spec=MambaSpec(), layer_names=["d"]),
    ])
    groups = kv_groups(cfg, 32)
    assert [(g.index, g.kind, g.window, g.layer_names) for g in groups] == [
        (0, "sliding_window", 64, ("a",)), (1, "full", 0, ("b", "c")),
        (2, "unsupported", 0, ("d",))]
    assert groups[0].describe() == "sliding_window(64):SlidingWindowSpec x1 b32"
    assert [g.kind for g in kv_groups(SimpleNamespace(), 16)] == ["full"]


@pytest.fixture(scope="module")
def backends(mooncake_master: LocalMooncakeMaster) -> Iterator[list[MooncakeBackend]]:
    """Two TP ranks' store clients (one contributes the segment); a client takes ~2 s to
    close, so the module shares them."""
    pair = [make_backend(mooncake_master), make_backend(mooncake_master, segment="0")]
    yield pair
    for b in pair:
        b.close()


def _mla_caches() -> dict[str, torch.Tensor]:
    return {f"layers.{i}": torch.zeros(NUM_BLOCKS, 16, 576, dtype=torch.float32)
            for i in range(2)}


def test_mla_saves_are_striped_over_tp_ranks_and_read_by_any_tp_size(
        backends: list[MooncakeBackend]) -> None:
    model = uniq("mla-stripe")
    src = [_mla_caches(), _mla_caches()]
    fill_random(src[0], seed=7)
    for t_src, t_dst in zip(src[0].values(), src[1].values(), strict=True):
        t_dst.copy_(t_src)  # MLA: every TP rank holds the same latent KV
    ranks = []
    for r in (0, 1):
        w = KVPoolWorker(Settings(), TP0, model, backends[r], stripe=(r, 2))  # type: ignore[arg-type]
        w.register_kv_caches(src[r])
        _ALIVE.append((src[r], w))
        ranks.append(w)
    hashes = chunk_hashes(tokens(5 * 32 + 3, seed=8), 32)
    blocks = list(range(2, 12))
    for r, w in enumerate(ranks):
        save_request(w, f"req-{r}", blocks, hashes)
    # Chunk i was written once, by rank i % 2: 3 keys and 2 keys, 5 values in the pool.
    assert [w.counters.saved_keys for w in ranks] == [3, 2]
    assert [w.counters.save_skipped_keys for w in ranks] == [0, 0]
    assert ranks[0].layout_digest == ranks[1].layout_digest

    dst = _mla_caches()
    reader = make_worker(backends[1], dst, model)  # TP=1: every chunk, one value each
    assert reader.layout_digest == ranks[0].layout_digest
    assert reader.lookup_chunks(hashes) == 5
    dst_blocks = list(range(12, 22))
    reader.start_load_kv(load_meta("req-r", dst_blocks, hashes, pool_tokens=160))
    assert reader.get_block_ids_with_load_errors() == set()
    for s, d in zip(blocks, dst_blocks, strict=True):
        assert block_bytes(src[0], s) == block_bytes(dst, d)
    for w in (*ranks, reader):
        w.shutdown()


@pytest.mark.parametrize("stripe", [(0, 1), (1, 3)])
def test_a_stripe_names_the_chunks_a_rank_saves(stripe: tuple[int, int],
                                                backends: list[MooncakeBackend]) -> None:
    backend = backends[0]
    kv = _mla_caches()
    w = KVPoolWorker(Settings(), TP0, uniq("stripe"), backend, stripe=stripe)  # type: ignore[arg-type]
    w.register_kv_caches(kv)
    _ALIVE.append((kv, w))
    hashes = chunk_hashes(tokens(7 * 32, seed=9), 32)
    save_request(w, "req", list(range(14)), hashes)
    rank, size = stripe
    assert w.counters.saved_keys == len(range(rank, 7, size))
    w.shutdown()


def _hybrid_worker(backend: MooncakeBackend, model: str, **settings: object) -> tuple[
        KVPoolWorker, dict[str, torch.Tensor]]:
    """A worker of two groups, one layer each: ``sw`` (window 32 tokens) and ``full``."""
    groups = [KVGroup(0, "sliding_window", "SlidingWindowSpec", ("sw",), 16, window=32),
              KVGroup(1, "full", "FullAttentionSpec", ("full",), 16)]
    kv = {name: torch.zeros(32, 16, 64, dtype=torch.float32) for name in ("sw", "full")}
    w = KVPoolWorker(Settings(chunk_size=64, **settings), TP0, model, backend,  # type: ignore[arg-type]
                     groups=groups)
    w.register_kv_caches(kv)
    _ALIVE.append((kv, w))
    return w, kv


def _table(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def _wait_recving(w: KVPoolWorker, timeout_s: float = 60.0) -> set[str]:
    """The async loads that ended, polled until one did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = w.get_finished(set())[1]
        if done:
            return done
        time.sleep(0.01)
    raise TimeoutError(f"no async load ended within {timeout_s} s")


def test_hybrid_worker_stores_the_window_and_a_failed_key_fails_the_whole_request(
        backends: list[MooncakeBackend]) -> None:
    model = uniq("hybrid")
    writer, src = _hybrid_worker(backends[0], model)
    fill_random(src, seed=11)
    hashes = chunk_hashes(tokens(3 * 64 + 5, seed=12), 64)
    # Window 32 tokens over 16-token blocks: a window value is a chunk's last 2 of 4 blocks.
    tables = (_table(1, 12), _table(13, 12))
    meta = KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id="w", block_ids=tables[1], chunk_hashes=hashes, save_from_chunk=0,
        save_to_chunk=3, is_last_save=True, group_block_ids=tables)])
    writer.start_load_kv(meta)
    writer.wait_for_save(meta)
    assert writer.drain_saves(10)
    block = 16 * 64 * 4
    assert writer.counters.saved_bytes == 3 * (2 + 4) * block

    # An async reader: the window group before the hit's end is 2 blocks of chunk 2; the
    # null block (0) stands where vLLM freed the window, and is never written.
    reader, dst = _hybrid_worker(backends[1], model, load_async=True)
    assert reader.lookup_chunks(hashes) == 3
    load = ReqMeta(req_id="r", block_ids=_table(1, 12), chunk_hashes=hashes,
                   load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=192, can_load=True),
                   group_block_ids=([0] * 10 + [20, 21], _table(1, 12)))
    reader.start_load_kv(KVPoolConnectorMetadata(requests=[load]))
    assert _wait_recving(reader) == {"r"}
    assert reader.take_failed_requests() == set()
    assert reader.counters.loaded_bytes == (12 + 2) * block
    for s, d in ((11, 20), (12, 21)):  # the window: blocks 10 and 11 of the writer's sw table
        assert block_bytes({"sw": src["sw"]}, s) == block_bytes({"sw": dst["sw"]}, d)
    assert all(set(b) == {0} for b in block_bytes({"sw": dst["sw"]}, 0))

    # The pool lost the window value of the last chunk: no hit reaches past chunk 2; and a
    # load already planned that meets the missing key fails its whole request (vLLM's
    # failed_recving), never single blocks (vLLM cannot map them to a group).
    backends[0].remove_by_scope(f"^kvpool@.*{hashes[2]}$", dry_run=False, force=True)
    assert reader.lookup_chunks(hashes) == 2
    again = ReqMeta(req_id="r2", block_ids=_table(1, 12), chunk_hashes=hashes,
                    load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=192, can_load=True),
                    group_block_ids=([0] * 10 + [20, 21], _table(1, 12)))
    reader.start_load_kv(KVPoolConnectorMetadata(requests=[again]))
    assert _wait_recving(reader) == {"r2"}
    assert reader.take_failed_requests() == {"r2"}
    assert reader.get_block_ids_with_load_errors() == set()
    outcomes = reader.build_connector_worker_meta()
    assert outcomes is not None and outcomes.outcomes["r2"] == (192, 0)
    writer.shutdown()
    reader.shutdown()


def _window_planner(window: int) -> TransferPlanner:
    """A planner of one sliding-window group (16-token blocks, 64-token chunks: 4 blocks)."""
    layer = LayerLayout("sw", 0, (Region(0x10000, 256, 256, 64),))
    group = KVGroup(0, "sliding_window", "SlidingWindowSpec", ("sw",), 16, window=window)
    return TransferPlanner([layer], "p", block_size=16, chunk_size=64, layerwise=False,
                           scratch=0xF000, group=group)


def _vllm_window_table(hit_tokens: int, window: int, first_id: int) -> list[int]:
    """The block table vLLM 0.32's ``SlidingWindowManager`` gives a request whose hit of
    ``hit_tokens`` is all external: null blocks for the tokens its window skips
    (``get_num_skipped_tokens``: ``hit - window + 1``), then a new block per position."""
    skipped = max(0, hit_tokens - window + 1) // 16
    return [0] * skipped + list(range(first_id, first_id + -(-hit_tokens // 16) - skipped))


def test_a_window_load_writes_every_block_vllm_allocated_or_fails() -> None:
    hashes = ["a" * 32, "b" * 32, "c" * 32]
    # A whole-chunk hit (192 tokens, window 32): vLLM allocated blocks 10 and 11, the last two
    # of chunk 2's value; both are written and nothing else.
    table = _vllm_window_table(192, 32, 50)
    req = ReqMeta("r", block_ids=[], chunk_hashes=hashes, group_block_ids=(table,),
                  load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=192, can_load=True))
    plan = _window_planner(32).load(req)
    assert plan is not None and [t.block_ids for t in plan.transfers] == [[50, 51]]
    # vLLM trimmed the hit to block 6 (mid chunk 1): its window needs blocks 4 and 5, which
    # no value holds (chunk 1's holds blocks 6 and 7). Writing nothing there would leave
    # vLLM's allocated blocks 4 and 5 unwritten yet counted as computed (and cached): the load
    # must fail instead (vLLM recomputes the request).
    table = _vllm_window_table(96, 32, 50)
    assert table == [0, 0, 0, 0, 50, 51]
    trimmed = ReqMeta("t", block_ids=[], chunk_hashes=hashes, group_block_ids=(table,),
                      load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=96,
                                    can_load=True))
    with pytest.raises(ValueError, match="WINDOW_NOT_STORED"):
        _window_planner(32).load(trimmed)
    # vLLM keeps more of the window than the pool stored (a longer retained window, e.g.
    # vLLM's ``extra_retained_tokens``): the block before the stored tail is not in the pool.
    longer = ReqMeta("l", block_ids=[], chunk_hashes=hashes,
                     group_block_ids=([0] * 9 + [50, 51, 52],),
                     load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=192,
                                   can_load=True))
    with pytest.raises(ValueError, match="WINDOW_NOT_STORED"):
        _window_planner(32).load(longer)


def test_a_window_layer_vllm_promoted_to_full_attention_is_a_full_group() -> None:
    # vLLM's hybrid allocator off (``disable_hybrid_kv_cache_manager``, or a MultiConnector
    # with a connector that is not SupportsHMA): ``unify_hybrid_kv_cache_specs`` rebuilds a
    # sliding-window layer as a FullAttentionSpec that keeps ``sliding_window`` but allocates
    # and keeps a block per position, as the pool stored every model before issue 22.
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, replace_as

    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32,
                           sliding_window=64)
    promoted = replace_as(sw, FullAttentionSpec, drop=("extra_retained_tokens",))
    cfg = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=promoted, layer_names=["a", "b"])])
    assert [(g.kind, g.window) for g in kv_groups(cfg, 16)] == [("full", 0)]


def test_a_window_save_leaves_out_chunks_vllm_freed_and_saves_the_rest() -> None:
    # A request with a local prefix hit of 2 chunks (window 32): vLLM padded the window table
    # with null blocks up to the window (blocks 0-5), so chunk 0's stored tail (blocks 2, 3)
    # is gone; chunks 1 and 2 hold theirs. The scheduler saves from chunk 0 (the pool may
    # lack what vLLM caches): chunk 0 has no window value, the others are saved.
    hashes = ["a" * 32, "b" * 32, "c" * 32]
    req = ReqMeta("r", block_ids=[], chunk_hashes=hashes, save_from_chunk=0, save_to_chunk=3,
                  group_block_ids=([0] * 6 + [56, 57, 58, 59, 60, 61],))
    rows = _window_planner(32).save(req)
    assert [[t.block_ids for t in row] for row in rows] == [[], [[56, 57]], [[60, 61]]]
    assert [t.chunk for row in rows for t in row] == [1, 2]


def test_a_block_id_outside_the_caches_fails_its_request_not_the_engine(
        backends: list[MooncakeBackend]) -> None:
    # The worker's caches have 32 blocks; a table naming block 99 (a scheduler/worker
    # mismatch) raises IndexError in the planner. It must end as that request's failure
    # (load: recomputed; save: skipped, its held blocks released), never raise in vLLM's
    # worker thread.
    w, _ = _hybrid_worker(backends[0], uniq("oob"), load_async=True)
    hashes = chunk_hashes(tokens(2 * 64 + 1, seed=21), 64)
    bad = _table(90, 8)
    save = ReqMeta(req_id="s", block_ids=bad, chunk_hashes=hashes, save_from_chunk=0,
                   save_to_chunk=2, is_last_save=True, group_block_ids=(bad, bad), save_job=7)
    w.start_load_kv(KVPoolConnectorMetadata(requests=[save]))
    w.wait_for_save(KVPoolConnectorMetadata(requests=[save]))
    outcomes = w.build_connector_worker_meta()
    assert outcomes is not None and outcomes.saves_done == {7: 1}
    assert w.counters.saved_bytes == 0
    load = ReqMeta(req_id="l", block_ids=bad, chunk_hashes=hashes,
                   load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=128, can_load=True),
                   group_block_ids=(bad, bad))
    w.start_load_kv(KVPoolConnectorMetadata(requests=[load]))
    assert _wait_recving(w) == {"l"}
    assert w.take_failed_requests() == {"l"}
    w.shutdown()


def test_engines_whose_groups_hold_other_layers_never_share(
        backends: list[MooncakeBackend]) -> None:
    # The same four layers and group kinds, counts and block sizes, but the window group holds
    # layers (a, c) on one engine and (a, b) on the other (another vLLM's grouping): the
    # ``.g0`` value of one is not the other's KV, so their layout digests differ.
    def worker(window_layers: tuple[str, str]) -> KVPoolWorker:
        full = tuple(n for n in "abcd" if n not in window_layers)
        groups = [KVGroup(0, "sliding_window", "SlidingWindowSpec", window_layers, 16, 32),
                  KVGroup(1, "full", "FullAttentionSpec", full, 16)]
        kv = {n: torch.zeros(8, 16, 64, dtype=torch.float32) for n in "abcd"}
        w = KVPoolWorker(Settings(chunk_size=64), TP0, "m", backends[0],  # type: ignore[arg-type]
                         groups=groups)
        w.register_kv_caches(kv)
        _ALIVE.append((kv, w))
        return w

    one, other, again = worker(("a", "c")), worker(("a", "b")), worker(("a", "c"))
    assert one.layout_digest != other.layout_digest
    assert one.layout_digest == again.layout_digest
    assert one.layout_facts is not None and " L0,2 " in f"{one.layout_facts.groups} "
    assert _ranges([0, 1, 2, 4, 6, 7]) == "0-2,4,6-7"
    for w in (one, other, again):
        w.shutdown()


def test_window_blocks_a_save_reads_are_held_until_every_worker_reported_it() -> None:
    # vLLM's own BlockPool and request objects; a producer scheduler of two groups (window 32,
    # 16-token blocks, 64-token chunks) over 2 workers.
    from vllm import SamplingParams
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import (
        CachedRequestData,
        KVConnectorBlockState,
        NewRequestData,
        SchedulerOutput,
    )
    from vllm.v1.request import Request

    from kvpool_connector.config import KVPoolConfig
    from kvpool_connector.scheduler import KVPoolScheduler

    cfg = KVPoolConfig.from_dicts({"chunk_size": 64}, kv_role="kv_producer", block_size=16,
                                  model=uniq("hold"))
    groups = [KVGroup(0, "sliding_window", "SlidingWindowSpec", ("sw",), 16, window=32),
              KVGroup(1, "full", "FullAttentionSpec", ("full",), 16)]
    sched = KVPoolScheduler(cfg, None, groups=groups, world_size=2)
    pool = BlockPool(64, enable_caching=True, hash_block_size=16)
    sched.bind_block_pool(pool)
    sw, full = pool.get_new_blocks(12), pool.get_new_blocks(12)
    tables = ([b.block_id for b in sw], [b.block_id for b in full])
    req = Request("r", list(range(3, 203)), SamplingParams(max_tokens=4), None)
    sched.update_state_after_alloc(req, KVCacheBlocks((sw, full)), 0)
    new = NewRequestData.from_request(req, tables)
    out = SchedulerOutput(
        scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={"r": 192}, total_num_scheduled_tokens=192,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[], kv_connector_block_state=KVConnectorBlockState(
            req_ids={"r"}, resolve_block_ids=lambda _rid: tables,
            boundary_state_offloads={}))
    (m,) = sched.build_connector_meta(out).requests
    assert (m.save_from_chunk, m.save_to_chunk, m.save_job) == (0, 3, 0)
    # Each chunk's stored tail (its last 2 window blocks) is held, nothing else.
    held = [tables[0][i] for i in (2, 3, 6, 7, 10, 11)]
    assert [pool.blocks[b].ref_cnt for b in tables[0]] == [
        2 if b in held else 1 for b in tables[0]]
    assert sched.has_held_blocks
    # vLLM frees the request's blocks (the window moved on): held ones stay out of the free
    # queue until both workers reported the job; a second report of a job changes nothing.
    pool.free_blocks(sw)
    sched.loads_outcome(LoadOutcomes({}, {0: 1}), ())
    assert sched.has_held_blocks and all(pool.blocks[b].ref_cnt == 1 for b in held)
    sched.loads_outcome(LoadOutcomes({}, {0: 1}), ())
    assert not sched.has_held_blocks and all(pool.blocks[b].ref_cnt == 0 for b in held)
    free = pool.get_num_free_blocks()
    sched.loads_outcome(LoadOutcomes({}, {0: 2}), ())
    assert pool.get_num_free_blocks() == free and all(pool.blocks[b].ref_cnt == 0 for b in held)


@pytest.mark.parametrize("window", [17, 31, 32, 33, 48, 64, 65, 100, 200])
def test_a_window_load_fills_exactly_vllms_window_for_any_window(window: int) -> None:
    # Windows shorter or longer than a chunk (64 tokens), multiples of the block (16) or
    # not: a whole-chunk hit writes exactly the blocks vLLM allocated, never the null block.
    table = _vllm_window_table(192, window, 50)
    req = ReqMeta("r", block_ids=[], chunk_hashes=["a" * 32, "b" * 32, "c" * 32],
                  group_block_ids=(table,),
                  load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=192, can_load=True))
    plan = _window_planner(window).load(req)
    assert plan is not None
    assert sorted(b for t in plan.transfers for b in t.block_ids) == [b for b in table if b]


# ---------------------------------------------------------------- Mamba (vLLM's align mode)
# vLLM 0.32 on CPU runs no Mamba model (no ``selective_scan_fwd``), so the Mamba plan is
# tested against vLLM's own objects: its KVCacheConfig and specs, its KVCacheManager (which
# builds the align-mode block tables and hands the boundary states over) and its
# SchedulerOutput / KVConnectorBlockState, with real workers over the real mooncake_master.

MAMBA = KVGroup(1, "mamba", "MambaSpec", ("mamba",), 16)
M_FULL = KVGroup(0, "full", "FullAttentionSpec", ("full",), 16)


def _mamba_config(mode: str = "align", num_blocks: int = 32) -> Any:
    """vLLM's KVCacheConfig of a full-attention group and a Mamba group (16-token blocks)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((4, 8), (2, 8)),
                      dtypes=(torch.float32, torch.float32), mamba_cache_mode=mode)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["mamba"], mamba)])


def test_only_an_align_mode_mamba_group_is_supported() -> None:
    groups = kv_groups(_mamba_config("align"), 16)
    assert [(g.kind, g.spec, g.layer_names) for g in groups] == [
        ("full", "FullAttentionSpec", ("full",)), ("mamba", "MambaSpec", ("mamba",))]
    assert groups[1].describe() == "mamba(align):MambaSpec x1 b16"
    # "all" keeps a state per block by position, "none" keeps none: no hit can resume there.
    for mode in ("all", "none"):
        assert [g.kind for g in kv_groups(_mamba_config(mode), 16)] == ["full", "unsupported"]


def test_a_mamba_group_needs_the_state_at_the_hit_end() -> None:
    # A chunk's value is the state after it: one block, the chunk's last.
    assert MAMBA.tail_blocks(2) == 1 and list(MAMBA.needed_chunks(3, 2)) == [2]
    assert list(MAMBA.needed_chunks(0, 2)) == []
    t, f = True, False
    # vLLM handed over the states after chunks 1 and 3 only: a hit ends where a state is.
    assert hybrid_hit([M_FULL, MAMBA], [[t, t, t, t], [f, t, f, t]], 2) == 4
    assert hybrid_hit([M_FULL, MAMBA], [[t, t, t, f], [f, t, f, t]], 2) == 2
    assert hybrid_hit([M_FULL, MAMBA], [[t, t], [f, f]], 2) == 0
    # A Mamba-only model: the hit is the last state the pool holds.
    assert hybrid_hit([replace(MAMBA, index=0)], [[t, f, t, f]], 2) == 3


def _mamba_worker(backend: MooncakeBackend, model: str, **settings: object) -> tuple[
        KVPoolWorker, dict[str, Any]]:
    """A worker of the two groups of ``_mamba_config``: ``full`` (one layer) and ``mamba``
    (one layer whose state is two tensors, as vLLM's conv and SSM states)."""
    groups = kv_groups(_mamba_config(), 16)
    kv: dict[str, Any] = {"full": torch.zeros(32, 16, 64, dtype=torch.float32),
                          "mamba": (torch.zeros(32, 4, 8), torch.zeros(32, 2, 8))}
    w = KVPoolWorker(Settings(chunk_size=32, **settings), TP0, model, backend,  # type: ignore[arg-type]
                     groups=groups)
    w.register_kv_caches(kv)
    _ALIVE.append((kv, w))
    return w, kv


def _step(mgr: Any, sched: Any, req: Any, tokens_now: int, new: bool) -> Any:
    """One scheduler step of vLLM's KVCacheManager (``tokens_now`` more tokens of ``req``)
    and the connector metadata ``sched`` builds from vLLM's SchedulerOutput."""
    from vllm.v1.core.sched.output import (
        CachedRequestData,
        KVConnectorBlockState,
        NewRequestData,
        SchedulerOutput,
    )

    blocks = mgr.allocate_slots(req, tokens_now)
    assert blocks is not None
    tables = mgr.get_block_ids(req.request_id)
    if new:
        sched.update_state_after_alloc(req, mgr.get_blocks(req.request_id), 0)
        news, cached = [NewRequestData.from_request(req, tables)], CachedRequestData.make_empty()
    else:
        news = []
        cached = CachedRequestData(
            req_ids=[req.request_id], resumed_req_ids=set(), new_token_ids=[[]],
            all_token_ids={}, new_block_ids=[blocks.get_block_ids()],
            num_computed_tokens=[req.num_computed_tokens], num_output_tokens=[0])
    out = SchedulerOutput(
        scheduled_new_reqs=news, scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: tokens_now}, total_num_scheduled_tokens=tokens_now,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[], kv_connector_block_state=KVConnectorBlockState(
            req_ids={req.request_id}, resolve_block_ids=mgr.get_block_ids,
            boundary_state_offloads=mgr.take_boundary_state_offloads()))
    meta = sched.build_connector_meta(out)
    req.num_computed_tokens += tokens_now
    return meta


def test_mamba_states_move_by_the_exact_block_ids_vllm_hands_over(
        backends: list[MooncakeBackend]) -> None:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvpool_connector.config import KVPoolConfig
    from kvpool_connector.scheduler import KVPoolScheduler

    init_none_hash(sha256)
    model = uniq("mamba")
    cfg = KVPoolConfig.from_dicts({"chunk_size": 32}, kv_role="kv_producer", block_size=16,
                                  model=model)
    sched = KVPoolScheduler(cfg, None, groups=kv_groups(_mamba_config(), 16), world_size=1)
    assert sched.unsupported == []
    mgr = KVCacheManager(_mamba_config(), max_model_len=512, scheduler_block_size=16,
                         hash_block_size=16, enable_caching=True)
    sched.bind_block_pool(mgr.block_pool)
    writer, src = _mamba_worker(backends[0], model)
    fill_random(src, seed=31)
    prompt = tokens(100, seed=32)
    req = Request("w", prompt, SamplingParams(max_tokens=4), None,
                  block_hasher=get_request_block_hasher(16, sha256))

    # vLLM computes the prompt in block-aligned steps of 48, 16 and 36 tokens, then decodes,
    # and keeps a state only where a step ends on a block: it offers the states at 48 (inside
    # chunk 1: no hit ends there) and 64 (after chunk 1), each by block id, never one at 32.
    metas, offered, states = [], [], []
    for n, new in ((48, True), (16, False), (36, False), (1, False)):
        if n == 1:
            req.append_output_token_ids(7)
        meta = _step(mgr, sched, req, n, new)
        metas.append(meta)
        offered.append([b for r in meta.requests for _, _, b in r.boundary_states])
        states += [s for r in meta.requests for s in r.boundary_states]
        writer.start_load_kv(meta)
        writer.wait_for_save(meta)
    (state,) = states
    assert state[:2] == (1, 1) and offered == [[], [state[2]], [], []]
    # vLLM has since nulled that position of the table and freed the block (the running
    # state moved on); the scheduler's hold alone keeps it until the save ended.
    table = mgr.get_block_ids("w")[1]
    assert table[3] == 0 and state[2] not in table
    assert mgr.block_pool.blocks[state[2]].ref_cnt == 1
    assert writer.drain_saves(10)
    sched.loads_outcome(writer.build_connector_worker_meta(), ())
    assert not sched.has_held_blocks and mgr.block_pool.blocks[state[2]].ref_cnt == 0
    state_bytes = (4 * 8 + 2 * 8) * 4
    full_block = 16 * 64 * 4
    # Three chunks of full attention (2 blocks each) and one state.
    assert writer.counters.saved_bytes == 3 * 2 * full_block + state_bytes

    # A reader: the longest hit every group serves ends at the one stored state (64 tokens,
    # not the 96 full attention holds). vLLM allocates the hit as external tokens; the state
    # goes into the block holding the hit's last token, the full-attention blocks into theirs.
    reader, dst = _mamba_worker(backends[1], model, load_async=True)
    assert reader.layout_digest == writer.layout_digest
    # The digest names the group: its kind, spec, layers, block size and state bytes.
    assert writer.layout_facts is not None
    assert f"mamba(align):MambaSpec x1 b16 {state_bytes}B/state L1" in writer.layout_facts.groups
    hashes = metas[0].requests[0].chunk_hashes
    assert reader.lookup_chunks(hashes) == 2
    rmgr = KVCacheManager(_mamba_config(), max_model_len=512, scheduler_block_size=16,
                          hash_block_size=16, enable_caching=True)
    r = Request("r", prompt, SamplingParams(max_tokens=4), None,
                block_hasher=get_request_block_hasher(16, sha256))
    assert rmgr.allocate_slots(r, 100 - 64, num_external_computed_tokens=64) is not None
    full_t, mamba_t = rmgr.get_block_ids("r")
    assert mamba_t[:3] == [0, 0, 0] and mamba_t[3] != 0
    load = ReqMeta(req_id="r", block_ids=list(full_t), chunk_hashes=hashes,
                   load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=64, can_load=True),
                   group_block_ids=(list(full_t), list(mamba_t)))
    reader.start_load_kv(KVPoolConnectorMetadata(requests=[load]))
    assert _wait_recving(reader) == {"r"}
    assert reader.take_failed_requests() == set()
    assert block_bytes({"m": src["mamba"]}, state[2]) == block_bytes({"m": dst["mamba"]},
                                                                     mamba_t[3])
    wfull = mgr.get_block_ids("w")[0]
    for s, d in zip(wfull[:4], full_t[:4], strict=True):
        assert block_bytes({"f": src["full"]}, s) == block_bytes({"f": dst["full"]}, d)
    assert reader.counters.loaded_bytes == 4 * full_block + state_bytes
    writer.shutdown()
    reader.shutdown()


def _mamba_planner() -> TransferPlanner:
    layer = LayerLayout("mamba", 0, (Region(0x10000, 192, 192, 64),))
    return TransferPlanner([layer], "p", block_size=16, chunk_size=32, layerwise=False,
                           scratch=0xF000, group=MAMBA)


def test_a_mamba_load_or_save_that_cannot_use_a_stored_state_fails() -> None:
    hashes = ["a" * 32, "b" * 32, "c" * 32]

    def load(tokens: int, table: list[int]) -> ReqMeta:
        return ReqMeta("r", block_ids=[], chunk_hashes=hashes, group_block_ids=([], table),
                       load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=tokens,
                                     can_load=True))

    plan = _mamba_planner().load(load(64, [0, 0, 0, 40]))
    assert plan is not None and [(t.chunk, t.block_ids) for t in plan.transfers] == [(1, [40])]
    # vLLM trimmed the hit inside a chunk (48 tokens): no state is stored there.
    with pytest.raises(ValueError, match="STATE_NOT_STORED"):
        _mamba_planner().load(load(48, [0, 0, 40]))
    # No block where the state goes: never write the null block.
    with pytest.raises(ValueError, match="STATE_NOT_STORED"):
        _mamba_planner().load(load(64, [0, 0, 0, 0]))
    # A save reads only the states vLLM handed over, and no chunk range.
    save = ReqMeta("s", block_ids=[], chunk_hashes=hashes, save_from_chunk=0, save_to_chunk=3,
                   group_block_ids=([], [7, 8, 9, 10, 11, 12]),
                   boundary_states=[(1, 0, 21), (0, 1, 5), (1, 2, 23)])
    rows = _mamba_planner().save(save)
    assert [[(t.chunk, t.block_ids, t.group) for t in row] for row in rows] == [
        [(0, [21], 1)], [(2, [23], 1)]]
    assert [t.chunk for row in _mamba_planner().save(save, (1, 2)) for t in row] == []
    bad = replace(save, boundary_states=[(1, 0, 0)])
    with pytest.raises(ValueError, match="block 0"):
        _mamba_planner().save(bad)
