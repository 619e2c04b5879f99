"""Backend calls sized to the transport (``kvpool_connector.staging``) against a real
``mooncake_master`` and a separate ``mooncake_client`` store process, TCP on 127.0.0.1.

The batch is the one Mooncake's TCP lane refuses when sent as one call: 3,072 slices of 16 KiB
(12 keys of 256 slices; one call of it fails with -800 TRANSFER_FAIL after 60 s, issue 38).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvpool_agent._aggregate import Aggregator
from kvpool_agent.pool_listing import ALL_KEYS_PATTERN
from kvpool_agent.protocol import Source
from kvpool_agent.reporter import Reporter, SaveCopied
from kvpool_connector import staging
from kvpool_connector._checksum import CHECKSUM_BYTES
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.keys import ParallelLayout, chunk_hashes
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadSpec, ReqMeta
from kvpool_connector.staging import TCP_LIMITS, SizedCalls, StagingBuffer, attach_staging
from kvpool_connector.worker import KVPoolWorker
from kvpool_replay import LocalMooncakeMaster, LocalPoolStore

SLICE = 16 << 10
PER_KEY = 256
KEYS = 12

_KEEP: list[object] = []
"""Registered memory stays allocated for the module: the client refuses a registration that
overlaps one it made before, and freed tensors get reused."""


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[LocalMooncakeMaster, LocalPoolStore]]:
    with LocalMooncakeMaster(eviction_high_watermark_ratio=0.95) as master, \
            LocalPoolStore(master, 256 << 20) as pool_store:
        yield master, pool_store


@pytest.fixture(scope="module")
def client(store: tuple[LocalMooncakeMaster, LocalPoolStore]) -> Iterator[MooncakeBackend]:
    master = store[0]
    cfg = {"master_server_address": master.address, "global_segment_size": 0,
           "master_admin_url": master.admin_url, "local_buffer_size": "16MB"}
    backend = MooncakeBackend(MooncakeConfig.load({"mooncake": cfg}))
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture(scope="module")
def buffers(client: MooncakeBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination, registered once (Mooncake refuses a second registration of
    memory that overlaps a registered range, and never forgets one in this client)."""
    n = 2 * KEYS * PER_KEY * SLICE
    src = torch.randint(-128, 127, (n,), dtype=torch.int8)
    dst = torch.zeros(n, dtype=torch.int8)
    client.register_buffer(src.data_ptr(), n)
    client.register_buffer(dst.data_ptr(), n)
    return src, dst


