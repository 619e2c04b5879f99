"""Cache models over recorded accesses: what a pool could have hit (one owner for the hub, the
console and ``kvpool_replay``'s reference).

An access is ``(prompt tokens, chunk ids of its prompt)``: the chained hashes of its whole
chunks in prompt order (``kvpool_connector.keys.chunk_hashes``, or any hashable id of them, such
as the 64-bit ints the hub keeps). Every model is token-weighted: a hit chunk counts
``chunk_size`` tokens.

* ``prefix_ceiling``: an unbounded pool that holds every chunk ever saved. A request hits the
  leading chunks an earlier request saved.
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
* ``capacity_curve``: LRU and MIN at ``CURVE_FACTORS`` times a pool's capacity (what-if).

All apply the connector's claim rules (``kvpool_connector.scheduler``, after vLLM Ascend's
``get_num_new_matched_tokens``): only whole chunks of ``chunk_size`` tokens are stored or looked
up, and the last prompt token is never claimed, so a prompt of ``n`` tokens claims at most
``(n - 1) // chunk_size`` chunks. After a request, every whole chunk of its prompt is in the
pool (it was loaded or saved).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = [
    "CURVE_FACTORS",
    "Admission",
    "CurvePoint",
    "ReuseResult",
    "belady_hits",
    "capacity_curve",
    "claimable_chunks",
    "lru_hits",
    "prefix_ceiling",
]

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)

CURVE_FACTORS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Multiples of the pool's capacity ``capacity_curve`` models (issue 41: 0.25x to 8x)."""


class Admission(Protocol[K_contra]):
    """How many leading chunks of a request are saved (``kvpool_connector.admission``'s
    ``AdmissionPolicy`` is one)."""

    def admit(self, hashes: Sequence[K_contra]) -> int:
        """Leading chunks of ``hashes`` to save."""
        ...


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


@dataclass(frozen=True)
class CurvePoint:
    """One capacity of ``capacity_curve``: hit rates (0..1, of the accesses' prompt tokens) of
    an exact LRU and of Belady's MIN holding ``capacity_tokens`` tokens."""

    capacity_tokens: int
    lru_hit_rate: float
    min_hit_rate: float


def claimable_chunks(num_tokens: int, chunk_size: int) -> int:
    """Most chunks a prompt of ``num_tokens`` tokens may take from the pool: whole chunks
    only, never the last token (vLLM must compute it to sample)."""
    return max(0, (num_tokens - 1) // chunk_size)


def _leading(hashes: Sequence[K], limit: int, present: Container[K]) -> int:
    n = 0
    for h in hashes[:limit]:
        if h not in present:
            break
        n += 1
    return n


def prefix_ceiling(
    requests: Iterable[tuple[int, Sequence[K]]], chunk_size: int
) -> ReuseResult:
    """Prefix-reuse ceiling of requests replayed in order through an unbounded pool.

    Args:
        requests: per request ``(input_length tokens, chunk ids of its prompt)`` (module
            docstring).
        chunk_size: tokens per chunk (> 0).
    """
    seen: set[K] = set()
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
    requests: Iterable[tuple[int, Sequence[K]]], chunk_size: int, capacity_tokens: int,
    admission: Admission[K] | None = None,
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
    cache: OrderedDict[K, None] = OrderedDict()
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
    requests: Sequence[tuple[int, Sequence[K]]], chunk_size: int, capacity_tokens: int
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
    last: dict[K, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        hashes = requests[i][1]
        next_use[i] = [last.get(h, never) for h in hashes]
        for h in hashes:
            last[h] = i
    cache: dict[K, int] = {}  # chunk -> its next use
    # (-next use, chunk); stale entries are skipped when popped. Ties: the smallest chunk id
    # goes first (ids of one window are all ints or all strs).
    heap: list[tuple[int, K]] = []
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


def capacity_curve(
    requests: Sequence[tuple[int, Sequence[K]]], chunk_size: int, capacity_tokens: int,
    factors: Sequence[float] = CURVE_FACTORS,
) -> list[CurvePoint]:
    """What-if capacity: ``lru_hits`` and ``belady_hits`` over ``requests`` at each of
    ``factors`` times ``capacity_tokens`` (rounded down to whole tokens), in ``factors`` order.

    Both start empty: over a window of recorded accesses, its first uses of a chunk are
    misses at every capacity (the window's cold start; the longer the window, the smaller).
    Cost: O(factors x chunks log chunks) time, O(chunks) memory.

    Raises:
        ValueError: ``capacity_tokens`` < 0, ``chunk_size`` < 1 or a factor < 0.
    """
    if any(f < 0 for f in factors):
        raise ValueError(f"factors must be >= 0, got {list(factors)}")
    points = []
    for f in factors:
        cap = int(capacity_tokens * f)
        points.append(CurvePoint(
            cap, lru_hits(requests, chunk_size, cap).hit_rate,
            belady_hits(requests, chunk_size, cap).hit_rate))
    return points
