"""KVPoolWorker against a real mooncake_master: paged KV blocks round-trip bit-exactly, keys of
different layouts/models never collide, a full pool and a dead master are handled."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from kvpool_agent.reporter import Loaded, Reporter, SaveSkipped, TransferFinished
from kvpool_connector.backends.base import BackendError
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, normalize_model_name
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadSpec, ReqMeta
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster

BLOCK = 16
NUM_BLOCKS = 24
TP0 = ParallelLayout()


@dataclass(frozen=True)
class Settings:
    block_size: int = BLOCK
    chunk_size: int = 2 * BLOCK
    use_layerwise: bool = False
    load_async: bool = False
    layerwise_timeout_ms: int = 2_000
    save_budget_bytes: int = 64 << 20
    hash_algo: str = "sha256"
    checksum: bool = False


KVCaches = dict[str, torch.Tensor | tuple[torch.Tensor, ...]]


def flash_attn(layers: int = 3) -> KVCaches:
    """CUDA FlashAttention layout: (2, num_blocks, block_size, kv_heads, head_size)."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 8,
                                                            dtype=torch.bfloat16)
            for i in range(layers)}


def separate_kv(layers: int = 2) -> KVCaches:
    """vLLM Ascend: a (K, V) tuple per layer, each (num_blocks, block_size, heads, head)."""
    return {f"layers.{i}": (torch.zeros(NUM_BLOCKS, BLOCK, 2, 8, dtype=torch.float16),
                            torch.zeros(NUM_BLOCKS, BLOCK, 2, 8, dtype=torch.float16))
            for i in range(layers)}


def mla(layers: int = 2) -> KVCaches:
    """MLA tuple of different widths: (k_nope (nb, bs, 1, 32), k_pe (nb, bs, 1, 8))."""
    return {f"layers.{i}": (torch.zeros(NUM_BLOCKS, BLOCK, 1, 32, dtype=torch.bfloat16),
                            torch.zeros(NUM_BLOCKS, BLOCK, 1, 8, dtype=torch.bfloat16))
            for i in range(layers)}


def cpu_layout(layers: int = 2) -> KVCaches:
    """vLLM's CPU backend: (num_blocks, kv_heads, block_size, 2 * head_size)."""
    return {f"layers.{i}": torch.zeros(NUM_BLOCKS, 2, BLOCK, 16, dtype=torch.float32)
            for i in range(layers)}


LAYOUTS: dict[str, Callable[[], KVCaches]] = {
    "flash_attn": flash_attn, "separate_kv": separate_kv, "mla": mla, "cpu": cpu_layout,
}


def tensors(kv: KVCaches) -> list[torch.Tensor]:
    return [t for v in kv.values() for t in ((v,) if isinstance(v, torch.Tensor) else v)]


def fill_random(kv: KVCaches, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in tensors(kv):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                generator=g, dtype=torch.uint8))


def block_bytes(kv: KVCaches, block: int) -> list[bytes]:
    """Every layer's bytes of one block (the FlashAttention K/V axis included)."""
    out = []
    for t in tensors(kv):
        sel = t[:, block] if t.dim() == 5 and t.shape[0] == 2 else t[block]
        out.append(sel.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def make_backend(master: LocalMooncakeMaster, segment: str = "32MB") -> MooncakeBackend:
    return MooncakeBackend(MooncakeConfig.load({"mooncake": {
        "master_server_address": master.address, "global_segment_size": segment,
        "local_buffer_size": "4MB", "master_admin_url": master.admin_url}}))


_ALIVE: list[object] = []
"""Caches and workers stay allocated for the whole module: a Mooncake client refuses to
register memory overlapping a range it registered before, and freed tensors get reused."""


@pytest.fixture(scope="module")
def engines(mooncake_master: LocalMooncakeMaster) -> Iterator[tuple[MooncakeBackend, ...]]:
    """Two store clients, like two engines: the first contributes a segment, the second none.
    Shared by the module because a client takes ~2 s to close."""
    pair = (make_backend(mooncake_master), make_backend(mooncake_master, segment="0"))
    yield pair
    for b in pair:
        b.close()


def make_worker(backend: MooncakeBackend, kv: KVCaches, model: str,
                layout: ParallelLayout = TP0, reporter: Reporter | None = None,
                **settings: object) -> KVPoolWorker:
    w = KVPoolWorker(Settings(**settings), layout, model, backend, reporter)  # type: ignore[arg-type]
    w.register_kv_caches(kv)
    _ALIVE.append((kv, w))
    return w




def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def save_request(w: KVPoolWorker, req_id: str, blocks: list[int], hashes: list[str]) -> None:
    meta = KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id=req_id, block_ids=blocks, chunk_hashes=hashes, save_from_chunk=0,
        save_to_chunk=len(hashes), is_last_save=True)])
    w.start_load_kv(meta)
    for name in w.kv.layers if w.kv else []:
        w.save_kv_layer(name.name, None)
    w.wait_for_save(meta)
    assert w.drain_saves(10)


