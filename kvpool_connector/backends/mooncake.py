"""Mooncake Store backend: ``MooncakeDistributedStore`` from the ``mooncake-transfer-engine`` wheel.

Configuration (same fields as the vLLM Ascend Mooncake guide), from the JSON file named by
``kv_connector_extra_config["mooncake_config_path"]`` or the environment variable
``MOONCAKE_CONFIG_PATH``, or inline as ``kv_connector_extra_config["mooncake"]``::

    {
      "local_hostname": "127.0.0.1",
      "metadata_server": "P2PHANDSHAKE",
      "master_server_address": "127.0.0.1:50051",   # or "etcd://127.0.0.1:2379" (HA pool)
      "protocol": "tcp",                 # "ascend" on NPUs, "rdma" with RDMA NICs
      "device_name": "",
      "global_segment_size": "1GB",      # memory this engine contributes; 0 = standalone
      "local_buffer_size": "64MB",
      "store_mode": "embedded",          # or "standalone"
      "master_admin_url": "http://127.0.0.1:9003",  # HA: every master's, comma-separated
      "eviction_high_watermark_ratio": 0.9,   # as passed to mooncake_master (for stats)
      "default_kv_lease_ttl": 5000,           # ms, as passed to mooncake_master (for stats)
      "transfer_timeout_ms": 60000,           # ms, the store client's transfer timeout
      "max_kv_soft_pin_ttl": 86400000         # ms, as passed to mooncake_master (pins)
    }

``MOONCAKE_MASTER`` overrides ``master_server_address`` and ``MOONCAKE_GLOBAL_SEGMENT_SIZE``
overrides ``global_segment_size``. Sizes are integers (bytes) or strings such as ``"1GB"``,
``"512MB"`` (binary units: 1 GB = 2**30 bytes, as Mooncake reads them).

Store modes:

* ``embedded``: the engine contributes ``global_segment_size`` bytes; its entries disappear
  when the engine exits.
* ``standalone``: the engine contributes nothing (``global_segment_size`` is forced to 0); a
  separate ``mooncake_client --global_segment_size=...`` process holds the memory, so the pool
  survives engine restarts.

``eviction_high_watermark_ratio`` and ``default_kv_lease_ttl`` (ms) repeat the master's own
flags (the master does not publish them) so ``stats()`` can show usage against the watermark
and the lease in force.

``max_kv_soft_pin_ttl`` (ms) repeats the master's longest soft pin TTL: a hard pin's chunks
already in the pool are soft-pinned that long and renewed before it ends
(``kvpool_connector.pins``); a TTL over the master's is refused (-600 INVALID_PARAMS).

``transfer_timeout_ms`` is how long a read's transfer may still run (ms): the store client
fails a transfer only after 60 s (``TRANSFER_TIMEOUT_MS``), whatever the lease. The connector
removes a key it saw under a reader's lease no sooner than this after it saw it
(``kvpool_connector._removals``); lower it only with a transport that gives up sooner.

``master_admin_url`` is the master's HTTP admin endpoint (``mooncake_master --metrics_port``,
default 9003 on the master host): ``/metrics`` and ``/health`` feed ``stats()`` and
``health()``, ``/get_all_keys`` and ``/batch_query_keys`` feed ``remove_by_scope``'s counts
(``/batch_query_keys`` reads the master's metadata without granting a lease; ``/query_key``
and ``get_size`` grant one).

Over 600 lines: the only module that calls the Mooncake client; every call goes through its
counted wrapper (a safe close) and its error mapping, kept in one reading.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from kvpool_agent.masters import leader_admin_url
from kvpool_agent.pool import mooncake_master_health, parse_master_metrics
from kvpool_agent.pool_listing import count_keys, key_sizes, list_keys
from kvpool_agent.protocol import HealthCheck, PoolStats
from kvpool_agent.vocabulary import ErrorCode
from kvpool_connector._validation import field_problems
from kvpool_connector.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    RemoveResult,
)
from kvpool_connector.backends.mooncake_address import (
    parse_master_address,
    reachable_problem,
)
from kvpool_connector.sizes import parse_size
from kvpool_connector.staging import TCP_LIMITS, TransportLimits

__all__ = [
    "CLOSE_WAIT_S", "HARD_PIN_UPSERT_TTL_MS", "HEALTH_CODES", "TRANSFER_TIMEOUT_MS",
    "MooncakeBackend", "MooncakeConfig",
]

logger = logging.getLogger(__name__)

HARD_PIN_UPSERT_TTL_MS = 86_400_000
"""Soft pin TTL (ms) a hard pin gives the values already in the pool by default, which an
upsert cannot hard-pin: Mooncake master's ``max_kv_soft_pin_ttl`` default (24 h), the longest
it grants (``MooncakeConfig.max_kv_soft_pin_ttl`` repeats another master's)."""

HEALTH_CODES: dict[int, str] = {0: "HEALTHY", 1: "NOT_INITIALIZED", 2: "MASTER_UNREACHABLE"}
"""``MooncakeDistributedStore.health_check()`` return codes by name."""


_MIN_SEGMENT = 16 << 20
"""Smallest segment ``MooncakeDistributedStore.setup`` accepts (bytes)."""

TRANSFER_TIMEOUT_MS = 60_000
"""How long (ms) the Mooncake store client waits for a transfer before failing it: the
constant ``timeout_milliseconds = 60 * 1000`` of ``TransferEngineOperationState::
wait_for_completion`` (mooncake-store/src/transfer_task.cpp; its log line "Failed to complete
transfers after 60000 milliseconds"). A reader's lease (``default_kv_lease_ttl``, 5-10 s) can
lapse long before its transfer ends."""

CLOSE_WAIT_S = 5.0
"""How long ``close`` waits (s) for calls still inside the store client before it leaves the
client open. Closing it under a running ``batch_put_from_multi_buffers`` crashed the process
(SIGSEGV in ``RealClient``, mooncake-transfer-engine 0.3.13, issue 38); a transfer the store
does not answer runs up to Mooncake's 60 s transfer timeout, too long for a shutdown."""

_ABANDONED: list[Any] = []
"""Store clients ``close`` gave up on: referenced for the life of the process so that neither
they nor the memory they use is freed under a thread still inside them."""


class MooncakeConfig(BaseModel):
    """Validated Mooncake client settings (see the module docstring for each field)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    master_server_address: str
    protocol: Literal["tcp", "rdma", "ascend"] = "tcp"
    device_name: str = ""
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 64 << 20
    store_mode: Literal["embedded", "standalone"] = "embedded"
    master_admin_url: str | None = None
    eviction_high_watermark_ratio: float = Field(default=0.9, gt=0, le=1)
    # mooncake_master's own default (--default_kv_lease_ttl, ms).
    default_kv_lease_ttl: int = Field(default=10_000, ge=0)
    # Strict: a JSON true is not 1 ms (pydantic's lax int would read it so).
    transfer_timeout_ms: StrictInt = Field(default=TRANSFER_TIMEOUT_MS, ge=0)
    # mooncake_master's own default (--max_kv_soft_pin_ttl, ms).
    max_kv_soft_pin_ttl: StrictInt = Field(default=HARD_PIN_UPSERT_TTL_MS, gt=0)

    @field_validator("global_segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("master_server_address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        parse_master_address(v)
        return v

    @field_validator("global_segment_size")
    @classmethod
    def _segment_min(cls, v: int) -> int:
        if 0 < v < _MIN_SEGMENT:
            raise ValueError(
                f"{v} bytes is below Mooncake's minimum segment of 16MB: use 0 (standalone: "
                "this engine contributes no memory) or at least '16MB'"
            )
        return v

    @model_validator(mode="after")
    def _mode(self) -> MooncakeConfig:
        if self.store_mode == "embedded" and self.global_segment_size == 0:
            # An engine contributing no memory is the standalone layout by definition.
            object.__setattr__(self, "store_mode", "standalone")
        if self.store_mode == "standalone":
            object.__setattr__(self, "global_segment_size", 0)
        return self

    @property
    def admin_url(self) -> str:
        """``master_admin_url`` or ``http://<master host>:9003`` (the master's default; an IPv6
        host in brackets, RFC 3986); an HA pool's masters comma-separated
        (``kvpool_agent.masters``)."""
        if self.master_admin_url:
            return self.master_admin_url.rstrip("/")
        host = parse_master_address(self.master_server_address).host
        return f"http://{f'[{host}]' if ':' in host else host}:9003"

    @classmethod
    def load(cls, extra_config: dict[str, Any] | None = None) -> MooncakeConfig:
        """Settings from ``kv_connector_extra_config``, the config file and the environment.

        Order: ``extra_config["mooncake"]`` (inline dict) or the JSON file named by
        ``extra_config["mooncake_config_path"]`` / ``$MOONCAKE_CONFIG_PATH``; then
        ``$MOONCAKE_MASTER`` and ``$MOONCAKE_GLOBAL_SEGMENT_SIZE``; then
        ``extra_config["master_admin_url"]``.

        Raises:
            ValueError: no configuration found, unreadable JSON, or a bad field (the message
                names the field and where it came from).
        """
        extra = dict(extra_config or {})
        path = extra.get("mooncake_config_path") or os.environ.get("MOONCAKE_CONFIG_PATH")
        source: str
        if isinstance(extra.get("mooncake"), dict):
            raw = dict(extra["mooncake"])
            source = "kv_connector_extra_config.mooncake"
        elif path:
            source = str(path)
            try:
                raw = json.loads(Path(path).read_text())
            except OSError as exc:
                raise ValueError(f"cannot read Mooncake config {path}: {exc}") from exc
            except json.JSONDecodeError as exc:
                raise ValueError(f"Mooncake config {path} is not valid JSON: {exc}") from exc
            if not isinstance(raw, dict):
                raise ValueError(f"Mooncake config {path} must be a JSON object")
        else:
            raw = {}
            source = "environment"
        if os.environ.get("MOONCAKE_MASTER"):
            raw["master_server_address"] = os.environ["MOONCAKE_MASTER"]
        if os.environ.get("MOONCAKE_GLOBAL_SEGMENT_SIZE"):
            raw["global_segment_size"] = os.environ["MOONCAKE_GLOBAL_SEGMENT_SIZE"]
        if extra.get("master_admin_url"):
            raw["master_admin_url"] = extra["master_admin_url"]
        if "master_server_address" not in raw:
            raise ValueError(
                "Mooncake master_server_address is not set: write a JSON config and point "
                "MOONCAKE_CONFIG_PATH (or kv_connector_extra_config.mooncake_config_path) at "
                "it, or set MOONCAKE_MASTER=host:port"
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = field_problems(exc)
            raise ValueError(f"bad Mooncake config ({source}): {problems}") from None


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail fast when nothing listens at the master's address (or the HA pool's etcd):
    ``setup`` itself retries for about 90 s before giving up."""
    problem = reachable_problem(parse_master_address(address), timeout_s)
    if problem is not None:
        raise BackendUnavailable(
            f"{problem}: start it or fix master_server_address / MOONCAKE_MASTER"
        )


