"""Pydantic models of the KV-pool part of a deployment.

They describe the keys ``kvpool-config`` reads (and the JSON Schema publishes): vLLM's
``kv_transfer_config`` (``vllm.config.KVTransferConfig`` field names), the store connectors'
``kv_connector_extra_config``, MindIE Motor's global ``kv_cache_store_config`` and ``env.json``
sections. The models check types only and keep unknown keys (``extra="allow"``): value rules
(ranges, allowed names, cross-field agreement) live in :mod:`kvpool_config.rules`,
which says what is wrong and how to fix it. Allowed values and ranges are still written into the
schema (``json_schema_extra``) so editors flag them while typing.

Sources: vLLM ``vllm/config/kv_transfer.py``; vllm-ascend ``docs/source/user_guide/
feature_guide/kv_pool.md`` (KV pool parameters, mooncake.json, mooncake_master flags); MindIE
Motor ``docs/zh/user_guide/features/kv_cache_store/README.md`` and ``backend/*.md``
(kv_cache_store_config tables, target_job_id, UCM); MindIE Motor
``examples/deployer/lib/generator/kv_cache_store.py`` (defaults the deployer fills in).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvpool_agent.vocabulary import KV_ROLES
from kvpool_connector.backends.memcache import MemcacheConfig
from kvpool_connector.backends.yuanrong import YuanrongConfig
from kvpool_connector.config import CONNECTOR_EXTRA_KEYS
from kvpool_connector.sizes import SIZE_PATTERN

__all__ = [
    "ASCEND_STORE_EXTRA_KEYS",
    "BACKENDS",
    "CONNECTOR_KEYS",
    "DEFAULT_KV_CACHE_STORE_PORT",
    "DEFAULT_LEASE_TTL_MS",
    "DEFAULT_MINDIE_BACKEND",
    "DEFAULT_MMC_CONFIG_STORE_PORT",
    "DEFAULT_MMC_METRICS_PORT",
    "DEPLOY_MODES",
    "ENGINE_SECTIONS",
    "KTC_FIELDS",
    "KVPOOL_BACKEND_KEYS",
    "KVPOOL_EXTRA_KEYS",
    "LOAD_FAILURE_POLICIES",
    "LOCAL_SERVICE_MODES",
    "MOONCAKE_PROTOCOLS",
    "STORE_FIELDS",
    "STORE_MODES",
    "STORE_ONLY_KEYS",
    "EngineConfig",
    "EngineSection",
    "EnvFile",
    "KVCacheStoreConfig",
    "KVTransferConfig",
    "MooncakeClientConfig",
    "MotorDeployConfig",
    "StorageMount",
    "UserConfig",
]

LOAD_FAILURE_POLICIES = ("recompute", "fail")
"""vLLM ``KVTransferConfig.kv_load_failure_policy`` values (default ``fail``)."""

BACKENDS = ("mooncake", "memcache", "yuanrong")
"""Pool backends of AscendStoreConnector / KVPoolConnector (vllm-ascend kv_pool.md)."""

DEFAULT_MINDIE_BACKEND = "memcache"
"""``kv_cache_store_config.backend`` when unset (MindIE Motor kv_cache_store README, table 2)."""

STORE_MODES = ("embedded", "standalone")
"""Mooncake ``store_mode`` (MindIE Motor kv_cache_store README, table 3; default embedded)."""

LOCAL_SERVICE_MODES = ("inprocess", "standalone")
"""MemCache ``local_service_mode`` (MindIE Motor kv_cache_store README, table 4)."""

DEPLOY_MODES = ("infer_service_set", "multi_deployment")
"""``motor_deploy_config.deploy_mode`` (MindIE Motor deployer, default infer_service_set)."""

MOONCAKE_PROTOCOLS = ("ascend", "tcp", "rdma", "efa", "nvlink", "nvmeof", "cxl", "hip", "barex")
"""Transfer-engine protocol names Mooncake Store accepts; NPU deployments use ``ascend``."""

DEFAULT_KV_CACHE_STORE_PORT = 50088
"""``kv_cache_store_config.port`` when unset (MindIE deployer ``DEFAULT_KV_CACHE_STORE_PORT``)."""

DEFAULT_MMC_CONFIG_STORE_PORT = 50089
"""MemCache MetaService config-store port when unset (MindIE Motor communication matrix)."""

DEFAULT_MMC_METRICS_PORT = 50090
"""MemCache MetaService metrics port when unset (MindIE kv_cache_store README, MemCache table)."""

DEFAULT_LEASE_TTL_MS = 11000
"""``default_kv_lease_ttl`` (milliseconds) the MindIE deployer passes to mooncake_master when
unset (``kv_cache_store.py``: ``kv_store_config.get(DEFAULT_KV_LEASE_TTL, 11000)``)."""

ASCEND_STORE_EXTRA_KEYS = frozenset(
    {
        "backend",
        "lookup_rpc_port",
        "mooncake_rpc_port",
        "load_async",
        "consumer_is_to_put",
        "consumer_is_to_load",
        "use_layerwise",
        "prefill_pp_size",
        "prefill_pp_layer_partition",
        "qos_priority",
        "save_decode_cache",
        "memcache_dp_init_barrier",
        "layerwise_num_shared_buffers",
        "layerwise_independent_layers",
        "layerwise_prefetch_layers",
        "layerwise_max_transfer_blocks",
        "layerwise_max_transfer_bytes",
        "h2d_stagger_us",
        "discard_partial_chunks",
    }
)
"""``kv_connector_extra_config`` keys of AscendStoreConnector documented in vllm-ascend
``kv_pool.md`` and ``layerwise_kv_pool.md``."""

KVPOOL_EXTRA_KEYS = CONNECTOR_EXTRA_KEYS
"""``kv_connector_extra_config`` keys of this project's KVPoolConnector, taken from
``kvpool_connector.config`` itself so the validator and the connector cannot drift; backend keys
(:data:`KVPOOL_BACKEND_KEYS`) may sit next to them."""

KVPOOL_BACKEND_KEYS = frozenset(
    {"mooncake_config_path", "mooncake", "master_admin_url"}
    | {f"yuanrong_{name}" for name in YuanrongConfig.model_fields}
    | {f"memcache_{name}" for name in MemcacheConfig.model_fields}
)
"""Backend keys KVPoolConnector's backends read from ``kv_connector_extra_config``
(``MooncakeConfig.load``, ``YuanrongConfig.load``, ``MemcacheConfig.load``)."""

_PORT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "integer", "minimum": 1, "maximum": 65535},
        {"type": "string", "pattern": "^[0-9]+$"},
    ]
}
_RATIO_SCHEMA: dict[str, Any] = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
_SIZE_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": SIZE_PATTERN}]
}


class _Open(BaseModel):
    """Typed view of a JSON object that keeps keys it does not know (rules report them)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class KVTransferConfig(_Open):
    """vLLM's ``--kv-transfer-config`` (``vllm.config.KVTransferConfig``); also each child of a
    ``MultiConnector``'s ``kv_connector_extra_config.connectors``. vLLM rejects keys it does not
    define, so unknown keys here are errors."""

    kv_connector: str | None = Field(
        default=None, description="Connector class name, e.g. MultiConnector, KVPoolConnector."
    )
    kv_role: str | None = Field(default=None, json_schema_extra={"enum": list(KV_ROLES)})
    kv_port: int | str | None = Field(
        default=None,
        description="Side-channel port of P/D transfer connectors.",
        json_schema_extra=_PORT_SCHEMA,
    )
    engine_id: str | int | None = None
    kv_buffer_device: str | None = None
    kv_connector_extra_config: dict[str, Any] | None = Field(
        default=None, description="Connector-specific settings (connectors of a MultiConnector)."
    )
    kv_connector_module_path: str | None = Field(
        default=None, description="Python module that defines kv_connector (kvpool_connector)."
    )
    enable_permute_local_kv: bool | None = None
    kv_load_failure_policy: str | None = Field(
        default=None,
        description="recompute | fail (vLLM default fail). Top level only under MultiConnector.",
        json_schema_extra={"enum": list(LOAD_FAILURE_POLICIES)},
    )