def load_meta(req_id: str, blocks: list[int], hashes: list[str], pool_tokens: int,
              local_tokens: int = 0) -> KVPoolConnectorMetadata:
    return KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id=req_id, block_ids=blocks, chunk_hashes=hashes,
        load=LoadSpec(vllm_cached_tokens=local_tokens, kvpool_cached_tokens=pool_tokens,
                      can_load=True))])


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("layerwise", [False, True])
def test_round_trip_bit_exact(kind: str, layerwise: bool,
                              engines: tuple[MooncakeBackend, ...]) -> None:
    model = uniq(f"rt-{kind}")
    src, dst = LAYOUTS[kind](), LAYOUTS[kind]()
    fill_random(src, seed=1)
    rep_a, rep_b = Reporter(), Reporter()
    a = make_worker(engines[0], src, model, reporter=rep_a, use_layerwise=layerwise)
    b = make_worker(engines[1], dst, model, reporter=rep_b, use_layerwise=layerwise)
    hashes = chunk_hashes(tokens(3 * 32 + 5, seed=2), 32)
    src_blocks = [3, 4, 10, 11, 12, 13]  # chunk 0: contiguous run, chunks 1-2: another
    save_request(a, "req-a", src_blocks, hashes)
    assert a.counters.saved_keys == 3 * (len(src) if layerwise else 1)
    assert a.get_finished({"req-a"}) == ({"req-a"}, None)

    assert b.lookup_chunks(hashes) == 3
    dst_blocks = [20, 1, 7, 8, 9, 0]
    meta = load_meta("req-b", dst_blocks, hashes, pool_tokens=96)
    b.start_load_kv(meta)
    for layer in b.kv.layers if b.kv else []:
        b.wait_for_layer_load(layer.name)
    assert b.get_block_ids_with_load_errors() == set()
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)
    untouched = block_bytes(dst, 2)
    assert all(set(x) == {0} for x in untouched)
    events = rep_b.drain()
    # The worker does not count hit tokens (the scheduler does, once): it hands the outcome on.
    assert not [e for e in events if isinstance(e, Loaded)]
    outcomes = b.build_connector_worker_meta()
    assert outcomes is not None and outcomes.outcomes == {"req-b": (96, 96)}
    assert b.build_connector_worker_meta() is None
    fin = [e for e in events if isinstance(e, TransferFinished)]
    assert fin and fin[-1].ok is True and fin[-1].nbytes == 6 * b.kv.block_bytes  # type: ignore[union-attr]
    a.shutdown()
    b.shutdown()


def test_partially_cached_chunk_keeps_local_blocks(
        engines: tuple[MooncakeBackend, ...]) -> None:
    """vLLM already holds the first block of chunk 0: that block is not overwritten."""
    model = uniq("partial")
    src, dst = cpu_layout(), cpu_layout()
    fill_random(src, 3)
    a = make_worker(engines[0], src, model)
    b = make_worker(engines[1], dst, model)
    hashes = chunk_hashes(tokens(64, 4), 32)
    save_request(a, "a", [0, 1, 2, 3], hashes)
    marker = torch.full_like(dst["layers.0"][5], 7.0)
    dst["layers.0"][5].copy_(marker)
    b.start_load_kv(load_meta("b", [5, 6, 7, 8], hashes, pool_tokens=64, local_tokens=16))
    assert b.get_block_ids_with_load_errors() == set()
    assert torch.equal(dst["layers.0"][5], marker)
    for s, d in zip([1, 2, 3], [6, 7, 8], strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)


def test_layouts_and_models_never_collide(engines: tuple[MooncakeBackend, ...]) -> None:
    model = uniq("collide")
    kv = cpu_layout()
    fill_random(kv, 5)
    hashes = chunk_hashes(tokens(64, 6), 32)
    writer = make_worker(engines[0], kv, model, ParallelLayout(tp_rank=0))
    save_request(writer, "w", [0, 1, 2, 3], hashes)
    reader_backend = engines[1]
    assert make_worker(reader_backend, cpu_layout(), model).lookup_chunks(hashes) == 2
    others = [ParallelLayout(tp_rank=1), ParallelLayout(pcp_rank=1), ParallelLayout(dcp_rank=1),
              ParallelLayout(pp_rank=1), ParallelLayout(group=1)]
    alive = []  # registered memory must stay allocated while the client knows it
    for lay in others:
        dst = cpu_layout()
        r = make_worker(reader_backend, dst, model, lay)
        alive.append((dst, r))
        assert r.lookup_chunks(hashes) == 0, lay
        r.start_load_kv(load_meta("r", [4, 5, 6, 7], hashes, pool_tokens=64))
        assert r.get_block_ids_with_load_errors() == {4, 5, 6, 7}, lay
        assert all(set(x) == {0} for b in (4, 5, 6, 7) for x in block_bytes(dst, b))
    assert make_worker(reader_backend, cpu_layout(), model + "-other").lookup_chunks(hashes) == 0
    # Same model written with a trailing slash: identical keys.
    assert make_worker(reader_backend, cpu_layout(), model + "/").lookup_chunks(hashes) == 2
    # A TP=2 reader needs both ranks' shards: rank 1 is missing.
    tp2 = KVPoolWorker(Settings(), ParallelLayout(), model, reader_backend,
                       tp_size=2)
    tp2_kv = cpu_layout()
    tp2.register_kv_caches(tp2_kv)
    _ALIVE.append((tp2_kv, tp2))
    assert tp2.lookup_chunks(hashes) == 0
    # Layer-wise keys are a different namespace from whole-chunk keys.
    lw = make_worker(reader_backend, cpu_layout(), model, use_layerwise=True)
    assert lw.lookup_chunks(hashes) == 0