def _fragmented(src: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """Every other 16 KiB slice of ``src`` (paged KV of one block per layer), 256 per key."""
    base = src.data_ptr()
    addrs = [[base + (2 * (k * PER_KEY + j)) * SLICE for j in range(PER_KEY)]
             for k in range(KEYS)]
    return addrs, [[SLICE] * PER_KEY for _ in range(KEYS)]


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "zero-copy"])
def test_fragmented_batch_moves_in_sized_calls(
        client: MooncakeBackend, buffers: tuple[torch.Tensor, torch.Tensor], staged: bool) -> None:
    src, dst = buffers
    dst.zero_()
    calls = SizedCalls.for_backend(client)
    assert calls.limits == TCP_LIMITS
    if staged:
        got = attach_staging([calls], client, "cpu", 1 << 20, PER_KEY * SLICE)
        assert got == PER_KEY * SLICE == calls.staging.nbytes  # type: ignore[union-attr]
    keys = [f"staging-test/{uuid.uuid4().hex}/{k}" for k in range(KEYS)]
    addrs, sizes = _fragmented(src)
    assert calls.put(keys, addrs, sizes) == [0] * KEYS
    # Staged: one value of 4 MiB fills the 4 MiB buffer, a call per key; zero-copy: 1,024
    # slices per call, four keys.
    assert calls.calls == (KEYS if staged else KEYS * PER_KEY // TCP_LIMITS.max_slices)
    assert calls.staged_keys == (KEYS if staged else 0)
    out_addrs, _ = _fragmented(dst)
    assert calls.get(keys, out_addrs, sizes) == [PER_KEY * SLICE] * KEYS
    view = (-1, 2, SLICE)
    assert torch.equal(dst.view(view)[:, 0], src.view(view)[:, 0])
    assert not dst.view(view)[:, 1].any()  # the gaps between slices were never written
    client.batch_remove(keys)


def test_a_value_of_more_ranges_than_a_call_carries_is_staged_whatever_their_size() -> None:
    """Llama-3-70B at block 16: 2,560 ranges of 64 KiB per 512-token chunk. Zero-copy, the
    key goes alone in one call over the TCP lane's queue and fails with -800 after 60 s; staged,
    it is one range. Ranges at or above ``stage_below`` move zero-copy up to ``max_slices``."""
    big = TCP_LIMITS.stage_below  # the mean range that alone never stages
    n = TCP_LIMITS.max_slices
    buf = StagingBuffer((n + 1) * big, lambda addr, size: None)  # mmap: untouched, not resident
    calls = SizedCalls(lambda *a: [], lambda *a: [], TCP_LIMITS, buf)
    for count, staged in ((n, False), (n + 1, True)):
        addrs, sizes = [[1 << 40] * count], [[big] * count]
        assert calls.stages_all(addrs, sizes) is staged, count
    # One range less than a whole small value: staged by its mean range, as before.
    assert calls.stages_all([[1, 2]], [[big - 1, big - 1]])
    # No staging threshold (RDMA, Ascend): never staged, however many ranges.
    rdma = SizedCalls(lambda *a: [], lambda *a: [], dataclasses.replace(TCP_LIMITS,
                      stage_below=0), buf)
    assert not rdma.stages_all([[1 << 40] * (n + 1)], [[big] * (n + 1)])


def test_staged_calls_overlap_copies_and_never_overwrite_a_call_in_flight(
        client: MooncakeBackend, buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A buffer of 2.5 values: a call per value, the helper copies the next call's value
    while a call is in the store (every put sees its successor copied before it goes out),
    in a region the running call does not use (the bytes a put sends are the source's, before
    and after it), and the blocks are free (``copied``) before the last put ended; the values
    come back bit-exact through a pipelined get."""
    src, dst = buffers
    dst.zero_()
    value = PER_KEY * SLICE
    keys = [f"staging-test/{uuid.uuid4().hex}/{k}" for k in range(KEYS)]
    addrs, sizes = _fragmented(src)
    want = {k: b"".join(ctypes.string_at(a, n) for a, n in zip(addrs[i], sizes[i], strict=True))
            for i, k in enumerate(keys)}
    sent: list[bool] = []
    freed_at: list[int] = []

    def in_buffer(a: list[list[int]], n: list[list[int]]) -> list[bytes]:
        return [ctypes.string_at(x[0], y[0]) for x, y in zip(a, n, strict=True)]

    def put(ks: list[str], a: list[list[int]], n: list[list[int]]) -> list[int]:
        ahead = _until(lambda: calls.staged_keys >= min(len(sent) + 2, KEYS), 30)
        assert in_buffer(a, n) == [want[k] for k in ks]
        rc = client.batch_put_from(ks, a, n)
        assert in_buffer(a, n) == [want[k] for k in ks]  # not overwritten while in the store
        sent.append(ahead)
        return rc

    calls = SizedCalls(put, client.batch_get_into, TCP_LIMITS,
                       StagingBuffer(5 * value // 2, client.register_buffer))
    assert calls.put(keys, addrs, sizes, lambda: freed_at.append(len(sent))) == [0] * KEYS
    assert calls.calls == calls.staged_keys == KEYS
    assert sent == [True] * KEYS
    assert len(freed_at) == 1 and freed_at[0] < KEYS
    out_addrs, _ = _fragmented(dst)
    assert calls.get(keys, out_addrs, sizes) == [value] * KEYS
    assert calls.calls == 2 * KEYS
    view = (-1, 2, SLICE)
    assert torch.equal(dst.view(view)[:, 0], src.view(view)[:, 0])
    assert not dst.view(view)[:, 1].any()
    client.batch_remove(keys)


def test_missing_key_is_not_scattered(client: MooncakeBackend,
                                      buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A staged get that does not come back whole leaves the ranges as they were."""
    dst = buffers[1][: 4 * SLICE]
    dst.fill_(7)
    calls = SizedCalls.for_backend(client)
    calls.staging = StagingBuffer(4 * SLICE, client.register_buffer)
    base = dst.data_ptr()
    res = calls.get([f"staging-test/absent/{uuid.uuid4().hex}"],
                    [[base, base + 2 * SLICE]], [[SLICE, SLICE]])
    assert res[0] < 0
    assert calls.staged_keys == 1 and bool((dst == 7).all())


@dataclass(frozen=True)
class _Settings:
    block_size: int = 16
    chunk_size: int = 64
    use_layerwise: bool = False
    load_async: bool = False
    layerwise_timeout_ms: int = 2_000
    save_budget_bytes: int = 256 << 20
    hash_algo: str = "sha256"
    checksum: bool = False
    staging_buffer_bytes: int | None = 1 << 20
    save_nice: int = 0


@pytest.mark.parametrize(("checksum", "staging"), [(False, 1 << 20), (True, 1 << 20),
                                                   (False, None)],
                         ids=["plain", "checksum", "auto-buffer"])
def test_worker_moves_llama3_8b_blocks_through_staging(client: MooncakeBackend,
                                                       checksum: bool, staging: int | None
                                                       ) -> None:
    """KVPoolWorker at Llama-3-8B's KV shape (32 layers x 8 KV heads x 128, bf16, 16-token
    blocks: 64 KiB per block and layer), every other block (as a busy engine's free queue hands
    them out: no two adjacent), against the separate store process: each 8 MiB value is 128
    slices of 64 KiB, so it is staged and comes back bit-exact: one value a call in a buffer
    of 1 MiB (raised to one value), all four in one call in the default buffer (``auto``: 64
    MiB, calls of at most half)."""
    settings = _Settings(checksum=checksum, staging_buffer_bytes=staging)
    chunks, bpc = 4, settings.chunk_size // settings.block_size
    shape = (2 * chunks * bpc + 1, 8, 16, 256)
    src = {f"model.layers.{i}.self_attn.attn": torch.randn(shape, dtype=torch.bfloat16)
           for i in range(32)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    _KEEP.append((src, dst))
    writer = KVPoolWorker(settings, ParallelLayout(), "real-shape", client, Reporter())
    writer.register_kv_caches(src)
    reader = KVPoolWorker(settings, ParallelLayout(), "real-shape", client, Reporter())
    reader.register_kv_caches(dst)
    _KEEP.append((writer, reader))
    src_ids = list(range(0, 2 * chunks * bpc, 2))
    dst_ids = list(range(1, 2 * chunks * bpc + 1, 2))
    tokens = chunks * settings.chunk_size
    hashes = chunk_hashes(list(range(tokens)), settings.chunk_size, extra=uuid.uuid4().bytes)
    writer.start_load_kv(KVPoolConnectorMetadata())
    writer.wait_for_save(KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id="w", block_ids=src_ids, chunk_hashes=hashes, save_from_chunk=0,
        save_to_chunk=chunks, is_last_save=True)]))
    assert writer.drain_saves(120)
    value = 32 * bpc * (64 << 10)
    assert (writer.counters.saved_keys, writer.counters.save_failed_keys) == (chunks, 0)
    assert writer.counters.saved_bytes == chunks * value
    reader.start_load_kv(KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id="r", block_ids=dst_ids, chunk_hashes=hashes,
        load=LoadSpec(0, tokens, can_load=True))]))
    assert not reader.get_block_ids_with_load_errors()
    assert reader.counters.loaded_bytes == chunks * value
    for name, t in src.items():
        assert torch.equal(t[src_ids], dst[name][dst_ids]), name
        assert not dst[name][[b - 1 for b in dst_ids]].any()  # blocks between stay untouched
    saves, loads = writer._saves.calls, reader._loads.calls
    assert saves.staged_keys == loads.staged_keys == chunks
    assert saves.calls == loads.calls == (chunks if staging else 1)
    writer.shutdown()
    reader.shutdown()
    # 32 MiB of values per case in the module's 256 MiB pool: gone before the next test saves
    # (leased for 10 s, the master would refuse its puts for space meanwhile).
    client.remove_by_scope(ALL_KEYS_PATTERN, dry_run=False, force=True)


