"""Backend error codes by name.

Codes and names are Mooncake Store's ``ErrorCode`` (mooncake-store ``types.h``); every backend
translates its own failures into these so one name means one thing across the product. ``HINTS``
says what an operator usually does about each; the console shows it next to the error.
"""

from __future__ import annotations

__all__ = ["HINTS", "LOAD_RETRYABLE", "NAMES", "error_name"]

NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -1000: "ETCD_OPERATION_ERROR",
    -1001: "ETCD_KEY_NOT_EXIST",
    -1002: "ETCD_TRANSACTION_FAIL",
    -1003: "ETCD_CTX_CANCELLED",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
    -1200: "INVALID_MODE",
}

LOAD_RETRYABLE = frozenset({-704, -707})
"""Load failures after a positive lookup that mean "the block went away": recompute it."""

HINTS: dict[str, str] = {
    "NO_AVAILABLE_HANDLE": "pool full: remaining saves of the request skipped; add segment memory "
    "(global_segment_size) or lower eviction_high_watermark_ratio",
    "OBJECT_NOT_FOUND": "block evicted or removed between lookup and load; blocks are recomputed",
    "LEASE_EXPIRED": "load started after the lookup's lease ran out: raise default_kv_lease_ttl "
    "above the transfer timeouts (ASCEND_TRANSFER_TIMEOUT)",
    "OBJECT_HAS_LEASE": "entry is leased by an in-flight load; flush again later or with force",
    "TRANSFER_FAIL": "transfer engine could not move the bytes: check protocol/device_name and "
    "the network between the segment owner and this engine",
    "RPC_FAIL": "master unreachable: check mooncake_master and master_server_address",
    "LOOKUP": "the scheduler's prefix lookup failed; requests run without the pool",
    "TIMEOUT": "a layer-wise load did not finish in time; its blocks are recomputed",
}


def error_name(code: int) -> str:
    """Name of a negative backend code, e.g. ``error_name(-707) == "LEASE_EXPIRED"``;
    ``"ERROR_<code>"`` for a code Mooncake does not define."""
    return NAMES.get(code, f"ERROR_{code}")
