"""``WorkerCounters``: a worker's running totals, shared by its load and save threads
(``_transfers``) and read by the agent and vLLM's stats (``_stats``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerCounters"]


@dataclass
class WorkerCounters:
    """Running totals of this worker (bytes, keys, blocks), for tests, benchmarks and the agent."""

    saved_bytes: int = 0
    saved_keys: int = 0
    save_skipped_keys: int = 0
    save_failed_keys: int = 0
    loaded_bytes: int = 0
    loaded_keys: int = 0
    load_failed_keys: int = 0
    load_failed_blocks: int = 0
    layer_timeouts: int = 0
    load_failed_tokens: int = 0
    checksum_failures: int = 0
    evicted_keys: int = 0
    evict_failed_keys: int = 0
