"""Pinned prefixes (``kvpool_connector.pins``) against a real mooncake_master: a pinned prefix
survives a flood that evicts everything unpinned, also the chunks saved after the pin; it is gone
after unpin + pressure; a pin over its share of the pool is refused with the numbers. With a
store process and two store clients (issue 40): two pins written at once are both kept and each
can be unpinned; a hard pin's chunks already in the pool outlive their soft pin's TTL; a new pin
reaches another rank within a poll, and a simulated engine's real connector worker without an
agent within 2 s."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from pins_testlib import wait_held

from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.keys import chunk_hashes, pins_key
from kvpool_connector.pins import PinnableBackend, PinRefused, Pins, pinned_chunks
from kvpool_replay import (
    EngineSpec,
    LocalMooncakeMaster,
    LocalPoolStore,
    ModelShape,
    free_port,
    mooncake_extra_config,
)

CHUNK = 16
VALUE = 256 << 10  # bytes per chunk value: a 32 MB segment holds ~128
_ALIVE: list[object] = []


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[MooncakeBackend, torch.Tensor]]:
    # A short lease: every exists check takes one, and unpin waits leases out, then a short
    # transfer timeout (a leased key is tried again that long after, kvpool_connector._removals).
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=500) as m:
        b = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": m.address, "global_segment_size": "32MB",
            "local_buffer_size": "4MB", "master_admin_url": m.admin_url,
            "transfer_timeout_ms": 1000}}))
        buf = torch.randint(0, 255, (VALUE,), dtype=torch.uint8)
        b.register_buffer(buf.data_ptr(), buf.numel())
        _ALIVE.append(buf)
        yield b, buf
        b.close()


def _keys(hashes: list[str]) -> list[str]:
    return [f"kvpool@test-pins@{h}" for h in hashes]


def _put(b: MooncakeBackend, buf: torch.Tensor, keys: list[str]) -> list[int]:
    return b.batch_put_from(keys, [[buf.data_ptr()]] * len(keys), [[VALUE]] * len(keys))


def _pins(b: MooncakeBackend, **kw: object) -> Pins:
    return Pins(b, _keys, CHUNK, VALUE, lambda: b.stats().total_bytes,
                lease_wait_s=10.0, **kw)  # type: ignore[arg-type]


def _flood(b: MooncakeBackend, buf: torch.Tensor, tag: str, deadline_s: float = 90.0) -> None:
    """Put unpinned values until the pool evicted the first of them (3x the pool at least).
    They are checked once per lease at most: each check leases them, and a leased value is
    never evicted."""
    first = [f"kvpool@flood-{tag}-{i}" for i in range(32)]
    _put(b, buf, first)
    end = time.monotonic() + deadline_s
    n, checked = 0, time.monotonic()
    while True:
        batch = [f"kvpool@flood-{tag}-x{n + i}" for i in range(32)]
        _put(b, buf, batch)
        n += 32
        if n >= 384 and time.monotonic() - checked > 0.6:
            if not any(rc == 1 for rc in b.batch_exists(first)):
                return
            checked = time.monotonic()
        assert time.monotonic() < end, "the flood never evicted the unpinned values"


def test_pinned_prefix_survives_a_flood_and_goes_after_unpin(
        pool: tuple[MooncakeBackend, torch.Tensor]) -> None:
    b, buf = pool
    pins = _pins(b)
    saved = list(range(CHUNK * 4 + 5))  # 4 whole chunks, saved before the pin
    later = [7, *range(100, 100 + CHUNK * 3)]  # 3 chunks, saved after it
    saved_keys = _keys(chunk_hashes(saved, CHUNK))
    later_keys = _keys(chunk_hashes(later, CHUNK))
    unpinned = _keys(chunk_hashes([9] * CHUNK * 2, CHUNK))
    assert _put(b, buf, saved_keys + unpinned) == [0] * 6
    r = pins.pin("system", saved)
    assert (r.pinned_now, r.pending, r.pin.tokens, r.errors) == (4, 0, 4 * CHUNK, {})
    r = pins.pin("template", later, mode="hard")
    assert (r.pinned_now, r.pending) == (0, 3)
    assert r.pinned_bytes == 7 * VALUE == pins.pinned_bytes
    # Saved later, in one batch with an unpinned key: the pinned ones are put pinned.
    late_unpinned = _keys(chunk_hashes([11] * CHUNK, CHUNK))
    assert _put(b, buf, [later_keys[0], *late_unpinned, *later_keys[1:]]) == [0] * 4
    unpinned += late_unpinned

    _flood(b, buf, "a")
    assert b.batch_exists(unpinned) == [0, 0, 0]
    assert b.batch_exists(saved_keys + later_keys) == [1] * 7
    got = b.store.get(saved_keys[0])
    assert got == bytes(buf.numpy())  # the value itself, not only its key

    assert pins.unpin("system") == 4
    assert [p.pin_id for p in pins.list()] == ["template"]
    _flood(b, buf, "b")
    assert b.batch_exists(saved_keys) == [0] * 4
    assert b.batch_exists(later_keys) == [1] * 3
    with pytest.raises(KeyError):
        pins.unpin("system")


def test_pin_over_its_share_is_refused_with_the_numbers(
        pool: tuple[MooncakeBackend, torch.Tensor]) -> None:
    b, _ = pool
    pins = _pins(b, share=0.3)
    total = b.stats().total_bytes
    fits = int(total * 0.3) // VALUE
    pins.pin("ok", list(range(CHUNK * fits)))
    with pytest.raises(PinRefused) as info:
        pins.pin("big", list(range(5000, 5000 + CHUNK * 2)))
    msg = str(info.value)
    assert f"{(fits + 2) * VALUE:,}" in msg and f"{total:,}" in msg and "30%" in msg
    assert [p.pin_id for p in pins.list()] == ["ok"]
    with pytest.raises(ValueError, match="no whole chunk"):
        pins.pin("short", [1, 2, 3])
    with pytest.raises(ValueError, match="ttl_ms > 0"):
        pins.pin("nottl", list(range(CHUNK)), ttl_ms=0)
    assert pins.unpin("ok") >= 0


# Pins that hold (issue 40): the records of a layout are versioned, hard pins on chunks in the
# pool are renewed before their soft pin lapses, and a started Pins learns a new pin within a
# poll. A pool of its own: a store process (standalone clients, as engines in production) and a
# master whose longest soft pin is short, so a lapse happens within the test.
SOFT_TTL_MS = 10_000
"""The master's ``max_kv_soft_pin_ttl`` here (ms): a hard pin's chunks in the pool hold a soft
pin this long, renewed every third of it. 3 s lapsed once at load average 20 (a renewal poll
late by over 2 s), 5 s once in a CI rehearsal at load average 11 (three test workers, the
flood's puts on the test's own thread); 10 s leaves a renewal 6.7 s late."""
SHAPE = ModelShape(layers=4, kv_heads=4, head_size=64, block_size=16)
ENGINE_CHUNK = 64
"""A simulated engine's chunk: 64 tokens x 4,096 bytes, one 64 KiB value per KV head."""


