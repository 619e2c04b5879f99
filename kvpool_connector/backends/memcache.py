"""MemCache backend: ``memcache_hybrid.DistributedObjectStore`` (MemFabric), as vLLM Ascend's
``MemcacheBackend`` uses it.

Data path: zero-copy by address. ``batch_put_from_layers`` / ``batch_get_into_layers`` take per
key a list of layer addresses and sizes, exactly ``Backend``'s shape. ``direct`` is the copy
direction of MemFabric's ``BmCopyType``: host buffers use ``H2G`` (3) to put and ``G2H`` (2)
to get; NPU buffers (``memcache_buffer_location = "device"``) use ``L2G`` (0) and ``G2L`` (1).
MemCache answers 0 per key on success; ``batch_get_into`` turns that into the byte count.

Setup. Settings (``MemcacheConfig``) and the Ascend driver checks live in
``_memcache_setup``: without the driver ``from_config`` raises
``BackendUnavailable("memcache needs the Ascend driver: ...")`` carrying the package's own
error lines (from a time-limited ``init`` in a child process), and
``MemcacheBackend.check(config)`` returns the same as ``HealthCheck`` results.

Return codes: MemCache's ``MmcErrorCode`` (``mmc_types.h``) mapped to Mooncake's
``ErrorCode`` (``kvpool_agent.vocabulary``) by ``MMC_CODES`` (MMC_OBJECT_NOT_EXISTS ->
OBJECT_NOT_FOUND, MMC_NOT_ENOUGH_MEMORY -> NO_AVAILABLE_HANDLE, MMC_LEASE_EXPIRED ->
LEASE_EXPIRED, ...; unknown -> INTERNAL_ERROR).

Listing and stats come from the meta service's HTTP endpoint (``memcache_metrics_url``, the
meta service's ``metrics_url``): ``/get_all_keys`` (one key per line), ``/health`` and
``/metrics`` (Prometheus text).

Configuration: ``memcache_<field>`` keys of ``kv_connector_extra_config`` (see
``MemcacheConfig``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, ClassVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent.protocol import HealthCheck, PoolStats
from kvpool_agent.vocabulary import ErrorCode
from kvpool_connector.backends._memcache_setup import (
    MemcacheConfig,
    ascend_driver_problem,
    probe_init,
    reachable,
)
from kvpool_connector.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    RemoveResult,
)

__all__ = [
    "MMC_CODES",
    "MemcacheBackend",
    "MemcacheConfig",
    "MmcErrorCode",
    "ascend_driver_problem",
    "meta_stats",
    "mmc_code",
    "probe_init",
]


class MmcErrorCode(IntEnum):
    """The MemCache return codes kvpool maps, named as in MemFabric's ``mmc_types.h``."""

    MMC_ERROR = -1
    MMC_INVALID_PARAM = -3000
    MMC_MALLOC_FAILED = -3001
    MMC_NOT_STARTED = -3003
    MMC_TIMEOUT = -3004
    MMC_DUPLICATED_OBJECT = -3006
    MMC_OBJECT_NOT_EXISTS = -3007
    MMC_NOT_INITIALIZED = -3008
    MMC_EXCEED_CAPACITY = -3013
    MMC_LINK_NOT_FOUND = -3014
    MMC_NOT_ENOUGH_MEMORY = -3016
    MMC_NOT_CONNET_META = -3017
    MMC_NOT_CONNET_LOCAL = -3018
    MMC_CLIENT_NOT_INIT = -3019
    MMC_UNMATCHED_STATE = -3101
    MMC_UNMATCHED_KEY = -3102
    MMC_LEASE_NOT_EXPIRED = -3104
    MMC_LEASE_EXPIRED = -3106