class MooncakeBackend(Backend):
    """``Backend`` over one ``MooncakeDistributedStore`` client.

    Args:
        config: validated settings.
        store: an already set-up store client (tests, sharing); built from ``config`` if None.

    Raises:
        BackendUnavailable: the ``mooncake`` wheel is missing or ``setup`` failed (master
            unreachable, segment could not be mounted); the message names the address.
    """

    name = "mooncake"

    def __init__(self, config: MooncakeConfig, store: Any | None = None) -> None:
        self.config = config
        self._http = httpx.Client(timeout=3.0)
        self._closed = False
        self._lock = threading.Lock()
        # Calls inside the store client now; close() waits on _idle until none is.
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        if store is None:
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as exc:
                raise BackendUnavailable(
                    f"mooncake.store is not importable ({exc}): pip install 'kvpool[mooncake]' "
                    "and apt-get install libibverbs1"
                ) from exc
            _check_reachable(config.master_server_address)
            store = MooncakeDistributedStore()
            rc = store.setup(
                config.local_hostname,
                config.metadata_server,
                config.global_segment_size,
                config.local_buffer_size,
                config.protocol,
                config.device_name,
                config.master_server_address,
            )
            if rc != 0:
                raise BackendUnavailable(
                    f"MooncakeDistributedStore.setup failed (code {rc}) with master "
                    f"{config.master_server_address}, protocol {config.protocol}, "
                    f"global_segment_size {config.global_segment_size}: is mooncake_master "
                    "running there and MC_TCP_BIND_ADDRESS set?",
                    rc,
                )
        self._store = store
        # Pool key -> ReplicateConfig with its pin (kvpool_connector.pins): saves put it pinned.
        self._pins: dict[str, Any] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MooncakeBackend:
        """Build from ``kv_connector_extra_config`` (see ``MooncakeConfig.load``)."""
        return cls(MooncakeConfig.load(config))

    @property
    def store(self) -> Any:
        """The underlying ``MooncakeDistributedStore``."""
        return self._store

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` counted as a call inside the store client (``close`` waits for it).

        Raises:
            BackendError: the backend is closed (UNAVAILABLE_IN_CURRENT_STATUS, the call was
                not made) or the client raised.
        """
        with self._lock:
            if self._closed:
                raise BackendError(f"mooncake {what}: backend is closed",
                                   ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS)
            self._inflight += 1
        try:
            return fn(*args)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise BackendError(f"mooncake {what} failed: {exc}") from exc
        finally:
            with self._lock:
                self._inflight -= 1
                if not self._inflight:
                    self._idle.notify_all()

    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        """Per key 1/0, or INTERNAL_ERROR when the master did not answer."""
        if not keys:
            return []
        res = self._call("batch_is_exist", self._store.batch_is_exist,
                         keys if isinstance(keys, list) else list(keys))
        return res if isinstance(res, list) else list(res)

    def lease_ttl_ms(self) -> int:
        """``default_kv_lease_ttl`` as the Mooncake config repeats the master's (ms)."""
        return self.config.default_kv_lease_ttl

    def transfer_timeout_ms(self) -> int:
        """``transfer_timeout_ms`` of the Mooncake config (ms; default ``TRANSFER_TIMEOUT_MS``,
        the store client's own 60 s)."""
        return self.config.transfer_timeout_ms

    def transport_limits(self) -> TransportLimits:
        """``TCP_LIMITS`` over TCP (measured, ``kvpool_connector.staging``); RDMA and Ascend
        keep its slice cap and move values zero-copy (not measured here)."""
        if self.config.protocol == "tcp":
            return TCP_LIMITS
        return TransportLimits(self.config.protocol, TCP_LIMITS.max_slices, 0)

    def register_buffer(self, addr: int, size: int) -> None:
        rc = self._call("register_buffer", self._store.register_buffer, addr, size)
        if rc != 0:
            raise BackendError(f"mooncake register_buffer({addr:#x}, {size}) returned {rc}", rc)

    def batch_put_from(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """``batch_put_from_multi_buffers``: per key 0 or a negative ``ErrorCode``. A key
        ``pin_keys`` pinned is put with its pin, in a call of its own."""
        if not keys:
            return []
        pins = self._pins
        if not pins or not any(k in pins for k in keys):
            return list(self._call(
                "batch_put_from_multi_buffers", self._store.batch_put_from_multi_buffers,
                list(keys), [list(a) for a in addrs], [list(s) for s in sizes],
            ))
        results = [0] * len(keys)
        groups: dict[int, list[int]] = {}
        configs: dict[int, Any] = {}
        for i, k in enumerate(keys):
            cfg = pins.get(k)
            groups.setdefault(id(cfg), []).append(i)
            configs[id(cfg)] = cfg
        for gid, idx in groups.items():
            args: list[Any] = [[keys[i] for i in idx], [list(addrs[i]) for i in idx],
                               [list(sizes[i]) for i in idx]]
            if configs[gid] is not None:
                args.append(configs[gid])
            got = self._call("batch_put_from_multi_buffers",
                             self._store.batch_put_from_multi_buffers, *args)
            for i, rc in zip(idx, got, strict=True):
                results[i] = int(rc)
        return results

    def pin_keys(self, keys: Sequence[str], hard: bool, ttl_ms: int, *,
                 upsert: bool = True) -> list[int]:
        """Pin ``keys`` (``kvpool_connector.pins``) with Mooncake's ``ReplicateConfig``: every
        key, present or not, is put with its pin by later saves of this client (soft:
        ``soft_pin_action`` ENABLE with ``soft_pin_ttl_ms`` = ``ttl_ms``; hard:
        ``with_hard_pin``). A key already in the pool is upserted with the pin; an upsert
        keeps no hard pin (mooncake-transfer-engine 0.3.13: a value upserted with
        ``with_hard_pin`` alone was evicted by the next flood), so a hard pin's present keys
        are upserted soft-pinned for ``hard_pin_ttl_ms`` as well (``Pins.poll`` renews it).
        ``upsert=False`` (pins another worker made, ``Pins.refresh``): only later saves are
        pinned, every key answers 0. Per key 1 pinned now, 0 not in the pool (pinned when
        saved), or a negative ``ErrorCode``."""
        from mooncake.store import ReplicateConfig, SoftPinAction

        cfg = ReplicateConfig()
        now = ReplicateConfig()
        if hard:
            cfg.with_hard_pin = now.with_hard_pin = True
        else:
            cfg.soft_pin_action = SoftPinAction.ENABLE
            cfg.soft_pin_ttl_ms = ttl_ms
        now.soft_pin_action = SoftPinAction.ENABLE
        now.soft_pin_ttl_ms = self.hard_pin_ttl_ms() if hard else ttl_ms
        out = []
        for key in keys:
            self._pins[key] = cfg
            if not upsert:
                out.append(0)
                continue
            value = self._call("get", self._store.get, key)
            if not value:
                out.append(0)
                continue
            rc = int(self._call("upsert", self._store.upsert, key, value, now))
            out.append(1 if rc == 0 else rc)
        return out

    def hard_pin_ttl_ms(self) -> int:
        """The soft pin TTL (ms) ``pin_keys`` gives a hard pin's values already in the pool:
        ``MooncakeConfig.max_kv_soft_pin_ttl``, the master's longest."""
        return self.config.max_kv_soft_pin_ttl

    def unpin_keys(self, keys: Sequence[str]) -> list[int]:
        """Forget the pins of ``keys`` and remove them from the pool: Mooncake keeps a pin
        through an upsert and refuses ``SoftPinAction.DISABLE`` with a TTL (-600, seen with
        mooncake-transfer-engine 0.3.13.post1), so the value goes and the next request that computes
        it saves it unpinned. Per key 0 removed, or a negative ``ErrorCode`` (a key under a
        lease is not removed: retry after ``default_kv_lease_ttl``)."""
        for key in keys:
            self._pins.pop(key, None)
        return self.batch_remove(keys)

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        """``batch_remove(keys, force=False)``: per key 0 removed or a negative
        ``ErrorCode`` (-704 OBJECT_NOT_FOUND, -706 OBJECT_HAS_LEASE, -703 REPLICA_IS_NOT_READY
        while a put of it runs)."""
        if not keys:
            return []
        return [int(rc) for rc in self._call("batch_remove", self._store.batch_remove,
                                             list(keys), False)]

    def forget_pins(self, keys: Sequence[str]) -> None:
        """Save ``keys`` unpinned from now on, leaving their values (a soft pin whose TTL
        ended: the master dropped it too)."""
        for key in keys:
            self._pins.pop(key, None)

    def read_record(self, key: str) -> bytes:
        """The small value at ``key`` (``b""``: none), e.g. a layout's pin records."""
        return bytes(self._call("get", self._store.get, key) or b"")

    def record_size(self, key: str) -> int:
        """Bytes of the value at ``key`` (``get_size``: no value moved), or a negative
        ``ErrorCode`` (-704 none): a record over the reader's buffer is skipped unread."""
        return int(self._call("get_size", self._store.get_size, key))

    def write_record(self, key: str, data: bytes) -> int:
        """Store ``data`` at ``key`` hard-pinned (never evicted): put with ``with_hard_pin``
        the first time, then upserted (an upsert keeps the hard pin of the value it replaces
        and works under readers' leases, mooncake-transfer-engine 0.3.13). 0 or a negative
        ``ErrorCode``."""
        from mooncake.store import ReplicateConfig

        if self._call("get", self._store.get, key):
            return int(self._call("upsert", self._store.upsert, key, data, ReplicateConfig()))
        cfg = ReplicateConfig()
        cfg.with_hard_pin = True
        return int(self._call("put", self._store.put, key, data, cfg))

    def create_record(self, key: str, data: bytes) -> int:
        """Put ``data`` at ``key`` hard-pinned unless ``key`` exists: Mooncake's put creates
        only (OBJECT_ALREADY_EXISTS, -705, leaves the value there; the client still answers 0,
        mooncake-transfer-engine 0.3.13.post1), so the caller reads ``key`` back to know whose
        value it holds. 0 or a negative ``ErrorCode``."""
        from mooncake.store import ReplicateConfig

        cfg = ReplicateConfig()
        cfg.with_hard_pin = True
        return int(self._call("put", self._store.put, key, data, cfg))

    @property
    def pinned_keys(self) -> int:
        """Keys this client pins (``pin_keys``, not yet ``unpin_keys``)."""
        return len(self._pins)

    def batch_get_into(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """``batch_get_into_multi_buffers``: per key bytes read or a negative ``ErrorCode``.

        A key may appear more than once (two requests of one step loading the same chunk into
        their own blocks). Mooncake fills only one destination of a key repeated within one
        batch yet reports every entry as read (seen with mooncake-transfer-engine 0.3.13 on TCP;
        ``bench/bench_peer.py`` produced wrong greedy outputs from it), so each repeat of a
        key goes into a later call: every call holds each key at most once."""
        if not keys:
            return []
        rounds: list[list[int]] = []
        seen: dict[str, int] = {}
        for i, key in enumerate(keys):
            n = seen.get(key, 0)
            seen[key] = n + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append(i)
        results = [0] * len(keys)
        for idx in rounds:
            got = self._call(
                "batch_get_into_multi_buffers", self._store.batch_get_into_multi_buffers,
                [keys[i] for i in idx], [list(addrs[i]) for i in idx],
                [list(sizes[i]) for i in idx],
            )
            for i, res in zip(idx, got, strict=True):
                results[i] = int(res)
        return results

    def _admin_url(self) -> str:
        """The admin URL to ask: the HA pool's serving leader when several are configured."""
        return leader_admin_url(self.config.admin_url, client=self._http)

    def _all_keys(self) -> list[str]:
        return list_keys(self._admin_url(), self._http)

    def _key_sizes(self, keys: list[str]) -> dict[str, int]:
        return key_sizes(self._admin_url(), keys, self._http)

    def remove_by_scope(self, pattern: str, *, dry_run: bool, force: bool = False) -> RemoveResult:
        """Count and remove the keys matching ``pattern`` (a regex, ``re.search`` semantics,
        anchored by the caller as ``keys.model_pattern`` does).

        Keys are listed with the master's ``/get_all_keys``. A dry run sizes one key of each
        model+digest+shard(+layer) group (all chunk keys of a group have one size) with
        ``/batch_query_keys``, which reads the master's metadata and grants no lease: a dry
        run leaves every key as it found it. A real run calls ``remove_by_regex(pattern, force)``;
        ``skipped_leased`` counts matched keys still present afterwards, ``keys`` those listed
        before the call or removed by it (at least removed + skipped), and ``bytes`` is what
        the master's ``master_allocated_bytes`` dropped by plus the sizes of those skipped keys.

        Raises:
            ValueError: ``pattern`` is not a valid regular expression.
            BackendError: the admin endpoint or the removal failed.
        """
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"flush scope pattern {pattern!r} is not a regex: {exc}") from exc
        try:
            if dry_run:
                # One key per model+digest+shard(+layer) group (``pool_listing.size_group``):
                # a pool of millions of keys is sized in a few requests.
                n, total = count_keys(self._admin_url(), pattern, self._http)
                return RemoveResult(keys=n, bytes=total)
            matched = [k for k in self._all_keys() if rx.search(k)]
            before = self._allocated_bytes()
            removed = self._call("remove_by_regex", self._store.remove_by_regex, pattern, force)
            if removed < 0:
                raise BackendError(
                    f"mooncake remove_by_regex({pattern!r}) returned {removed}", removed
                )
            left = set(matched) & {k for k in self._all_keys() if rx.search(k)}
            freed = max(0, before - self._allocated_bytes())
            # The regex also removes keys saved between the listing and the call (a live
            # fleet saves hundreds a second): they count as matched too, so that removed plus
            # skipped never exceeds matched (the hub holds an answer that does as suspect).
            return RemoveResult(
                keys=max(len(matched), int(removed) + len(left)),
                bytes=freed + sum(self._key_sizes(sorted(left)).values()),
                removed=int(removed), skipped_leased=len(left),
            )
        except httpx.HTTPError as exc:
            raise BackendError(
                f"mooncake master admin endpoint {self.config.admin_url} failed: {exc} "
                "(set master_admin_url to mooncake_master's --metrics_port)"
            ) from exc

    def _allocated_bytes(self) -> int:
        r = self._http.get(f"{self._admin_url()}/metrics")
        r.raise_for_status()
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name == "master_allocated_bytes":
                    return int(sample.value)
        return 0

    def health(self) -> list[HealthCheck]:
        """``client``: ``health_check()`` code (0 HEALTHY, 1 NOT_INITIALIZED, 2
        MASTER_UNREACHABLE); ``master``: HTTP ``/health`` of the admin endpoint."""
        checks: list[HealthCheck] = []
        t0 = time.perf_counter()
        try:
            code = int(self._call("health_check", self._store.health_check))
            detail = HEALTH_CODES.get(code, f"UNKNOWN_{code}")
        except BackendError as exc:
            code = 1 if self._closed else ErrorCode.INTERNAL_ERROR
            detail = "backend is closed" if self._closed else str(exc)
        except Exception as exc:  # a health check reports, never raises
            code, detail = ErrorCode.INTERNAL_ERROR, f"health_check raised {exc!r}"
        checks.append(HealthCheck(name="client", ok=code == 0, code=code, detail=detail,
                                  latency_ms=(time.perf_counter() - t0) * 1e3))
        try:
            checks.append(mooncake_master_health(self.config.admin_url, client=self._http))
        except RuntimeError as exc:  # httpx: the client was closed by close()
            checks.append(HealthCheck(name="master", ok=False,
                                      code=ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
                                      detail=f"backend is closed ({exc})", latency_ms=0.0))
        return checks

    def stats(self) -> PoolStats:
        """Usage from the master's ``/metrics`` (Prometheus text format)."""
        out = PoolStats(backend=self.name,
                        high_watermark=self.config.eviction_high_watermark_ratio,
                        lease_ttl_ms=self.config.default_kv_lease_ttl)
        try:
            r = self._http.get(f"{self._admin_url()}/metrics")
            r.raise_for_status()
            text = r.text
        except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: closed by close()
            out.healthy = False
            out.health_detail = f"{self.config.admin_url}/metrics: {exc}"
            return out
        try:
            parse_master_metrics(text, out)
        except ValueError as exc:
            out.health_detail = f"unparsable /metrics: {exc}"
            return out
        out.healthy = True
        return out

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Close the store client (its embedded segment leaves the pool). Idempotent.

        Calls started from now on fail (UNAVAILABLE_IN_CURRENT_STATUS); calls already inside
        the client (saves, loads, lookups, pin reads, agent probes) are waited for, at most
        ``timeout_s`` seconds. A client still in use then is never closed nor freed (kept in
        ``_ABANDONED``, logged): a leak, never a crash. Callers stop their users first
        (``KVPoolWorker.shutdown``) so the wait is normally nil."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._idle.wait_for(lambda: not self._inflight, timeout_s)
            left = self._inflight
        try:
            if idle:
                self._store.close()
            else:
                _ABANDONED.append(self._store)
                logger.error("mooncake close: %d calls still inside the store client after "
                             "%.1f s; the client is left open", left, timeout_s)
        finally:
            self._http.close()
