"""KVPoolWorker with backend ``yuanrong`` against a real worker: paged KV blocks saved by one
engine load bit-exactly into another (whole-chunk and layer-wise keys), other layouts and
models see nothing, a full worker yields NO_AVAILABLE_HANDLE, a killed worker turns loads
into reported load errors."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kvpool_agent.reporter import Reporter
from kvpool_connector.backends import create_backend
from kvpool_connector.backends.base import BackendError
from kvpool_connector.backends.yuanrong import YuanrongBackend
from kvpool_connector.keys import ParallelLayout, chunk_hashes
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadSpec, ReqMeta
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalYuanrongWorker

BLOCK = 16
NUM_BLOCKS = 16


@dataclass(frozen=True)
class Settings:
    block_size: int = BLOCK
    chunk_size: int = 2 * BLOCK
    use_layerwise: bool = False
    load_async: bool = False
    layerwise_timeout_ms: int = 5_000
    save_budget_bytes: int = 64 << 20
    checksum: bool = False
    hash_algo: str = "sha256"


def backend_for(worker: LocalYuanrongWorker, **extra: object) -> YuanrongBackend:
    b = create_backend("yuanrong", {
        "yuanrong_worker_address": worker.address, "yuanrong_request_timeout_ms": 1000,
        **extra})
    assert isinstance(b, YuanrongBackend)
    return b


@pytest.fixture(scope="module")
def backend(yuanrong_worker: LocalYuanrongWorker) -> Iterator[YuanrongBackend]:
    b = backend_for(yuanrong_worker)
    yield b
    b.close()


def flash_attn(layers: int = 3) -> dict[str, torch.Tensor]:
    """(2, num_blocks, block_size, kv_heads, head_size) per layer, bf16."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 8,
                                                            dtype=torch.bfloat16)
            for i in range(layers)}


def cpu_layout(layers: int = 2) -> dict[str, torch.Tensor]:
    """vLLM CPU backend: (num_blocks, kv_heads, block_size, 2 * head_size) per layer."""
    return {f"layers.{i}": torch.zeros(NUM_BLOCKS, 2, BLOCK, 16, dtype=torch.float32)
            for i in range(layers)}


def fill_random(kv: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in kv.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def block_bytes(kv: dict[str, torch.Tensor], block: int) -> list[bytes]:
    return [(t[:, block] if t.dim() == 5 else t[block]).contiguous().view(torch.uint8)
            .numpy().tobytes() for t in kv.values()]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_worker(backend: YuanrongBackend, kv: dict[str, torch.Tensor], model: str,
                layout: ParallelLayout | None = None, reporter: Reporter | None = None,
                **settings: object) -> KVPoolWorker:
    w = KVPoolWorker(Settings(**settings), layout or ParallelLayout(), model,  # type: ignore[arg-type]
                     backend, reporter)
    w.register_kv_caches(kv)
    return w


def save(w: KVPoolWorker, req_id: str, blocks: list[int], hashes: list[str]) -> None:
    meta = KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id=req_id, block_ids=blocks, chunk_hashes=hashes, save_from_chunk=0,
        save_to_chunk=len(hashes), is_last_save=True)])
    w.start_load_kv(meta)
    for layer in w.kv.layers if w.kv else []:
        w.save_kv_layer(layer.name, None)
    w.wait_for_save(meta)
    assert w.drain_saves(10)


def load(w: KVPoolWorker, req_id: str, blocks: list[int], hashes: list[str]) -> None:
    w.start_load_kv(KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id=req_id, block_ids=blocks, chunk_hashes=hashes,
        load=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=len(hashes) * 2 * BLOCK,
                      can_load=True))]))
    for layer in w.kv.layers if w.kv else []:
        w.wait_for_layer_load(layer.name)


def uniq(prefix: str) -> str:
    return f"org/{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("kind", ["flash_attn", "cpu"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_worker_round_trip_bit_exact(kind: str, layerwise: bool,
                                     backend: YuanrongBackend) -> None:
    make = flash_attn if kind == "flash_attn" else cpu_layout
    model = uniq(f"w-{kind}")
    src, dst = make(), make()
    fill_random(src, seed=1)
    a = make_worker(backend, src, model, use_layerwise=layerwise)
    rep = Reporter()
    b = make_worker(backend, dst, model, reporter=rep, use_layerwise=layerwise)
    hashes = chunk_hashes(tokens(3 * 2 * BLOCK + 5, seed=2), 2 * BLOCK)
    src_blocks, dst_blocks = [3, 4, 10, 11, 12, 13], [15, 1, 7, 8, 9, 0]
    save(a, "req-a", src_blocks, hashes)
    assert a.counters.saved_keys == 3 * (len(src) if layerwise else 1)
    assert b.lookup_chunks(hashes) == 3
    load(b, "req-b", dst_blocks, hashes)
    assert b.get_block_ids_with_load_errors() == set()
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)
    assert all(set(x) == {0} for x in block_bytes(dst, 2))
    assert b.counters.loaded_bytes == 6 * b.kv.block_bytes  # type: ignore[union-attr]
    a.shutdown()
    b.shutdown()


