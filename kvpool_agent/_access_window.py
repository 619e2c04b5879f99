"""The hub's window of recorded lookups: what the fleet's traffic could have hit (issue 41).

Every lookup an engine reports is an access: its prompt's length in tokens and the compact ids
of its whole chunks (``protocol.chunk_id``: the first 8 bytes of each chained chunk hash), under the
engine's model and chunk size. ``AccessWindow`` keeps the most recent accesses, at most
``max_chunks`` chunk ids in all (default ``WINDOW_CHUNKS``), and runs ``kvpool_agent.reuse``'s
models over them:

* ``ceiling``: the live reuse ceiling, what an unbounded shared pool would have hit over the
  window, per model and fleet-wide (models never share chunks: the fleet figure is their sum);
* ``whatif``: an exact LRU and Belady's MIN at 0.25x..8x a pool's capacity in tokens over one
  model's accesses.

Error, stated: (1) ids are 64-bit, so two of the window's ``n`` distinct chunks share an id
with probability <= n^2 / 2^65 (200,000 chunks: ~1e-9); a shared id is a false hit. (2) the
window starts empty: the first use in the window of a chunk saved before it is a miss, so the
ceiling and the what-if rates are low by at most the share of the window's tokens whose chunks
were first used there (it vanishes as the window covers the traffic's reuse distance).
(3) an access keeps at most ``protocol.MAX_ACCESS_CHUNKS`` chunks (the leading ones): hits
past them are not counted.

Memory: 8 bytes per chunk id (``array('Q')``) plus ~120 bytes per access: 200,000 chunks in
accesses of 64 chunks are ~2 MB. Cost: ``ceiling`` is O(chunks), ``whatif`` O(factors x
chunks log chunks) in pure Python (not measured here: bench/ is where its figure belongs), so a
hub must run them off its socket thread on a ``snapshot()`` and cache the result.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool_agent.protocol import MAX_ACCESS_CHUNKS
from kvpool_agent.reuse import CURVE_FACTORS, CurvePoint, capacity_curve, prefix_ceiling

__all__ = ["FLEET", "WINDOW_CHUNKS", "AccessWindow", "Ceiling"]

WINDOW_CHUNKS = 200_000
"""Chunk ids the hub keeps over every engine's recent lookups (issue 41's suggested size)."""

FLEET = ""
"""``Ceiling`` key of the fleet-wide figure (every model's)."""


@dataclass(frozen=True)
class Ceiling:
    """The reuse ceiling over a window: ``hit_tokens`` an unbounded pool would have served of
    ``prompt_tokens`` looked up (tokens)."""

    prompt_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class _Access:
    model: str
    chunk_size: int
    tokens: int
    chunks: array[int]


class AccessWindow:
    """The most recent accesses, at most ``max_chunks`` chunk ids in all (module docstring).

    Not thread-safe: the hub adds on its socket thread and hands ``snapshot()`` (a list
    copy, O(accesses)) to the thread that computes.

    Args:
        max_chunks: chunk ids kept (>= 1); the oldest accesses leave first.

    Attributes:
        added: accesses added since creation; ``truncated``: of those, accesses cut to
            ``MAX_ACCESS_CHUNKS`` chunks.
    """

    def __init__(self, max_chunks: int = WINDOW_CHUNKS) -> None:
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.max_chunks = max_chunks
        self._accesses: deque[_Access] = deque()
        self._chunks = 0
        self.added = 0
        self.truncated = 0

    def __len__(self) -> int:
        return len(self._accesses)

    @property
    def chunks(self) -> int:
        """Chunk ids held now."""
        return self._chunks

    def add(self, model: str, chunk_size: int, tokens: int, chunks: Sequence[int]) -> None:
        """One lookup of a prompt of ``tokens`` tokens whose whole chunks have ids ``chunks``
        (``protocol.chunk_id``), by an engine of ``model`` storing ``chunk_size``-token chunks."""
        if len(chunks) > MAX_ACCESS_CHUNKS:
            chunks = chunks[:MAX_ACCESS_CHUNKS]
            self.truncated += 1
        ids = array("Q", chunks)
        self._accesses.append(_Access(model, chunk_size, tokens, ids))
        self._chunks += len(ids)
        self.added += 1
        while self._chunks > self.max_chunks and len(self._accesses) > 1:
            self._chunks -= len(self._accesses.popleft().chunks)

    def snapshot(self) -> list[_Access]:
        """The window's accesses, oldest first (a copy of the list; the arrays are shared and
        never changed)."""
        return list(self._accesses)

    @staticmethod
    def _of(accesses: list[_Access], model: str) -> dict[int, list[tuple[int, array[int]]]]:
        by_size: dict[int, list[tuple[int, array[int]]]] = {}
        for a in accesses:
            if a.model == model:
                by_size.setdefault(a.chunk_size, []).append((a.tokens, a.chunks))
        return by_size

    @staticmethod
    def ceiling(accesses: list[_Access]) -> dict[str, Ceiling]:
        """The live reuse ceiling per model, and fleet-wide under ``FLEET`` (``""``).

        Engines of one model with different chunk sizes store different keys: each size is
        its own unbounded pool, their figures added."""
        out: dict[str, Ceiling] = {}
        total = hits = 0
        for model in dict.fromkeys(a.model for a in accesses):
            m_total = m_hits = 0
            for size, reqs in AccessWindow._of(accesses, model).items():
                r = prefix_ceiling(reqs, size)
                m_total += r.input_tokens
                m_hits += r.hit_tokens
            out[model] = Ceiling(m_total, m_hits)
            total += m_total
            hits += m_hits
        out[FLEET] = Ceiling(total, hits)
        return out

    @staticmethod
    def main_chunk_size(accesses: list[_Access], model: str) -> int:
        """``model``'s most used chunk size in ``accesses`` (by accesses); 0 for none."""
        by_size = AccessWindow._of(accesses, model)
        return max(by_size, key=lambda k: len(by_size[k])) if by_size else 0

    @staticmethod
    def whatif(accesses: list[_Access], model: str, capacity_tokens: int,
               factors: Sequence[float] = CURVE_FACTORS) -> list[CurvePoint]:
        """LRU and MIN hit rates over ``model``'s accesses at ``factors`` x ``capacity_tokens``
        (``kvpool_agent.reuse.capacity_curve``), for its most used chunk size (by accesses);
        ``[]`` when the window holds none of ``model``'s accesses."""
        size = AccessWindow.main_chunk_size(accesses, model)
        if not size:
            return []
        return capacity_curve(AccessWindow._of(accesses, model)[size], size, capacity_tokens,
                              factors)