def test_another_value_layout_never_reads_the_values(
        engines: tuple[MooncakeBackend, ...]) -> None:
    """Same model and the same bytes per chunk, but another dtype or block size: the reader's
    keys carry another layout digest, so it finds and loads nothing; the same layout on another
    client reads everything."""
    model = uniq("value-layout")
    hashes = chunk_hashes(tokens(64, 31), 32)

    def cpu(dtype: torch.dtype, block: int = BLOCK) -> KVCaches:
        return {f"layers.{i}": torch.zeros(NUM_BLOCKS, 2, block, 16, dtype=dtype)
                for i in range(2)}

    src = cpu(torch.bfloat16)
    fill_random(src, 32)
    writer = make_worker(engines[0], src, model)
    save_request(writer, "w", [0, 1, 2, 3], hashes)
    fp16, wide = cpu(torch.float16), cpu(torch.bfloat16, 2 * BLOCK)
    readers = [make_worker(engines[1], fp16, model),
               make_worker(engines[1], wide, model, block_size=2 * BLOCK)]
    for r, dst, blocks in ((readers[0], fp16, [4, 5, 6, 7]), (readers[1], wide, [4, 5])):
        assert r.kv is not None and writer.kv is not None
        assert r.kv.block_bytes * len(blocks) == writer.kv.block_bytes * 4  # same value size
        assert r.layout_digest != writer.layout_digest
        assert r.lookup_chunks(hashes) == 0
        r.start_load_kv(load_meta("r", blocks, hashes, pool_tokens=64))
        assert r.get_block_ids_with_load_errors() == set(blocks)
        assert all(set(x) == {0} for b in blocks for x in block_bytes(dst, b))
    same = cpu(torch.bfloat16)
    reader = make_worker(engines[1], same, model)
    assert reader.layout_digest == writer.layout_digest
    assert reader.lookup_chunks(hashes) == 2
    reader.start_load_kv(load_meta("s", [4, 5, 6, 7], hashes, pool_tokens=64))
    assert reader.get_block_ids_with_load_errors() == set()
    assert [block_bytes(same, b) for b in (4, 5, 6, 7)] == [block_bytes(src, b) for b in range(4)]


def _step(w: KVPoolWorker, meta: KVPoolConnectorMetadata) -> None:
    """One engine step as vLLM drives it: loads, per-layer hooks, end-of-forward save."""
    w.start_load_kv(meta)
    for layer in w.kv.layers if w.kv else []:
        w.save_kv_layer(layer.name, None)
    w.wait_for_save(meta)


@pytest.mark.parametrize("layerwise", [False, True])
def test_pool_full_skips_request_without_raising(
        layerwise: bool, fresh_mooncake_master: LocalMooncakeMaster) -> None:
    backend = make_backend(fresh_mooncake_master, segment="16MB")  # Mooncake's minimum
    try:
        kv: KVCaches = {f"layers.{i}": torch.zeros(48, 2, BLOCK, 1024, dtype=torch.float32)
                        for i in range(8)}  # 128 KiB per layer-block, 1 MiB per block
        fill_random(kv, 7)
        rep = Reporter()
        w = make_worker(backend, kv, uniq("full"), reporter=rep, chunk_size=BLOCK,
                        use_layerwise=layerwise)
        per_chunk = 8 if layerwise else 1  # keys per chunk
        hashes = chunk_hashes(tokens(40 * BLOCK, 8), BLOCK)
        _step(w, KVPoolConnectorMetadata(requests=[ReqMeta(
            req_id="big", block_ids=list(range(40)), chunk_hashes=hashes,
            save_from_chunk=0, save_to_chunk=20)]))
        # The same request's next chunks are skipped without a put.
        _step(w, KVPoolConnectorMetadata(requests=[ReqMeta(
            req_id="big", block_ids=list(range(40)), chunk_hashes=hashes,
            save_from_chunk=20, save_to_chunk=40, is_last_save=True)]))
        assert w.drain_saves(20)
        c = w.counters
        assert 0 < c.saved_keys < 20 * per_chunk
        assert c.save_skipped_keys == 40 * per_chunk - c.saved_keys
        assert c.save_failed_keys == 0
        events = rep.drain()
        skipped = [e for e in events if isinstance(e, SaveSkipped)]
        assert skipped and all(e.reason == "NO_AVAILABLE_HANDLE" for e in skipped)
        if not layerwise:
            assert sum(e.blocks for e in skipped) == 40 - c.saved_keys
        # One finished event for the step that hit the full pool, naming the error.
        (fin,) = [e for e in events if isinstance(e, TransferFinished)]
        assert fin.ok is False and fin.error_name == "NO_AVAILABLE_HANDLE" and fin.failed_blocks > 0
        assert w.get_finished({"big"}) == ({"big"}, None)
        # A later request tries again (and gets the same answer from a still-full pool).
        _step(w, KVPoolConnectorMetadata(requests=[ReqMeta(
            req_id="next", block_ids=[0], chunk_hashes=chunk_hashes(tokens(BLOCK, 9), BLOCK),
            save_from_chunk=0, save_to_chunk=1)]))
        assert w.drain_saves(10)
        assert w.counters.save_skipped_keys + w.counters.saved_keys == 41 * per_chunk
        w.shutdown()
    finally:
        backend.close()


