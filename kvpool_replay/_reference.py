"""What a replay should reach, computed from the trace alone (independently of the connector):
the cache models of ``kvpool_agent.reuse`` (their one owner; the hub runs them over live
accesses), under the names the replay has always used."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool_agent.reuse import ReuseResult, belady_hits, claimable_chunks, lru_hits, prefix_ceiling
from kvpool_connector.keys import chunk_hashes
from kvpool_replay._tokens import DEFAULT_VOCAB_SIZE, request_tokens
from kvpool_replay._trace import TraceRequest

__all__ = ["ReuseResult", "belady_hits", "claimable_chunks", "lru_hits", "prefix_ceiling",
           "reference_for", "unique_chunks"]


def reference_for(
    requests: Sequence[TraceRequest], chunk_size: int, capacity_tokens: int | None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> tuple[ReuseResult, ReuseResult]:
    """``(ceiling, lru)`` for ``requests`` in order; LRU at ``capacity_tokens`` (the ceiling
    again when ``None``)."""
    items = [(r.input_length, chunk_hashes(request_tokens(r, vocab_size), chunk_size))
             for r in requests]
    ceiling = prefix_ceiling(items, chunk_size)
    lru = ceiling if capacity_tokens is None else lru_hits(items, chunk_size, capacity_tokens)
    return ceiling, lru


def unique_chunks(requests: Sequence[TraceRequest], chunk_size: int,
                   vocab_size: int) -> int:
    """Distinct chunks of ``chunk_size`` tokens over ``requests``' prompts."""
    seen: set[str] = set()
    for r in requests:
        seen.update(chunk_hashes(request_tokens(r, vocab_size), chunk_size))
    return len(seen)

