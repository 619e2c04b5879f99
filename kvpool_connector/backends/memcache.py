"""MemCache backend: ``memcache_hybrid.DistributedObjectStore`` (MemFabric), as vLLM Ascend's
``MemcacheBackend`` uses it.

Data path: zero-copy by address. ``batch_put_from_layers`` / ``batch_get_into_layers`` take per
key a list of layer addresses and sizes, exactly ``Backend``'s shape. ``direct`` is the copy
direction of MemFabric's ``BmCopyType``: host buffers use ``H2G`` (3) to put and ``G2H`` (2)
to get; NPU buffers (``memcache_buffer_location = "device"``) use ``L2G`` (0) and ``G2L`` (1).
MemCache answers 0 per key on success; ``batch_get_into`` turns that into the byte count.

The Ascend driver. ``init`` builds the memory pool through MemFabric's ``hybm``, which reads
the driver version from ``<driver install path>/driver/version.info`` (the path comes from
``/etc/ascend_install.info``, default ``/usr/local/Ascend``) and gives up with "the current
version of ascend driver does not support mf!" when it is missing. Before that it connects to
the meta service's config store and, if none answers, retries for minutes. So
``from_config`` first checks the driver file itself (``ascend_driver_problem``); without it,
it still runs the real ``setup`` + ``init`` - in a child process with a time limit
(``memcache_init_timeout_s``), and only when the config store accepts connections - and raises
``BackendUnavailable("memcache needs the Ascend driver: ...")`` carrying the package's own
error lines. ``MemcacheBackend.check(config)`` returns the same as ``HealthCheck`` results.

Return codes: MemCache's ``MmcErrorCode`` (``mmc_types.h``) mapped to the Mooncake-style
names of ``kvpool_connector.errors`` by ``MMC_CODES`` (-3007 OBJECT_NOT_EXISTS -> -704,
-3016 NOT_ENOUGH_MEMORY -> -200, -3106 LEASE_EXPIRED -> -707, ...; unknown -> -1).

Listing and stats come from the meta service's HTTP endpoint (``memcache_metrics_url``, the
meta service's ``metrics_url``): ``/get_all_keys`` (one key per line), ``/health`` and
``/metrics`` (Prometheus text).

Configuration (``kv_connector_extra_config``, ``memcache_<field>``; environment variables
``MEMCACHE_META_SERVICE_URL``, ``MEMCACHE_CONFIG_STORE_URL``, ``MEMCACHE_METRICS_URL``
override): ``meta_service_url``, ``config_store_url`` (``tcp://host:port``, as in
``mmc-local.conf``), ``metrics_url`` (``http://host:port``), ``protocol`` (``host_rdma``,
``host_tcp``, ``host_shm``, ``device_rdma``, ``device_sdma``...), ``dram_size`` /
``hbm_size`` (``"1GB"``, ``"0"``), ``device_id``, ``world_size``, ``buffer_location``
(``host``/``device``), ``init_timeout_s``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from kvpool_agent.protocol import HealthCheck, PoolStats
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
    "ascend_driver_problem",
    "meta_stats",
    "mmc_code",
    "probe_init",
]

MMC_CODES: dict[int, int] = {
    -1: -1,  # MMC_ERROR
    -3000: -600,  # INVALID_PARAM -> INVALID_PARAMS
    -3001: -200,  # MALLOC_FAILED -> NO_AVAILABLE_HANDLE
    -3003: -1010,  # NOT_STARTED -> UNAVAILABLE_IN_CURRENT_STATUS
    -3004: -900,  # TIMEOUT -> RPC_FAIL
    -3006: -705,  # DUPLICATED_OBJECT -> OBJECT_ALREADY_EXISTS
    -3007: -704,  # OBJECT_NOT_EXISTS -> OBJECT_NOT_FOUND
    -3008: -1010,  # NOT_INITIALIZED
    -3013: -200,  # EXCEED_CAPACITY
    -3014: -900,  # LINK_NOT_FOUND
    -3016: -200,  # NOT_ENOUGH_MEMORY
    -3017: -900,  # NOT_CONNET_META
    -3018: -900,  # NOT_CONNET_LOCAL
    -3019: -1010,  # CLIENT_NOT_INIT
    -3101: -703,  # UNMATCHED_STATE -> REPLICA_IS_NOT_READY
    -3102: -704,  # UNMATCHED_KEY
    -3104: -706,  # LEASE_NOT_EXPIRED -> OBJECT_HAS_LEASE
    -3106: -707,  # LEASE_EXPIRED
}
"""MemCache ``MmcErrorCode`` -> Mooncake ``ErrorCode`` (``kvpool_connector.errors``)."""

_DIRECT = {"host": (3, 2), "device": (0, 1)}  # (put, get): H2G/G2H or L2G/G2L
_INSTALL_INFO = Path("/etc/ascend_install.info")
_DEFAULT_ASCEND = Path("/usr/local/Ascend")


def mmc_code(code: int) -> int:
    """Mooncake-style code of a MemCache result: 0 stays 0, known codes by ``MMC_CODES``,
    any other negative or positive failure -> -1."""
    return 0 if code == 0 else MMC_CODES.get(code, -1)


def ascend_driver_problem(install_info: Path = _INSTALL_INFO) -> str | None:
    """Why MemFabric cannot find the Ascend driver here, or ``None`` if it can.

    Mirrors what ``hybm`` reads: ``Driver_Install_Path_Param`` in ``install_info`` (else
    ``/usr/local/Ascend``), then ``<that>/driver/version.info``, which must name a version."""
    base = _DEFAULT_ASCEND
    try:
        for line in install_info.read_text().splitlines():
            if line.startswith("Driver_Install_Path_Param="):
                base = Path(line.split("=", 1)[1].strip())
    except OSError:
        pass
    version = base / "driver" / "version.info"
    try:
        if "Version=" in version.read_text():
            return None
        return f"{version} names no driver version"
    except OSError:
        return f"{version} not found (no Ascend NPU driver installed on this host)"


class MemcacheConfig(BaseModel):
    """Validated client settings (see the module docstring)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    meta_service_url: str = "tcp://127.0.0.1:5000"
    config_store_url: str = "tcp://127.0.0.1:6000"
    metrics_url: str | None = None
    protocol: Literal[
        "host_rdma", "host_tcp", "host_shm", "host_urma",
        "device_rdma", "device_sdma", "device_urma", "device_uboe",
    ] = "host_rdma"
    dram_size: str = "1GB"
    hbm_size: str = "0"
    device_id: int = 0
    world_size: int = 256
    buffer_location: Literal["host", "device"] = "host"
    init_timeout_s: float = 30.0

    @field_validator("meta_service_url", "config_store_url")
    @classmethod
    def _tcp(cls, v: str) -> str:
        u = urlparse(v)
        if u.scheme != "tcp" or not u.hostname or not u.port:
            raise ValueError(f"{v!r} is not tcp://host:port (e.g. 'tcp://127.0.0.1:5000')")
        return v

    @field_validator("metrics_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and urlparse(v).scheme not in ("http", "https"):
            raise ValueError(f"{v!r} is not http://host:port (the meta service's metrics_url)")
        return v.rstrip("/") if v else v

    @classmethod
    def load(cls, extra_config: dict[str, Any] | None = None) -> MemcacheConfig:
        """Settings from ``kv_connector_extra_config`` (``memcache_*`` keys) and the
        ``MEMCACHE_*_URL`` environment variables (which win).

        Raises:
            ValueError: a bad field; the message names the ``kv_connector_extra_config`` key.
        """
        extra = dict(extra_config or {})
        raw = {n: extra[f"memcache_{n}"] for n in cls.model_fields if f"memcache_{n}" in extra}
        for name in ("meta_service_url", "config_store_url", "metrics_url"):
            env = os.environ.get(f"MEMCACHE_{name.upper()}")
            if env:
                raw[name] = env
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"kv_connector_extra_config.memcache_{err['loc'][0]}: {err['msg']}"
                for err in exc.errors()
            )
            raise ValueError(f"bad memcache config: {problems}") from None

    def local_config(self) -> Any:
        """The package's ``LocalConfig`` for ``DistributedObjectStore.setup``."""
        from memcache_hybrid import LocalConfig

        cfg = LocalConfig()
        cfg.meta_service_url = self.meta_service_url
        cfg.config_store_url = self.config_store_url
        cfg.protocol = self.protocol
        cfg.dram_size = self.dram_size
        cfg.hbm_size = self.hbm_size
        cfg.world_size = self.world_size
        return cfg