def test_master_killed_turns_loads_into_load_errors(
        fresh_mooncake_master: LocalMooncakeMaster) -> None:
    model = uniq("kill")
    # One client for writer and reader: closing a client of a dead master takes ~6 s of
    # reconnect attempts (and holds the GIL), so the test pays that once.
    backend = make_backend(fresh_mooncake_master)
    try:
        src, dst = cpu_layout(), cpu_layout()
        fill_random(src, 11)
        a = make_worker(backend, src, model)
        hashes = chunk_hashes(tokens(64, 12), 32)
        save_request(a, "a", [0, 1, 2, 3], hashes)
        rep = Reporter()
        b = make_worker(backend, dst, model, reporter=rep)
        assert b.lookup_chunks(hashes) == 2
        fresh_mooncake_master.kill()
        b.start_load_kv(load_meta("b", [8, 9, 10, 11], hashes, pool_tokens=64))
        failed = b.get_block_ids_with_load_errors()
        loaded_ok = [blk for s, blk in zip([0, 1, 2, 3], [8, 9, 10, 11], strict=True)
                     if block_bytes(src, s) == block_bytes(dst, blk)]
        # Every block is either reported failed or holds exactly the saved bytes.
        for blk in (8, 9, 10, 11):
            assert blk in failed or blk in loaded_ok
        assert failed, "a dead master must surface as load errors"
        fin = [e for e in rep.drain() if isinstance(e, TransferFinished)]
        assert (fin[-1].ok, fin[-1].error_name, fin[-1].after_hit) == (False, "RPC_FAIL", True)
        assert b.counters.load_failed_blocks == len(failed)
        with pytest.raises(BackendError, match="lookup failed"):
            b.lookup_chunks(hashes)
    finally:
        backend.close()


class SlowStore:
    """The real backend, with one batch method held until ``gate`` opens (a pool made slow on
    purpose); ``entered`` is set once a call is waiting at the gate."""

    def __init__(self, backend: MooncakeBackend, method: str = "batch_get_into") -> None:
        self._backend, self._method = backend, method
        self.gate, self.entered = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._backend, name)
        if name != self._method:
            return attr

        def held(*args: object) -> object:
            self.entered.set()
            self.gate.wait()
            return attr(*args)
        return held


def test_layerwise_timeout_recomputes_and_the_late_loader_is_waited_for(
        engines: tuple[MooncakeBackend, ...]) -> None:
    model = uniq("lwtimeout")
    src, dst = cpu_layout(), cpu_layout()
    fill_random(src, 13)
    hashes = chunk_hashes(tokens(64, 14), 32)
    save_request(make_worker(engines[0], src, model, use_layerwise=True), "a",
                 [0, 1, 2, 3], hashes)
    rep = Reporter()
    slow = SlowStore(engines[1])
    b = make_worker(slow, dst, model, reporter=rep,  # type: ignore[arg-type]
                    use_layerwise=True, layerwise_timeout_ms=200)
    b.start_load_kv(load_meta("b", [4, 5, 6, 7], hashes, pool_tokens=64))
    assert slow.entered.wait(10)
    # No exception into the forward pass: the step's load blocks are reported, recomputed.
    b.wait_for_layer_load("layers.0")
    b.wait_for_layer_load("layers.1")  # the step is already failed: no second wait
    assert b.get_block_ids_with_load_errors() == {4, 5, 6, 7}
    outcomes = b.build_connector_worker_meta()
    assert outcomes is not None and outcomes.outcomes == {"b": (64, 0)}
    assert b.counters.layer_timeouts == 1 and b.counters.load_failed_tokens == 64
    fin = [e for e in rep.drain() if isinstance(e, TransferFinished)]
    assert len(fin) == 1 and fin[0].timed_out is True and fin[0].error_name == "TIMEOUT"
    # The next step (vLLM calls handle_preemptions first, every step) does not run its
    # forward pass while the late loader may still write into those blocks.
    next_step = threading.Thread(target=b.handle_preemptions, args=(set(),))
    next_step.start()
    next_step.join(0.5)
    assert next_step.is_alive()
    slow.gate.set()
    next_step.join(10)
    assert not next_step.is_alive()
    # The late loader finished its layer and stopped: layer 1 was never written.
    for s_blk, d_blk in zip([0, 1, 2, 3], [4, 5, 6, 7], strict=True):
        assert block_bytes(src, s_blk)[0] == block_bytes(dst, d_blk)[0]
        assert set(block_bytes(dst, d_blk)[1]) == {0}
    assert b.get_block_ids_with_load_errors() == set()
    assert b.build_connector_worker_meta() is None  # the step was reported once
    b.shutdown()