def test_the_default_buffer_holds_four_of_the_models_values(client: MooncakeBackend) -> None:
    """``staging_buffer: auto`` (the default, ``None``) at Llama-3-8B's KV shape in 256-token
    chunks (32 MiB values): each transfer thread's buffer holds four values, past the 64 MiB a
    fixed default gave (calls of one value: no copy overlapped a put). The caches' pages and
    the buffer's are never touched: only the sizes are read."""
    settings = _Settings(chunk_size=256, staging_buffer_bytes=None)
    bpc = settings.chunk_size // settings.block_size
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros((bpc + 1, 8, 16, 256),
                                                              dtype=torch.bfloat16)
              for i in range(32)}
    worker = KVPoolWorker(settings, ParallelLayout(), "auto-buffer", client, Reporter())
    worker.register_kv_caches(caches)
    _KEEP.append((caches, worker))
    value = 32 * bpc * (64 << 10) + CHECKSUM_BYTES
    assert value > 16 << 20  # four of them are past the 64 MiB floor
    for calls in (worker._saves.calls, worker._loads.calls):
        assert calls.staging is not None and calls.staging.nbytes == 4 * value
    worker.shutdown()


def _thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_save_nice_and_transfer_cpus_place_the_transfer_threads(
        client: MooncakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """``save_nice: 7``: the save thread (its put) and its copy helper (the staged copy) run 7
    nice levels below the engine's thread, capped at 19; the load thread and its scatter keep
    the engine's priority. ``cpus`` (``transfer_cpus``): all four run on those CPUs, the
    engine's thread stays where it is. The values still arrive bit-exact."""
    settings = _Settings(save_nice=7)
    allowed = frozenset(os.sched_getaffinity(0))
    cpus = frozenset({max(allowed)})
    bpc = settings.chunk_size // settings.block_size
    shape = (4 * bpc + 1, 8, 16, 256)
    src = {f"model.layers.{i}.self_attn.attn": torch.randn(shape, dtype=torch.bfloat16)
           for i in range(8)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    writer = KVPoolWorker(settings, ParallelLayout(), "placed", client, Reporter(), cpus=cpus)
    writer.register_kv_caches(src)
    reader = KVPoolWorker(settings, ParallelLayout(), "placed", client, Reporter(), cpus=cpus)
    reader.register_kv_caches(dst)
    _KEEP.append((src, dst, writer, reader))
    src_ids, dst_ids = list(range(0, 4 * bpc, 2)), list(range(1, 4 * bpc + 1, 2))
    hashes = chunk_hashes(list(range(2 * settings.chunk_size)), settings.chunk_size,
                          extra=uuid.uuid4().bytes)
    seen: dict[str, set[tuple[int, frozenset[int]]]] = {
        "put": set(), "copy": set(), "get": set(), "scatter": set()}

    def spy(what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen[what].add((_thread_nice(), frozenset(os.sched_getaffinity(0))))
            return fn(*args, **kwargs)
        return call

    saves, loads = writer._saves.calls, reader._loads.calls
    saves._put = spy("put", saves._put)  # type: ignore[method-assign]
    loads._get = spy("get", loads._get)  # type: ignore[method-assign]
    monkeypatch.setattr(staging, "_gather", spy("copy", staging._gather))
    monkeypatch.setattr(staging, "_scatter_all", spy("scatter", staging._scatter_all))
    engine = _thread_nice()
    writer.start_load_kv(KVPoolConnectorMetadata())
    writer.wait_for_save(KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id="w", block_ids=src_ids, chunk_hashes=hashes, save_from_chunk=0,
        save_to_chunk=2, is_last_save=True)]))
    assert writer.drain_saves(120)
    assert (writer.counters.saved_keys, writer.counters.save_failed_keys) == (2, 0)
    reader.start_load_kv(KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id="r", block_ids=dst_ids, chunk_hashes=hashes,
        load=LoadSpec(0, 2 * settings.chunk_size, can_load=True))]))
    assert not reader.get_block_ids_with_load_errors()
    for name, t in src.items():
        assert torch.equal(t[src_ids], dst[name][dst_ids]), name
    assert saves.staged_keys == loads.staged_keys == 2  # the copy helpers did run
    lowered = min(19, engine + 7)
    assert seen == {"put": {(lowered, cpus)}, "copy": {(lowered, cpus)},
                    "get": {(engine, cpus)}, "scatter": {(engine, cpus)}}, (engine, seen)
    assert frozenset(os.sched_getaffinity(0)) == allowed
    writer.shutdown()
    reader.shutdown()


