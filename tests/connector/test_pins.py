"""Pinned prefixes (``kvpool_connector.pins``) against a real mooncake_master: a pinned prefix
survives a flood that evicts everything unpinned, also the chunks saved after the pin; it is gone
after unpin + pressure; a pin over its share of the pool is refused with the numbers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.keys import chunk_hashes
from kvpool_connector.pins import PinRefused, Pins
from kvpool_replay import LocalMooncakeMaster

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
