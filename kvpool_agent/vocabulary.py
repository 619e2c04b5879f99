"""Wire vocabulary: the names every part of kvpool says to every other.

Roles, backend error names, the KV keys' namespace and the environment variable that names
the hub. They travel in
reports (``kvpool_agent.protocol``), are shown by the console and chosen by the connector, so
they have one owner here, beside the wire schema, and nobody else defines them.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal

__all__ = [
    "AGENT_ADDRESS_ENV",
    "AGENT_KEYS_ENV",
    "HINTS",
    "INSTANCE_ROLES",
    "INSTANCE_ROLE_ENV",
    "INSTANCE_ROLE_OF",
    "KEY_PREFIX",
    "KV_ROLES",
    "KV_ROLE_FOR",
    "LOAD_RETRYABLE",
    "ErrorCode",
    "InstanceRole",
    "KVRole",
    "error_name",
]

AGENT_ADDRESS_ENV = "KVPOOL_AGENT_ADDRESS"
"""Environment variable naming the fleet hub (``tcp://HOST:P``) when ``agent_address`` is not
configured."""

AGENT_KEYS_ENV = "KVPOOL_AGENT_KEYS"
"""Environment variable naming the agent's keys directory (``hub.key`` and
``agent.key_secret``, ``kvpool_agent.auth``) when ``agent_keys`` is not configured; without
either the agent connects without a key, which a hub with keys refuses."""

KEY_PREFIX = "kvpool@"
"""Every KV key starts with this (``kvpool_connector.keys``); ``flush --scope all`` counts and
removes only these (``kvpool_agent.pool_listing.ALL_KEYS_PATTERN``)."""

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
"""vLLM's ``KVTransferConfig.kv_role``."""

KV_ROLES: tuple[KVRole, ...] = ("kv_producer", "kv_consumer", "kv_both")

InstanceRole = Literal["prefill", "decode", "mixed"]
"""What an instance serves: MindIE Motor's and vllm-ascend's prefill, decode or PD-mixed."""

INSTANCE_ROLES: tuple[InstanceRole, ...] = ("prefill", "decode", "mixed")

INSTANCE_ROLE_ENV = "KVPOOL_INSTANCE_ROLE"
"""Environment variable declaring the instance role (``prefill``, ``decode`` or ``mixed``) when
``kv_connector_extra_config.instance_role`` does not: set by the orchestrator that decided the
role (MindIE Motor, a Kubernetes template), so ``kv_role`` can be checked against it."""

KV_ROLE_FOR: dict[str, KVRole] = {
    "prefill": "kv_producer",
    "decode": "kv_consumer",
    "mixed": "kv_both",
}
"""Instance role -> the ``kv_role`` its connector must have (MindIE Motor kv_cache_store README
FAQ: P is kv_producer, D is kv_consumer; vllm-ascend kv_pool.md PD-mixed scenario: kv_both)."""

INSTANCE_ROLE_OF: dict[str, InstanceRole] = {
    "kv_producer": "prefill",
    "kv_consumer": "decode",
    "kv_both": "mixed",
}
"""``kv_role`` -> the instance role it implies when nothing else declares one."""


class ErrorCode(IntEnum):
    """Mooncake Store's ``ErrorCode`` (mooncake-store ``include/types.h``), names as there.

    Every backend translates its own failures into these, so one name means one thing across
    the product.
    """

    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SHARD_INDEX_OUT_OF_RANGE = -100
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    ETCD_OPERATION_ERROR = -1000
    ETCD_KEY_NOT_EXIST = -1001
    ETCD_TRANSACTION_FAIL = -1002
    ETCD_CTX_CANCELLED = -1003
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    INVALID_MODE = -1200


LOAD_RETRYABLE = frozenset({ErrorCode.OBJECT_NOT_FOUND, ErrorCode.LEASE_EXPIRED})
"""Load failures after a positive lookup that mean "the block went away": recompute it."""