class KVCacheStoreConfig(_Open):
    """MindIE Motor's global ``kv_cache_store_config`` (shared by P and D instances)."""

    enable: bool | None = None
    mode: str | None = Field(
        default=None,
        description="NodeManager layout: combined (engine + KV store in one pod) or separated.",
        json_schema_extra={"enum": ["combined", "separated"]},
    )
    service: str | None = None
    backend: str | None = Field(
        default=None,
        description="Pool backend; default memcache. Must equal the store connector's backend.",
        json_schema_extra={"enum": list(BACKENDS)},
    )
    port: int | None = Field(
        default=None,
        description="mooncake_master / KV Pool service port (default 50088).",
        json_schema_extra={"minimum": 1, "maximum": 65535},
    )
    metadata_server: str | None = None
    protocol: str | None = Field(default=None, json_schema_extra={"enum": list(MOONCAKE_PROTOCOLS)})
    device_name: str | None = None
    global_segment_size: int | str | None = Field(
        default=None,
        description='Memory each contributor gives the pool ("1GB", bytes).',
        json_schema_extra=_SIZE_SCHEMA,
    )
    local_buffer_size: int | str | None = Field(default=None, json_schema_extra=_SIZE_SCHEMA)
    default_kv_lease_ttl: int | None = Field(
        default=None,
        description="Lease of a looked-up object in milliseconds (default 11000); must exceed "
        "ASCEND_CONNECT_TIMEOUT and ASCEND_TRANSFER_TIMEOUT (milliseconds).",
        json_schema_extra={"minimum": 1},
    )
    eviction_high_watermark_ratio: float | None = Field(
        default=None,
        description="Mooncake: required; usage fraction that starts eviction.",
        json_schema_extra=_RATIO_SCHEMA,
    )
    eviction_ratio: float | None = Field(
        default=None,
        description="Mooncake: required; fraction evicted per round.",
        json_schema_extra=_RATIO_SCHEMA,
    )
    store_mode: str | None = Field(default=None, json_schema_extra={"enum": list(STORE_MODES)})
    store_http_port: int | None = None
    target_job_id: str | None = Field(
        default=None, description="job_id of another service whose kv_store this one reuses."
    )
    enable_ssd_offload: bool | None = None
    ssd_offload_path: str | None = Field(
        default=None, description="Absolute path (no '..').", json_schema_extra={"pattern": "^/"}
    )
    tenant_id: str | None = None
    local_service_mode: str | None = Field(
        default=None, json_schema_extra={"enum": list(LOCAL_SERVICE_MODES)}
    )
    config_store_port: int | None = None
    metrics_port: int | None = None
    dram_size: str | None = None
    local_config_path: str | None = None
    etcd_address: str | None = None
    worker_port: int | None = None
    pool_endpoint: str | None = None
    additional_labels: dict[str, str] | None = None
    additional_annotations: dict[str, str] | None = None


