"""Backend calls sized to the transport: a per-call slice cap, and staging of fragmented values.

A value (one pool key) is a list of address ranges, one per (layer, region, run of adjacent
blocks) (``_layout.ranges_for_blocks`` already merges adjacent blocks). Each range is one slice
of Mooncake's transfer engine. Measured here with mooncake-transfer-engine 0.3.13.post1, TCP on
127.0.0.1, the segment in a separate ``mooncake_client`` process (``bench/bench_datapath.py
--cross-process`` repeats it):

* one ``batch_put_from_multi_buffers`` of 2,048 slices of 16 KiB completes; one of 3,072 is
  refused by the TCP lane (``TCP lane queue-full rejection``) and every key fails with -800
  TRANSFER_FAIL after 60 s. The queue is per peer and shared by every call of the client, and a
  worker runs one save and one load thread at once: ``TCP_LIMITS.max_slices`` is half of it;
* slices of 16-64 KiB move at 0.2-0.5 GB/s, slices of 256 KiB and more (and contiguous values)
  at 0.6-1.8 GB/s on the same machine, while a host memory copy runs at several GB/s: a value
  whose mean slice is below ``TCP_LIMITS.stage_below`` is copied into a registered staging
  buffer and moved as one contiguous range (copy-then-put; get-then-scatter on loads);
* a value of more slices than ``max_slices`` is staged whatever their size: it would go alone
  in one call over the cap (Llama-3-70B at block 128 in 4,096-token chunks: one key of 2,560
  slices of 512 KiB failed with -800 zero-copy).

The threshold also keeps the engine's waits bounded, which zero-copy cannot: a staged save
frees its blocks once copied, a staged inline load waits ``layerwise_timeout_ms`` at most (its
late bytes land in the buffer, never in a block), while a zero-copy call reads or writes the
blocks until it returns (up to the store client's transfer timeout). Zero-copy was faster for
values of at most ``max_slices`` slices of 64 KiB and more (issue 38, ``docs/benchmarks.md``:
0.77-0.89x raw contiguous against 0.73-0.79x staged at Llama-3-8B's 64 KiB slices, 0.90-1.01x
against 0.70-0.76x at MLA's 144 KiB); the threshold stays at 256 KiB, as lowering it gives up
the bound for those shapes (16-token blocks of every real model, MLA at 128).

RDMA and Ascend (HCCS/RoCE) transports post one work request per slice with their own queue
depths; they are not measured here, so they keep the same per-call slice cap (a bound that is
never wrong, at worst one more call) and move values zero-copy (``stage_below`` 0). Yuanrong
and MemCache take a value's ranges in one call of their own SDK with no slice queue seen:
``Backend.transport_limits`` gives them no limit.

Staging copies with ``ctypes.memmove``, so it needs the KV caches in host memory; caches on a
device (CUDA, NPU) are only split by the slice cap (``SizedCalls`` is built without staging).

Copies and backend calls overlap (issue 38: copied on one thread, then put, the staged path
ran at 0.67-0.89x raw contiguous). A staged batch moves in calls of at most half the buffer
(a value larger than half goes alone), and a helper thread per ``SizedCalls`` copies: on a
save it copies every call's values into the buffer one call after the other while the transfer
thread puts the calls already copied (a call's region is reused only once the put that read it
returned); on a load it scatters a call's values into their blocks while the transfer thread
gets the next call. ``ctypes.memmove`` and Mooncake's batch calls both release the GIL. With a
buffer of one value (a value as large as ``staging_buffer``) the calls cannot overlap, and with
two each call carries one value: the default buffer (``staging_buffer: auto``) holds four
values (calls of two, one copied while the other moves). Measured (``bench_datapath.py
--cross-process``, Llama-3-8B at block 16 in 256-token chunks of 32 MiB, 8 per operation, one
engine, 11 rounds): worker / raw contiguous 0.72x save and 0.69x load with 64 MiB (calls of
one value), 0.82x / 0.81x with 128 MiB (four values), 0.82x / 0.80x with 256 MiB.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from kvpool_connector.sizes import parse_size

if TYPE_CHECKING:
    from kvpool_connector.backends.base import Backend

__all__ = [
    "AUTO_STAGING_MAX_BYTES",
    "AUTO_STAGING_MIN_BYTES",
    "AUTO_STAGING_VALUES",
    "NO_LIMITS",
    "TCP_LIMITS",
    "SizedCalls",
    "StagingBuffer",
    "TransportLimits",
    "attach_staging",
    "parse_staging_buffer",
]

AUTO_STAGING_MIN_BYTES = 64 << 20
"""Least bytes of the default staging buffer per transfer thread (``staging_buffer: auto``): a
Llama-3-8B chunk of 512 tokens (128 KiB per token), or 32 of its 16-token chunks."""

AUTO_STAGING_VALUES = 4
"""Values the default buffer holds (``staging_buffer: auto``): calls of two values, the next
call's copy overlapping this call's transfer (see the module's measurements)."""

AUTO_STAGING_MAX_BYTES = 1 << 30
"""Most bytes the default buffer takes for ``AUTO_STAGING_VALUES`` (two buffers per worker):
past it, fewer values (at least one)."""


_KEY = "kv_connector_extra_config.staging_buffer"
_FIX = 'use a size like "256MB", or "auto" (the default)'


def parse_staging_buffer(value: object) -> int | None:
    """The connector's ``staging_buffer`` (``kv_connector_extra_config``): ``"auto"`` (the
    default: ``None``, sized by ``StagingBuffer.sized``) or a size in whole bytes.

    Raises:
        ValueError: not ``"auto"`` and not a size of a whole number of bytes, more than 0
            (``kvpool_connector.sizes.parse_size``); one line naming the key and the fix. A
            YAML ``staging_buffer:`` left empty is ``null`` and a bool would be 1 byte to
            ``int``: both are refused as no size, and ``1.5`` is not taken as 1 byte.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    if value is None or isinstance(value, bool):
        raise ValueError(f"{_KEY}: {json.dumps(value)} is not a size; {_FIX}")
    try:
        nbytes = parse_size(cast("int | float | str", value), whole=True)
    except ValueError as exc:
        raise ValueError(f'{_KEY}: {exc}, or "auto"') from None
    if nbytes <= 0:
        raise ValueError(f'{_KEY}: must be more than 0 bytes, e.g. "256MB", or "auto" (the '
                         "default)")
    return nbytes


@dataclass(frozen=True, slots=True)
class TransportLimits:
    """What one backend call may carry.

    Attributes:
        name: the transport (``tcp``, ``rdma``, ``ascend``, ``none``).
        max_slices: address ranges per call, all keys together (a key is never split: a key
            of more ranges goes alone, staged when it can be).
        stage_below: a value whose mean range is smaller than this (bytes) is staged, and one
            of more than ``max_slices`` ranges whatever their size; 0 never.
    """

    name: str
    max_slices: int
    stage_below: int


TCP_LIMITS = TransportLimits("tcp", max_slices=1024, stage_below=256 << 10)
"""Mooncake TCP (see the module docstring for the measurements behind both figures)."""

NO_LIMITS = TransportLimits("none", max_slices=1 << 30, stage_below=0)
"""Backends without a slice queue: one call per batch, zero-copy."""


_RETAINED: list[mmap.mmap] = []
"""Every staging buffer's memory, never unmapped: Mooncake keeps a registration for the life of
its client (memory freed and handed out again is refused as overlapping, -600, or written by a
late transfer), and a transfer thread may still be inside a call at shutdown. A leak, never a
free under a thread."""


class StagingBuffer:
    """A reusable host buffer of ``nbytes`` bytes, registered with the backend once.

    Anonymous ``mmap`` memory: pages are resident only once touched, so a buffer sized for a
    large value costs nothing until values of that size move through it.

    Args:
        nbytes: size in bytes (> 0).
        register: ``Backend.register_buffer``, called with the buffer's address and size.

    Raises:
        BackendError: the backend refused to register the buffer.
    """

    def __init__(self, nbytes: int, register: Callable[[int, int], None]) -> None:
        # mmap, not torch: backends.base imports this module and kvpool_config (which
        # never imports torch) imports the backends.
        mem = mmap.mmap(-1, nbytes)
        _RETAINED.append(mem)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        self.nbytes = nbytes
        register(self.addr, nbytes)

    @staticmethod
    def sized(configured: int | None, value_bytes: int) -> int:
        """Bytes of a staging buffer for values of ``value_bytes`` bytes: ``configured``, or
        by default (``None``, ``staging_buffer: auto``) ``AUTO_STAGING_VALUES`` values, at
        least ``AUTO_STAGING_MIN_BYTES`` and at most ``AUTO_STAGING_MAX_BYTES``; either way
        raised to one value (a value is staged whole or not at all)."""
        if configured is None:
            configured = max(AUTO_STAGING_MIN_BYTES,
                             min(AUTO_STAGING_VALUES * value_bytes, AUTO_STAGING_MAX_BYTES))
        return max(configured, value_bytes)


class SizedCalls:
    """Puts and gets of a batch of keys as backend calls within ``limits``.

    Args:
        put, get: ``Backend.batch_put_from`` / ``batch_get_into``.
        limits: the transport's (``Backend.transport_limits``).
        staging: the buffer of this thread (one per transfer thread: calls of one
            ``SizedCalls`` never overlap); ``None``: zero-copy only.
        thread_init: run first on the helper thread that copies (its transfer thread's
            priority and CPUs: ``_transfers``); ``None``: nothing.

    ``staged_bytes``/``staged_keys``/``calls`` count what went through (for benchmarks and
    tests).
    """

    def __init__(self, put: Callable[..., list[int]], get: Callable[..., list[int]],
                 limits: TransportLimits = NO_LIMITS, staging: StagingBuffer | None = None,
                 thread_init: Callable[[], None] | None = None) -> None:
        self._put, self._get = put, get
        self._thread_init = thread_init
        self.limits = limits
        self.staging = staging
        self.staged_bytes = 0
        self.staged_keys = 0
        self.calls = 0
        self._helper: ThreadPoolExecutor | None = None

    def _copier(self) -> ThreadPoolExecutor:
        """The helper thread that copies into (saves) and out of (loads) the staging buffer
        while the transfer thread is in a backend call; started on first use."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvpool-stage",
                                              initializer=self._thread_init)
        return self._helper

    @classmethod
    def for_backend(cls, backend: Backend, thread_init: Callable[[], None] | None = None
                    ) -> SizedCalls:
        """Zero-copy calls within ``backend.transport_limits()`` (``attach_staging`` adds a
        staging buffer)."""
        return cls(backend.batch_put_from, backend.batch_get_into, backend.transport_limits(),
                   thread_init=thread_init)

    def _staged(self, addrs: Sequence[int], sizes: Sequence[int]) -> bool:
        if self.staging is None or len(addrs) < 2:
            return False
        total = sum(sizes)
        if total > self.staging.nbytes:
            return False
        # A value of more ranges than a call may carry would go alone over the cap (Llama-3-70B
        # at block 128 in 4,096-token chunks: 2,560 ranges of 512 KiB, -800 zero-copy): staged
        # whatever its ranges' size, when the transport has a staging threshold at all.
        too_many = self.limits.stage_below > 0 and len(addrs) > self.limits.max_slices
        return too_many or total < self.limits.stage_below * len(addrs)

    def stages_all(self, addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
                   ) -> bool:
        """True when every value goes through the staging buffer (a get of them writes no
        destination range before its value came back whole)."""
        return all(self._staged(a, s) for a, s in zip(addrs, sizes, strict=True))

    def _calls(self, addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
               ) -> list[tuple[list[int], list[bool]]]:
        """Per call: the key indices it carries and whether each is staged. A call ends
        before it would pass ``max_slices`` or (staged keys) half the staging buffer (so the
        next call's values can be copied while it runs; a larger value goes alone)."""
        cap = self.limits.max_slices
        room = self.staging.nbytes // 2 if self.staging is not None else 0
        out: list[tuple[list[int], list[bool]]] = []
        idx: list[int] = []
        staged: list[bool] = []
        slices = used = 0
        for i, (a, s) in enumerate(zip(addrs, sizes, strict=True)):
            st = self._staged(a, s)
            n = 1 if st else len(a)
            nbytes = sum(s) if st else 0
            if idx and (slices + n > cap or used + nbytes > room):
                out.append((idx, staged))
                idx, staged, slices, used = [], [], 0, 0
            idx.append(i)
            staged.append(st)
            slices += n
            used += nbytes
        if idx:
            out.append((idx, staged))
        return out

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]],
            sizes: Sequence[Sequence[int]], copied: Callable[[], None] | None = None
            ) -> list[int]:
        """``Backend.batch_put_from`` of every key, in calls within the limits; staged values
        are copied into the staging buffer first (their source blocks are read once, before
        their call), by the helper thread while earlier calls run. Per key the put's result
        code. Raises what the backend raises.

        ``copied`` is called once the source ranges are read no more: when every value is
        staged, as soon as the last one is in the buffer (on the helper thread: the engine's
        blocks are then free however long the store takes to answer), else after the last
        call."""
        results = [0] * len(keys)
        plan = self._calls(addrs, sizes)
        if self.staging is None or not any(any(st) for _, st in plan):
            for idx, _ in plan:
                self._put_call(keys, idx, [list(addrs[i]) for i in idx],
                               [list(sizes[i]) for i in idx], results)
            if copied is not None:
                copied()
            return results
        all_staged = all(all(st) for _, st in plan)
        ring = _Ring(self.staging.nbytes)
        filled = [threading.Event() for _ in plan]
        sent = [threading.Event() for _ in plan]
        layouts: list[tuple[list[list[int]], list[list[int]]] | None] = [None] * len(plan)
        stop = threading.Event()

        def fill() -> None:
            try:
                for k, (idx, staged) in enumerate(plan):
                    off = ring.place(_staged_bytes(idx, staged, sizes), sent)
                    if stop.is_set():
                        return
                    c_addrs, c_sizes, _ = self._layout(idx, staged, addrs, sizes, True, off)
                    layouts[k] = (c_addrs, c_sizes)
                    filled[k].set()
                if copied is not None and all_staged:
                    copied()
            finally:
                for ev in filled:  # a call not filled (stopped, or a copy raised) is not sent
                    ev.set()

        job = self._copier().submit(fill)
        try:
            for k, (idx, _) in enumerate(plan):
                filled[k].wait()
                layout = layouts[k]
                if layout is None:
                    job.result()  # raises what the copy raised
                    raise RuntimeError("kvpool staging: a call was never copied")
                self._put_call(keys, idx, layout[0], layout[1], results)
                sent[k].set()
        finally:
            stop.set()
            for ev in sent:  # the helper waits for no region any more
                ev.set()
            job.result()
        if copied is not None and not all_staged:
            copied()
        return results

    def _put_call(self, keys: Sequence[str], idx: list[int], addrs: list[list[int]],
                  sizes: list[list[int]], results: list[int]) -> None:
        got = self._put([keys[i] for i in idx], addrs, sizes)
        self.calls += 1
        for i, rc in zip(idx, got, strict=True):
            results[i] = int(rc)

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]],
            sizes: Sequence[Sequence[int]], cancel: threading.Event | None = None
            ) -> list[int]:
        """``Backend.batch_get_into`` of every key, in calls within the limits; a staged value
        lands in the staging buffer and is scattered into its ranges (by the helper thread,
        while the next call runs) only when it came back whole and ``cancel`` is not set (its
        reader gave up on it). Returns once every scatter ended; per key the bytes read or an
        error code. Raises what the backend raises."""
        results = [0] * len(keys)
        plan = self._calls(addrs, sizes)
        if self.staging is None or not any(any(st) for _, st in plan):
            for idx, _ in plan:
                got = self._get([keys[i] for i in idx], [list(addrs[i]) for i in idx],
                                [list(sizes[i]) for i in idx])
                self.calls += 1
                for i, res in zip(idx, got, strict=True):
                    results[i] = int(res)
            return results
        ring = _Ring(self.staging.nbytes)
        scattered = [threading.Event() for _ in plan]
        jobs: list[Future[None]] = []
        try:
            for k, (idx, staged) in enumerate(plan):
                off = ring.place(_staged_bytes(idx, staged, sizes), scattered)
                c_addrs, c_sizes, _ = self._layout(idx, staged, addrs, sizes, False, off)
                got = [int(r) for r in self._get([keys[i] for i in idx], c_addrs, c_sizes)]
                self.calls += 1
                for i, res in zip(idx, got, strict=True):
                    results[i] = res
                whole = [(c_addrs[j][0], i) for j, i in enumerate(idx)
                         if staged[j] and got[j] == c_sizes[j][0]]
                jobs.append(self._copier().submit(_scatter_all, whole, addrs, sizes, cancel,
                                                  scattered[k]))
        finally:
            for job in jobs:
                job.result()
        return results

    def _layout(self, idx: list[int], staged: list[bool], addrs: Sequence[Sequence[int]],
                sizes: Sequence[Sequence[int]], copy_in: bool, off: int = 0
                ) -> tuple[list[list[int]], list[list[int]], int]:
        """The call's ranges: a staged key's one range in the staging buffer from offset
        ``off`` on (filled from its ranges when ``copy_in``), the others' own ranges; and the
        offset after the last staged value."""
        out_a: list[list[int]] = []
        out_s: list[list[int]] = []
        for i, st in zip(idx, staged, strict=True):
            if not st:
                out_a.append(list(addrs[i]))
                out_s.append(list(sizes[i]))
                continue
            assert self.staging is not None
            dst = self.staging.addr + off
            if copy_in:
                _gather(dst, addrs[i], sizes[i])
            n = sum(sizes[i])
            out_a.append([dst])
            out_s.append([n])
            off += n
            self.staged_bytes += n
            self.staged_keys += 1
        return out_a, out_s, off


