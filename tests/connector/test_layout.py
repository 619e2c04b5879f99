"""KV layout discovery (block dimension, regions, merged ranges) and the device ordering layer,
on CPU tensors shaped like each vLLM attention backend's caches."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool_connector._device import DeviceSync, _StreamSync, device_sync_for
from kvpool_connector._layout import KVLayout, find_block_dim, ranges_for_blocks


@pytest.mark.parametrize(("shape", "hint", "dim"), [
    ((2, 100, 16, 8, 64), None, 1),       # FlashAttention (K/V first)
    ((100, 2, 16, 8, 64), None, 0),       # FlashInfer (blocks first)
    ((100, 8, 16, 128), None, 0),         # vLLM CPU
    ((100, 16, 576), None, 0),            # MLA
    ((2, 2, 16, 8, 64), 2, 1),            # two blocks: the hint resolves the K/V axis
    ((7, 100, 16), 100, 1),               # unusual layout, found by the hint
])
def test_find_block_dim(shape: tuple[int, ...], hint: int | None, dim: int) -> None:
    assert find_block_dim(shape, hint) == dim


def test_find_block_dim_errors() -> None:
    with pytest.raises(ValueError, match="no dimension"):
        find_block_dim((4, 16, 8), 99)
    with pytest.raises(ValueError, match="at least one dimension"):
        find_block_dim((), None)


def test_flash_attention_layer_has_separate_k_and_v_regions() -> None:
    t = torch.zeros(2, 10, 16, 4, 8, dtype=torch.float16)
    kv = KVLayout.from_kv_caches({"a": t, "b": torch.zeros_like(t)})
    assert kv.num_blocks == 10
    (k, v) = kv.layers[0].regions
    block = 16 * 4 * 8 * 2
    assert (k.base, k.stride, k.block_len) == (t.data_ptr(), block, block)
    assert v.base == t.data_ptr() + 10 * block
    assert kv.layers[0].block_bytes == 2 * block
    assert kv.block_bytes == 4 * block
    assert len(kv.spans) == 2 and kv.spans[0][1] == t.numel() * 2
    assert kv.layer_index("b") == 1
    with pytest.raises(KeyError, match="registered"):
        kv.layer_index("c")


def test_mla_tuple_and_shared_storage() -> None:
    base = torch.zeros(10 * (32 + 8) * 16, dtype=torch.bfloat16)
    # Both tensors view one allocation (as vLLM's raw KV buffers do): one span to register.
    nope = base[: 10 * 16 * 32].view(10, 16, 32)
    pe = base[10 * 16 * 32 :].view(10, 16, 8)
    kv = KVLayout.from_kv_caches({"l0": (nope, pe)})
    r0, r1 = kv.layers[0].regions
    assert (r0.block_len, r1.block_len) == (16 * 32 * 2, 16 * 8 * 2)
    assert kv.spans == [(base.data_ptr(), base.numel() * 2)]


def test_strided_blocks_and_rejected_layouts() -> None:
    # Blocks with padding between them (stride > block length) are fine.
    padded = torch.zeros(6, 40)[:, :32]
    kv = KVLayout.from_kv_caches({"l": padded})
    r = kv.layers[0].regions[0]
    assert (r.stride, r.block_len) == (160, 128)
    # A block scattered in memory (block dimension innermost) cannot be moved as one range.
    scattered = torch.zeros(16, 6).t()
    with pytest.raises(ValueError, match="not one contiguous byte range"):
        KVLayout.from_kv_caches({"l": scattered})
    with pytest.raises(ValueError, match="disagree"):
        KVLayout.from_kv_caches({"a": torch.zeros(6, 4), "b": torch.zeros(7, 4)})
    with pytest.raises(ValueError, match="no layers"):
        KVLayout.from_kv_caches({})


def test_ranges_merge_contiguous_blocks_and_route_skipped_to_scratch() -> None:
    t = torch.zeros(2, 10, 4, dtype=torch.uint8)  # 4 bytes per block, K and V regions
    kv = KVLayout.from_kv_caches({"l": t}, num_blocks=10)
    base = t.data_ptr()
    addrs, sizes = ranges_for_blocks(kv.layers, [3, 4, 5, 8])
    assert addrs == [base + 12, base + 32, base + 40 + 12, base + 40 + 32]
    assert sizes == [12, 4, 12, 4]
    addrs, sizes = ranges_for_blocks(kv.layers, [3, 4, 5], skip=frozenset({3}), scratch=999)
    assert addrs == [999, base + 16, 999, base + 40 + 16]
    assert sizes == [4, 8, 4, 8]
    with pytest.raises(IndexError):
        ranges_for_blocks(kv.layers, [10])


def test_cpu_device_sync_is_a_no_op() -> None:
    sync = device_sync_for(torch.device("cpu"))
    assert type(sync) is DeviceSync and sync.kind == "cpu"
    assert sync.record() is None
    sync.wait(None)


class _Stream:
    pass


class _Event:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self, stream: Any = None) -> None:
        self.log.append(f"record:{type(stream).__name__}")

    def synchronize(self) -> None:
        self.log.append("event.synchronize")


class _Accel:
    """Stand-in for ``torch.npu`` / ``torch.cuda`` (no accelerator here), with the real
    names: ``Event()``, ``Event.record(stream)``, ``Event.synchronize()``,
    ``current_stream()``."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def Event(self) -> _Event:  # named like torch.npu.Event
        return _Event(self.log)

    def current_stream(self) -> _Stream:
        return _Stream()


def test_stream_sync_orders_transfers_after_compute() -> None:
    accel = _Accel()
    sync = _StreamSync(accel, "npu")
    marker = sync.record()  # on the engine thread, after the step's kernels were queued
    assert accel.log == ["record:_Stream"]
    sync.wait(marker)  # on the transfer thread, before the backend touches the blocks
    assert accel.log == ["record:_Stream", "event.synchronize"]
    sync.wait(None)
    assert len(accel.log) == 2


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None,
                    reason="torch_npu is installed: the missing-driver message cannot occur")
def test_npu_without_torch_npu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"torch_npu.*kvpool\[ascend\]"):
        # torch.device("npu") only parses once torch_npu registered the device type; the
        # worker passes the caches' device, whose .type is all that is read.
        device_sync_for(SimpleNamespace(type="npu"))  # type: ignore[arg-type]