class EngineConfig(_Open):
    """The vLLM arguments of one MindIE engine section (only the keys the KV pool depends on
    are typed; every other vLLM argument passes through)."""

    kv_transfer_config: KVTransferConfig | None = None
    model: str | None = None
    served_model_name: str | None = None
    block_size: int | None = None
    prefix_match_unit: int | None = None
    enforce_eager: bool | None = Field(default=None, alias="enforce-eager")
    compilation_config: dict[str, Any] | str | None = None
    pipeline_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    data_parallel_rpc_port: int | None = None
    port: int | None = None
    hf_overrides: dict[str, Any] | None = None


class EngineSection(_Open):
    """``motor_engine_prefill_config`` / ``motor_engine_decode_config`` / union config."""

    engine_type: str | None = None
    engine_config: EngineConfig | None = None


class StorageMount(_Open):
    """One ``motor_deploy_config.storage`` entry (UCM cache volume)."""

    type: str | None = None
    size: str | None = None
    mount_path: str | None = None


class MotorDeployConfig(_Open):
    """``motor_deploy_config``: only what the KV-pool rules read."""

    job_id: str | None = None
    deploy_mode: str | None = Field(default=None, json_schema_extra={"enum": list(DEPLOY_MODES)})
    hardware_type: str | None = None
    p_pod_npu_num: int | None = None
    d_pod_npu_num: int | None = None
    storage: list[StorageMount] | None = None
    dshm_size: str | None = None


class UserConfig(_Open):
    """MindIE Motor ``user_config.json`` (KV-pool part)."""

    motor_deploy_config: MotorDeployConfig | None = None
    kv_cache_store_config: KVCacheStoreConfig | None = None
    motor_engine_prefill_config: EngineSection | None = None
    motor_engine_decode_config: EngineSection | None = None
    motor_engine_union_config: EngineSection | None = None


