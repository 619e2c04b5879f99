"""Rules on the connectors and the engines that load them: kv_role per instance, P/D transfer
connector for hybrid-attention models, load-failure policy, layer-wise transfer, prefill PP
partition, block and chunk sizes, store-connector options (QoS, agent address, staging
buffer) and ``PYTHONHASHSEED``."""

from __future__ import annotations

import re
from typing import Any

from kvpool_agent.hub import hub_ports
from kvpool_agent.vocabulary import KV_ROLE_FOR, KV_ROLES
from kvpool_config._model import LOAD_FAILURE_POLICIES
from kvpool_config.rules._finding import Finding
from kvpool_connector.staging import AUTO_STAGING_MAX_BYTES, parse_staging_buffer

__all__ = [
    "HYBRID_MODEL_PATTERN",
    "check_agent_address",
    "check_block_multiple",
    "check_hybrid_kvpool",
    "check_hybrid_transfer_connector",
    "check_kv_role",
    "check_layerwise_graph",
    "check_load_failure_policy",
    "check_pp_layer_partition",
    "check_pythonhashseed",
    "check_qos_priority",
    "check_staging_buffer",
    "is_hybrid_attention_model",
]

HYBRID_MODEL_PATTERN = re.compile(
    r"deepseek[-_ ]?v4|qwen[-_ ]?3\.5|qwen[-_ ]?3[-_ ]?next|gemma[-_ ]?[23]|gpt[-_ ]?oss",
    re.IGNORECASE)
"""Model names of hybrid-attention models: those the guides name (MindIE Motor kv_cache_store
README table 1: DeepSeek V4 / V4 Flash / V4 Pro; vllm-ascend kv_pool.md: DeepSeekV4, Qwen 3.5)
and those vLLM runs with several KV-cache groups (Qwen3-Next: linear attention; Gemma 2/3 and
gpt-oss: sliding-window next to full attention)."""


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


def check_hybrid_kvpool(extra: dict[str, Any], *, allocator_off: bool, model: str,
                        path: str) -> list[Finding]:
    """``KVPoolConnector`` on a hybrid-attention model: it supports vLLM's hybrid allocator
    (``SupportsHMA``), which lets each sliding-window group store and load only its window, so
    turning the allocator off (``disable_hybrid_kv_cache_manager``) only costs pool bytes; and
    ``use_layerwise`` is turned off (vLLM takes a hybrid model's load failures only per
    request, for asynchronous loads). ``allocator_off``: the engine sets vLLM's
    ``disable_hybrid_kv_cache_manager``."""
    out: list[Finding] = []
    if allocator_off:
        out.append(Finding(
            "warning", "hybrid-allocator-off", path,
            f"{model!r} runs with vLLM's hybrid KV-cache manager off: every layer is stored "
            "and loaded as full attention, the sliding-window layers' whole prompts included",
            "drop disable_hybrid_kv_cache_manager: KVPoolConnector supports the hybrid "
            "manager and stores only each sliding window"))
    if extra.get("use_layerwise") is True:
        out.append(Finding(
            "warning", "hybrid-layerwise", f"{path}.kv_connector_extra_config.use_layerwise",
            f"{model!r} is a hybrid-attention model: use_layerwise is turned off and loads "
            "run asynchronously (vLLM reports a hybrid model's failed loads per request only)",
            "remove use_layerwise (or set load_async: true)"))
    return out


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
    """``agent_address`` is the fleet hub's ``tcp://HOST:PORT`` to connect to (the agent
    DEALER-connects to it; ``kvpool-agent hub --address tcp://0.0.0.0:7600`` listens): the
    hub's own rule, ``kvpool_agent.hub_ports(..., connect=True)`` (a port in 1..65532, no
    listen-only wildcard host)."""
    if value is None:
        return None
    try:
        hub_ports(str(value), connect=True)
    except ValueError as exc:
        return Finding("error", "agent-address", path, f"agent_address: {exc}",
                       'use the hub\'s address, e.g. "tcp://127.0.0.1:7600"')
    return None


STAGING_BUFFER_WARN_BYTES = AUTO_STAGING_MAX_BYTES
"""Above this ``staging_buffer`` (bytes) ``kvpool-config`` warns: each worker holds two (save and
load thread) in host memory, one value (a chunk of every layer) is all a buffer must hold, and
``auto`` (the default) takes four values up to this size (``kvpool_connector.staging``): 1 GiB
is a 2,048-token chunk of Llama-3-70B (320 KiB/token)."""


def check_staging_buffer(value: Any, *, path: str) -> Finding | None:
    """KVPoolConnector's ``staging_buffer`` (``auto`` or a size): each worker allocates two in
    host memory (``kvpool_connector.staging``: fragmented values go through it over Mooncake
    TCP). A value the connector refuses is the parser's error finding; this warns above
    ``STAGING_BUFFER_WARN_BYTES``."""
    if value is None or isinstance(value, bool):
        return None
    try:
        nbytes = parse_staging_buffer(value)
    except ValueError:
        return None  # the connector's own parser reports it as an error
    if nbytes is None:
        return None
    if nbytes <= STAGING_BUFFER_WARN_BYTES:
        return None
    return Finding(
        "warning",
        "staging-buffer",
        path,
        f"staging_buffer {value!r} is {nbytes} bytes: every worker allocates two of them in "
        f"host memory ({2 * nbytes >> 20} MiB per worker); a buffer needs to hold one chunk "
        "of every layer only, and is raised to it when smaller",
        'use the default ("auto": four chunks of every layer, at most 1 GiB) or the bytes of '
        "one chunk (chunk_size x KV bytes per token)",
    )
