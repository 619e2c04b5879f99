"""openYuanrong datasystem backend: the pool is a local ``datasystem_worker`` (``dscli start``)
reached through ``yr.datasystem.KVClient``.

Data path. ``KVClient`` has no call that reads from or writes into caller addresses on a CPU
host (``DsTensorClient``'s ``mset_d2h``/``mget_h2d`` take NPU tensors only). So each value is
moved with exactly one ``memcpy`` per address range, in ``_gather``/``_scatter`` and nowhere
else:

- put: ``mcreate(keys, sizes)`` allocates the values in the worker (in its shared memory for
  values of ``oc_shm_transfer_threshold_kb`` = 500 KB and more), the ranges are copied into
  each buffer's ``MutableData()``, and ``mset_buffer`` publishes them. No temporary copy.
- get: ``get_buffers(keys)`` maps the stored values read-only and each is copied into its
  ranges. A value whose size differs from the sum of its ranges is not copied at all.

Keys and status codes: the worker's alphabet and its StatusCode texts are mapped to kvpool's
keys and Mooncake's ``ErrorCode`` by ``encode_key``/``status_code`` (see
``_yuanrong_names``).

Listing. The KV client cannot list keys, so ``remove_by_scope`` and ``stats`` see the keys
*this client* wrote (an in-process index of key -> size), confirmed with ``exist``; keys
written by other engines are invisible to them. The worker has no leases.

Configuration (``kv_connector_extra_config``; environment variables override):

- ``yuanrong_worker_address`` / ``$YUANRONG_WORKER_ADDRESS``: ``host:port`` of the worker
  (``dscli start -w --worker_address``). Required.
- ``yuanrong_connect_timeout_ms`` (5000) and ``yuanrong_request_timeout_ms`` (5000) /
  ``$YUANRONG_REQUEST_TIMEOUT_MS``: a dead worker turns calls into RPC_FAIL after this long.
- ``yuanrong_write_mode``: ``none_l2_cache_evict`` (default: the worker may evict values
  when its memory is full, like a cache) or ``none_l2_cache`` (never evicted).
- ``yuanrong_ttl_second`` (0 = no expiry).
- ``yuanrong_log_dir``: the worker's ``log_dir``; ``stats`` then reads the worker's own
  ``resource.log`` (object count, shared-memory use and limit).
- ``yuanrong_shared_memory_size_mb``: the worker's ``shared_memory_size_mb``, reported as
  ``PoolStats.total_bytes`` when there is no ``resource.log`` to read.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from kvpool_agent.protocol import HealthCheck, PoolStats
from kvpool_agent.vocabulary import ErrorCode
from kvpool_connector._validation import field_problems
from kvpool_connector.backends._yuanrong_names import encode_key, status_code
from kvpool_connector.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    RemoveResult,
)
from kvpool_connector.keys import probe_key

__all__ = ["YuanrongBackend", "YuanrongConfig", "encode_key", "status_code"]

_T = TypeVar("_T")

_MAX_SET_BATCH = 1000  # mcreate/mset_buffer take fewer than 2000 keys per call
_MAX_EXIST_BATCH = 10_000  # exist takes at most 10,000 keys per call


class YuanrongConfig(BaseModel):
    """Validated client settings (see the module docstring for each field)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    worker_address: str
    connect_timeout_ms: int = 5000
    request_timeout_ms: int = 5000
    write_mode: Literal["none_l2_cache_evict", "none_l2_cache"] = "none_l2_cache_evict"
    ttl_second: int = 0
    shared_memory_size_mb: int = 0
    log_dir: str | None = None

    @field_validator("worker_address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{v!r} is not host:port (e.g. '127.0.0.1:31501')")
        return v

    @field_validator("connect_timeout_ms", "request_timeout_ms")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"{v} must be > 0 milliseconds")
        return v

    @property
    def host(self) -> str:
        return self.worker_address.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.worker_address.rpartition(":")[2])

    @classmethod
    def load(cls, extra_config: dict[str, Any] | None = None) -> YuanrongConfig:
        """Settings from ``kv_connector_extra_config`` (``yuanrong_*`` keys), overridden by
        ``$YUANRONG_WORKER_ADDRESS`` and ``$YUANRONG_REQUEST_TIMEOUT_MS``.

        Raises:
            ValueError: the worker address is missing or a field is bad; the message names
                the ``kv_connector_extra_config`` key.
        """
        extra = dict(extra_config or {})
        raw = {
            name: extra[f"yuanrong_{name}"]
            for name in cls.model_fields
            if f"yuanrong_{name}" in extra
        }
        if os.environ.get("YUANRONG_WORKER_ADDRESS"):
            raw["worker_address"] = os.environ["YUANRONG_WORKER_ADDRESS"]
        if os.environ.get("YUANRONG_REQUEST_TIMEOUT_MS"):
            raw["request_timeout_ms"] = os.environ["YUANRONG_REQUEST_TIMEOUT_MS"]
        if "worker_address" not in raw:
            raise ValueError(
                "yuanrong worker address is not set: set kv_connector_extra_config."
                "yuanrong_worker_address (or $YUANRONG_WORKER_ADDRESS) to the host:port given "
                "to `dscli start -w --worker_address`"
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = field_problems(exc, "kv_connector_extra_config.yuanrong_")
            raise ValueError(f"bad yuanrong config: {problems}") from None


def _gather(dst: memoryview, addrs: Sequence[int], sizes: Sequence[int]) -> None:
    """Copy the ranges ``addrs[j]`` of ``sizes[j]`` bytes, back to back, into ``dst``."""
    off = 0
    for addr, size in zip(addrs, sizes, strict=True):
        dst[off : off + size] = memoryview((ctypes.c_ubyte * size).from_address(addr)).cast("B")
        off += size


def _scatter(src: memoryview, addrs: Sequence[int], sizes: Sequence[int]) -> None:
    """Copy ``src`` into the ranges ``addrs[j]`` of ``sizes[j]`` bytes, in order."""
    off = 0
    for addr, size in zip(addrs, sizes, strict=True):
        memoryview((ctypes.c_ubyte * size).from_address(addr)).cast("B")[:] = src[off : off + size]
        off += size


def _chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


class YuanrongBackend(Backend):
    """``Backend`` over one ``yr.datasystem.KVClient`` connected to a local worker.

    Args:
        config: validated settings.
        client: an initialised ``KVClient`` (built and ``init()``-ed from ``config`` when
            omitted).

    Raises:
        BackendUnavailable: ``yr.datasystem`` is not installed or the worker did not answer
            ``init`` within ``connect_timeout_ms``.
    """

    name: ClassVar[str] = "yuanrong"

    def __init__(self, config: YuanrongConfig, client: Any | None = None) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._index: dict[str, int] = {}
        self._closed = False
        try:
            from yr.datasystem import KVClient
            from yr.datasystem.object_client import WriteMode
        except ImportError as exc:
            raise BackendUnavailable(
                f"yr.datasystem cannot be imported ({exc}): pip install 'kvpool[yuanrong]'"
            ) from exc
        self._write_mode = WriteMode[config.write_mode.upper()]
        if client is None:
            client = KVClient(
                config.host,
                config.port,
                connect_timeout_ms=config.connect_timeout_ms,
                req_timeout_ms=config.request_timeout_ms,
            )
            try:
                client.init()
            except RuntimeError as exc:
                raise BackendUnavailable(
                    f"yuanrong worker {config.worker_address} did not answer "
                    f"({str(exc).splitlines()[0][:160]}); start one "
                    "with `dscli start -w --worker_address <host:port> ...` and check "
                    "kv_connector_extra_config.yuanrong_worker_address",
                    status_code(str(exc)),
                ) from exc
        self._client = client

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> YuanrongBackend:
        """See the module docstring for the keys. Raises ``ValueError`` naming the key, or
        ``BackendUnavailable``."""
        return cls(YuanrongConfig.load(config))

    def _call(self, fn: Callable[[], _T]) -> _T | int:
        """``fn()``, or the mapped negative code when the client raises."""
        if self._closed:
            return ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS
        try:
            return fn()
        except RuntimeError as exc:
            return status_code(str(exc))

    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        """Per key 1/0, or the mapped negative code for every key of a failed call."""
        out: list[int] = []
        for rng in _chunks(len(keys), _MAX_EXIST_BATCH):
            names = [encode_key(keys[i]) for i in rng]
            res = self._call(partial(self._client.exist, names))
            if isinstance(res, int):
                # The worker answers "not found" for a batch in which no key exists.
                out.extend([0 if res == ErrorCode.OBJECT_NOT_FOUND else res] * len(names))
            else:
                out.extend(1 if e else 0 for e in res)
        return out

    def register_buffer(self, addr: int, size: int) -> None:
        """No-op: the KV client copies from any readable address (see the module docstring),
        so there is nothing to register."""

    def batch_put_from(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Store each key as the concatenation of its ranges. Per key 0, or INVALID_PARAMS for
        ranges that don't match, or the mapped code of the failed ``mcreate``/``mset_buffer``
        (NO_AVAILABLE_HANDLE when the worker's memory is full, RPC_FAIL when it is
        unreachable)."""
        if not len(keys) == len(addrs) == len(sizes):
            raise ValueError(
                f"batch_put_from: {len(keys)} keys, {len(addrs)} address lists, "
                f"{len(sizes)} size lists"
            )
        out: list[int] = [ErrorCode.INVALID_PARAMS] * len(keys)
        valid = [
            i for i in range(len(keys))
            if len(addrs[i]) == len(sizes[i]) and sizes[i] and all(s > 0 for s in sizes[i])
        ]
        for rng in _chunks(len(valid), _MAX_SET_BATCH):
            idx = [valid[j] for j in rng]
            names = [encode_key(keys[i]) for i in idx]
            totals = [sum(sizes[i]) for i in idx]
            bufs = self._call(
                partial(
                    self._client.mcreate, names, totals, self._write_mode, self.config.ttl_second
                )
            )
            if isinstance(bufs, int):
                for i in idx:
                    out[i] = bufs
                continue
            created = []
            for i, buf in zip(idx, bufs, strict=True):
                if buf is None:
                    out[i] = ErrorCode.WRITE_FAIL  # the worker refused this key's allocation
                    continue
                _gather(memoryview(buf.MutableData()), addrs[i], sizes[i])
                created.append((i, buf))
            if not created:
                continue
            res = self._call(partial(self._client.mset_buffer, [b for _, b in created]))
            code = res if isinstance(res, int) else 0
            with self._lock:
                for i, _ in created:
                    out[i] = code
                    if code == 0:
                        self._index[keys[i]] = sum(sizes[i])
        return out

    def batch_get_into(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Load each key into its ranges. Per key the bytes read (the sum of its sizes),
        OBJECT_NOT_FOUND when absent, INVALID_PARAMS when the stored size differs (nothing is
        written then), or the mapped code of a failed call (RPC_FAIL when the worker is
        unreachable)."""
        if not len(keys) == len(addrs) == len(sizes):
            raise ValueError(
                f"batch_get_into: {len(keys)} keys, {len(addrs)} address lists, "
                f"{len(sizes)} size lists"
            )
        out: list[int] = []
        for rng in _chunks(len(keys), _MAX_SET_BATCH):
            names = [encode_key(keys[i]) for i in rng]
            bufs = self._call(partial(self._client.get_buffers, names, 0))
            if isinstance(bufs, int):
                out.extend([bufs] * len(names))
                continue
            for i, buf in zip(rng, bufs, strict=True):
                if buf is None:
                    out.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                src = memoryview(buf)
                want = sum(sizes[i])
                if src.nbytes != want or len(addrs[i]) != len(sizes[i]):
                    out.append(ErrorCode.INVALID_PARAMS)
                    continue
                _scatter(src, addrs[i], sizes[i])
                out.append(want)
        return out

    def remove_by_scope(self, pattern: str, *, dry_run: bool, force: bool = False) -> RemoveResult:
        """Remove the keys this client wrote that match ``pattern`` and still exist (see the
        module docstring: the client cannot list other writers' keys). No leases here, so
        ``force`` changes nothing.

        Raises:
            BackendError: the worker failed to answer ``exist`` or ``delete``.
        """
        regex = re.compile(pattern)
        with self._lock:
            candidates = [(k, n) for k, n in self._index.items() if regex.search(k)]
        present = self.batch_exists([k for k, _ in candidates])
        failed = [c for c in present if c < 0]
        if failed:
            raise BackendError(f"yuanrong exist failed while matching {pattern!r}", failed[0])
        matched = [(k, n) for (k, n), p in zip(candidates, present, strict=True) if p == 1]
        with self._lock:
            for (k, _), p in zip(candidates, present, strict=True):
                if p == 0:
                    self._index.pop(k, None)  # evicted or removed by someone else
        nbytes = sum(n for _, n in matched)
        if dry_run or not matched:
            return RemoveResult(keys=len(matched), bytes=nbytes)
        removed = 0
        for rng in _chunks(len(matched), _MAX_EXIST_BATCH):
            names = {encode_key(matched[i][0]): matched[i][0] for i in rng}
            res = self._call(partial(self._client.delete, list(names)))
            if isinstance(res, int):
                raise BackendError(f"yuanrong delete failed for {pattern!r}", res)
            still = set(res)
            with self._lock:
                for name, key in names.items():
                    if name not in still:
                        self._index.pop(key, None)
                        removed += 1
        return RemoveResult(keys=len(matched), bytes=nbytes, removed=removed)

    def health(self) -> list[HealthCheck]:
        """``worker``: the client's ``health_check()`` (code 0 healthy, else the mapped code);
        ``probe_put``/``probe_get``/``probe_remove``: write, read back and delete a 64-byte
        ``kvpool-probe@`` key. Never raises."""
        checks: list[HealthCheck] = []
        t0 = time.perf_counter()
        status = self._call(self._client.health_check)
        if isinstance(status, int):
            ok, code, detail = False, status, "client closed" if self._closed else "failed"
        else:
            ok = bool(status.is_ok())
            code = 0 if ok else status_code(status.to_string())
            detail = (
                f"worker {self.config.worker_address} healthy"
                if ok else f"worker {self.config.worker_address}: {status.to_string()[:200]}"
            )
        checks.append(HealthCheck(name="worker", ok=ok, code=code, detail=detail,
                                  latency_ms=(time.perf_counter() - t0) * 1e3))
        if not ok:
            return checks
        key = probe_key()
        payload = os.urandom(64)
        buf = ctypes.create_string_buffer(payload, len(payload))
        addr = ctypes.addressof(buf)
        steps: list[tuple[str, Callable[[], int], int]] = [
            ("probe_put", lambda: self.batch_put_from([key], [[addr]], [[64]])[0], 0),
            ("probe_get", lambda: self._probe_get(key, payload), 64),
            ("probe_remove", lambda: self._probe_remove(key), 0),
        ]
        for name, step, want in steps:
            t0 = time.perf_counter()
            try:
                res = step()
            except Exception as exc:  # a health check reports, never raises
                res, text = ErrorCode.INTERNAL_ERROR, repr(exc)
            else:
                text = "ok" if res == want else f"returned {res}"
            checks.append(HealthCheck(name=name, ok=res == want, code=res if res < 0 else 0,
                                      detail=text, latency_ms=(time.perf_counter() - t0) * 1e3))
        return checks

    def _probe_get(self, key: str, payload: bytes) -> int:
        back = ctypes.create_string_buffer(len(payload))
        res = self.batch_get_into([key], [[ctypes.addressof(back)]], [[len(payload)]])[0]
        if res == len(payload) and back.raw != payload:
            return ErrorCode.INVALID_READ  # bytes differ from what was written
        return res

    def _probe_remove(self, key: str) -> int:
        res = self._call(lambda: self._client.delete([encode_key(key)]))
        with self._lock:
            self._index.pop(key, None)
        if isinstance(res, int):
            return res
        return ErrorCode.INTERNAL_ERROR if res else 0

    def stats(self) -> PoolStats:
        """Pool usage. With ``yuanrong_log_dir`` (the worker's ``log_dir``; the worker is on
        this host, it shares memory with the client) from the worker's own ``resource.log``
        (written every ``log_monitor_interval_ms``, 10 s by default): ``keys`` = object nums,
        ``used_bytes`` = shm memoryUsage, ``total_bytes`` = shm totalLimit. Otherwise the
        keys and bytes this client wrote and the configured ``yuanrong_shared_memory_size_mb``
        (the KV client has no usage call). ``healthy``: the worker's ``health_check()``.
        Never raises."""
        with self._lock:
            keys, used = len(self._index), sum(self._index.values())
        out = PoolStats(
            backend=self.name, keys=keys, used_bytes=used,
            total_bytes=self.config.shared_memory_size_mb << 20,
        )
        usage = self._resource_usage()
        if usage is not None:
            out.keys, out.used_bytes, out.total_bytes = usage
        status = self._call(self._client.health_check)
        if isinstance(status, int):
            out.healthy, out.health_detail = False, f"client unavailable ({status})"
        else:
            out.healthy = bool(status.is_ok())
            out.health_detail = "" if out.healthy else status.to_string()[:200]
        return out

    def _resource_usage(self) -> tuple[int, int, int] | None:
        """(object nums, shm memoryUsage, shm totalLimit) from the last line of the worker's
        ``resource.log``; fields as the datasystem log guide documents them:
        ``time | level | file | pod | pid:tid | trace | cluster | shm info | spill info |
        client nums | object nums | object total datasize | ...`` with shm info
        ``memoryUsage/physicalMemoryUsage/totalLimit/rate/scMemoryUsage/scMemoryLimit``."""
        if not self.config.log_dir:
            return None
        path = Path(self.config.log_dir) / "resource.log"
        try:
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - 8192))
                lines = f.read().decode(errors="replace").strip().splitlines()
            fields = [x.strip() for x in lines[-1].split("|")]
            shm = fields[7].split("/")
            return int(fields[10]), int(shm[0]), int(shm[2])
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        """Stop using the client; later calls return UNAVAILABLE_IN_CURRENT_STATUS.
        Idempotent."""
        self._closed = True
