"""YuanrongBackend against a real openYuanrong datasystem worker (``dscli start``): paged KV
blocks round-trip bit-exactly, keys of different layouts and models never collide, a full
worker yields NO_AVAILABLE_HANDLE, a killed worker turns calls into negative codes."""

from __future__ import annotations

import ctypes
import re
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from kvpool_connector.backends.base import BackendUnavailable
from kvpool_connector.backends.yuanrong import (
    YuanrongBackend,
    YuanrongConfig,
    encode_key,
    status_code,
)
from kvpool_connector.keys import ParallelLayout, PoolKey, chunk_hashes, model_pattern
from kvpool_replay import LocalYuanrongWorker, free_port

NUM_BLOCKS = 12


def backend_for(worker: LocalYuanrongWorker, **extra: object) -> YuanrongBackend:
    # The product's default timeouts (5 s): four threads' calls at 1 s timed out once on a
    # loaded CI-like machine (load average 16).
    return YuanrongBackend.from_config({
        "yuanrong_worker_address": worker.address, "yuanrong_request_timeout_ms": 5000,
        "yuanrong_connect_timeout_ms": 5000,
        "yuanrong_shared_memory_size_mb": worker.shared_memory_size_mb, **extra})


@pytest.fixture(scope="module")
def backend(yuanrong_worker: LocalYuanrongWorker) -> Iterator[YuanrongBackend]:
    b = backend_for(yuanrong_worker)
    yield b
    b.close()


def cpu_cache(layers: int, heads: int, block: int, width: int) -> list[torch.Tensor]:
    """vLLM CPU layout per layer: (num_blocks, kv_heads, block_size, 2 * head_size)."""
    return [torch.zeros(NUM_BLOCKS, heads, block, width, dtype=torch.float32)
            for _ in range(layers)]


def flash_cache(layers: int) -> list[torch.Tensor]:
    """FlashAttention layout per layer: (2, num_blocks, block_size, kv_heads, head_size)."""
    return [torch.zeros(2, NUM_BLOCKS, 16, 2, 8, dtype=torch.bfloat16) for _ in range(layers)]


