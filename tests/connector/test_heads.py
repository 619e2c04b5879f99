"""KV-head shares (``_heads``): which shares a TP rank holds, the byte ranges of a share in
vLLM's cache layouts, and values written at one TP size read at another, bit for bit."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch

from kvpool_agent.protocol import FlushArgs, Source
from kvpool_connector._heads import HeadShares, plan_shares, share_layers, share_signature
from kvpool_connector._layout import ranges_for_blocks
from kvpool_connector._layout_digest import ModelFacts, describe_layout
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes
from kvpool_connector.operations import BackendOperations
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster

from test_worker_mooncake import (  # isort: skip
    _ALIVE, BLOCK, NUM_BLOCKS, Settings, fill_random, load_meta, make_backend, save_request,
    tokens, uniq,
)

HEAD = 16  # head size (elements)


def _cpu(heads: int) -> torch.Tensor:
    """vLLM's CPU backend: (num_blocks, kv_heads, block_size, 2 * head_size)."""
    return torch.zeros(NUM_BLOCKS, heads, BLOCK, 2 * HEAD, dtype=torch.float32)


def _nhd(heads: int) -> torch.Tensor:
    """FlashAttention NHD: (2, num_blocks, block_size, kv_heads, head_size)."""
    return torch.zeros(2, NUM_BLOCKS, BLOCK, heads, HEAD, dtype=torch.bfloat16)


def _hnd(heads: int) -> torch.Tensor:
    """FlashAttention HND as vLLM allocates it: physical (2, B, H, bs, hs), logical NHD."""
    return torch.zeros(2, NUM_BLOCKS, heads, BLOCK, HEAD, dtype=torch.float16).transpose(2, 3)


CACHES: dict[str, Callable[[int], torch.Tensor]] = {"cpu": _cpu, "nhd": _nhd, "hnd": _hnd}


def _head_dim(t: torch.Tensor) -> int:
    return 1 if t.dim() == 4 else 3