@pytest.mark.parametrize("given_blocks", [5, 6])
def test_trimmed_hit_loads_up_to_the_cut(given_blocks: int,
                                         engines: tuple[MooncakeBackend, ...]) -> None:
    """vLLM accepted 80 of the 96 tokens offered (3 chunks of 32): the cut is inside chunk 2.
    Blocks up to the cut are written from the pool; the block after it is not touched."""
    model = uniq("trim")
    src, dst = cpu_layout(), cpu_layout()
    fill_random(src, 21)
    hashes = chunk_hashes(tokens(100, 22), 32)
    save_request(make_worker(engines[0], src, model), "a", [0, 1, 2, 3, 4, 5], hashes)
    b = make_worker(engines[1], dst, model)
    blocks = [10, 11, 12, 13, 14, 15][:given_blocks]
    b.start_load_kv(load_meta("b", blocks, hashes, pool_tokens=80))
    assert b.get_block_ids_with_load_errors() == set()
    for s_blk, d_blk in zip([0, 1, 2, 3, 4], blocks[:5], strict=True):
        assert block_bytes(src, s_blk) == block_bytes(dst, d_blk)
    assert all(set(x) == {0} for x in block_bytes(dst, 15))
    outcomes = b.build_connector_worker_meta()
    assert outcomes is not None and outcomes.outcomes == {"b": (80, 80)}


@pytest.mark.parametrize("layerwise", [False, True])
def test_async_load_completes_through_get_finished(
        layerwise: bool, engines: tuple[MooncakeBackend, ...]) -> None:
    model = uniq("async")
    src, dst = separate_kv(), separate_kv()
    fill_random(src, 15)
    hashes = chunk_hashes(tokens(64, 16), 32)
    save_request(make_worker(engines[0], src, model, use_layerwise=layerwise), "a",
                 [0, 1, 2, 3], hashes)
    b = make_worker(engines[1], dst, model, load_async=True, use_layerwise=layerwise)
    missing = chunk_hashes(tokens(64, 17), 32)
    b.start_load_kv(KVPoolConnectorMetadata(requests=[
        load_meta("ok", [4, 5, 6, 7], hashes, 64).requests[0],
        load_meta("gone", [8, 9, 10, 11], missing, 64).requests[0]]))
    recv: set[str] = set()
    deadline = time.monotonic() + 10
    while recv != {"ok", "gone"} and time.monotonic() < deadline:
        recv |= b.get_finished(set())[1] or set()
        time.sleep(0.01)
    assert recv == {"ok", "gone"}
    assert b.get_block_ids_with_load_errors() == {8, 9, 10, 11}
    for s, d in zip([0, 1, 2, 3], [4, 5, 6, 7], strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)
    b.shutdown()


def save_meta(req_id: str, blocks: list[int], hashes: list[str]) -> KVPoolConnectorMetadata:
    return KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id=req_id, block_ids=blocks, chunk_hashes=hashes, save_to_chunk=len(hashes),
        is_last_save=True)])


@pytest.mark.parametrize("events", [False, True], ids=["staged", "kv-events"])
def test_finished_sending_waits_for_saves_and_preemption_waits_for_its_own(
        engines: tuple[MooncakeBackend, ...], events: bool) -> None:
    """Staged values (KV events off): a request's blocks are released once its values are in
    the staging buffer, while the put still waits for the store, and preempting it waits for
    nothing. With KV events on (a request in finished_sending has its chunks recorded) the
    blocks are held until the save ends and a preemption waits for the running save."""
    model = uniq(f"finish-{events}")
    kv = cpu_layout()
    fill_random(kv, 18)
    rep = Reporter()
    slow = SlowStore(engines[0], "batch_put_from")
    w = make_worker(slow, kv, model, reporter=rep)  # type: ignore[arg-type]
    if events:
        w.enable_kv_events()
    h_r, h_q = chunk_hashes(tokens(64, 19), 32), chunk_hashes(tokens(64, 20), 32)
    for rid, blocks, hashes in (("r", [0, 1, 2, 3], h_r), ("q", [4, 5, 6, 7], h_q)):
        meta = save_meta(rid, blocks, hashes)
        w.start_load_kv(meta)
        w.wait_for_save(meta)  # returns at once: r's save holds the save thread, q's queues
    assert slow.entered.wait(10)
    try:
        # A request that never saved is never reported.
        assert w.get_finished({"r", "never-saved"}) == (({"r"} if not events else None), None)
        assert w.inflight_saves == 2
        # q is preempted: its queued save is dropped, r's running save is not waited for.
        w.handle_preemptions({"q"})
        # r is preempted: its running save is waited for while it reads r's blocks.
        preempt = threading.Thread(target=w.handle_preemptions, args=({"r"},))
        preempt.start()
        preempt.join(0.3 if events else 10)
        assert preempt.is_alive() == events
    finally:
        slow.gate.set()
    preempt.join(10)
    assert not preempt.is_alive()
    assert w.drain_saves(10)
    assert w.get_finished(set()) == (({"r"} if events else None), None)
    assert w.get_finished({"q"}) == ({"q"}, None)
    reader = make_worker(engines[1], cpu_layout(), model)
    assert (reader.lookup_chunks(h_r), reader.lookup_chunks(h_q)) == (2, 0)
    skipped = [(e.req_id, e.blocks, e.reason) for e in rep.drain() if isinstance(e, SaveSkipped)]
    assert skipped == [("q", 4, "PREEMPTED")]


