"""Rules on the pool and its store: the Mooncake master's lease and eviction flags, store modes,
transfer protocol, segment sizes, SSD offload, and which backend the pool runs.

Units: ``default_kv_lease_ttl`` is milliseconds (mooncake_master flag, MindIE
kv_cache_store_config table), and so are ``ASCEND_CONNECT_TIMEOUT`` and
``ASCEND_TRANSFER_TIMEOUT``: Mooncake's Ascend Direct Transport reads them as integer
milliseconds (Mooncake ``doc/zh/ascend_direct_transport.md`` table: "link setup timeout (ms)",
"data transfer timeout (ms)"; ``transfer_executor_base.h``: ``connect_timeout = 10000`` and
``transfer_timeout = 10000`` passed to ADXL as ``timeout_in_millis``).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from kvpool_config._model import (
    BACKENDS,
    DEFAULT_LEASE_TTL_MS,
    LOCAL_SERVICE_MODES,
    MOONCAKE_PROTOCOLS,
    STORE_MODES,
)
from kvpool_config.rules._finding import Finding, check_choice
from kvpool_connector.backends.mooncake import HARD_PIN_UPSERT_TTL_MS, TRANSFER_TIMEOUT_MS
from kvpool_connector.backends.mooncake_address import parse_master_address
from kvpool_connector.sizes import parse_size

__all__ = [
    "ASCEND_DEFAULT_TIMEOUT_MS",
    "GIB",
    "check_backend_choice",
    "check_backend_match",
    "check_engine_segment",
    "check_global_segment_size",
    "check_lease_ttl",
    "check_local_service_mode",
    "check_master_address",
    "check_offload_env",
    "check_protocol",
    "check_ratio",
    "check_size",
    "check_ssd_offload_path",
    "check_store_mode",
    "check_transfer_timeout",
    "host_problem",
    "master_endpoint",
    "whole_bytes",
]

ASCEND_DEFAULT_TIMEOUT_MS = 10_000
"""ASCEND_CONNECT_TIMEOUT / ASCEND_TRANSFER_TIMEOUT when unset: Mooncake
``transfer_executor_base.h`` ``InitParams{connect_timeout = 10000, transfer_timeout = 10000}``
(milliseconds; the older doc table says 3000, the code is what runs)."""

GIB = 1 << 30

OFFLOAD_PATH_ENV = "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"
OFFLOAD_TOTAL_ENV = "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"
OFFLOAD_STAGING_ENV = "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES"


def check_lease_ttl(
    ttl_ms: int | None,
    connect_timeout_ms: int | None,
    transfer_timeout_ms: int | None,
    *,
    path: str = "$.kv_cache_store_config.default_kv_lease_ttl",
    where: str = "",
) -> Finding | None:
    """``default_kv_lease_ttl`` must exceed both ASCEND transfer timeouts.

    A lookup grants a lease of ``default_kv_lease_ttl`` ms; a load that takes up to the connect
    plus transfer timeout can find the lease expired and the object evicted (``LEASE_EXPIRED``).
    Sources: vllm-ascend kv_pool.md (mooncake_master parameters: "Milliseconds; must be larger
    than ASCEND_CONNECT_TIMEOUT and ASCEND_TRANSFER_TIMEOUT"; FAQ Issue 1), MindIE Motor
    kv_cache_store README (default 11000 ms).

    Args:
        ttl_ms: lease in milliseconds; ``None`` = MindIE's default 11000.
        connect_timeout_ms / transfer_timeout_ms: milliseconds; ``None`` = Mooncake's default
            10000 (:data:`ASCEND_DEFAULT_TIMEOUT_MS`).
        where: where the timeouts come from (e.g. ``env.json motor_engine_decode_env``).
    """
    ttl = DEFAULT_LEASE_TTL_MS if ttl_ms is None else ttl_ms
    timeouts = {
        "ASCEND_CONNECT_TIMEOUT": connect_timeout_ms,
        "ASCEND_TRANSFER_TIMEOUT": transfer_timeout_ms,
    }
    name, limit = max(
        ((k, ASCEND_DEFAULT_TIMEOUT_MS if v is None else v) for k, v in timeouts.items()),
        key=lambda kv: kv[1],
    )
    if ttl > limit:
        return None
    source = "Mooncake's default" if timeouts[name] is None else (where or "the environment")
    ttl_text = f"{ttl} ms" + (" (default)" if ttl_ms is None else "")
    return Finding(
        "error",
        "lease-ttl",
        path,
        f"default_kv_lease_ttl {ttl_text} does not exceed {name} {limit} ms ({source}): a load "
        "that runs into the timeout finds its lease expired (LEASE_EXPIRED) and fails",
        f"set default_kv_lease_ttl above {limit} (e.g. {limit + 2000}) or lower {name}",
    )


# One DNS label (RFC 1123: letters, digits, inner hyphens, 1-63 characters); underscores too,
# which container networks resolve (Docker Compose service names).
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")

_MASTER_EXAMPLE = (
    '"<master_ip>:50088" (the port mooncake_master listens on), or "etcd://<etcd_ip>:2379" '
    "for an HA pool (masters run with --enable_ha)"
)


def host_problem(host: str) -> str | None:
    """Why ``host`` names no machine a client can connect to, or ``None``: it must be an IP
    address (IPv6 with or without brackets) or a DNS name of dot-separated labels (RFC 1123,
    253 characters at most; a trailing dot allowed)."""
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        name = host.removesuffix(".")
        if name and len(name) <= 253 and all(_HOST_LABEL.fullmatch(p) for p in name.split(".")):
            return None
        return f"{host!r} is not a host name or IP address"
    return None


def master_endpoint(host: str, port: int) -> str:
    """``host:port`` as a ``master_server_address`` is written: an IPv6 literal in brackets
    (``[fd00::5]:50051``), any other host as given (brackets around an IPv4 address dropped).

    Mooncake's master client hands the address to yalantinglibs' ``coro_rpc_client::connect``,
    which splits it at its last colon and strips one pair of brackets from the host; Mooncake's
    own host:port parser (``extractIPv6HostAndPort``, mooncake-transfer-engine ``common.h``)
    and its IPv6 tests write ``[::1]:port``. Without brackets an address such as
    ``fd00::5:5005`` is itself a valid IPv6 address, so the port is a guess.
    """
    bare = host.removeprefix("[").removesuffix("]")
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return f"{host}:{port}"
    return f"[{bare}]:{port}" if ip.version == 6 else f"{bare}:{port}"


def _unbracketed_ipv6(text: str) -> str | None:
    """The first ``host:port`` item of a master address whose host is an IPv6 literal written
    without brackets (``::1:50051``), or ``None``."""
    items = text.removeprefix("etcd://").split(";")
    for item in items:
        host, _, _port = item.strip().rpartition(":")
        try:
            if not host.startswith("[") and ipaddress.ip_address(host).version == 6:
                return item.strip()
        except ValueError:
            continue
    return None


def check_master_address(value: Any, *, path: str) -> Finding | None:
    """``master_server_address`` of a Mooncake client: present, ``host:port`` or an HA pool's
    ``etcd://host:port[;...]`` as the connector parses it
    (``kvpool_connector.backends.mooncake_address``), every host a name or IP address
    (:func:`host_problem`; the connector's parser takes any text before the colon, and the
    client then fails to resolve it)."""
    if value is None:
        return Finding("error", "master-address", path, "master_server_address is missing",
                       f"add the master's HOST:PORT, e.g. {_MASTER_EXAMPLE}; or set "
                       "MOONCAKE_MASTER=HOST:PORT in every engine's environment")
    try:
        address = parse_master_address(str(value))
    except ValueError:
        return Finding("error", "master-address", path,
                       f"master_server_address {value!r} is not host:port or etcd://host:port",
                       f"write it as {_MASTER_EXAMPLE}")
    for host, _port in address.endpoints:
        problem = host_problem(host)
        if problem is not None:
            return Finding("error", "master-address", path,
                           f"master_server_address {value!r}: {problem}",
                           f"write it as {_MASTER_EXAMPLE}")
    item = _unbracketed_ipv6(str(value))
    if item is not None:
        host, _, port = item.rpartition(":")
        return Finding("warning", "master-address", path,
                       f"master_server_address {value!r}: the IPv6 address in {item!r} has no "
                       "brackets, so where it ends and the port starts is a guess (Mooncake "
                       "splits at the last colon)",
                       f"write it as {master_endpoint(host, int(port))!r}")
    return None


def check_ratio(
    name: str, value: float | None, *, path: str, required: bool = True
) -> Finding | None:
    """Mooncake eviction ratios: present (MindIE's deploy.py rejects a mooncake config without
    them: ``kv_cache_store.py`` "eviction params are required") and in (0, 1] (a fraction of
    the pool; mooncake_master flags ``--eviction_high_watermark_ratio`` / ``--eviction_ratio``)."""
    if value is None:
        if not required:
            return None
        suggested = 0.9 if "watermark" in name else 0.1
        return Finding(
            "error",
            "eviction-ratio",
            path,
            f"{name} is missing: MindIE's deploy.py stops with 'Missing required kv cache pool "
            "config' for the mooncake backend",
            f'add "{name}": {suggested} (the guides\' recommended value)',
        )
    if isinstance(value, bool) or not 0 < value <= 1:
        return Finding(
            "error",
            "eviction-ratio",
            path,
            f"{name} {value!r} is not a fraction in (0, 1]",
            f"use a value such as {0.9 if 'watermark' in name else 0.1}",
        )
    return None


def check_store_mode(value: Any, *, path: str) -> Finding | None:
    """Mooncake ``store_mode`` is ``embedded`` (default) or ``standalone`` (MindIE Motor
    kv_cache_store README, table 3; backend/mooncake.md)."""
    return check_choice(
        "store_mode",
        value,
        STORE_MODES,
        path=path,
        rule="store-mode",
        source="MindIE kv_cache_store_config table 3",
    )


def check_local_service_mode(value: Any, *, path: str) -> Finding | None:
    """MemCache ``local_service_mode`` is ``inprocess`` or ``standalone`` (MindIE Motor
    kv_cache_store README, table 4)."""
    return check_choice(
        "local_service_mode",
        value,
        LOCAL_SERVICE_MODES,
        path=path,
        rule="local-service-mode",
        source="MindIE kv_cache_store_config table 4",
    )


def check_protocol(value: Any, *, path: str, npu: bool) -> Finding | None:
    """Mooncake ``protocol`` is a transport Mooncake knows; on NPUs it must be ``ascend``
    (vllm-ascend kv_pool.md mooncake.json table: "Must be set to ascend on NPU")."""
    finding = check_choice(
        "protocol",
        value,
        MOONCAKE_PROTOCOLS,
        path=path,
        rule="protocol",
        source="Mooncake transfer-engine protocols",
    )
    if finding or value is None or not npu or value == "ascend":
        return finding
    return Finding(
        "warning",
        "protocol",
        path,
        f"protocol {value!r} on an Ascend deployment: the NPU build of Mooncake moves KV with "
        "the ascend transport",
        'use "protocol": "ascend"',
    )


def check_backend_choice(value: Any, *, path: str, mindie: bool) -> Finding | None:
    """Pool backend is ``mooncake``, ``memcache`` or ``yuanrong`` (vllm-ascend kv_pool.md);
    ``ucm`` is not a backend (MindIE: "不要配置 "backend": "ucm""); MindIE Motor's deployer
    does not start yuanrong yet (its README lists it as TODO)."""
    if value == "ucm":
        return Finding(
            "error",
            "backend",
            path,
            '"ucm" is not a backend: UCM is its own store connector (UCMConnector)',
            'remove "backend": "ucm" and put UCMConnector at connectors[1]',
        )
    finding = check_choice(
        "backend", value, BACKENDS, path=path, rule="backend", source="vllm-ascend kv_pool.md"
    )
    if finding:
        return finding
    if mindie and value == "yuanrong":
        return Finding(
            "error",
            "backend",
            path,
            'backend "yuanrong" is not supported by MindIE Motor\'s deploy.py yet (its '
            "kv_cache_store README lists Yuanrong as TODO)",
            "use mooncake or memcache here, or run yuanrong with a plain vLLM "
            "--kv-transfer-config and a dscli-started datasystem worker",
        )
    return None


def check_backend_match(
    connector_backend: str,
    store_backend: str,
    *,
    path: str,
    connector_default: bool,
    store_default: bool,
) -> Finding | None:
    """The store connector's ``backend`` equals ``kv_cache_store_config.backend`` (MindIE Motor
    kv_cache_store README: "需与 AscendStoreConnector 中的 backend 保持一致"; FAQ 5). Defaults
    differ: the connector defaults to mooncake, kv_cache_store_config to memcache."""
    if connector_backend == store_backend:
        return None
    c_text = f"{connector_backend!r}" + (" (connector default)" if connector_default else "")
    s_text = f"{store_backend!r}" + (" (MindIE default)" if store_default else "")
    return Finding(
        "error",
        "backend-match",
        path,
        f"the store connector uses backend {c_text} but kv_cache_store_config.backend is "
        f"{s_text}: the engines look for a pool the deployer does not start",
        f'set both to the same backend, e.g. "backend": "{store_backend}" here',
    )


def check_size(name: str, value: Any, *, path: str, rule: str) -> tuple[int | None, Finding | None]:
    """``value`` is a size the engine reads: :func:`kvpool_connector.sizes.parse_size`, the
    parser the Mooncake backend's ``MooncakeConfig`` uses (Mooncake's grammar: bytes, or a
    number and B/K/KB/M/MB/G/GB/T/TB, powers of 1024).

    Returns:
        ``(bytes, None)`` when it parses, else ``(None, error finding)``.
    """
    try:
        return parse_size(value), None
    except ValueError:
        example = "" if isinstance(value, int | float) else " like 1GB, 512MB or 1073741824"
        return None, Finding(
            "error",
            rule,
            path,
            f"{name}: {value!r} is not a size{example}",
            'write a size such as "1GB", "512MB" or a byte count',
        )


def check_global_segment_size(
    value: Any, *, path: str, fabric_mem: bool, npu: bool = True
) -> Finding | None:
    """``global_segment_size`` parses as a size (:func:`check_size`); with FabricMem
    (``ASCEND_ENABLE_USE_FABRIC_MEM=1``) it must be a whole number of GiB (vllm-ascend
    kv_pool.md mooncake.json table "Must align to 1 GB"; FAQ Issue 3 "each fabric mem
    allocation must be an integer multiple of 1 GB"). Off NPUs (``npu`` False) any size works.
    """
    if value is None:
        return None
    size, unreadable = check_size("global_segment_size", value, path=path, rule="segment-size")
    if size is None:
        return unreadable
    if size <= 0:
        return Finding(
            "error",
            "segment-size",
            path,
            "global_segment_size is 0: this contributor gives the pool no memory",
            'give at least "1GB" (or use store_mode standalone where engines give none)',
        )
    if size % GIB == 0 or not (npu or fabric_mem):
        return None
    whole = max(1, round(size / GIB))
    if fabric_mem:
        return Finding(
            "error",
            "segment-size",
            path,
            f"global_segment_size {value!r} ({size} bytes) is not a whole number of GB while "
            "ASCEND_ENABLE_USE_FABRIC_MEM=1: fabric memory allocation fails (adxl MallocMem "
            "Invalid_Argument)",
            f'use "{whole}GB"',
        )
    return Finding(
        "warning",
        "segment-size",
        path,
        f"global_segment_size {value!r} ({size} bytes) is not aligned to 1 GB as the "
        "vllm-ascend guide requires on NPUs",
        f'use "{whole}GB"',
    )


def check_engine_segment(value: Any, *, path: str, store_mode: Any) -> Finding | None:
    """An ``info`` note for an engine's Mooncake config giving the pool memory
    (``global_segment_size`` above 0, ``store_mode`` not ``standalone``): its segment goes with
    the engine. The objects the master placed there are lost when the engine stops, and a
    killed engine's segment stays listed for the master's ``client_ttl`` (``mooncake_master
    --client_ttl``, 10 s by default), where puts fail TRANSFER_FAIL (-800). A note, not a
    warning: it is the documented embedded layout (vllm-ascend kv_pool.md), where a separate
    ``mooncake_client`` store is the alternative. An unreadable or 0 size is
    :func:`check_global_segment_size`'s."""
    if value is None or store_mode == "standalone":
        return None
    try:
        size = parse_size(value)
    except ValueError:
        return None
    if size <= 0:
        return None
    return Finding(
        "info",
        "engine-segment",
        path,
        f"global_segment_size {value!r}: every engine gives the pool a segment of its own "
        "memory, which goes with the engine: the pool's objects in it are lost when the engine "
        "stops, and puts placed in a killed engine's segment fail (TRANSFER_FAIL) until the "
        "master drops it (client_ttl, 10 s by default); a separate mooncake_client store "
        "process (engines at global_segment_size 0, store_mode standalone) keeps them across "
        "engine restarts",
    )


def check_ssd_offload_path(value: Any, *, path: str, enabled: bool) -> Finding | None:
    """``ssd_offload_path`` is absolute without ``..`` and required when SSD offload is on
    (vllm-ascend kv_pool.md mooncake.json table: "Relative paths, symlinks, and paths
    containing .. are rejected")."""
    if value is None:
        if enabled:
            return Finding(
                "error",
                "ssd-offload-path",
                path,
                "enable_ssd_offload is true but ssd_offload_path is not set",
                'set "ssd_offload_path" to an absolute directory, e.g. "/nvme/mooncake_offload"',
            )
        return None
    text = str(value)
    if not text.startswith("/") or ".." in text.split("/"):
        return Finding(
            "error",
            "ssd-offload-path",
            path,
            f"ssd_offload_path {text!r} must be an absolute path without '..'; Mooncake rejects it",
            'use an absolute path such as "/nvme/mooncake_offload"',
        )
    return None



def check_transfer_timeout(value: Any, *, path: str) -> Finding | None:
    """``transfer_timeout_ms`` (kvpool's Mooncake backend) not below the store client's own
    transfer timeout (``MooncakeConfig.transfer_timeout_ms``: 60000 ms, the constant of
    Mooncake's transfer_task.cpp): a key seen under a reader's lease is removed that long
    after, and a shorter wait can free a value a read still copies (issue 39). Types and
    negative values are the model's findings."""
    if isinstance(value, bool) or not isinstance(value, int) or not \
            0 <= value < TRANSFER_TIMEOUT_MS:
        return None
    return Finding(
        "warning",
        "transfer-timeout",
        path,
        f"transfer_timeout_ms {value} is below the Mooncake store client's transfer timeout "
        f"({TRANSFER_TIMEOUT_MS} ms): a key seen under a reader's lease may be removed while "
        "that read still copies it",
        f"leave transfer_timeout_ms out (default {TRANSFER_TIMEOUT_MS}) unless the transport "
        "gives up on a transfer sooner",
    )


def check_soft_pin_ttl(value: Any, *, path: str) -> Finding | None:
    """``max_kv_soft_pin_ttl`` (kvpool's Mooncake backend) above mooncake_master's own default
    ``--max_kv_soft_pin_ttl`` (86,400,000 ms): a hard pin's chunks already in the pool are
    upserted soft-pinned with this TTL, which a master started with its default refuses
    (Mooncake -600 INVALID_PARAMS: the pin reports those keys failed). kvpool cannot read the
    master's flags, so a value at or below the default is not flagged. Types and values <= 0
    are the model's findings."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= HARD_PIN_UPSERT_TTL_MS:
        return None
    return Finding(
        "warning",
        "soft-pin-ttl",
        path,
        f"max_kv_soft_pin_ttl {value} ms is above mooncake_master's default "
        f"--max_kv_soft_pin_ttl ({HARD_PIN_UPSERT_TTL_MS} ms): a master started with its "
        "default refuses it (-600 INVALID_PARAMS) and hard pins of chunks already in the pool "
        "fail",
        f"start mooncake_master with --max_kv_soft_pin_ttl={value} (or more), or leave "
        f"max_kv_soft_pin_ttl out (default {HARD_PIN_UPSERT_TTL_MS})",
    )


def whole_bytes(value: Any) -> int | None:
    """A positive whole byte count written as a number or a digit string, else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, str) and value.strip().isdecimal():
        return int(value.strip()) or None
    return None