_EnvSection = dict[str, str | int | float | bool]


class EnvFile(_Open):
    """MindIE Motor ``env.json``: environment variables per component. ``ASCEND_CONNECT_TIMEOUT``
    and ``ASCEND_TRANSFER_TIMEOUT`` (milliseconds, Mooncake Ascend Direct Transport) belong in
    the engine sections."""

    version: str | None = None
    motor_common_env: _EnvSection | None = None
    motor_engine_prefill_env: _EnvSection | None = None
    motor_engine_decode_env: _EnvSection | None = None
    motor_kv_cache_store_env: _EnvSection | None = None


class MooncakeClientConfig(_Open):
    """The Mooncake client JSON ``MOONCAKE_CONFIG_PATH`` points to (vllm-ascend kv_pool.md
    "mooncake.json Parameters"; ``local_hostname`` as Mooncake's store examples write it)."""

    local_hostname: str | None = None
    metadata_server: str | None = None
    protocol: str | None = Field(default=None, json_schema_extra={"enum": list(MOONCAKE_PROTOCOLS)})
    device_name: str | None = None
    master_server_address: str | None = Field(
        default=None,
        description="host:port of mooncake_master, or etcd://host:port of an HA pool's etcd "
        "(MOONCAKE_MASTER overrides it).",
    )
    global_segment_size: int | str | None = Field(default=None, json_schema_extra=_SIZE_SCHEMA)
    local_buffer_size: int | str | None = Field(default=None, json_schema_extra=_SIZE_SCHEMA)
    store_mode: str | None = Field(
        default=None,
        description="kvpool's Mooncake backend: standalone = this engine contributes no memory.",
        json_schema_extra={"enum": list(STORE_MODES)},
    )
    master_admin_url: str | None = Field(
        default=None,
        description="mooncake_master HTTP admin URL (kvpool's Mooncake backend); an HA pool's "
        "masters comma-separated.",
    )
    preferred_segment: bool | None = None
    prefer_alloc_in_same_node: bool | None = None
    enable_ssd_offload: bool | None = None
    ssd_offload_path: str | None = Field(default=None, json_schema_extra={"pattern": "^/"})
    tenant_id: str | None = None
    transfer_timeout_ms: StrictInt | None = Field(
        default=None, ge=0,
        description="kvpool's Mooncake backend: how long (ms) after a refused remove a key a "
        "reader leased is tried again; default 60000, the store client's transfer timeout.",
    )
    max_kv_soft_pin_ttl: StrictInt | None = Field(
        default=None, gt=0,
        description="kvpool's Mooncake backend: the master's --max_kv_soft_pin_ttl (ms), the "
        "TTL a hard pin's chunks already in the pool are upserted with; default 86400000.",
    )


KTC_FIELDS = frozenset(KVTransferConfig.model_fields)
"""Keys of vLLM's ``KVTransferConfig`` (vLLM rejects any other)."""

STORE_FIELDS = frozenset(KVCacheStoreConfig.model_fields)
"""Keys of MindIE's ``kv_cache_store_config``."""

CONNECTOR_KEYS = (ASCEND_STORE_EXTRA_KEYS | KVPOOL_EXTRA_KEYS) - {"backend"}
"""Store-connector ``kv_connector_extra_config`` keys other than ``backend`` (which also belongs
in ``kv_cache_store_config``): misplaced anywhere but in the connector."""

STORE_ONLY_KEYS = STORE_FIELDS - {
    "port",
    "backend",
    "mode",
    "service",
    "enable",
    "additional_labels",
    "additional_annotations",
}
"""``kv_cache_store_config`` keys misplaced in a connector. ``port`` is left out: in a connector
or kv_transfer_config it is more likely a mistyped ``kv_port``."""

ENGINE_SECTIONS: dict[str, tuple[str, str, str]] = {
    "motor_engine_prefill_config": ("prefill", "motor_engine_prefill_env", "p_pod_npu_num"),
    "motor_engine_decode_config": ("decode", "motor_engine_decode_env", "d_pod_npu_num"),
    "motor_engine_union_config": ("mixed", "motor_engine_prefill_env", "p_pod_npu_num"),
}
"""MindIE engine sections of ``user_config.json``: section -> (instance role, its env.json
section, its ``motor_deploy_config`` NPU count key)."""
