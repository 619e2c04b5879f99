"""The deployment rules, one function each, importable on their own.

Every function takes plain values (numbers, strings, the JSON path of the checked field) and
returns a :class:`Finding` (or ``None`` / a list) saying what is wrong and how to fix it. The
validator (:mod:`kvpool_connector.validate.validator`) walks a config file and calls them; the
console raises alerts from what agents report with the same functions and thresholds, e.g.
``check_lease_ttl(lease_ttl_ms, connect_ms, transfer_ms)``.

Units: ``default_kv_lease_ttl`` is milliseconds (mooncake_master flag, MindIE
kv_cache_store_config table), and so are ``ASCEND_CONNECT_TIMEOUT`` and
``ASCEND_TRANSFER_TIMEOUT``: Mooncake's Ascend Direct Transport reads them as integer
milliseconds (Mooncake ``doc/zh/ascend_direct_transport.md`` table: "link setup timeout (ms)",
"data transfer timeout (ms)"; ``transfer_executor_base.h``: ``connect_timeout = 10000`` and
``transfer_timeout = 10000`` passed to ADXL as ``timeout_in_millis``).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvpool_agent.vocabulary import KV_ROLE_FOR
from kvpool_connector.validate.model import (
    BACKENDS,
    DEFAULT_LEASE_TTL_MS,
    KV_ROLES,
    LOAD_FAILURE_POLICIES,
    LOCAL_SERVICE_MODES,
    MOONCAKE_PROTOCOLS,
    STORE_MODES,
)

__all__ = [
    "ASCEND_DEFAULT_BASE_PORT",
    "ASCEND_DEFAULT_TIMEOUT_MS",
    "ASCEND_PORTS_PER_DEVICE",
    "DEFAULT_DEVICES_PER_HOST",
    "GIB",
    "HYBRID_MODEL_PATTERN",
    "Finding",
    "Severity",
    "ascend_port_window",
    "check_agent_address",
    "check_backend_choice",
    "check_backend_match",
    "check_block_multiple",
    "check_choice",
    "check_duplicate_ports",
    "check_global_segment_size",
    "check_hybrid_transfer_connector",
    "check_kv_port_in_ascend_window",
    "check_kv_role",
    "check_layerwise_graph",
    "check_lease_ttl",
    "check_load_failure_policy",
    "check_local_service_mode",
    "check_pp_layer_partition",
    "check_protocol",
    "check_pythonhashseed",
    "check_qos_priority",
    "check_ratio",
    "check_ssd_offload_path",
    "check_store_mode",
    "check_unknown_keys",
    "is_hybrid_attention_model",
    "json_path",
    "parse_size",
]

Severity = Literal["error", "warning", "info"]

ASCEND_DEFAULT_TIMEOUT_MS = 10_000
"""ASCEND_CONNECT_TIMEOUT / ASCEND_TRANSFER_TIMEOUT when unset: Mooncake
``transfer_executor_base.h`` ``InitParams{connect_timeout = 10000, transfer_timeout = 10000}``
(milliseconds; the older doc table says 3000, the code is what runs)."""

ASCEND_DEFAULT_BASE_PORT = 20_000
"""First port of the Ascend Direct Transport listen windows when ``ASCEND_BASE_PORT`` is unset
(Mooncake ``ascend_direct_transport.h``: ``int32_t base_port_ = 20000``)."""

ASCEND_PORTS_PER_DEVICE = 100
"""Width of each physical NPU's listen window (Mooncake ``ascend_direct_transport/utils.cpp``:
``kPortRange = 100``; ``FindAdxlListenPort`` binds a random port in
``[base + dev * 100, base + (dev + 1) * 100]``)."""

DEFAULT_DEVICES_PER_HOST = 16
"""NPUs per host assumed when ``p_pod_npu_num`` / ``d_pod_npu_num`` is not given (Atlas 800 A3)."""

GIB = 1 << 30


HYBRID_MODEL_PATTERN = re.compile(r"deepseek[-_ ]?v4|qwen[-_ ]?3\.5", re.IGNORECASE)
"""Model names of hybrid-attention models named by the guides (MindIE Motor kv_cache_store
README table 1: DeepSeek V4 / V4 Flash / V4 Pro; vllm-ascend kv_pool.md: DeepSeekV4, Qwen 3.5)."""

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)(B?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class Finding:
    """One result of a rule.

    Attributes:
        severity: ``error`` (the deployment fails or misbehaves; exit status 2), ``warning``
            (likely wrong or risky; exit status 1 with ``--strict``), ``info`` (what will happen).
        rule: stable rule id, e.g. ``lease-ttl``.
        path: JSON path of the field, e.g. ``$.kv_cache_store_config.default_kv_lease_ttl``.
        message: what is wrong, with the values involved.
        fix: how to fix it (empty for ``info``).
    """

    severity: Severity
    rule: str
    path: str
    message: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        """The finding as a JSON-ready dict (``--json`` output)."""
        return asdict(self)


def json_path(*parts: str | int) -> str:
    """``json_path("a", "b", 1, "c") == "$.a.b[1].c"``."""
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def parse_size(value: int | float | str) -> int:
    """Bytes in a size written as Mooncake/MindIE configs write it.

    ``1073741824``, ``"1GB"``, ``"1 GiB"``, ``"512MB"``, ``"2.5G"``: K/M/G/T are powers of 1024
    (Mooncake's reading; vllm-ascend kv_pool.md: "1 GB (1024 MB / 1048576 KB / 1073741824 B)").

    Raises:
        ValueError: not a non-negative number of bytes with an optional K/M/G/T[i][B] unit.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"{value!r} is not a size")
        return int(value)
    match = _SIZE_RE.match(str(value))
    if not match or (match.group(3) and not match.group(2)):
        raise ValueError(f"{value!r} is not a size like 1GB, 512MB or 1073741824")
    return int(float(match.group(1)) * _UNIT[match.group(2).upper()])


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