def _reachable(url: str, timeout_s: float = 1.0) -> bool:
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "", u.port or 0), timeout=timeout_s):
            return True
    except OSError:
        return False


_LOG_ERROR = re.compile(r"\bERROR \[[^\]]*\]\s*(?:\[[^\]]*\]\s*)?(.*)$")


def probe_init(config: MemcacheConfig) -> tuple[int | None, list[str]]:
    """Run the real ``DistributedObjectStore().setup(...)`` + ``init(device_id)`` in a child
    process, killed after ``config.init_timeout_s`` seconds.

    Returns ``(rc, errors)``: ``init``'s return code (``None`` if it did not return in time)
    and the ``ERROR`` lines the package logged, oldest first, without repeats."""
    args = json.dumps(config.model_dump())
    root = str(Path(__file__).resolve().parents[2])  # the child imports this package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvpool_connector.backends.memcache", args],
            capture_output=True, text=True, timeout=config.init_timeout_s, env=env,
        )
        output, rc_text = proc.stdout + proc.stderr, proc.stdout
    except subprocess.TimeoutExpired as exc:
        raw = (exc.stdout or b"") + (exc.stderr or b"")
        output = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        rc_text = ""
    found = re.search(r"^KVPOOL_INIT_RC=(-?\d+)$", rc_text, re.M)
    errors: list[str] = []
    for line in output.splitlines():
        m = _LOG_ERROR.search(line)
        if m and m.group(1).strip() not in errors:
            errors.append(m.group(1).strip())
    return (int(found.group(1)) if found else None), errors


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
        reachable = _reachable(cfg.config_store_url)
        checks.append(HealthCheck(
            name="config_store", ok=reachable,
            detail=f"{cfg.config_store_url} "
            + ("accepts connections" if reachable else "unreachable: start the meta service"),
            latency_ms=(time.perf_counter() - t0) * 1e3))
        if problem and reachable:
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
        if not _reachable(cfg.config_store_url):
            # init would retry the connection for minutes before giving up.
            raise BackendUnavailable(
                f"memcache config store {cfg.config_store_url} is unreachable: start the meta "
                "service or fix kv_connector_extra_config.memcache_config_store_url", -900)
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
        """Per-key results of ``fn(*args)`` mapped to Mooncake codes; -1 for every key when
        the call raises or answers with the wrong length, -1010 after ``close``."""
        if self._closed:
            return [-1010] * n
        try:
            res = list(fn(*args))
        except Exception:  # the binding raises for bad arguments; a batch must not crash
            return [-1] * n
        return [mmc_code(int(r)) for r in res] if len(res) == n else [-1] * n

    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        """``batch_is_exist``: 1/0 per key, -1 (MemCache's error) otherwise."""
        if self._closed:
            return [-1010] * len(keys)
        try:
            res = [int(r) for r in self._store.batch_is_exist(list(keys))]
        except Exception:  # a lookup never turns an error into "absent"
            return [-1] * len(keys)
        return [r if r in (0, 1) else mmc_code(r) for r in res]

    def register_buffer(self, addr: int, size: int) -> None:
        """``register_buffer``: required before zero-copy transfers from/into the range.

        Raises:
            BackendError: MemCache refused (its code mapped; e.g. -1010 before ``init``).
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
        negative code (-704 absent, -707 lease expired...)."""
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
            raise BackendError(f"{self.config.metrics_url}/get_all_keys: {exc}", -900) from exc
        return [k for k in r.text.split() if k]

    def remove_by_scope(self, pattern: str, *, dry_run: bool, force: bool = False) -> RemoveResult:
        """Keys from the meta service's ``/get_all_keys`` matching ``pattern``; sizes from
        ``batch_get_key_info``; removal with ``remove_batch``. A key MemCache refuses to remove
        because a lease holds it (-3104) counts as ``skipped_leased``; ``force`` cannot
        override MemCache leases.

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
            skipped_leased=sum(1 for r in res if r == -3104))

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


def _child_init(args: str) -> None:
    """Child side of ``probe_init``: the real package's ``setup`` + ``init``."""
    from memcache_hybrid import DistributedObjectStore

    cfg = MemcacheConfig.model_validate(json.loads(args))
    store = DistributedObjectStore()
    rc = store.setup(cfg.local_config())
    if rc == 0:
        rc = store.init(cfg.device_id)
    print(f"KVPOOL_INIT_RC={rc}", flush=True)


if __name__ == "__main__":
    _child_init(sys.argv[1])