@dataclass
class HeldPool:
    a: MooncakeBackend
    b: MooncakeBackend
    buf_a: torch.Tensor
    buf_b: torch.Tensor
    record_key: str
    master_address: str
    admin_url: str


@pytest.fixture(scope="module")
def held() -> Iterator[HeldPool]:
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=500, extra_args=[
            f"-max_kv_soft_pin_ttl={SOFT_TTL_MS}", f"-default_kv_soft_pin_ttl={SOFT_TTL_MS}"]
            ) as m, LocalPoolStore(m, 32 << 20):
        conf = mooncake_extra_config(m.address, m.admin_url, lease_ttl_ms=500)["mooncake"]
        conf.update(local_buffer_size="4MB", transfer_timeout_ms=1000,
                    max_kv_soft_pin_ttl=SOFT_TTL_MS)
        # Two store clients: two workers (TP ranks) of one layout.
        a, b = (MooncakeBackend(MooncakeConfig.load({"mooncake": conf})) for _ in range(2))
        bufs = []
        for backend in (a, b):
            buf = torch.randint(0, 255, (VALUE,), dtype=torch.uint8)
            backend.register_buffer(buf.data_ptr(), buf.numel())
            bufs.append(buf)
            _ALIVE.append(buf)
        try:
            yield HeldPool(a, b, bufs[0], bufs[1], "kvpool-pins@test-pins@layout", m.address,
                           m.admin_url)
        finally:
            a.close()
            b.close()