def fill(cache: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in cache:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def block_ranges(cache: list[torch.Tensor], block: int) -> tuple[list[int], list[int]]:
    """Address ranges of one paged block across all layers (K and V separately for the
    FlashAttention layout), as the connector passes them."""
    addrs, sizes = [], []
    for t in cache:
        parts = (t[0, block], t[1, block]) if t.dim() == 5 else (t[block],)
        for p in parts:
            assert p.is_contiguous()
            addrs.append(p.data_ptr())
            sizes.append(p.numel() * p.element_size())
    return addrs, sizes


def block_bytes(cache: list[torch.Tensor], block: int) -> bytes:
    return b"".join(
        ctypes.string_at(a, n) for a, n in zip(*block_ranges(cache, block), strict=True))


DEFAULT_LAYOUT = ParallelLayout()
DIGEST, OTHER_DIGEST = "0123456789ab", "ba9876543210"


def keys_for(model: str, n: int, layout: ParallelLayout = DEFAULT_LAYOUT,
             seed: int = 0, digest: str = DIGEST) -> list[str]:
    toks = torch.randint(0, 32000, (n * 16,), generator=torch.Generator().manual_seed(seed))
    return [str(PoolKey(model, digest, layout, h)) for h in chunk_hashes(toks.tolist(), 16)]


def put_blocks(b: YuanrongBackend, keys: list[str], cache: list[torch.Tensor],
               blocks: list[int]) -> list[int]:
    ranges = [block_ranges(cache, blk) for blk in blocks]
    return b.batch_put_from(keys, [r[0] for r in ranges], [r[1] for r in ranges])


def get_blocks(b: YuanrongBackend, keys: list[str], cache: list[torch.Tensor],
               blocks: list[int]) -> list[int]:
    ranges = [block_ranges(cache, blk) for blk in blocks]
    return b.batch_get_into(keys, [r[0] for r in ranges], [r[1] for r in ranges])


def uniq(prefix: str) -> str:
    return f"Org/{prefix}-{uuid.uuid4().hex[:8]}.v1"


CACHES = {
    # 2 layers x 2 heads x 16 tokens x 32 floats: 8 KiB per block, below the worker's 500 KB
    # shared-memory threshold (values travel over RPC).
    "cpu_small": lambda: cpu_cache(2, 2, 16, 32),
    # 8 layers x 4 heads x 16 tokens x 512 floats: 1 MiB per block, through shared memory.
    "cpu_large": lambda: cpu_cache(8, 4, 16, 512),
    "flash_bf16": lambda: flash_cache(3),
}


@pytest.mark.parametrize("kind", list(CACHES))
def test_paged_blocks_round_trip_bit_exact(kind: str, backend: YuanrongBackend) -> None:
    src, dst = CACHES[kind](), CACHES[kind]()
    fill(src, seed=1)
    keys = keys_for(uniq(kind), 4)
    src_blocks, dst_blocks = [2, 3, 7, 11], [9, 0, 4, 5]
    assert backend.batch_exists(keys) == [0, 0, 0, 0]
    assert put_blocks(backend, keys, src, src_blocks) == [0, 0, 0, 0]
    assert backend.batch_exists(keys) == [1, 1, 1, 1]
    want = sum(block_ranges(src, 0)[1])
    assert get_blocks(backend, keys, dst, dst_blocks) == [want] * 4
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert block_bytes(src, s) == block_bytes(dst, d)
    for untouched in (1, 2, 3, 6):
        assert set(block_bytes(dst, untouched)) == {0}


def test_missing_and_mismatched_keys_write_nothing(backend: YuanrongBackend) -> None:
    src, dst = cpu_cache(2, 2, 16, 32), cpu_cache(2, 2, 16, 32)
    fill(src, seed=2)
    stored, missing = keys_for(uniq("miss"), 2)
    assert put_blocks(backend, [stored], src, [0]) == [0]
    # A batch whose keys are all absent, and a mixed batch.
    assert backend.batch_exists([missing]) == [0]
    assert get_blocks(backend, [missing], dst, [1]) == [-704]
    assert get_blocks(backend, [missing, stored], dst, [1, 2]) == [-704, 8192]
    assert set(block_bytes(dst, 1)) == {0}
    assert block_bytes(dst, 2) == block_bytes(src, 0)
    # Stored value is 8 KiB; a reader with another block shape must not get a partial copy.
    small = cpu_cache(2, 2, 8, 32)
    assert get_blocks(backend, [stored], small, [3]) == [-600]
    assert set(block_bytes(small, 3)) == {0}
    # Ranges that don't match sizes are refused per key, not by raising.
    assert backend.batch_put_from([missing], [[src[0].data_ptr()]], [[]]) == [-600]
    assert backend.batch_exists([missing]) == [0]


def test_layouts_and_models_never_collide(backend: YuanrongBackend) -> None:
    model = uniq("collide")
    layouts = [ParallelLayout(), ParallelLayout(tp_rank=1), ParallelLayout(pcp_rank=1),
               ParallelLayout(dcp_rank=1), ParallelLayout(pp_rank=1), ParallelLayout(group=1)]
    caches = []
    for i, lay in enumerate(layouts):
        cache = cpu_cache(2, 2, 16, 32)
        fill(cache, seed=10 + i)
        caches.append(cache)
        assert put_blocks(backend, keys_for(model, 2, lay, seed=3), cache, [0, 1]) == [0, 0]
    for lay, cache in zip(layouts, caches, strict=True):
        dst = cpu_cache(2, 2, 16, 32)
        assert get_blocks(backend, keys_for(model, 2, lay, seed=3), dst, [4, 5]) == [8192] * 2
        assert block_bytes(dst, 4) == block_bytes(cache, 0)
        assert block_bytes(dst, 5) == block_bytes(cache, 1)
    # Same hashes under another model, layout digest or TP rank, or as layer keys: absent.
    assert backend.batch_exists(keys_for(model + "x", 2, seed=3)) == [0, 0]
    assert backend.batch_exists(keys_for(model, 2, seed=3, digest=OTHER_DIGEST)) == [0, 0]
    assert backend.batch_exists(keys_for(model, 2, ParallelLayout(tp_rank=2), seed=3)) == [0, 0]
    layer_key = str(PoolKey(model, DIGEST, ParallelLayout(), chunk_hashes(list(range(16)), 16)[0])
                    .layer(0))
    assert backend.batch_exists([layer_key]) == [0]


def test_key_encoding_is_injective_and_fits_the_worker() -> None:
    # Characters the worker refuses (., /, %, #) and their escaped spellings stay distinct.
    keys = ["kvpool@a.b@x", "kvpool@a/b@x", "kvpool@a%2Eb@x", "kvpool@a%252Eb@x",
            "kvpool@a#b@x", "kvpool@a%23b@x", "kvpool@ä@x"]
    encoded = [encode_key(k) for k in keys]
    assert len(set(encoded)) == len(keys)
    allowed = re.compile(r"^[a-zA-Z0-9\-_!@#%\^\*\(\)\+\=\:;]*$")
    assert all(allowed.match(e) for e in encoded)
    long_a, long_b = "kvpool@" + "m" * 300 + "@a", "kvpool@" + "m" * 300 + "@b"
    assert len(encode_key(long_a)) == 255
    assert encode_key(long_a) != encode_key(long_b)
    assert encode_key(long_a) == encode_key(long_a)
    # Keys of a long model name that differ only in their layout digest (cut off by the
    # length limit) stay distinct through the SHA-256 suffix.
    digests = [str(PoolKey("m" * 300, d, ParallelLayout(), "0" * 32))
               for d in (DIGEST, OTHER_DIGEST)]
    assert encode_key(digests[0])[:222] == encode_key(digests[1])[:222]
    assert encode_key(digests[0]) != encode_key(digests[1])


def test_long_model_name_round_trips(backend: YuanrongBackend) -> None:
    src, dst = cpu_cache(2, 2, 16, 32), cpu_cache(2, 2, 16, 32)
    fill(src, 4)
    keys = keys_for("/models/" + "very-long-name." * 25, 1)
    assert len(keys[0]) > 255
    assert put_blocks(backend, keys, src, [0]) == [0]
    assert get_blocks(backend, keys, dst, [1]) == [8192]
    assert block_bytes(dst, 1) == block_bytes(src, 0)


def test_remove_by_scope(backend: YuanrongBackend) -> None:
    a, other = uniq("flush-a"), uniq("flush-b")
    src = cpu_cache(2, 2, 16, 32)
    fill(src, 5)
    ka, kb = keys_for(a, 3), keys_for(other, 2)
    assert put_blocks(backend, ka, src, [0, 1, 2]) == [0, 0, 0]
    assert put_blocks(backend, kb, src, [0, 1]) == [0, 0]
    dry = backend.remove_by_scope(model_pattern(a), dry_run=True)
    assert (dry.keys, dry.bytes, dry.removed) == (3, 3 * 8192, 0)
    assert backend.batch_exists(ka) == [1, 1, 1]
    done = backend.remove_by_scope(model_pattern(a), dry_run=False)
    assert (done.keys, done.bytes, done.removed, done.skipped_leased) == (3, 3 * 8192, 3, 0)
    assert backend.batch_exists(ka) == [0, 0, 0]
    assert backend.batch_exists(kb) == [1, 1]
    assert backend.remove_by_scope(model_pattern(a), dry_run=False).keys == 0


def test_health_and_stats(backend: YuanrongBackend, yuanrong_worker: LocalYuanrongWorker) -> None:
    checks = backend.health()
    assert [c.name for c in checks] == ["worker", "probe_put", "probe_get", "probe_remove"]
    assert all(c.ok and c.latency_ms > 0 for c in checks), checks
    assert yuanrong_worker.address in checks[0].detail
    src = cpu_cache(2, 2, 16, 32)
    key = keys_for(uniq("stats"), 1)
    before = backend.stats()
    assert put_blocks(backend, key, src, [0]) == [0]
    after = backend.stats()
    # Without the worker's log dir: what this client wrote, and the configured size.
    assert after.backend == "yuanrong" and after.healthy is True
    assert after.keys == before.keys + 1
    assert after.used_bytes == before.used_bytes + 8192
    assert after.total_bytes == 256 << 20
    assert not any(k.startswith("kvpool-probe@") for k in backend._index)
    # With it: the worker's own resource.log (every object of every client). No configured
    # size here, so total_bytes can only come from the worker.
    with_log = YuanrongBackend.from_config({
        "yuanrong_worker_address": yuanrong_worker.address,
        "yuanrong_log_dir": str(yuanrong_worker.log_dir)})
    # The log is written every 500 ms: polled until it caught up with earlier writes (two
    # reads a log interval apart agree).
    deadline = time.monotonic() + 30
    first = with_log.stats()
    while time.monotonic() < deadline:
        time.sleep(0.6)
        again = with_log.stats()
        if again.keys == first.keys and first.keys > 0 and first.used_bytes > 0:
            break
        first = again
    assert first.total_bytes == 256 << 20 and first.keys > 0 and first.used_bytes > 0
    big = CACHES["cpu_large"]()
    assert put_blocks(with_log, keys_for(uniq("stats-log"), 3), big, [0, 1, 2]) == [0, 0, 0]
    deadline = time.monotonic() + 30
    while (now := with_log.stats()).keys < first.keys + 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert now.keys == first.keys + 3, (first, now)
    assert now.used_bytes >= first.used_bytes + 3 * (1 << 20), (first, now)
    with_log.close()


def test_config_errors_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("YUANRONG_WORKER_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="yuanrong_worker_address"):
        YuanrongConfig.load({})
    with pytest.raises(ValueError, match=r"yuanrong_worker_address: .*not host:port"):
        YuanrongConfig.load({"yuanrong_worker_address": "localhost"})
    with pytest.raises(ValueError, match="yuanrong_request_timeout_ms"):
        YuanrongConfig.load({"yuanrong_worker_address": "127.0.0.1:1",
                             "yuanrong_request_timeout_ms": 0})
    with pytest.raises(ValueError, match="yuanrong_write_mode"):
        YuanrongConfig.load({"yuanrong_worker_address": "127.0.0.1:1",
                             "yuanrong_write_mode": "write_back"})
    monkeypatch.setenv("YUANRONG_WORKER_ADDRESS", "127.0.0.1:4242")
    cfg = YuanrongConfig.load({"yuanrong_worker_address": "127.0.0.1:1"})
    assert (cfg.host, cfg.port) == ("127.0.0.1", 4242)


def test_unreachable_worker_is_unavailable() -> None:
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable, match=r"did not answer.*yuanrong_worker_address"):
        YuanrongBackend.from_config({
            "yuanrong_worker_address": f"127.0.0.1:{free_port()}",
            "yuanrong_connect_timeout_ms": 500, "yuanrong_request_timeout_ms": 500})
    assert time.monotonic() - t0 < 10


def test_status_texts_map_to_mooncake_codes() -> None:
    assert status_code("code: [Key not found], msg: [Cannot get objects from worker]") == -704
    assert status_code("code: [Out of memory], msg: [no shm]") == -200
    assert status_code("code: [RPC unavailable], msg: [SOCK_CONN_WAIT_TIMEOUT]") == -900
    assert status_code("code: [Invalid parameter], msg: [The key contains illegal char(s)]") == -400
    assert status_code("code: [Invalid parameter], msg: [size]") == -600
    assert status_code("code: [RPC unavailable], msg: [RPC Retry detail: [ RPC unavailable * 1 "
                       "Out of memory * 3 ]]") == -200
    assert status_code("code: [Runtime error], msg: [?]") == -1


def test_concurrent_transfer_threads_share_one_client(backend: YuanrongBackend) -> None:
    """The connector's save and load threads and the agent call one backend at once."""
    from concurrent.futures import ThreadPoolExecutor

    model = uniq("threads")
    caches = [cpu_cache(2, 2, 16, 32) for _ in range(4)]
    for i, c in enumerate(caches):
        fill(c, 20 + i)

    def cycle(i: int) -> bool:
        keys = keys_for(model, 3, ParallelLayout(tp_rank=i), seed=i)
        dst = cpu_cache(2, 2, 16, 32)
        ok = True
        for _ in range(10):
            ok &= put_blocks(backend, keys, caches[i], [0, 1, 2]) == [0, 0, 0]
            ok &= get_blocks(backend, keys, dst, [3, 4, 5]) == [8192] * 3
            ok &= all(block_bytes(dst, 3 + b) == block_bytes(caches[i], b) for b in range(3))
            ok &= backend.batch_exists(keys) == [1, 1, 1]
        return ok

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(cycle, range(4))) == [True] * 4
    assert backend.remove_by_scope(model_pattern(model), dry_run=False).removed == 12