def test_save_budget_skips_saves_instead_of_queueing_them(
        engines: tuple[MooncakeBackend, ...]) -> None:
    model = uniq("budget")
    kv = cpu_layout()
    fill_random(kv, 23)
    rep = Reporter()
    slow = SlowStore(engines[0], "batch_put_from")
    chunk_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # 2 blocks x 2 layers of (2, 16, 16) float32
    w = make_worker(slow, kv, model, reporter=rep,  # type: ignore[arg-type]
                    save_budget_bytes=2 * chunk_bytes + 100)
    hashes = [chunk_hashes(tokens(64, 30 + i), 32) for i in range(3)]
    for i, rid in enumerate(("a", "b")):
        meta = save_meta(rid, [4 * i + j for j in range(4)], hashes[i])
        w.start_load_kv(meta)
        w.wait_for_save(meta)  # never blocks: b does not fit next to a, it is skipped
    assert slow.entered.wait(10)
    assert w._saves.inflight_bytes == 2 * chunk_bytes
    assert w.get_finished({"b"}) == ({"b"}, None)  # nothing of b in flight: freed at once
    slow.gate.set()
    assert w.drain_saves(10) and w._saves.inflight_bytes == 0
    # The budget is free again: the next request is saved.
    meta = save_meta("c", [8, 9, 10, 11], hashes[2])
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert w.drain_saves(10)
    reader = make_worker(engines[1], cpu_layout(), model)
    assert [reader.lookup_chunks(h) for h in hashes] == [2, 0, 2]
    assert w.counters.save_skipped_keys == 2
    skipped = [(e.req_id, e.blocks, e.reason) for e in rep.drain() if isinstance(e, SaveSkipped)]
    assert skipped == [("b", 4, "SAVE_BUDGET")]


def test_budget_below_one_save_still_saves_one_at_a_time(
        engines: tuple[MooncakeBackend, ...]) -> None:
    """A budget smaller than one request's save (``save_budget: 256`` means 256 bytes) slows
    saves to one in flight instead of skipping every request."""
    model = uniq("tiny-budget")
    kv = cpu_layout()
    fill_random(kv, 24)
    w = make_worker(engines[0], kv, model, save_budget_bytes=256)
    hashes = [chunk_hashes(tokens(64, 40 + i), 32) for i in range(2)]
    for i, rid in enumerate(("a", "b")):
        meta = save_meta(rid, [4 * i + j for j in range(4)], hashes[i])
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        assert w.drain_saves(10)  # nothing in flight before the next request
    reader = make_worker(engines[1], cpu_layout(), model)
    assert [reader.lookup_chunks(h) for h in hashes] == [2, 2]
    assert w.counters.save_skipped_keys == 0


def test_second_engine_does_not_store_chunks_again(engines: tuple[MooncakeBackend, ...]) -> None:
    model = uniq("dedupe")
    hashes = chunk_hashes(tokens(64, 20), 32)
    first, second = cpu_layout(), cpu_layout()
    fill_random(first, 21)
    fill_random(second, 22)
    a = make_worker(engines[0], first, model)
    save_request(a, "a", [0, 1, 2, 3], hashes)
    b = make_worker(engines[1], second, model)
    save_request(b, "b", [4, 5, 6, 7], hashes)
    assert (a.counters.saved_keys, b.counters.saved_keys) == (2, 0)
    assert b.counters.save_failed_keys == 0
    dst = cpu_layout()
    c = make_worker(engines[1], dst, model)
    c.start_load_kv(load_meta("c", [8, 9, 10, 11], hashes, pool_tokens=64))
    assert c.get_block_ids_with_load_errors() == set()
    assert block_bytes(dst, 8) == block_bytes(first, 0)  # the first writer's bytes stay