_Mmc = MmcErrorCode
MMC_CODES: dict[int, ErrorCode] = {
    _Mmc.MMC_ERROR: ErrorCode.INTERNAL_ERROR,
    _Mmc.MMC_INVALID_PARAM: ErrorCode.INVALID_PARAMS,
    _Mmc.MMC_MALLOC_FAILED: ErrorCode.NO_AVAILABLE_HANDLE,
    _Mmc.MMC_NOT_STARTED: ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    _Mmc.MMC_TIMEOUT: ErrorCode.RPC_FAIL,
    _Mmc.MMC_DUPLICATED_OBJECT: ErrorCode.OBJECT_ALREADY_EXISTS,
    _Mmc.MMC_OBJECT_NOT_EXISTS: ErrorCode.OBJECT_NOT_FOUND,
    _Mmc.MMC_NOT_INITIALIZED: ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    _Mmc.MMC_EXCEED_CAPACITY: ErrorCode.NO_AVAILABLE_HANDLE,
    _Mmc.MMC_LINK_NOT_FOUND: ErrorCode.RPC_FAIL,
    _Mmc.MMC_NOT_ENOUGH_MEMORY: ErrorCode.NO_AVAILABLE_HANDLE,
    _Mmc.MMC_NOT_CONNET_META: ErrorCode.RPC_FAIL,
    _Mmc.MMC_NOT_CONNET_LOCAL: ErrorCode.RPC_FAIL,
    _Mmc.MMC_CLIENT_NOT_INIT: ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    _Mmc.MMC_UNMATCHED_STATE: ErrorCode.REPLICA_IS_NOT_READY,
    _Mmc.MMC_UNMATCHED_KEY: ErrorCode.OBJECT_NOT_FOUND,
    _Mmc.MMC_LEASE_NOT_EXPIRED: ErrorCode.OBJECT_HAS_LEASE,
    _Mmc.MMC_LEASE_EXPIRED: ErrorCode.LEASE_EXPIRED,
}
"""MemCache ``MmcErrorCode`` -> Mooncake ``ErrorCode``."""

_DIRECT = {"host": (3, 2), "device": (0, 1)}  # (put, get): H2G/G2H or L2G/G2L


def mmc_code(code: int) -> int:
    """Mooncake ``ErrorCode`` of a MemCache result: 0 stays 0, known codes by ``MMC_CODES``,
    any other negative or positive failure -> INTERNAL_ERROR."""
    return 0 if code == 0 else MMC_CODES.get(code, ErrorCode.INTERNAL_ERROR)