def attach_staging(calls: Sequence[SizedCalls], backend: Backend, device_type: str,
                   configured: int | None, value_bytes: int) -> int:
    """Give each of ``calls`` (one per transfer thread) a staging buffer of its own, registered
    with ``backend``, when its transport stages fragmented values and the caches are in host
    memory (``device_type`` ``cpu``). Each buffer is ``StagingBuffer.sized(configured,
    value_bytes)`` bytes (``configured``: ``staging_buffer_bytes``, ``None`` for the default;
    ``value_bytes``: a chunk of every layer, with its digest). Returns the bytes of each buffer
    (0: none).

    Raises:
        BackendError: the backend refused to register a buffer.
    """
    if device_type != "cpu" or not calls or calls[0].limits.stage_below <= 0:
        return 0
    nbytes = StagingBuffer.sized(configured, value_bytes)
    for c in calls:
        c.staging = StagingBuffer(nbytes, backend.register_buffer)
    return nbytes


class _Ring:
    """Where each call of a batch puts its staged values in a buffer of ``room`` bytes: right
    after the previous call's, or at 0 when they do not fit before the end. A region is handed
    out once every earlier call whose region it overlaps is done with it (its event set)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.regions: list[tuple[int, int]] = []
        self.cursor = 0

    def place(self, need: int, done: Sequence[threading.Event]) -> int:
        """The offset of the next call's ``need`` bytes (<= ``room``), after waiting for the
        earlier calls using that region (``done[j]``: call ``j`` no longer uses its region)."""
        off = self.cursor if self.cursor + need <= self.room else 0
        for j, (start, end) in enumerate(self.regions):
            if need and start < off + need and off < end:
                done[j].wait()
        self.regions.append((off, off + need))
        self.cursor = off + need
        return off


def _staged_bytes(idx: list[int], staged: list[bool], sizes: Sequence[Sequence[int]]) -> int:
    """Bytes of a call's staged values in the staging buffer."""
    return sum(sum(sizes[i]) for i, st in zip(idx, staged, strict=True) if st)


def _scatter_all(whole: list[tuple[int, int]], addrs: Sequence[Sequence[int]],
                 sizes: Sequence[Sequence[int]], cancel: threading.Event | None,
                 done: threading.Event) -> None:
    """Scatter each ``(buffer address, key index)`` of ``whole`` into the key's ranges unless
    ``cancel`` is set; ``done`` is set at the end, whatever happens (the buffer region is free
    again)."""
    try:
        for src, i in whole:
            if cancel is not None and cancel.is_set():
                return
            _scatter(src, addrs[i], sizes[i])
    finally:
        done.set()


def _gather(dst: int, addrs: Sequence[int], sizes: Sequence[int]) -> None:
    """Copy the ranges one after another to ``dst`` (host memory)."""
    for a, s in zip(addrs, sizes, strict=True):
        ctypes.memmove(dst, a, s)
        dst += s


def _scatter(src: int, addrs: Sequence[int], sizes: Sequence[int]) -> None:
    """Copy the bytes at ``src`` back into the ranges, in order (host memory)."""
    for a, s in zip(addrs, sizes, strict=True):
        ctypes.memmove(a, src, s)
        src += s