def _held_pins(p: HeldPool, b: PinnableBackend) -> Pins:
    return _pins(b, record_key=p.record_key)  # type: ignore[arg-type]


class _Interleaved:
    """A store client whose first records write lets ``first`` run before it: another
    worker's pin completes between this worker's read of the records and its write."""

    def __init__(self, inner: MooncakeBackend, first: Callable[[], object]) -> None:
        self.inner, self.first = inner, first

    def create_record(self, key: str, data: bytes) -> int:
        if self.first is not None:
            first, self.first = self.first, None
            first()
        return self.inner.create_record(key, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_concurrent_pins_are_both_kept_and_each_unpinnable(held: HeldPool) -> None:
    one = list(range(CHUNK * 2))
    two = list(range(500, 500 + CHUNK * 3))
    pins_a = _held_pins(held, held.a)
    # Worker b reads the records (no pin), then worker a pins "one", then b writes "two":
    # a read-modify-write of one record lost "one" here.
    pins_b = _held_pins(held, _Interleaved(held.b, lambda: pins_a.pin("one", one, "hard")))
    pins_b.pin("two", two, "hard")
    reader = _held_pins(held, held.a)
    reader.refresh(force=True)
    assert sorted((p.pin_id, p.mode, p.tokens) for p in reader.list()) == [
        ("one", "hard", 2 * CHUNK), ("two", "hard", 3 * CHUNK)]
    assert {p.pin_id for p in pins_b.list()} == {"one", "two"}
    assert held.b.pinned_keys >= 5  # b saves both prefixes pinned
    # What a remover of chunks (the policy service) reads: both prefixes.
    assert pinned_chunks(held.b, "test-pins", "layout", CHUNK) == frozenset(
        chunk_hashes(one, CHUNK) + chunk_hashes(two, CHUNK))

    # Each unpinned by the worker that did not make it.
    pins_a.unpin("two")
    pins_b.unpin("one")
    reader.refresh(force=True)
    assert reader.list() == []
    assert pinned_chunks(held.a, "test-pins", "layout", CHUNK) == frozenset()


def test_hard_pin_on_chunks_in_the_pool_outlives_their_soft_pin_ttl(held: HeldPool) -> None:
    hard = list(range(1000, 1000 + CHUNK * 3))
    soft = list(range(2000, 2000 + CHUNK * 2))
    hard_keys = _keys(chunk_hashes(hard, CHUNK))
    soft_keys = _keys(chunk_hashes(soft, CHUNK))
    assert _put(held.a, held.buf_a, hard_keys + soft_keys) == [0] * 5
    pins = _held_pins(held, held.a)
    r = pins.pin("hard", hard, "hard")
    assert (r.pinned_now, r.pending) == (3, 0)  # upserted soft-pinned: Mooncake's only way
    # The control: a soft pin of the same TTL, which nothing renews.
    assert pins.pin("soft", soft, "soft", ttl_ms=SOFT_TTL_MS).pinned_now == 2
    pinned_ms = time.time() * 1e3
    pins.start()
    try:
        # Past two TTLs of the first soft pin, renewed (every TTL / 3) meanwhile.
        wait_held(lambda: time.time() * 1e3 > pinned_ms + 2 * SOFT_TTL_MS and pins.renewals >= 4,
              30, "renewals")
        _flood(held.a, held.buf_a, "held")
        assert held.a.batch_exists(hard_keys) == [1] * 3
        assert held.a.batch_exists(soft_keys) == [0] * 2  # lapsed, and evicted
        assert held.a.store.get(hard_keys[0]) == bytes(held.buf_a.numpy())
    finally:
        pins.close()
    assert pins.unpin("hard") == 3


def test_a_new_pin_reaches_another_rank_within_a_poll(held: HeldPool) -> None:
    prefix = list(range(3000, 3000 + CHUNK * 2))  # not in the pool: saved after the pin
    keys = _keys(chunk_hashes(prefix, CHUNK))
    rank0, rank1 = _held_pins(held, held.a), _held_pins(held, held.b)
    rank1.refresh(force=True)  # its start; no agent refreshes it after
    rank1.start()
    try:
        assert rank1.pinned_keys() == frozenset()
        rank0.pin("late", prefix, "hard")
        # The poll asks every PIN_POLL_S (0.5 s); the bound leaves a loaded 2-core CI its
        # margin (the records were read every 10 s before, never without an agent).
        wait_held(lambda: rank1.pinned_keys() == frozenset(keys), 2.0, "rank 1 learns the pin")
        # Rank 1 saves the prefix: put hard-pinned, it outlives a flood.
        assert _put(held.b, held.buf_b, keys) == [0, 0]
        _flood(held.a, held.buf_a, "late")
        assert held.a.batch_exists(keys) == [1, 1]
        rank0.unpin("late")
        wait_held(lambda: not rank1.pinned_keys(), 2.0, "rank 1 learns the unpin")
    finally:
        rank1.close()


def test_an_engine_without_an_agent_takes_a_new_pin_within_a_poll(held: HeldPool) -> None:
    from kvpool_replay._sim_engine import SimEngine

    # A simulated engine's real connector worker on the pool, no agent (agent_address None):
    # only its own poll thread (started with its KV caches) can tell it of a pin.
    extra = mooncake_extra_config(held.master_address, held.admin_url, lease_ttl_ms=500)
    extra["mooncake"]["max_kv_soft_pin_ttl"] = SOFT_TTL_MS
    model = "org/pin-poll"
    engine = SimEngine(EngineSpec(
        engine_id="pin-poll", master_address=held.master_address, model=model, shape=SHAPE,
        chunk_size=ENGINE_CHUNK, trace_path="unused", wait_saves=True,
        lookup_rpc_port=free_port(), extra_config=extra), num_blocks=64)
    try:
        worker = engine.worker.pool_worker
        assert worker is not None and worker.pinned_keys is not None
        # The pin is made by another worker of the layout (its own store client).
        other = Pins(held.a, worker.rank_keys, ENGINE_CHUNK, worker.key_bytes,
                     lambda: held.a.stats().total_bytes,
                     record_key=pins_key(model, worker.layout_digest))
        prefix = list(range(ENGINE_CHUNK * 2))
        keys = frozenset(worker.rank_keys(chunk_hashes(prefix, ENGINE_CHUNK)))
        assert len(keys) == 2 * SHAPE.kv_heads and not worker.pinned_keys()
        other.pin("poll", prefix, "hard")
        # Polled every 0.5 s (PIN_POLL_S); the bound leaves a loaded CI its margin.
        wait_held(lambda: keys <= worker.pinned_keys(), 2.0, "the engine learns the pin")
        other.unpin("poll")
        wait_held(lambda: not worker.pinned_keys(), 2.0, "the engine learns the unpin")
    finally:
        engine.close()
    # Its poll thread stopped with it.
    assert not [t for t in threading.enumerate() if t.name == "kvpool-pins"]