def check_kv_role(instance: str, kv_role: str | None, *, path: str) -> Finding | None:
    """kv_role per instance: prefill ``kv_producer``, decode ``kv_consumer``, mixed ``kv_both``
    (MindIE Motor kv_cache_store README FAQ "P/D 实例间无法传输 KV Cache"; vllm-ascend PD-mixed).
    Also rejects a missing or unknown role (vLLM: kv_role is required with kv_connector)."""
    if kv_role is None:
        return Finding(
            "error",
            "kv-role",
            path,
            "kv_role is missing: vLLM refuses a kv_connector without kv_role",
            f'set "kv_role": "{KV_ROLE_FOR.get(instance, "kv_both")}"',
        )
    if kv_role not in KV_ROLES:
        return Finding(
            "error",
            "kv-role",
            path,
            f"kv_role {kv_role!r} is not one of {', '.join(KV_ROLES)}",
            f'use "{KV_ROLE_FOR.get(instance, "kv_both")}"',
        )
    expected = KV_ROLE_FOR.get(instance)
    if expected and kv_role != expected:
        return Finding(
            "error",
            "kv-role",
            path,
            f"a {instance} instance has kv_role {kv_role!r}; it must be {expected!r}, otherwise "
            "KV flows the wrong way between P and D",
            f'set "kv_role": "{expected}"',
        )
    return None


def check_choice(
    name: str,
    value: Any,
    allowed: Sequence[str],
    *,
    path: str,
    rule: str,
    source: str,
) -> Finding | None:
    """``value`` is one of ``allowed`` (``None`` = unset = the default, accepted)."""
    if value is None or value in allowed:
        return None
    close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.6)
    hint = f'"{close[0]}"' if close else " or ".join(f'"{a}"' for a in allowed)
    return Finding(
        "error",
        rule,
        path,
        f"{name} {value!r} is not one of {', '.join(allowed)} ({source})",
        f"use {hint}",
    )


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


def check_global_segment_size(
    value: Any, *, path: str, fabric_mem: bool, npu: bool = True
) -> Finding | None:
    """``global_segment_size`` parses as a size; with FabricMem
    (``ASCEND_ENABLE_USE_FABRIC_MEM=1``) it must be a whole number of GiB (vllm-ascend
    kv_pool.md mooncake.json table "Must align to 1 GB"; FAQ Issue 3 "each fabric mem
    allocation must be an integer multiple of 1 GB"). Off NPUs (``npu`` False) any size works.
    """
    if value is None:
        return None
    try:
        size = parse_size(value)
    except ValueError as exc:
        return Finding(
            "error",
            "segment-size",
            path,
            f"global_segment_size: {exc}",
            'write a size such as "1GB", "512MB" or a byte count',
        )
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