HINTS: dict[str, str] = {
    "INTERNAL_ERROR": "the master or client hit an internal error: read mooncake_master's log "
    "and the engine's log around this time; restart the master if it repeats",
    "BUFFER_OVERFLOW": "a value did not fit the client's buffer: raise local_buffer_size in "
    "the Mooncake config (it must hold one chunk: chunk_size tokens of KV)",
    "SHARD_INDEX_OUT_OF_RANGE": "the master's metadata shards disagree with the client: run "
    "engines and mooncake_master from the same Mooncake release",
    "SEGMENT_NOT_FOUND": "a segment the pool refers to is gone (its store process or engine "
    "stopped): restart that store, or flush its keys; reads of it are recomputed",
    "SEGMENT_ALREADY_EXISTS": "a segment with this name is still mounted (a restarted client "
    "before its old lease ended): wait for the master's client TTL or restart the master",
    "NO_AVAILABLE_HANDLE": "pool full: remaining saves of the request skipped; add segment memory "
    "(global_segment_size) or lower eviction_high_watermark_ratio",
    "INVALID_VERSION": "client and master speak different Mooncake versions: install the same "
    "mooncake-transfer-engine release everywhere",
    "INVALID_KEY": "the pool refused a key: run every engine from the same kvpool release "
    "(keys are built in kvpool_connector.keys)",
    "WRITE_FAIL": "writing a replica failed: check the segment owner's host (memory, network) "
    "and the store process's log",
    "INVALID_PARAMS": "the pool refused the call's parameters (a size or a buffer not "
    "registered): check local_buffer_size and that engines and master share a release",
    "INVALID_WRITE": "a write was refused by the replica's state: usually a concurrent save of "
    "the same key; harmless once, check the master's log if it repeats",
    "INVALID_READ": "a read was refused by the replica's state: the block is recomputed; check "
    "the master's log if it repeats",
    "INVALID_REPLICA": "the replica is invalid (its segment went away): blocks are recomputed; "
    "check the segment owners",
    "REPLICA_IS_NOT_READY": "the value is still being written by another engine: the load is "
    "recomputed; harmless unless it repeats for the same keys",
    "OBJECT_NOT_FOUND": "block evicted or removed between lookup and load (it is recomputed): if "
    "it is frequent, add segment memory (global_segment_size) or raise default_kv_lease_ttl "
    "so looked-up blocks stay until loaded",
    "OBJECT_ALREADY_EXISTS": "another engine saved the same chunk first: harmless (the value is "
    "shared); nothing to do",
    "OBJECT_HAS_LEASE": "entry is leased by an in-flight load; flush again later or with force",
    "LEASE_EXPIRED": "load started after the lookup's lease ran out, or lasted longer than the "
    "lease (its bytes are recomputed): raise default_kv_lease_ttl above load times and the "
    "transfer timeouts (ASCEND_TRANSFER_TIMEOUT)",
    "TRANSFER_FAIL": "transfer engine could not move the bytes: check protocol/device_name and "
    "the network between the segment owner and this engine",
    "RPC_FAIL": "master unreachable: check mooncake_master and master_server_address",
    "RPC_TIMEOUT": "the master did not answer within the RPC timeout (a stopped or overloaded "
    "master): check mooncake_master's process and load; the call may still have taken effect",
    "ETCD_OPERATION_ERROR": "the master's etcd failed: check etcd (metadata_server / the "
    "master's --etcd_endpoints) and its health",
    "ETCD_KEY_NOT_EXIST": "a key the master expects in etcd is missing: restart the master "
    "against the right etcd cluster",
    "ETCD_TRANSACTION_FAIL": "an etcd transaction failed (contention or a leader change): "
    "transient; check etcd's health if it repeats",
    "ETCD_CTX_CANCELLED": "an etcd call was cancelled (timeout): check etcd's latency and the "
    "network to it",
    "UNAVAILABLE_IN_CURRENT_STATUS": "the master is not serving yet (starting, or a standby in "
    "HA mode): wait, or point master_server_address at the leader",
    "UNAVAILABLE_IN_CURRENT_MODE": "the call is not supported in this store mode: check "
    "store_mode (embedded/standalone) matches the deployment",
    "INVALID_MODE": "the master runs in another mode than the client expects: check the "
    "master's HA / store mode flags",
    "LOOKUP": "the scheduler's prefix lookup failed; requests run without the pool",
    "TIMEOUT": "a layer-wise load did not finish in time; its blocks are recomputed",
}
"""Error name -> what an operator usually does about it (shown next to the error); every
``ErrorCode`` name has one."""


def error_name(code: int) -> str:
    """Name of a negative backend code, e.g. ``error_name(-707) == "LEASE_EXPIRED"``;
    ``"ERROR_<code>"`` for a code Mooncake does not define."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"ERROR_{code}"