def test_worker_layouts_and_models_never_collide(backend: YuanrongBackend) -> None:
    model = uniq("w-collide")
    kv = cpu_layout()
    fill_random(kv, 5)
    hashes = chunk_hashes(tokens(4 * BLOCK, 6), 2 * BLOCK)
    save(make_worker(backend, kv, model), "w", [0, 1, 2, 3], hashes)
    assert make_worker(backend, cpu_layout(), model).lookup_chunks(hashes) == 2
    assert make_worker(backend, cpu_layout(), model + "/").lookup_chunks(hashes) == 2
    for lay in (ParallelLayout(tp_rank=1), ParallelLayout(pcp_rank=1), ParallelLayout(dcp_rank=1),
                ParallelLayout(pp_rank=1), ParallelLayout(group=1)):
        dst = cpu_layout()
        r = make_worker(backend, dst, model, lay)
        assert r.lookup_chunks(hashes) == 0, lay
        load(r, "r", [4, 5, 6, 7], hashes)
        assert r.get_block_ids_with_load_errors() == {4, 5, 6, 7}, lay
        assert all(set(x) == {0} for blk in (4, 5, 6, 7) for x in block_bytes(dst, blk))
    assert make_worker(backend, cpu_layout(), model + "-b").lookup_chunks(hashes) == 0
    assert make_worker(backend, cpu_layout(), model, use_layerwise=True).lookup_chunks(hashes) == 0


def test_full_then_killed_worker(fresh_yuanrong_worker: LocalYuanrongWorker) -> None:
    """A 64 MB worker holding values that must not be evicted fills up: puts return -200
    (NO_AVAILABLE_HANDLE) without raising. After SIGKILL of the worker, backend calls return
    -900 (RPC_FAIL), the engine's lookup raises instead of reporting a miss, and its load
    reports every block as a load error (recompute) and leaves the blocks untouched."""
    # The writer waits up to 2 s per call (a loaded CI host must not turn "pool full" into a
    # timeout); the reader gives up after 1 s once the worker is dead.
    writer = backend_for(fresh_yuanrong_worker, yuanrong_write_mode="none_l2_cache",
                         yuanrong_request_timeout_ms=2000)
    backend = backend_for(fresh_yuanrong_worker)
    model = uniq("w-kill")
    src, dst = cpu_layout(), cpu_layout()
    fill_random(src, 11)
    hashes = chunk_hashes(tokens(4 * BLOCK, 12), 2 * BLOCK)
    save(make_worker(writer, src, model), "a", [0, 1, 2, 3], hashes)
    b = make_worker(backend, dst, model, reporter=Reporter())
    assert b.lookup_chunks(hashes) == 2

    big = torch.randint(0, 256, (4, 1 << 20), dtype=torch.uint8)
    keys = [f"kvpool@{model}@fill{i}" for i in range(80)]
    # The reader's own key, so its scope removal has something to look up after the kill.
    assert backend.batch_put_from([f"kvpool@{model}@own"], [[big[0].data_ptr()]], [[64]]) == [0]
    results: list[int] = []
    for i in range(0, 80, 4):
        results += writer.batch_put_from(
            keys[i:i + 4], [[big[j].data_ptr()] for j in range(4)], [[1 << 20]] * 4)
        if results[-1] < 0:
            break
    assert results[0] == 0 and results[-1] == -200, results
    assert 40 <= results.count(0) < 64

    fresh_yuanrong_worker.kill()
    assert backend.batch_exists(keys[:2]) == [-900, -900]
    with pytest.raises(BackendError) as err:
        b.lookup_chunks(hashes)
    assert err.value.code == -900
    load(b, "b", [8, 9, 10, 11], hashes)
    assert b.get_block_ids_with_load_errors() == {8, 9, 10, 11}
    assert all(set(x) == {0} for blk in (8, 9, 10, 11) for x in block_bytes(dst, blk))
    assert b.counters.load_failed_keys == 2
    with pytest.raises(BackendError):
        backend.remove_by_scope(".*", dry_run=True)
    health = backend.health()
    assert [(c.name, c.ok, c.code) for c in health] == [("worker", False, -900)]
    b.shutdown()
    backend.close()
    writer.close()
    assert backend.batch_exists(keys[:1]) == [-1010]
