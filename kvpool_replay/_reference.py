"""What a replay should reach, computed from the trace alone (independently of the connector).

* ``prefix_ceiling``: an unbounded pool that holds every chunk ever saved. A request hits the
  leading chunks whose chained hash was saved by an earlier request.
* ``lru_hits``: an exact LRU cache of a given capacity in tokens (``OrderedDict``), the
  baseline of the Mooncake paper's Figure 9; with an ``admission`` policy
  (``kvpool_connector.admission``), only the chunks it admits are inserted (the policy's model).
* ``belady_hits``: Belady's MIN at a given capacity (Belady, "A study of replacement algorithms
  for a virtual-storage computer", IBM Systems Journal 1966): with the future known, evict the
  chunk whose next use is farthest (or never), including the chunk just inserted (so a chunk
  used farther than everything cached is not admitted). Next uses are precomputed in one
  backward pass and victims come from a max-heap with lazy deletion: O(chunks log chunks).
  It is the offline optimum for independent objects; a prefix hit also needs every earlier
  chunk of the prompt, so MIN is a strong bound here, not a proven optimum.

Both apply the connector's claim rules (``kvpool_connector.scheduler``, after vLLM Ascend's
``get_num_new_matched_tokens``): only whole chunks of ``chunk_size`` tokens are stored or looked
up, and the last prompt token is never claimed, so a prompt of ``n`` tokens claims at most
``(n - 1) // chunk_size`` chunks. After a request, every whole chunk of its prompt is in the
pool (it was loaded or saved).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

from kvpool_connector.admission import AdmissionPolicy

__all__ = ["ReuseResult", "belady_hits", "claimable_chunks", "lru_hits", "prefix_ceiling"]


@dataclass(frozen=True)
class ReuseResult:
    """Totals over the replayed requests, in tokens.

    ``hit_rate`` = ``hit_tokens / input_tokens`` (0.0 for no input). ``per_request`` holds each
    request's hit tokens in replay order.
    """

    input_tokens: int
    hit_tokens: int
    per_request: list[int]
    evicted_chunks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def claimable_chunks(num_tokens: int, chunk_size: int) -> int:
    """Most chunks a prompt of ``num_tokens`` tokens may take from the pool: whole chunks
    only, never the last token (vLLM must compute it to sample)."""
    return max(0, (num_tokens - 1) // chunk_size)


def _leading(hashes: Sequence[str], limit: int, present: Container[str]) -> int:
    n = 0
    for h in hashes[:limit]:
        if h not in present:
            break
        n += 1
    return n


def prefix_ceiling(
    requests: Iterable[tuple[int, Sequence[str]]], chunk_size: int
) -> ReuseResult:
    """Prefix-reuse ceiling of requests replayed in order through an unbounded pool.

    Args:
        requests: per request ``(input_length tokens, chunk hashes of its prompt)`` as
            ``keys.chunk_hashes(tokens, chunk_size)`` returns them.
        chunk_size: tokens per chunk (> 0).
    """
    seen: set[str] = set()
    total = hits = 0
    per: list[int] = []
    for n, hashes in requests:
        hit = _leading(hashes, claimable_chunks(n, chunk_size), seen) * chunk_size
        per.append(hit)
        total += n
        hits += hit
        seen.update(hashes)
    return ReuseResult(total, hits, per)


def _check_capacity(capacity_tokens: int, chunk_size: int) -> None:
    if capacity_tokens < 0 or chunk_size < 1:
        raise ValueError(
            f"capacity_tokens must be >= 0 and chunk_size >= 1, got {capacity_tokens}, "
            f"{chunk_size}"
        )


def lru_hits(
    requests: Iterable[tuple[int, Sequence[str]]], chunk_size: int, capacity_tokens: int,
    admission: AdmissionPolicy | None = None,
) -> ReuseResult:
    """Exact LRU simulation: a cache of ``capacity_tokens // chunk_size`` chunks.

    Per request: the leading chunks present are hits (and become most recent); then every
    whole chunk of the prompt is inserted or refreshed in order, evicting the least recently
    used chunks beyond capacity. With ``admission``, chunks past the count it admits for the
    request are refreshed when present but not inserted (as the connector skips their saves).

    Raises:
        ValueError: ``capacity_tokens`` < 0 or ``chunk_size`` < 1.
    """
    _check_capacity(capacity_tokens, chunk_size)
    cap = capacity_tokens // chunk_size
    cache: OrderedDict[str, None] = OrderedDict()
    total = hits = evicted = 0
    per: list[int] = []
    for n, hashes in requests:
        hit = _leading(hashes, claimable_chunks(n, chunk_size), cache) * chunk_size
        per.append(hit)
        total += n
        hits += hit
        admitted = len(hashes) if admission is None else admission.admit(hashes)
        for i, h in enumerate(hashes):
            if h in cache:
                cache.move_to_end(h)
            elif i < admitted:
                cache[h] = None
        while len(cache) > cap:
            cache.popitem(last=False)
            evicted += 1
    return ReuseResult(total, hits, per, evicted)


def belady_hits(
    requests: Sequence[tuple[int, Sequence[str]]], chunk_size: int, capacity_tokens: int
) -> ReuseResult:
    """Belady's MIN (module docstring): a cache of ``capacity_tokens // chunk_size`` chunks.

    Per request: the leading chunks present are hits; then every whole chunk of the prompt is
    inserted (its next use updated), and chunks are evicted farthest next use first until the
    cache fits. ``requests`` must be a sequence: next uses need the whole future.

    Raises:
        ValueError: ``capacity_tokens`` < 0 or ``chunk_size`` < 1.
    """
    _check_capacity(capacity_tokens, chunk_size)
    cap = capacity_tokens // chunk_size
    never = len(requests)
    # next_use[i][j]: index of the next request after i holding chunk j of request i.
    next_use: list[list[int]] = [[] for _ in requests]
    last: dict[str, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        hashes = requests[i][1]
        next_use[i] = [last.get(h, never) for h in hashes]
        for h in hashes:
            last[h] = i
    cache: dict[str, int] = {}  # chunk -> its next use
    heap: list[tuple[int, str]] = []  # (-next use, chunk); stale entries skipped when popped
    total = hits = evicted = 0
    per: list[int] = []
    for i, (n, hashes) in enumerate(requests):
        hit = _leading(hashes, claimable_chunks(n, chunk_size), cache) * chunk_size
        per.append(hit)
        total += n
        hits += hit
        for h, nxt in zip(hashes, next_use[i], strict=True):
            cache[h] = nxt
            heapq.heappush(heap, (-nxt, h))
        while len(cache) > cap:
            neg, h = heapq.heappop(heap)
            if cache.get(h) == -neg:
                del cache[h]
                evicted += 1
    return ReuseResult(total, hits, per, evicted)
