"""The deployment rules of ``kvpool-config``, one function each, importable on their own.

Every function takes plain values (numbers, strings, the JSON path of the checked field) and
returns a :class:`Finding` (or ``None`` / a list) saying what is wrong and how to fix it, e.g.
``check_lease_ttl(lease_ttl_ms, connect_ms, transfer_ms)``. The shape modules of
:mod:`kvpool_config` walk a config file and call them. They check configs before start-up only:
the console's alerts (``kvpool_console.alerts``) are separate rules over what running agents
report, and do not call these functions.

By topic: :mod:`~kvpool_config.rules._store` (the pool, its master and sizes),
:mod:`~kvpool_config.rules._disk_tier` (what bounds the SSD tier's bytes),
:mod:`~kvpool_config.rules._connector` (connectors and engines),
:mod:`~kvpool_config.rules._ports` (port clashes) and :mod:`~kvpool_config.rules._finding`
(the finding type, allowed values, unknown keys).
"""

from kvpool_config.rules._connector import (
    HYBRID_MODEL_PATTERN,
    check_agent_address,
    check_block_multiple,
    check_hybrid_kvpool,
    check_hybrid_transfer_connector,
    check_kv_role,
    check_layerwise_graph,
    check_load_failure_policy,
    check_pp_layer_partition,
    check_pythonhashseed,
    check_qos_priority,
    check_staging_buffer,
    is_hybrid_attention_model,
)
from kvpool_config.rules._disk_tier import (
    check_disk_tier_limit,
    check_service_beside_disk_tier,
    file_per_key_bound,
    filesystem_space,
)
from kvpool_config.rules._finding import (
    Finding,
    Severity,
    check_choice,
    check_unknown_keys,
    json_path,
)
from kvpool_config.rules._ports import (
    ASCEND_DEFAULT_BASE_PORT,
    ASCEND_PORTS_PER_DEVICE,
    DEFAULT_DEVICES_PER_HOST,
    ascend_port_window,
    check_duplicate_ports,
    check_kv_port_in_ascend_window,
)
from kvpool_config.rules._store import (
    ASCEND_DEFAULT_TIMEOUT_MS,
    GIB,
    OFFLOAD_PATH_ENV,
    check_backend_choice,
    check_backend_match,
    check_engine_segment,
    check_global_segment_size,
    check_lease_ttl,
    check_local_service_mode,
    check_master_address,
    check_offload_env,
    check_protocol,
    check_ratio,
    check_size,
    check_soft_pin_ttl,
    check_ssd_offload_path,
    check_store_mode,
    check_transfer_timeout,
    host_problem,
    master_endpoint,
)

__all__ = [
    "ASCEND_DEFAULT_BASE_PORT",
    "ASCEND_DEFAULT_TIMEOUT_MS",
    "ASCEND_PORTS_PER_DEVICE",
    "DEFAULT_DEVICES_PER_HOST",
    "GIB",
    "HYBRID_MODEL_PATTERN",
    "OFFLOAD_PATH_ENV",
    "Finding",
    "Severity",
    "ascend_port_window",
    "check_agent_address",
    "check_backend_choice",
    "check_backend_match",
    "check_block_multiple",
    "check_choice",
    "check_disk_tier_limit",
    "check_duplicate_ports",
    "check_engine_segment",
    "check_global_segment_size",
    "check_hybrid_kvpool",
    "check_hybrid_transfer_connector",
    "check_kv_port_in_ascend_window",
    "check_kv_role",
    "check_layerwise_graph",
    "check_lease_ttl",
    "check_load_failure_policy",
    "check_local_service_mode",
    "check_master_address",
    "check_offload_env",
    "check_pp_layer_partition",
    "check_protocol",
    "check_pythonhashseed",
    "check_qos_priority",
    "check_ratio",
    "check_service_beside_disk_tier",
    "check_size",
    "check_soft_pin_ttl",
    "check_ssd_offload_path",
    "check_staging_buffer",
    "check_store_mode",
    "check_transfer_timeout",
    "check_unknown_keys",
    "file_per_key_bound",
    "filesystem_space",
    "host_problem",
    "is_hybrid_attention_model",
    "json_path",
    "master_endpoint",
]