def check_offload_env(
    values: dict[str, Any], *, section: str, value_bytes: int | None = None
) -> list[Finding]:
    """The SSD tier's environment of a Mooncake store (``mooncake_client --enable_offload``):
    ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`` absolute without ``..``;
    ``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` (the tier's capacity) and
    ``MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES`` (the staging buffer every value passes through
    to and from disk; 1.25 GiB, allocated at start, when unset) whole positive byte counts; the
    staging buffer at least one value (``value_bytes``: chunk tokens x KV bytes per token, when
    the caller knows it) and no larger than the tier.

    Args:
        values: one env.json section (variable -> value).
        section: its name, for the finding's path.
        value_bytes: the largest value the engines save, bytes; ``None`` = not checked.
    """
    out: list[Finding] = []
    where = f"$.{section}"
    raw_path = values.get(OFFLOAD_PATH_ENV)
    if raw_path is not None:
        text = str(raw_path)
        if not text.startswith("/") or ".." in text.split("/"):
            out.append(Finding(
                "error", "ssd-offload-path", f"{where}.{OFFLOAD_PATH_ENV}",
                f"{OFFLOAD_PATH_ENV} {text!r} must be an absolute path without '..': the store "
                "resolves a relative one against its own working directory",
                'use an absolute directory such as "/nvme/mooncake_offload"'))
    sizes: dict[str, int] = {}
    for key in (OFFLOAD_TOTAL_ENV, OFFLOAD_STAGING_ENV):
        if key not in values:
            continue
        size = whole_bytes(values[key])
        if size is None:
            out.append(Finding(
                "error", "offload-size", f"{where}.{key}",
                f"{key} {values[key]!r} is not a whole positive number of bytes",
                f"write bytes as digits, e.g. {4 * GIB} for 4 GiB"))
        else:
            sizes[key] = size
    staging, total = sizes.get(OFFLOAD_STAGING_ENV), sizes.get(OFFLOAD_TOTAL_ENV)
    if staging is not None and value_bytes and staging < value_bytes:
        out.append(Finding(
            "error", "offload-staging", f"{where}.{OFFLOAD_STAGING_ENV}",
            f"{OFFLOAD_STAGING_ENV} {staging} is smaller than one value ({value_bytes} bytes, "
            "--value-bytes): a value on disk cannot be read back through it (the store logs "
            "'Failed to allocate batch objects', INVALID_PARAMS, and the read misses)",
            f"set it to at least {value_bytes} (several values: offload batches them)"))
    if staging is not None and total is not None and staging > total:
        out.append(Finding(
            "warning", "offload-staging", f"{where}.{OFFLOAD_STAGING_ENV}",
            f"{OFFLOAD_STAGING_ENV} {staging} exceeds the disk tier's capacity "
            f"{OFFLOAD_TOTAL_ENV} {total}: the store allocates the whole buffer in memory at "
            "start for a tier that holds less",
            f"lower it below {total}"))
    return out