def ascend_port_window(base_port: int, devices: int) -> tuple[int, int]:
    """Inclusive port range Ascend Direct Transport may bind on a host with ``devices`` NPUs:
    ``[base, base + devices * 100]`` (see :data:`ASCEND_PORTS_PER_DEVICE`)."""
    return base_port, base_port + devices * ASCEND_PORTS_PER_DEVICE


def check_kv_port_in_ascend_window(
    kv_port: int, *, base_port: int | None, devices: int | None, path: str
) -> Finding | None:
    """A ``kv_port`` inside the Ascend Direct Transport listen range can collide: each NPU's
    transfer engine binds a random free port in its window (Mooncake ``FindAdxlListenPort``),
    so the connector's side channel on ``kv_port`` may find it taken, or take the engine's."""
    base = ASCEND_DEFAULT_BASE_PORT if base_port is None else base_port
    ndev = devices if devices else DEFAULT_DEVICES_PER_HOST
    low, high = ascend_port_window(base, ndev)
    if not low <= kv_port <= high:
        return None
    device = (kv_port - base) // ASCEND_PORTS_PER_DEVICE
    base_text = (
        f"ASCEND_BASE_PORT {base}" if base_port is not None else f"ASCEND_BASE_PORT unset -> {base}"
    )
    return Finding(
        "warning",
        "ascend-port-window",
        path,
        f"kv_port {kv_port} lies in the Ascend Direct Transport listen range {low}-{high} "
        f"({base_text}, {ASCEND_PORTS_PER_DEVICE} ports per NPU, {ndev} NPUs; NPU {device}'s "
        "window): the transfer engine binds a random free port there, so the two can collide "
        "at start-up",
        f"move kv_port outside {low}-{high} (e.g. {high + 1000}) or set ASCEND_BASE_PORT so "
        "the range starts above it",
    )


def check_duplicate_ports(entries: Iterable[tuple[int, str, str]]) -> list[Finding]:
    """No two services of one host/pod share a port. ``entries`` are ``(port, path, what)``;
    one error per later use of a port already taken."""
    seen: dict[int, tuple[str, str]] = {}
    out: list[Finding] = []
    for port, path, what in entries:
        if port in seen:
            first_path, first_what = seen[port]
            out.append(
                Finding(
                    "error",
                    "port-conflict",
                    path,
                    f"{what} uses port {port}, already used by {first_what} ({first_path})",
                    "give each service its own port",
                )
            )
        else:
            seen[port] = (path, what)
    return out


def check_layerwise_graph(
    cudagraph_mode: str | None, *, enforce_eager: bool, path: str
) -> Finding | None:
    """Layer-wise transfer (``use_layerwise``) needs piecewise graph capture or eager mode: the
    per-layer ``wait_for_layer_load`` / ``save_kv_layer`` calls cannot run inside a captured
    full graph (vLLM ``config/vllm.py``: "KV connector requires PIECEWISE CUDA graph mode due to
    layerwise async operations that cannot be captured"; vllm-ascend layerwise examples use
    ``--enforce-eager``)."""
    if enforce_eager or cudagraph_mode is None:
        return None
    mode = cudagraph_mode.upper()
    if not mode.startswith("FULL"):
        return None
    return Finding(
        "error",
        "layerwise-graph",
        path,
        f"use_layerwise with cudagraph_mode {cudagraph_mode!r}: per-layer loads and saves "
        "cannot run inside a captured full graph",
        'set compilation_config.cudagraph_mode to "PIECEWISE" (or enforce_eager: true)',
    )