def _until(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


Caches = dict[str, torch.Tensor]


def _writer_and_reader(settings: _Settings, client: MooncakeBackend, model: str, chunks: int
                       ) -> tuple[Caches, Caches, KVPoolWorker, KVPoolWorker, list[int],
                                  list[int], list[str]]:
    """A writer and a reader of ``model`` over 8 layers of Llama-3's KV heads (8 x 128,
    bf16), their caches, the writer's blocks (every other one: values are fragmented, so they
    are staged), the reader's, and the hashes of ``chunks`` chunks of a fresh prompt."""
    bpc = settings.chunk_size // settings.block_size
    shape = (2 * chunks * bpc + 1, 8, 16, 256)
    src = {f"model.layers.{i}.self_attn.attn": torch.randn(shape, dtype=torch.bfloat16)
           for i in range(8)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    writer = KVPoolWorker(settings, ParallelLayout(), model, client, Reporter())
    writer.register_kv_caches(src)
    reader = KVPoolWorker(settings, ParallelLayout(), model, client, Reporter())
    reader.register_kv_caches(dst)
    _KEEP.append((src, dst, writer, reader))
    tokens = chunks * settings.chunk_size
    hashes = chunk_hashes(list(range(tokens)), settings.chunk_size, extra=uuid.uuid4().bytes)
    return (src, dst, writer, reader, list(range(0, 2 * chunks * bpc, 2)),
            list(range(1, 2 * chunks * bpc + 1, 2)), hashes)


def test_stopped_store_never_holds_engine_blocks(
        store: tuple[LocalMooncakeMaster, LocalPoolStore], client: MooncakeBackend) -> None:
    """The store SIGSTOPped during a save (issue 38): the values are copied to the staging
    buffer, the request is reported finished_sending (vLLM frees its blocks) while the put is
    still stuck, the blocks are then overwritten as vLLM would reuse them, and after SIGCONT the
    pool holds the bytes of the save, never the overwritten ones. The agent's view of it
    (issue 38 item 4): no block held, the save's bytes staged, its age growing; none once it
    ended."""
    proc = store[1].proc
    assert proc is not None
    settings = _Settings(staging_buffer_bytes=32 << 20)  # the whole save at once
    chunks = 4
    src, dst, writer, reader, src_ids, dst_ids, hashes = _writer_and_reader(
        settings, client, "stopped", chunks)
    saved = {k: v[src_ids].clone() for k, v in src.items()}
    tokens = chunks * settings.chunk_size
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        writer.start_load_kv(KVPoolConnectorMetadata())
        writer.wait_for_save(KVPoolConnectorMetadata(requests=[ReqMeta(
            req_id="w", block_ids=src_ids, chunk_hashes=hashes, save_from_chunk=0,
            save_to_chunk=chunks, is_last_save=True)]))
        finished: set[str] = set()

        def released() -> bool:
            finished.update(writer.get_finished({"w"})[0] or ())
            return "w" in finished

        assert _until(released, 20), "blocks held while the store does not answer"
        assert writer.inflight_saves == 1  # the put itself is still waiting for the store
        for t in src.values():  # vLLM hands the freed blocks to another request
            t[src_ids] = 0
        agg = Aggregator(Source(agent_id="w/0", engine_id="w", instance_role="mixed",
                                kv_role="kv_both", process_role="worker"))
        agg.apply(writer.reporter.drain())
        started = agg.in_flight[("w", "save")].started_ms
        tr = agg.state(started + 1500).transfers
        nbytes = chunks * settings.chunk_size * 8 * 2 * 128 * 2 * 8  # tokens x K,V x layers
        assert (tr.save_blocks_held, tr.save_bytes_staged, tr.oldest_save_age_ms) == (
            0, nbytes, 1500.0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert writer.drain_saves(120)
    agg.apply(writer.reporter.drain())
    tr = agg.state(started + 1500).transfers
    assert (tr.save_blocks_held, tr.save_bytes_staged, tr.oldest_save_age_ms) == (0, 0, 0.0)
    reader.start_load_kv(KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id="r", block_ids=dst_ids, chunk_hashes=hashes,
        load=LoadSpec(0, tokens, can_load=True))]))
    failed = reader.get_block_ids_with_load_errors()
    assert writer.counters.saved_keys + writer.counters.save_failed_keys == chunks
    for name, want in saved.items():
        got = dst[name][dst_ids]
        for j, block in enumerate(dst_ids):  # a block is the saved bytes, or failed: recompute
            assert block in failed or torch.equal(got[j], want[j]), (name, block)
    assert writer.counters.saved_keys == chunks and not failed  # the put went through