def test_partial_and_missing_values_are_load_errors(engines: tuple[MooncakeBackend, ...]) -> None:
    """A value shorter than the chunk (truncated) or absent is never half-used."""
    model = uniq("partial-read")
    hashes = chunk_hashes(tokens(96, 23), 32)
    src = cpu_layout()
    fill_random(src, 24)
    w = make_worker(engines[0], src, model)
    assert w.kv is not None
    save_request(w, "a", [0, 1, 2, 3], hashes[:2])
    # Chunk 2 holds only half its bytes (e.g. written by a differently shaped engine).
    key = str(PoolKey(normalize_model_name(model), w.layout_digest, TP0, hashes[2]))
    half = w.kv.block_bytes  # one of its two blocks
    assert engines[0].batch_put_from([key], [[tensors(src)[0].data_ptr()]], [[half]]) == [0]
    rep = Reporter()
    dst = cpu_layout()
    b = make_worker(engines[1], dst, model, reporter=rep)
    assert b.lookup_chunks(hashes) == 3
    b.start_load_kv(load_meta("b", [10, 11, 12, 13, 14, 15], hashes, pool_tokens=96))
    assert b.get_block_ids_with_load_errors() == {14, 15}
    assert b.counters.load_failed_keys == 1
    fin = [e for e in rep.drain() if isinstance(e, TransferFinished)][-1]
    # Mooncake refuses the size mismatch itself (TRANSFER_FAIL); a short byte count would be
    # PARTIAL_READ. Either way the blocks are recomputed.
    assert (fin.ok, fin.failed_blocks, fin.after_hit) == (False, 2, True)
    assert fin.error_name in {"TRANSFER_FAIL", "PARTIAL_READ"}
    # Missing key: OBJECT_NOT_FOUND, named.
    gone = chunk_hashes(tokens(32, 25), 32)
    b.start_load_kv(load_meta("c", [16, 17], gone, pool_tokens=32))
    assert b.get_block_ids_with_load_errors() == {16, 17}
    fin = [e for e in rep.drain() if isinstance(e, TransferFinished)][-1]
    assert fin.error_name == "OBJECT_NOT_FOUND"


def test_bad_settings_and_metadata_are_clear(engines: tuple[MooncakeBackend, ...]) -> None:
    with pytest.raises(ValueError, match=r"chunk_size \(24\) must be a positive multiple"):
        KVPoolWorker(Settings(chunk_size=24), TP0, "m", engines[1])
    lw = KVPoolWorker(Settings(use_layerwise=True), TP0, "m", engines[1])
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        lw.lookup_chunks(["00" * 16])
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        lw.start_load_kv(KVPoolConnectorMetadata())
    rep = Reporter()
    w = make_worker(engines[1], cpu_layout(), uniq("badmeta"), reporter=rep)
    w.wait_for_layer_load("layers.0")  # nothing pending: returns at once
    hashes = chunk_hashes(tokens(64, 26), 32)
    # Two chunks to load but block ids for one and a half: nothing is loaded, and every
    # given block in the load range is reported failed instead of trusted.
    w.start_load_kv(load_meta("short", [3, 4, 5], hashes, pool_tokens=64))
    assert w.get_block_ids_with_load_errors() == {3, 4, 5}
    fin = [e for e in rep.drain() if isinstance(e, TransferFinished)]
    assert fin[-1].error_name == "BAD_METADATA"


def test_checksum_detects_a_corrupted_value_and_recomputes(
        engines: tuple[MooncakeBackend, ...]) -> None:
    model = uniq("checksum")
    src = cpu_layout()
    fill_random(src, 41)
    hashes = chunk_hashes(tokens(96, 42), 32)
    a = make_worker(engines[0], src, model, checksum=True)
    save_request(a, "a", [0, 1, 2, 3, 4, 5], hashes)
    # Values with a digest live under their own layout digest: a reader without it finds
    # nothing, a reader with it finds every chunk.
    assert make_worker(engines[1], cpu_layout(), model).lookup_chunks(hashes) == 0
    rep = Reporter()
    dst = cpu_layout()
    b = make_worker(engines[1], dst, model, reporter=rep, checksum=True)
    assert b.lookup_chunks(hashes) == 3
    # Chunk 1's value rewritten in the pool: same size, digest intact, one KV byte flipped.
    key = str(PoolKey(normalize_model_name(model), b.layout_digest, TP0, hashes[1]))
    raw = bytearray(engines[0].store.get(key))
    raw[100] ^= 0xFF
    assert engines[0].store.upsert(key, bytes(raw)) == 0
    # vLLM holds the first block already: chunk 0 goes through the staging buffer.
    marker = torch.full_like(dst["layers.0"][8], 7.0)
    dst["layers.0"][8].copy_(marker)
    b.start_load_kv(load_meta("b", [8, 9, 10, 11, 12, 13], hashes, pool_tokens=96,
                              local_tokens=16))
    assert b.get_block_ids_with_load_errors() == {10, 11}
    assert torch.equal(dst["layers.0"][8], marker)
    for s_blk, d_blk in ((1, 9), (4, 12), (5, 13)):
        assert block_bytes(src, s_blk) == block_bytes(dst, d_blk)
    assert b.counters.checksum_failures == 1
    outcomes = b.build_connector_worker_meta()
    assert outcomes is not None and outcomes.outcomes == {"b": (80, 16)}
    (fin,) = [e for e in rep.drain() if isinstance(e, TransferFinished)]
    assert fin.ok is False and fin.error_name == "CHECKSUM_MISMATCH"


