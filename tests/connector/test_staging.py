"""Backend calls sized to the transport (``kvpool_connector.staging``) against a real
``mooncake_master`` and a separate ``mooncake_client`` store process, TCP on 127.0.0.1.

The batch is the one Mooncake's TCP lane refuses when sent as one call: 3,072 slices of 16 KiB
(12 keys of 256 slices; one call of it fails with -800 TRANSFER_FAIL after 60 s, issue 38).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.staging import TCP_LIMITS, SizedCalls, StagingBuffer, attach_staging
from kvpool_replay import LocalMooncakeMaster, LocalPoolStore

SLICE = 16 << 10
PER_KEY = 256
KEYS = 12


@pytest.fixture(scope="module")
def client() -> Iterator[MooncakeBackend]:
    with LocalMooncakeMaster(eviction_high_watermark_ratio=0.95) as master, \
            LocalPoolStore(master, 256 << 20):
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
