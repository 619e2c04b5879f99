"""Ordering pool transfers against the accelerator's compute stream.

The worker moves KV bytes on its own threads while the model runs on the device's compute
stream. Two rules keep the bytes right:

* a save reads a block only after the step that wrote it has finished on the device: the
  worker records an event on the compute stream when the step (or layer) is done and the
  transfer thread waits for that event before the backend reads the memory;
* a load writes a block only after the compute stream's earlier work on it (for example vLLM
  zeroing newly allocated blocks) has finished: same event, recorded in ``start_load_kv``;
  and a loaded block is visible before attention reads it because the backend's batch get
  has completed on the host before ``start_load_kv`` / ``wait_for_layer_load`` return, so
  every kernel that reads it is enqueued after the bytes landed.

On Ascend the events are ``torch_npu``'s (``torch.npu.Event``; ``torch_npu`` is imported only
when the caches live on an NPU), on CUDA ``torch.cuda.Event``; on CPU the forward pass is
synchronous and every method is a no-op.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

__all__ = ["DeviceSync", "device_sync_for"]


class DeviceSync:
    """Stream ordering for one device type; the CPU implementation does nothing.

    ``record()`` returns an opaque marker (``None`` on CPU) that ``wait()`` blocks on from any
    thread.
    """

    kind = "cpu"

    def record(self) -> Any:
        """Mark the current point of the compute stream; returns the marker."""
        return None

    def wait(self, marker: Any) -> None:
        """Block the calling (transfer) thread until the work before ``marker`` is done."""


class _StreamSync(DeviceSync):
    """Events on the compute stream of a ``torch.cuda``-like module (``torch.cuda``,
    ``torch.npu``): ``Event()``, ``Event.record(stream)``, ``Event.synchronize()``,
    ``current_stream()``."""

    def __init__(self, module: ModuleType | Any, kind: str) -> None:
        self._mod = module
        self.kind = kind

    def record(self) -> Any:
        event = self._mod.Event()
        event.record(self._mod.current_stream())
        return event

    def wait(self, marker: Any) -> None:
        if marker is not None:
            marker.synchronize()



def device_sync_for(device: torch.device) -> DeviceSync:
    """The ordering helper for caches on ``device``.

    Raises:
        RuntimeError: the caches are on an NPU but ``torch_npu`` is not installed (install the
            ``ascend`` extra), or on a device type this connector does not support.
    """
    if device.type == "cpu":
        return DeviceSync()
    if device.type == "cuda":
        return _StreamSync(torch.cuda, "cuda")
    if device.type == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise RuntimeError(
                "KV caches are on an Ascend NPU but torch_npu is not importable: "
                "pip install 'kvpool[ascend]'"
            ) from exc
        return _StreamSync(torch.npu, "npu")  # type: ignore[attr-defined]
    raise RuntimeError(f"unsupported KV cache device type {device.type!r} (cpu, cuda, npu)")