def check_pp_layer_partition(
    partition: Any, *, pp_size: int | None, num_layers: int | None, path: str
) -> list[Finding]:
    """``prefill_pp_layer_partition`` ("30,31") lists one positive layer count per prefill PP
    stage: as many entries as ``prefill_pp_size`` and, when the model's layer count is known,
    summing to it (vllm-ascend kv_pool.md: "Prefill PP layer partition"; layers are divided by
    stage)."""
    if partition is None:
        return []
    parts = [p.strip() for p in str(partition).split(",")]
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        return [
            Finding(
                "error",
                "pp-partition",
                path,
                f"prefill_pp_layer_partition {partition!r} is not a comma-separated list of "
                "layer counts",
                'write one layer count per PP stage, e.g. "30,31"',
            )
        ]
    out: list[Finding] = []
    if any(c <= 0 for c in counts):
        out.append(
            Finding(
                "error",
                "pp-partition",
                path,
                f"prefill_pp_layer_partition {partition!r} has a stage with no layers",
                "give every stage at least one layer",
            )
        )
    if pp_size is not None and len(counts) != pp_size:
        out.append(
            Finding(
                "error",
                "pp-partition",
                path,
                f"prefill_pp_layer_partition has {len(counts)} stages but the prefill PP size "
                f"is {pp_size}",
                f"list exactly {pp_size} layer counts",
            )
        )
    if num_layers is not None and sum(counts) != num_layers:
        out.append(
            Finding(
                "error",
                "pp-partition",
                path,
                f"prefill_pp_layer_partition {partition!r} sums to {sum(counts)} layers but the "
                f"model has {num_layers}",
                f"make the counts add up to {num_layers}",
            )
        )
    return out