class MemcacheBackend(Backend):
    """``Backend`` over one ``memcache_hybrid.DistributedObjectStore``.

    Args:
        config: validated settings.
        store: an initialised store (or any object with its method names and signatures).
    """

    name: ClassVar[str] = "memcache"

    def __init__(self, config: MemcacheConfig, store: Any) -> None:
        self.config = config
        self._store = store
        self._put_direct, self._get_direct = _DIRECT[config.buffer_location]
        self._http = httpx.Client(timeout=2.0)
        self._closed = False

    @classmethod
    def check(cls, config: dict[str, Any]) -> list[HealthCheck]:
        """Can a store be built here? ``ascend_driver``: the driver file MemFabric reads;
        ``config_store``: the meta service's config store accepts TCP connections;
        ``client_init``: the real ``setup`` + ``init`` in a child process (only run when
        the driver is missing and the config store answers - otherwise it would wait for
        minutes). Never raises."""
        t0 = time.perf_counter()
        try:
            cfg = MemcacheConfig.load(config)
        except ValueError as exc:
            return [HealthCheck(name="config", ok=False, detail=str(exc), latency_ms=0.0)]
        problem = ascend_driver_problem()
        checks = [HealthCheck(
            name="ascend_driver", ok=problem is None,
            detail=f"memcache needs Ascend driver: {problem}" if problem else "driver found",
            latency_ms=(time.perf_counter() - t0) * 1e3)]
        t0 = time.perf_counter()
        store_up = reachable(cfg.config_store_url)
        checks.append(HealthCheck(
            name="config_store", ok=store_up,
            detail=f"{cfg.config_store_url} "
            + ("accepts connections" if store_up else "unreachable: start the meta service"),
            latency_ms=(time.perf_counter() - t0) * 1e3))
        if problem and store_up:
            t0 = time.perf_counter()
            rc, errors = probe_init(cfg)
            # The driver lines say why; the last line says what gave up.
            said = "; ".join(
                dict.fromkeys([e for e in errors if "driver" in e.lower()][-2:] + errors[-1:])
            ) or "no error logged"
            outcome = f"init returned {rc}" if rc is not None else (
                f"init did not return within {cfg.init_timeout_s}s")
            checks.append(HealthCheck(
                name="client_init", ok=False, code=rc,
                detail=f"memcache needs Ascend driver ({problem}); memcache_hybrid {outcome}: "
                f"{said}",
                latency_ms=(time.perf_counter() - t0) * 1e3))
        return checks

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MemcacheBackend:
        """Build and ``init`` a real store (see the module docstring).

        Raises:
            ValueError: a bad ``memcache_*`` field (named in the message).
            BackendUnavailable: ``memcache_hybrid`` is missing, the Ascend driver is missing
                (message starts "memcache needs the Ascend driver"), the config store does
                not accept connections, or ``init`` failed.
        """
        cfg = MemcacheConfig.load(config)
        try:
            from memcache_hybrid import DistributedObjectStore
        except ImportError as exc:
            raise BackendUnavailable(
                f"memcache_hybrid cannot be imported ({exc}): pip install 'kvpool[memcache]'"
            ) from exc
        if ascend_driver_problem() is not None:
            failed = [c for c in cls.check(config) if not c.ok]
            raise BackendUnavailable(
                "memcache needs the Ascend driver: "
                + " | ".join(f"{c.name}: {c.detail}" for c in failed)
            )
        if not reachable(cfg.config_store_url):
            # init would retry the connection for minutes before giving up.
            raise BackendUnavailable(
                f"memcache config store {cfg.config_store_url} is unreachable: start the meta "
                "service or fix kv_connector_extra_config.memcache_config_store_url",
                ErrorCode.RPC_FAIL)
        store = DistributedObjectStore()
        rc = store.setup(cfg.local_config())
        if rc == 0:
            rc = store.init(cfg.device_id)
        if rc != 0:
            raise BackendUnavailable(
                f"memcache_hybrid setup/init returned {rc} (meta service "
                f"{cfg.meta_service_url}, config store {cfg.config_store_url})", mmc_code(rc))
        return cls(cfg, store)

    def _guard(self, n: int, fn: Any, *args: Any) -> list[int]:
        """Per-key results of ``fn(*args)`` mapped to Mooncake codes; INTERNAL_ERROR for every
        key when the call raises or answers with the wrong length,
        UNAVAILABLE_IN_CURRENT_STATUS after ``close``."""
        if self._closed:
            return [ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS] * n
        try:
            res = list(fn(*args))
        except Exception:  # the binding raises for bad arguments; a batch must not crash
            return [ErrorCode.INTERNAL_ERROR] * n
        if len(res) != n:
            return [ErrorCode.INTERNAL_ERROR] * n
        return [mmc_code(int(r)) for r in res]

    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        """``batch_is_exist``: 1/0 per key, INTERNAL_ERROR (MemCache's error) otherwise."""
        if self._closed:
            return [ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS] * len(keys)
        try:
            res = [int(r) for r in self._store.batch_is_exist(list(keys))]
        except Exception:  # a lookup never turns an error into "absent"
            return [ErrorCode.INTERNAL_ERROR] * len(keys)
        return [r if r in (0, 1) else mmc_code(r) for r in res]

    def register_buffer(self, addr: int, size: int) -> None:
        """``register_buffer``: required before zero-copy transfers from/into the range.

        Raises:
            BackendError: MemCache refused (its code mapped; e.g. UNAVAILABLE_IN_CURRENT_STATUS
                before ``init``).
        """
        rc = int(self._store.register_buffer(addr, size))
        if rc != 0:
            raise BackendError(
                f"memcache register_buffer(0x{addr:x}, {size}) returned {rc}", mmc_code(rc))

    def batch_put_from(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """``batch_put_from_layers`` (H2G or L2G): per key 0 or a mapped negative code."""
        return self._guard(
            len(keys), self._store.batch_put_from_layers, list(keys),
            [list(a) for a in addrs], [list(s) for s in sizes], self._put_direct)

    def batch_get_into(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """``batch_get_into_layers`` (G2H or G2L): per key the bytes read, or a mapped
        negative code (OBJECT_NOT_FOUND, LEASE_EXPIRED...)."""
        res = self._guard(
            len(keys), self._store.batch_get_into_layers, list(keys),
            [list(a) for a in addrs], [list(s) for s in sizes], self._get_direct)
        return [sum(sizes[i]) if r == 0 else r for i, r in enumerate(res)]

    def _all_keys(self) -> list[str]:
        if not self.config.metrics_url:
            raise BackendError(
                "memcache remove_by_scope needs the meta service's HTTP endpoint: set "
                "kv_connector_extra_config.memcache_metrics_url (its metrics_url)")
        try:
            r = self._http.get(f"{self.config.metrics_url}/get_all_keys")
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise BackendError(f"{self.config.metrics_url}/get_all_keys: {exc}",
                               ErrorCode.RPC_FAIL) from exc
        return [k for k in r.text.split() if k]

    def remove_by_scope(self, pattern: str, *, dry_run: bool, force: bool = False) -> RemoveResult:
        """Keys from the meta service's ``/get_all_keys`` matching ``pattern``; sizes from
        ``batch_get_key_info``; removal with ``remove_batch``. A key MemCache refuses to remove
        because a lease holds it (MMC_LEASE_NOT_EXPIRED) counts as ``skipped_leased``;
        ``force`` cannot override MemCache leases.

        Raises:
            BackendError: no ``memcache_metrics_url`` or the meta service did not answer.
        """
        regex = re.compile(pattern)
        matched = [k for k in self._all_keys() if regex.search(k)]
        if not matched:
            return RemoveResult(keys=0, bytes=0)
        infos = self._store.batch_get_key_info(matched)
        nbytes = sum(int(info.size()) for info in infos)
        if dry_run:
            return RemoveResult(keys=len(matched), bytes=nbytes)
        res = [int(r) for r in self._store.remove_batch(matched)]
        return RemoveResult(
            keys=len(matched), bytes=nbytes, removed=sum(1 for r in res if r == 0),
            skipped_leased=sum(1 for r in res if r == MmcErrorCode.MMC_LEASE_NOT_EXPIRED))

    def health(self) -> list[HealthCheck]:
        """``client``: a ``batch_is_exist`` of a probe key answers 0/1; ``meta_service``:
        HTTP ``/health`` of ``memcache_metrics_url`` (when set). Never raises."""
        t0 = time.perf_counter()
        (res,) = self.batch_exists(["kvpool-probe@health"])
        checks = [HealthCheck(
            name="client", ok=res in (0, 1), code=None if res in (0, 1) else res,
            detail="batch_is_exist answered" if res in (0, 1) else f"batch_is_exist -> {res}",
            latency_ms=(time.perf_counter() - t0) * 1e3)]
        if self.config.metrics_url:
            t0 = time.perf_counter()
            try:
                r = self._http.get(f"{self.config.metrics_url}/health")
                ok, detail = r.status_code == 200, f"HTTP {r.status_code} {r.text.strip()[:80]}"
            except httpx.HTTPError as exc:
                ok, detail = False, f"{self.config.metrics_url}/health unreachable: {exc}"
            checks.append(HealthCheck(name="meta_service", ok=ok, detail=detail,
                                      latency_ms=(time.perf_counter() - t0) * 1e3))
        return checks

    def stats(self) -> PoolStats:
        """From the meta service's ``/metrics``: ``memcache_stored_keys``, the sums over media
        of ``memcache_allocated_bytes`` and ``memcache_total_capacity_bytes``. Never raises."""
        return meta_stats(self.config.metrics_url, self._http)

    def close(self) -> None:
        """``close()`` the store once. Idempotent."""
        if not self._closed:
            self._closed = True
            try:
                self._store.close()
            finally:
                self._http.close()


def meta_stats(metrics_url: str | None, http: httpx.Client | None = None) -> PoolStats:
    """``PoolStats`` from a MemCache meta service's ``/metrics`` (Prometheus text). Never
    raises: an unreachable endpoint gives ``healthy=False`` and the reason."""
    out = PoolStats(backend="memcache")
    if not metrics_url:
        out.health_detail = "memcache_metrics_url not set"
        return out
    client = http or httpx.Client(timeout=2.0)
    try:
        r = client.get(f"{metrics_url}/metrics")
        r.raise_for_status()
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError) as exc:
        out.healthy, out.health_detail = False, f"{metrics_url}/metrics: {exc}"
        return out
    finally:
        if http is None:
            client.close()
    for family in families:
        for s in family.samples:
            if s.name == "memcache_stored_keys":
                out.keys = int(s.value)
            elif s.name == "memcache_allocated_bytes":
                out.used_bytes += int(s.value)
            elif s.name == "memcache_total_capacity_bytes":
                out.total_bytes += int(s.value)
    out.healthy = True
    return out
