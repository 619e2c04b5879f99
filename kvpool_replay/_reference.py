"""What a replay should reach, computed from the trace alone (independently of the connector):
the cache models of ``kvpool_agent.reuse`` (their one owner; the hub runs them over live
accesses), under the names the replay has always used."""

from __future__ import annotations

from kvpool_agent.reuse import ReuseResult, belady_hits, claimable_chunks, lru_hits, prefix_ceiling

__all__ = ["ReuseResult", "belady_hits", "claimable_chunks", "lru_hits", "prefix_ceiling"]