@pytest.mark.parametrize("heads", [2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_holds_its_heads_shares(heads: int, tp: int) -> None:
    ranks = [plan_shares(heads, r, tp) for r in range(tp)]
    assert all(isinstance(s, HeadShares) for s in ranks)
    plans = [s for s in ranks if isinstance(s, HeadShares)]
    # One head per share, every share of the model stored, by the ranks that hold its head.
    assert {p.store_size for p in plans} == {heads}
    if tp <= heads:
        assert [list(p.shares) for p in plans] == [
            list(range(r * heads // tp, (r + 1) * heads // tp)) for r in range(tp)]
        assert {(p.replica, p.replicas) for p in plans} == {(0, 1)}
    else:  # 2 heads over 4 ranks: each head on 2 ranks, which stripe their saves
        assert [(p.first_share, p.replica, p.replicas) for p in plans] == [
            (r // (tp // heads), r % (tp // heads), tp // heads) for r in range(tp)]
    assert all(p.local_heads == max(1, heads // tp) for p in plans)
    assert {p.describe() for p in plans} == {f"{heads}x1h"}


@pytest.mark.parametrize(("heads", "tp", "store", "why"), [
    (3, 2, None, "per-rank: TP 2 does not divide the 3 KV heads"),
    (2, 3, None, "per-rank: TP 3 is no multiple of the 2 KV heads"),
    (8, 4, 2, "per-rank: a TP 4 rank holds 2 KV heads, less than a 4-head share "
              "(store_tp_size 2)"),
    (8, 1, 3, "per-rank: store_tp_size 3 does not divide the 8 KV heads"),
    (2, 4, 1, "per-rank: a TP 4 rank holds 1 KV head, less than a 2-head share "
              "(store_tp_size 1)"),
])
def test_heads_that_do_not_split_keep_per_rank_values_and_say_why(
        heads: int, tp: int, store: int | None, why: str) -> None:
    assert plan_shares(heads, 0, tp, store_tp_size=store) == why


def test_context_parallel_ranks_keep_per_rank_values() -> None:
    assert plan_shares(4, 0, 2, dcp_size=2) == (
        "per-rank: PCP 1 / DCP 2 split the tokens, not the heads")
    assert isinstance(plan_shares(4, 0, 2, pcp_size=1, dcp_size=1), HeadShares)


def test_a_coarser_store_tp_size_gives_fewer_larger_shares() -> None:
    plans = [plan_shares(8, r, 2, store_tp_size=4) for r in range(2)]
    assert [(p.first_share, p.local_shares, p.share_heads) for p in plans
            if isinstance(p, HeadShares)] == [(0, 2, 2), (2, 2, 2)]


def test_store_tp_size_is_a_connector_field() -> None:
    def parse(extra: dict[str, object]) -> KVPoolConfig:
        return KVPoolConfig.from_dicts(extra, kv_role="kv_both", block_size=16, model="m")

    assert parse({}).store_tp_size is None and parse({"store_tp_size": 4}).store_tp_size == 4
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.store_tp_size"):
        parse({"store_tp_size": 0})


def _split(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """What each of ``tp`` ranks holds of ``full``: its heads, in the same physical layout."""
    dim, heads = _head_dim(full), full.shape[_head_dim(full)]
    n = heads // tp
    out = []
    for r in range(tp):
        like = CACHES[_kind(full)](n)
        like.copy_(full.narrow(dim, r * n, n))
        out.append(like)
    return out


def _kind(t: torch.Tensor) -> str:
    if t.dim() == 4:
        return "cpu"
    return "hnd" if t.stride(2) == HEAD else "nhd"


def _copy_out(t: torch.Tensor, shares: HeadShares, blocks: list[int]) -> dict[int, bytes]:
    """Each share's value of ``blocks``, as a save reads it (``ranges_for_blocks``)."""
    out = {}
    for s in shares.shares:
        addrs, sizes = ranges_for_blocks(share_layers({"l": t}, NUM_BLOCKS, shares, s), blocks)
        out[s] = b"".join(ctypes.string_at(a, n) for a, n in zip(addrs, sizes, strict=True))
    return out


def _copy_in(t: torch.Tensor, shares: HeadShares, blocks: list[int],
             values: dict[int, bytes]) -> None:
    for s in shares.shares:
        addrs, sizes = ranges_for_blocks(share_layers({"l": t}, NUM_BLOCKS, shares, s), blocks)
        assert sum(sizes) == len(values[s])
        off = 0
        for a, n in zip(addrs, sizes, strict=True):
            ctypes.memmove(a, values[s][off:off + n], n)
            off += n


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("heads", [2, 4, 8])
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1)])
def test_values_written_at_one_tp_size_fill_another_bit_for_bit(
        kind: str, heads: int, writer_tp: int, reader_tp: int) -> None:
    if max(writer_tp, reader_tp) > heads:
        writer_tp, reader_tp = min(writer_tp, heads), min(reader_tp, heads)
    full = CACHES[kind](heads)
    fill_random({"l": full}, seed=heads * 10 + writer_tp)
    src_blocks, dst_blocks = [3, 4, 9], [10, 11, 2]
    store: dict[int, bytes] = {}
    for r, t in enumerate(_split(full, writer_tp)):
        plan = plan_shares(heads, r, writer_tp)
        assert isinstance(plan, HeadShares)
        store |= _copy_out(t, plan, src_blocks)
    assert sorted(store) == list(range(heads))  # one value per head share
    readers = [CACHES[kind](heads // reader_tp) for _ in range(reader_tp)]
    for r, t in enumerate(readers):
        plan = plan_shares(heads, r, reader_tp)
        assert isinstance(plan, HeadShares)
        _copy_in(t, plan, dst_blocks, store)
    dim = _head_dim(full)
    block_dim = 0 if full.dim() == 4 else 1
    got = torch.cat(readers, dim=dim)
    want = full.index_select(block_dim, torch.tensor(src_blocks))
    assert torch.equal(got.index_select(block_dim, torch.tensor(dst_blocks)).view(torch.uint8),
                       want.view(torch.uint8))
    # Blocks the load did not name stay untouched.
    others = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
    assert not got.index_select(block_dim, torch.tensor(others)).view(torch.uint8).any()


@pytest.mark.parametrize("kind", list(CACHES))
def test_a_share_is_described_alike_at_every_tp_size_and_other_layouts_differ(kind: str) -> None:
    def sig(heads: int, tp: int, make: Callable[[int], torch.Tensor] = CACHES[kind]) -> str:
        plan = plan_shares(heads, 0, tp)
        assert isinstance(plan, HeadShares)
        return share_signature(make(heads // tp), NUM_BLOCKS, plan)

    assert len({sig(4, 1), sig(4, 2), sig(4, 4)}) == 1
    assert sig(4, 1) != sig(2, 1, lambda h: CACHES[kind](h).to(torch.int8))  # other dtype
    assert len({sig(4, 4, m) for m in CACHES.values()}) == 3  # one head: still three orders
    assert share_signature(_cpu(2), NUM_BLOCKS, HeadShares(4, 1, 0, 2, 2)) == (
        "float32(B,1,16,32)/(*,512,32,1)")


def _digest(caches: dict[str, torch.Tensor], plan: HeadShares | str, block: int = BLOCK,
            kv_heads: int = 0) -> tuple[str, dict[str, str | int]]:
    facts = describe_layout(
        caches, NUM_BLOCKS, model="m", facts=ModelFacts(kv_heads=kv_heads, head_size=HEAD),
        block_size=block, chunk_size=2 * block, tp_size=2,
        shares=plan if isinstance(plan, HeadShares) else None,
        kv_share=plan if isinstance(plan, str) else "")
    return facts.digest, facts.as_dict()


def test_the_digest_names_the_stored_share_not_the_tp_size() -> None:
    one, two = plan_shares(2, 0, 1), plan_shares(2, 1, 2)
    assert isinstance(one, HeadShares) and isinstance(two, HeadShares)
    d1, f1 = _digest({"a": _cpu(2)}, one, kv_heads=2)
    d2, _ = _digest({"a": _cpu(1)}, two, kv_heads=1)
    assert d1 == d2
    assert (f1["tp"], f1["kv_heads"], f1["kv_share"]) == (1, 2, "2x1h")
    assert f1["cache"] == "1x float32(B,1,16,32)/(*,512,32,1)"
    # Other bytes per share: other digests.
    assert _digest({"a": _cpu(2).half()}, one, kv_heads=2)[0] != d1
    assert _digest({"a": _cpu(2)}, one, block=2 * BLOCK, kv_heads=2)[0] != d1
    coarse = plan_shares(2, 0, 1, store_tp_size=1)
    assert isinstance(coarse, HeadShares)
    assert _digest({"a": _cpu(2)}, coarse, kv_heads=2)[0] != d1
    # Per-rank values say why in the facts the console compares.
    why = plan_shares(3, 0, 2)
    assert isinstance(why, str)
    _, fallback = _digest({"a": _cpu(3)}, why)
    assert fallback["kv_share"] == why and fallback["tp"] == 2


def test_a_cache_whose_head_dimension_is_ambiguous_is_stored_per_rank(
        backends: list[MooncakeBackend]) -> None:
    plan = plan_shares(16, 1, 2)
    assert isinstance(plan, HeadShares)
    same = {"a": torch.zeros(NUM_BLOCKS, 8, BLOCK // 2, 8)}  # 8 heads, block size 8
    with pytest.raises(ValueError, match="per-rank: cannot tell the KV-head dimension"):
        share_layers(same, NUM_BLOCKS, plan, plan.first_share)
    w = KVPoolWorker(Settings(block_size=8, chunk_size=16), ParallelLayout(tp_rank=1),  # type: ignore[arg-type]
                     "m", backends[0], tp_size=2, shares=plan)
    w.register_kv_caches(same, ModelFacts(kv_heads=8, head_size=8))
    _ALIVE.append((same, w))
    assert w.shares is None and w.layout == ParallelLayout(tp_rank=1) and w.lookup_shards == 2
    assert w.layout_facts is not None and w.layout_facts.tp == 2
    assert w.layout_facts.kv_share.startswith("per-rank: cannot tell the KV-head dimension")
    w.shutdown()


@pytest.fixture(scope="module")
def backends(mooncake_master: LocalMooncakeMaster) -> Iterator[list[MooncakeBackend]]:
    pair = [make_backend(mooncake_master), make_backend(mooncake_master, segment="0")]
    yield pair
    for b in pair:
        b.close()


def _worker(backend: MooncakeBackend, kv: dict[str, torch.Tensor], model: str, heads: int,
            rank: int, tp: int, **settings: object) -> KVPoolWorker:
    plan = plan_shares(heads, rank, tp)
    assert isinstance(plan, HeadShares)
    w = KVPoolWorker(Settings(**settings), ParallelLayout(tp_rank=rank), model,  # type: ignore[arg-type]
                     backend, tp_size=tp, shares=plan)
    w.register_kv_caches(kv, ModelFacts(kv_heads=heads // tp, head_size=HEAD))
    _ALIVE.append((kv, w))
    return w


def _blocks(t: torch.Tensor, blocks: list[int], heads: slice = slice(None)) -> torch.Tensor:
    """Bytes of ``blocks`` (and ``heads``) of a cache, comparable across layouts."""
    if t.dim() == 4:
        return t[blocks][:, heads].contiguous().view(torch.uint8)
    return t[:, blocks][..., heads, :].contiguous().view(torch.uint8)


@pytest.mark.parametrize(("kind", "layerwise", "checksum"), [
    ("cpu", False, False), ("cpu", True, False), ("nhd", False, False), ("cpu", False, True)])
def test_workers_of_two_tp_sizes_share_values_through_the_pool(
        backends: list[MooncakeBackend], kind: str, layerwise: bool, checksum: bool) -> None:
    model, heads, make = uniq("heads"), 2, CACHES[kind]
    full = {f"layers.{i}": make(heads) for i in range(2)}
    fill_random(full, seed=31)  # type: ignore[arg-type]
    ranks = [{n: _split(t, 2)[r] for n, t in full.items()} for r in range(2)]
    writers = [_worker(backends[r], ranks[r], model, heads, r, 2, use_layerwise=layerwise,
                     checksum=checksum)
               for r in range(2)]
    hashes = chunk_hashes(tokens(3 * 32 + 5, seed=32), 32)
    blocks = list(range(2, 8))
    for r, w in enumerate(writers):
        save_request(w, f"w-{r}", blocks, hashes)
    per_chunk = 2 if layerwise else 1  # keys of one chunk and share
    assert [w.counters.saved_keys for w in writers] == [3 * per_chunk] * 2
    dst_kv = {n: make(heads) for n in full}
    reader = _worker(backends[1], dst_kv, model, heads, 0, 1, use_layerwise=layerwise,
                     checksum=checksum)
    assert reader.layout_digest == writers[0].layout_digest == writers[1].layout_digest
    assert reader.lookup_shards == 2 and reader.own_shards == [
        "tp0.pcp0.dcp0.pp0.g0", "tp1.pcp0.dcp0.pp0.g0"]
    assert reader.lookup_chunks(hashes) == 3
    # One value per chunk and head share; no third share.
    digest = reader.layout_digest
    for h in hashes:
        keys = [str(PoolKey(reader.model, digest, ParallelLayout(tp_rank=s), h))
                for s in range(3)]
        if layerwise:
            keys = [f"{k}@L1" for k in keys]
        assert backends[0].batch_exists(keys) == [1, 1, 0]
    dst = list(range(10, 16))
    reader.start_load_kv(load_meta("r", dst, hashes, pool_tokens=96))
    for i in range(2):
        reader.wait_for_layer_load(f"layers.{i}")
    assert reader.get_block_ids_with_load_errors() == set()
    for n, t in full.items():
        assert torch.equal(_blocks(dst_kv[n], dst), _blocks(t, blocks))
    # TP=1 -> TP=2: the reader's values back into a TP=2 rank (its one head only).
    again = chunk_hashes(tokens(2 * 32, seed=33), 32)
    save_request(reader, "r-save", dst[:4], again)
    assert reader.counters.saved_keys == 2 * 2 * per_chunk  # 2 chunks x 2 shares
    rank1 = {n: make(1) for n in full}
    tp2 = _worker(backends[0], rank1, model, heads, 1, 2, use_layerwise=layerwise,
                     checksum=checksum)
    assert tp2.lookup_chunks(again) == 2
    tp2.start_load_kv(load_meta("r2", [20, 21, 22, 23], again, pool_tokens=64))
    for i in range(2):
        tp2.wait_for_layer_load(f"layers.{i}")
    assert tp2.get_block_ids_with_load_errors() == set()
    for n, t in full.items():
        assert torch.equal(_blocks(rank1[n], [20, 21, 22, 23]),
                           _blocks(t, blocks[:4], slice(1, 2)))
    # Only one share of a chunk in the pool: no hit (a lookup needs every share).
    half = chunk_hashes(tokens(32, seed=34), 32)
    save_request(writers[0], "w-half", blocks[:2], half)
    assert reader.lookup_chunks(half) == 0
    for w in (*writers, reader, tp2):
        w.shutdown()


def test_engine_flush_removes_every_share_the_worker_holds(
        backends: list[MooncakeBackend]) -> None:
    """``flush --scope engine`` on a TP=1 worker of a 4-head model with ``store_tp_size`` 2
    (two 2-head shares per chunk): the key scope the connector gives the agent
    (``KVPoolWorker.shard_layouts``) covers both shares, so the flush removes every value
    the worker wrote, not only its first share's; a value of a share it does not hold stays."""
    model, heads = uniq("flush-shares"), 4
    plan = plan_shares(heads, 0, 1, store_tp_size=2)
    assert isinstance(plan, HeadShares) and list(plan.shares) == [0, 1]
    kv = {f"layers.{i}": _cpu(heads) for i in range(2)}
    fill_random(kv, seed=41)  # type: ignore[arg-type]
    w = KVPoolWorker(Settings(), ParallelLayout(), model, backends[0],  # type: ignore[arg-type]
                     tp_size=1, shares=plan)
    w.register_kv_caches(kv, ModelFacts(kv_heads=heads, head_size=HEAD))
    _ALIVE.append((kv, w))
    hashes = chunk_hashes(tokens(3 * 32, seed=42), 32)
    save_request(w, "flush", list(range(2, 8)), hashes)
    digest = w.layout_digest
    written = [str(PoolKey(w.model, digest, ParallelLayout(tp_rank=s), h))
               for s in (0, 1) for h in hashes]
    foreign = str(PoolKey(w.model, digest, ParallelLayout(tp_rank=2), hashes[0]))
    assert backends[0].store.put(foreign, b"\x05" * 4096) == 0
    assert backends[0].batch_exists([*written, foreign]) == [1] * 7

    src = Source(agent_id="flush-e/dp0.tp0.pp0", engine_id="flush-e", instance_role="mixed",
                 kv_role="kv_both", process_role="worker", tp_rank=0, pid=1, host="localhost",
                 backend="mooncake", model=model)
    ops = BackendOperations(backends[0], src,
                            key_scope=(model, digest, tuple(w.shard_layouts)))
    args = FlushArgs(scope="engine", engine_id="flush-e", dry_run=True)
    assert ops.flush(args).keys == 6
    res = ops.flush(msgspec.structs.replace(args, dry_run=False, force=True))
    assert (res.keys, res.removed_keys, res.skipped_leased) == (6, 6, 0)
    assert backends[0].batch_exists([*written, foreign]) == [0] * 6 + [1]
    assert ops.take_flushes() == ["engine"]
    w.shutdown()
