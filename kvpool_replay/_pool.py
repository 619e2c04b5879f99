"""One replay pool's settings: its segment size in bytes for a capacity in tokens, whether the
machine can hold it, and the ``kv_connector_extra_config`` an engine reaches it with."""

from __future__ import annotations

import math
from typing import Any

import psutil

from kvpool_replay._spec import ModelShape

__all__ = [
    "MIN_SEGMENT_BYTES",
    "mooncake_extra_config",
    "pool_bytes_for_tokens",
    "require_memory",
]

_MIB = 1 << 20

MIN_SEGMENT_BYTES = 16 * _MIB
"""Smallest segment ``mooncake_client`` accepts here (smaller ones fail with INVALID_PARAMS)."""


def pool_bytes_for_tokens(tokens: int, shape: ModelShape) -> int:
    """``global_segment_size`` in bytes for a pool of ``tokens`` tokens of KV, rounded up to
    whole MiB.

    Raises:
        ValueError: the pool would be smaller than ``MIN_SEGMENT_BYTES`` (the message gives
            the smallest ``--pool-tokens`` for this model shape).
    """
    raw = max(1, tokens) * shape.bytes_per_token
    if raw < MIN_SEGMENT_BYTES:
        need = math.ceil(MIN_SEGMENT_BYTES / shape.bytes_per_token)
        raise ValueError(
            f"pool of {tokens:,} tokens is {raw:,} bytes at {shape.bytes_per_token} B/token, "
            f"below Mooncake's 16 MiB minimum segment: use --pool-tokens >= {need:,} or a "
            "larger model shape"
        )
    return math.ceil(raw / _MIB) * _MIB


def require_memory(pool_bytes: int, available_bytes: int | None = None, *,
                   fix: str = "use a smaller --pool-tokens") -> None:
    """Refuse pools the machine cannot hold before starting anything: ``mooncake_client``
    allocates its whole segment at start and aborts when that fails ("Failed to allocate
    segment memory", then a fatal ``Failed to setup client: INVALID_PARAMS``).

    Args:
        pool_bytes: segment bytes of every pool the run starts, together.
        available_bytes: memory available to new processes, bytes (default
            ``psutil.virtual_memory().available``).
        fix: what the message tells the operator to change.

    Raises:
        ValueError: ``pool_bytes`` > ``available_bytes``; the message names both.
    """
    if available_bytes is None:
        available_bytes = psutil.virtual_memory().available
    if pool_bytes > available_bytes:
        raise ValueError(
            f"the pool needs {pool_bytes:,} bytes of memory but only {available_bytes:,} bytes "
            f"are available: {fix}"
        )


def mooncake_extra_config(
    master_address: str,
    admin_url: str | None = None,
    *,
    lease_ttl_ms: int | None = None,
    high_watermark: float | None = None,
) -> dict[str, Any]:
    """``kv_connector_extra_config`` keys for the Mooncake backend of a replay engine:
    Mooncake's standalone store mode (the engine contributes no segment; the replay's
    ``mooncake_client`` holds the pool memory), TCP on 127.0.0.1. ``admin_url`` (the master's
    HTTP admin endpoint) lets the agent report pool usage and evictions; ``lease_ttl_ms`` and
    ``high_watermark`` repeat the master's ``--default_kv_lease_ttl`` (ms) and
    ``--eviction_high_watermark_ratio`` so lease expiries and watermark alerts are right."""
    mooncake: dict[str, Any] = {
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master_address,
        "protocol": "tcp",
        "global_segment_size": 0,
        "local_buffer_size": "16MB",
        "store_mode": "standalone",
    }
    extra: dict[str, Any] = {"backend": "mooncake", "mooncake": mooncake}
    if admin_url:
        mooncake["master_admin_url"] = admin_url
    if lease_ttl_ms is not None:
        mooncake["default_kv_lease_ttl"] = lease_ttl_ms
        extra["lease_ttl_ms"] = lease_ttl_ms
    if high_watermark is not None:
        mooncake["eviction_high_watermark_ratio"] = high_watermark
    return extra