def check_block_multiple(
    value: int, unit: int, *, name: str, unit_name: str, path: str
) -> Finding | None:
    """``value`` is a positive multiple of ``unit`` (vLLM: "block_size must be divisible by
    hash_block_size" for ``prefix_match_unit``; KVPoolConnector: ``chunk_size`` a multiple of
    ``block_size``)."""
    if unit > 0 and value > 0 and value % unit == 0:
        return None
    good = max(1, value // unit) * unit if unit > 0 else value
    return Finding(
        "error",
        "block-size",
        path,
        f"{name} {value} is not a positive multiple of {unit_name} {unit}",
        f"use {name} {good}",
    )


def is_hybrid_attention_model(name: str | None) -> bool:
    """Whether a model name is one the guides call hybrid-attention
    (:data:`HYBRID_MODEL_PATTERN`)."""
    return bool(name and HYBRID_MODEL_PATTERN.search(name))


def check_hybrid_transfer_connector(connector: str, *, model: str, path: str) -> Finding | None:
    """A hybrid-attention model needs ``MooncakeHybridConnector`` as the P/D transfer connector
    (MindIE Motor kv_cache_store README table 1 and FAQ: with MooncakeConnectorV1 "Decode 节点
    可能在推理时崩溃重启")."""
    if connector == "MooncakeHybridConnector":
        return None
    return Finding(
        "error",
        "hybrid-connector",
        path,
        f"{model!r} is a hybrid-attention model but the transfer connector is {connector!r}: "
        "decode instances crash and restart during inference",
        'use "kv_connector": "MooncakeHybridConnector" at connectors[0]',
    )


def check_load_failure_policy(
    value: Any, *, has_store: bool, hybrid: bool, path: str
) -> Finding | None:
    """``kv_load_failure_policy``: ``recompute`` or ``fail`` (vLLM default ``fail``). A
    best-effort pool should recompute: with ``fail`` every block evicted between lookup and load
    fails its request (vllm-ascend kv_pool.md "KV Load Failure Handling Policy"). Recompute does
    not yet support hybrid-attention models (same guide)."""
    if value is not None and value not in LOAD_FAILURE_POLICIES:
        return Finding(
            "error",
            "load-failure-policy",
            path,
            f'kv_load_failure_policy {value!r} is not "recompute" or "fail"',
            'use "recompute"',
        )
    if hybrid and value == "recompute":
        return Finding(
            "warning",
            "load-failure-policy",
            path,
            'kv_load_failure_policy "recompute" is not supported yet for hybrid-attention '
            "models (vllm-ascend kv_pool.md)",
            "check the vllm-ascend release notes before relying on it",
        )
    if has_store and not hybrid and value != "recompute":
        shown = 'unset (vLLM default "fail")' if value is None else f"{value!r}"
        return Finding(
            "warning",
            "load-failure-policy",
            path,
            f"kv_load_failure_policy is {shown}: a failed load from the store (e.g. a block "
            "evicted between lookup and load) fails the whole request instead of being "
            "recomputed",
            'set "kv_load_failure_policy": "recompute" on the top-level kv_transfer_config',
        )
    return None


def check_pythonhashseed(prefill: str | None, decode: str | None, *, path: str) -> Finding | None:
    """``PYTHONHASHSEED`` is set, and equal, on every node of an AscendStoreConnector pool
    (vllm-ascend kv_pool.md "Environment Variable Configuration": "To guarantee uniform hash
    generation, it is required to synchronize the PYTHONHASHSEED environment variable across
    all nodes"). ``prefill`` / ``decode`` are the values the two engine kinds see (``None`` =
    unset)."""
    if prefill is not None and prefill == decode:
        return None
    if prefill is None or decode is None:
        return Finding(
            "error",
            "pythonhashseed",
            path,
            "PYTHONHASHSEED is not set for every engine in env.json: AscendStoreConnector's "
            "block hashes then differ between processes and P never finds what D saved",
            'set "PYTHONHASHSEED": "0" in motor_common_env',
        )
    return Finding(
        "error",
        "pythonhashseed",
        path,
        f"PYTHONHASHSEED in env.json is {prefill!r} on prefill but {decode!r} on decode: "
        "block hashes differ and the pool never hits",
        "use the same value everywhere (set it once in motor_common_env)",
    )


def check_qos_priority(value: Any, *, path: str) -> Finding | None:
    """``qos_priority`` is an integer 0..4 (vllm-ascend kv_pool.md QoS: invalid values fail
    start-up)."""
    if value is None or (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 4
    ):
        return None
    return Finding(
        "error",
        "qos-priority",
        path,
        f"qos_priority {value!r} is not an integer in 0..4: vLLM-Ascend fails at start-up",
        "use an integer from 0 (default) to 4",
    )


def check_agent_address(value: Any, *, path: str) -> Finding | None:
    """``agent_address`` is the fleet hub's ``tcp://HOST:PORT`` (the agent DEALER-connects to
    it; ``kvpool-agent hub --address tcp://0.0.0.0:7600``)."""
    if value is None:
        return None
    match = re.fullmatch(r"tcp://([^:/\s]+|\[[0-9a-fA-F:]+\]):(\d{1,5})", str(value))
    if match and 0 < int(match.group(2)) < 65536:
        return None
    return Finding(
        "error",
        "agent-address",
        path,
        f"agent_address {value!r} is not a ZMQ address tcp://HOST:PORT",
        'use the hub\'s address, e.g. "tcp://127.0.0.1:7600"',
    )


def check_unknown_keys(
    obj: Mapping[str, Any],
    known: Iterable[str],
    *,
    path: str,
    what: str,
    severity: Severity,
    misplaced: Mapping[str, str] | None = None,
    consequence: str = "",
    only_close: bool = False,
) -> list[Finding]:
    """Keys of ``obj`` not in ``known``: a misplaced key names where it belongs
    (``misplaced[key]`` = that place), a misspelt key names the close match; with
    ``only_close`` other unknown keys are let through (open-ended extra configs)."""
    known_set = set(known)
    out: list[Finding] = []
    for key in obj:
        if key in known_set:
            continue
        sub = f"{path}.{key}"
        if misplaced and key in misplaced:
            out.append(
                Finding(
                    severity,
                    "misplaced-key",
                    sub,
                    f"{key} does not belong in {what}{consequence}",
                    f"move it to {misplaced[key]}",
                )
            )
            continue
        close = difflib.get_close_matches(key, sorted(known_set), n=1, cutoff=0.8)
        if close:
            out.append(
                Finding(
                    severity,
                    "unknown-key",
                    sub,
                    f"{key} is not a key of {what}{consequence}",
                    f'did you mean "{close[0]}"?',
                )
            )
        elif not only_close:
            out.append(
                Finding(
                    severity,
                    "unknown-key",
                    sub,
                    f"{key} is not a key of {what}{consequence}",
                    "remove it or check the spelling",
                )
            )
    return out