def test_layerwise_save_reports_its_copy(client: MooncakeBackend) -> None:
    """A layer-wise save at Llama-3's KV heads (8 layers, staged per layer) tells the operators
    its blocks are free once its last layer is copied (issue 38 item 5): before that copy every
    block is held; after it none is, and only the last layer's bytes are staged (the earlier
    layers' puts ended); nothing once the save ended."""
    settings = _Settings(use_layerwise=True, staging_buffer_bytes=32 << 20)
    chunks = 2
    _, _, writer, _, src_ids, _, hashes = _writer_and_reader(
        settings, client, "layerwise-copy", chunks)
    meta = KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id="w", block_ids=src_ids, chunk_hashes=hashes, save_from_chunk=0,
        save_to_chunk=chunks, is_last_save=True)])
    writer.start_load_kv(meta)
    assert writer.kv is not None
    for layer in writer.kv.layers:
        writer.save_kv_layer(layer.name, None)
    writer.wait_for_save(meta)
    assert writer.drain_saves(120)
    assert (writer.counters.saved_keys, writer.counters.save_failed_keys) == (8 * chunks, 0)
    events = writer.reporter.drain()
    (at,) = [i for i, ev in enumerate(events) if isinstance(ev, SaveCopied)]
    agg = Aggregator(Source(agent_id="lw/0", engine_id="lw", instance_role="mixed",
                            kv_role="kv_both", process_role="worker"))
    agg.apply(events[:at])
    started = agg.in_flight[("w", "save")].started_ms
    nbytes = chunks * settings.chunk_size * 8 * 2 * 128 * 2 * 8  # tokens x K,V x layers
    tr = agg.state(started + 100).transfers
    assert (tr.save_blocks_held, tr.save_bytes_staged) == (len(src_ids), 0)
    agg.apply(events[at:at + 1])
    tr = agg.state(started + 100).transfers
    assert (tr.save_blocks_held, tr.save_bytes_staged, tr.oldest_save_age_ms) == (
        0, nbytes // 8, 100.0)
    agg.apply(events[at + 1:])
    tr = agg.state(started + 100).transfers
    assert (tr.save_blocks_held, tr.save_bytes_staged, tr.oldest_save_age_ms) == (0, 0, 0.0)
    assert tr.saves_finished == 1 and tr.saved_bytes == nbytes


def test_stopped_store_turns_an_inline_load_into_recompute(
        store: tuple[LocalMooncakeMaster, LocalPoolStore], client: MooncakeBackend) -> None:
    """A load the SIGSTOPped store does not answer (issue 38): the step waits
    ``layerwise_timeout_ms``, not Mooncake's 60 s transfer timeout, every block of the load is
    reported failed (vLLM recomputes it), and the bytes that arrive after SIGCONT are never
    scattered into the blocks."""
    proc = store[1].proc
    assert proc is not None
    settings = _Settings(layerwise_timeout_ms=500)
    chunks = 2
    _, dst, writer, reader, src_ids, dst_ids, hashes = _writer_and_reader(
        settings, client, "stalled-load", chunks)
    tokens = chunks * settings.chunk_size
    writer.start_load_kv(KVPoolConnectorMetadata())
    writer.wait_for_save(KVPoolConnectorMetadata(requests=[ReqMeta(
        req_id="w", block_ids=src_ids, chunk_hashes=hashes, save_from_chunk=0,
        save_to_chunk=chunks, is_last_save=True)]))
    assert writer.drain_saves(60) and writer.counters.saved_keys == chunks
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        reader.start_load_kv(KVPoolConnectorMetadata(requests=[ReqMeta(
            req_id="r", block_ids=dst_ids, chunk_hashes=hashes,
            load=LoadSpec(0, tokens, can_load=True))]))
        waited = time.monotonic() - started
        assert reader.get_block_ids_with_load_errors() == set(dst_ids)
        # Bounded by the budget, far below Mooncake's 60 s (a loaded machine adds seconds).
        assert waited < 30, waited
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # The load thread's late get ends; nothing of it reaches the blocks.
    reader._loads.executor.submit(lambda: None).result(120)
    assert all(not t.any() for t in dst.values())
    assert reader.counters.loaded_keys == 0