def test_checksum_refuses_a_whole_value_found_under_another_key(
        engines: tuple[MooncakeBackend, ...]) -> None:
    """Chunk 0's whole value (its bytes and their digest, self-consistent) written under
    chunk 1's key: the right size and a digest of the bytes that match, but the wrong KV for
    chunk 1. The digest covers the key too, so the load is refused and recomputed."""
    model = uniq("checksum-swap")
    src = cpu_layout()
    fill_random(src, 43)
    hashes = chunk_hashes(tokens(64, 44), 32)
    a = make_worker(engines[0], src, model, checksum=True)
    save_request(a, "a", [0, 1, 2, 3], hashes)
    keys = [str(PoolKey(normalize_model_name(model), a.layout_digest, TP0, h)) for h in hashes]
    assert engines[0].store.upsert(keys[1], engines[0].store.get(keys[0])) == 0
    dst = cpu_layout()
    b = make_worker(engines[1], dst, model, checksum=True)
    b.start_load_kv(load_meta("b", [8, 9, 10, 11], hashes, pool_tokens=64))
    assert b.get_block_ids_with_load_errors() == {10, 11}
    for s_blk, d_blk in ((0, 8), (1, 9)):
        assert block_bytes(src, s_blk) == block_bytes(dst, d_blk)
    assert b.counters.checksum_failures == 1


@pytest.mark.parametrize("layerwise", [False, True])
def test_written_chunks_are_those_the_save_wrote(layerwise: bool,
                                                 engines: tuple[MooncakeBackend, ...]) -> None:
    """KV events (``take_written_chunks``): every chunk whose value(s) this save put, once;
    a chunk the pool already held (another engine wrote it) is not reported again, and a
    worker without ``enable_kv_events`` records nothing."""
    model = uniq(f"events-{layerwise}")
    shared = chunk_hashes(tokens(64, 30), 32)
    own = chunk_hashes(tokens(96, 31), 32)
    kv_a, kv_b, kv_off = cpu_layout(), cpu_layout(), cpu_layout()
    for i, kv in enumerate((kv_a, kv_b, kv_off)):
        fill_random(kv, 32 + i)
    a = make_worker(engines[0], kv_a, model, use_layerwise=layerwise)
    a.enable_kv_events()
    save_request(a, "a", [0, 1, 2, 3], shared)
    assert a.take_written_chunks() == [("a", 0, 0), ("a", 1, 0)]
    assert a.take_written_chunks() == []
    b = make_worker(engines[1], kv_b, model, use_layerwise=layerwise)
    b.enable_kv_events()
    # The first two chunks are the ones a wrote: only b's third chunk is new.
    save_request(b, "b", [4, 5, 6, 7, 8, 9], [*shared, own[2]])
    assert b.take_written_chunks() == [("b", 2, 0)]
    per_chunk = len(kv_b) if layerwise else 1
    assert b.counters.saved_keys == per_chunk
    assert b.lookup_shards == 1
    off = make_worker(engines[1], kv_off, uniq("events-off"), use_layerwise=layerwise)
    save_request(off, "c", [10, 11, 12, 13], shared)
    assert off.counters.saved_keys == 2 * per_chunk and off.take_written_chunks() == []


class OutlivingStore:
    """The real backend whose gets last the pool's lease or longer (a transfer the lease does
    not cover): the real bytes land, then the call returns once ``lease_ms`` passed."""

    def __init__(self, backend: MooncakeBackend, lease_ms: int) -> None:
        self._backend, self._lease_ms = backend, lease_ms

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)

    def lease_ttl_ms(self) -> int:
        return self._lease_ms

    def batch_get_into(self, *args: object) -> list[int]:
        end = time.monotonic() + self._lease_ms / 1e3
        out = self._backend.batch_get_into(*args)  # type: ignore[arg-type]
        while time.monotonic() < end:
            time.sleep(0.005)
        return out


def test_a_load_that_outlives_its_lease_is_recomputed(
        engines: tuple[MooncakeBackend, ...]) -> None:
    """A read holds a lease, not a reference: once a get lasted the lease, a remove may have
    reused the bytes mid-copy, so the load is doubtful and recomputed (issue 39)."""
    model = uniq("outlived")
    src = cpu_layout()
    fill_random(src, 31)
    hashes = chunk_hashes(tokens(64, 32), 32)
    save_request(make_worker(engines[0], src, model), "a", [0, 1, 2, 3], hashes)
    # The Mooncake config's default_kv_lease_ttl (the master's own default: 10 s).
    assert engines[1].lease_ttl_ms() == 10_000
    rep = Reporter()
    slow = make_worker(OutlivingStore(engines[1], 200), cpu_layout(), model,  # type: ignore[arg-type]
                       reporter=rep)
    slow.start_load_kv(load_meta("b", [4, 5, 6, 7], hashes, pool_tokens=64))
    assert slow.get_block_ids_with_load_errors() == {4, 5, 6, 7}
    assert slow.counters.load_failed_keys == 2 and slow.counters.loaded_keys == 0
    fin = [e for e in rep.drain() if isinstance(e, TransferFinished)][-1]
    assert (fin.ok, fin.error_name, fin.failed_blocks, fin.after_hit) == (
        False, "LEASE_EXPIRED", 4, True)
    # The same get within the lease loads every block bit-exactly.
    dst = cpu_layout()
    fast = make_worker(engines[1], dst, model)
    fast.start_load_kv(load_meta("c", [8, 9, 10, 11], hashes, pool_tokens=64))
    assert fast.get_block_ids_with_load_errors() == set()
    for s_blk, d_blk in zip([0, 1, 2, 3], [8, 9, 10, 11], strict=True):
        assert block_bytes(src, s_blk) == block_bytes(dst, d_blk)
