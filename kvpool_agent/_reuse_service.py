"""The hub's reuse figures (issue 41): the access window fed by reports, computed off the
socket thread.

``ReuseService.add`` runs on the hub's socket thread for each accepted report: O(chunk ids of
the report) to copy them into the window (``kvpool_agent._access_window``). A worker thread
recomputes the live reuse ceiling at most every ``refresh_s`` seconds, only after new
accesses came, and the what-if curves (LRU and MIN at ``CURVE_FACTORS`` x each model's pool
capacity: the costly part, O(factors x chunks log chunks)) at most every ``whatif_refresh_s``,
on a snapshot of the window: a scrape or a console reads the last ``ReuseView`` and never waits
for a computation.

The pool capacity of a model (``pool_capacity_tokens``), stated as an estimate: the pool's
``high_watermark x total_bytes`` (where its eviction starts) divided by the bytes one chunk
takes, that is the pool's average key (``used_bytes / keys``) times the keys one chunk has (an
engine's worker agents: one key per rank), times ``chunk_size`` tokens. It is off when the
pool's keys differ in size (several models: the average) and high for layouts whose ranks
share a key (MLA ``kv_share``: fewer keys per chunk than workers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from kvpool_agent._access_window import FLEET, WINDOW_CHUNKS, AccessWindow, Ceiling, _Access
from kvpool_agent.protocol import (
    MAX_REUSE_MODELS,
    Access,
    EngineState,
    ModelReuse,
    ReuseView,
    WhatIfPoint,
)

__all__ = [
    "REUSE_REFRESH_S", "WHATIF_REFRESH_S", "ReuseService", "pool_capacity_tokens",
]

REUSE_REFRESH_S = 5.0
"""Seconds between two computations of the ceiling at most (one after new accesses)."""

WHATIF_REFRESH_S = 60.0
"""Seconds between two computations of the what-if curves at most."""


def pool_capacity_tokens(states: Iterable[EngineState], model: str, chunk_size: int) -> int:
    """Tokens of ``model`` (in ``chunk_size``-token chunks) the pool holds before its eviction
    starts, estimated from the agents' pool stats (module docstring); 0 when no worker of
    ``model`` reports a pool with keys."""
    workers: dict[str, int] = {}
    pools = []
    for st in states:
        src = st.source
        if src.model != model or src.process_role != "worker":
            continue
        workers[src.engine_id] = workers.get(src.engine_id, 0) + 1
        if st.pool is not None and st.pool.keys > 0 and st.pool.total_bytes > 0:
            pools.append(st.pool)
    if not pools or chunk_size < 1:
        return 0
    pool = max(pools, key=lambda p: p.total_bytes)
    chunk_bytes = pool.used_bytes / pool.keys * max(workers.values())
    if chunk_bytes <= 0:
        return 0
    return int(pool.high_watermark * pool.total_bytes / chunk_bytes) * chunk_size


class ReuseService:
    """The window and its last computed figures (module docstring).

    Args:
        max_chunks: chunk ids the window keeps (``WINDOW_CHUNKS``).
        refresh_s: seconds between two computations of the ceiling at most (> 0).
        whatif_refresh_s: seconds between two computations of the what-if curves at most.
        capacity: ``(model, chunk_size) -> tokens`` of the pool for that model (0: unknown,
            no curve); ``None``: no what-if.

    Attributes:
        computed: computations done so far (read from any thread).
    """

    def __init__(self, max_chunks: int = WINDOW_CHUNKS,
                 refresh_s: float = REUSE_REFRESH_S,
                 whatif_refresh_s: float = WHATIF_REFRESH_S,
                 capacity: Callable[[str, int], int] | None = None) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.refresh_s = refresh_s
        self.whatif_refresh_s = whatif_refresh_s
        self._capacity = capacity
        self._whatif: dict[str, ModelReuse] = {}
        self._whatif_at = float("-inf")
        self._view: ReuseView | None = None
        self._window = AccessWindow(max_chunks)
        self._lock = threading.Lock()
        self._fresh = threading.Event()  # accesses came since the last computation
        self._stop = threading.Event()
        self._ceilings: dict[str, Ceiling] = {}
        self._thread: threading.Thread | None = None
        self.computed = 0

    def add(self, model: str, accesses: list[Access]) -> None:
        """One accepted report's lookups, by an engine of ``model``."""
        if not accesses:
            return
        with self._lock:
            for a in accesses:
                self._window.add(model, a.chunk_size, a.tokens, a.chunks)
        self._fresh.set()

    def ceilings(self) -> dict[str, Ceiling]:
        """The last computed ceilings: model -> ``Ceiling``, fleet-wide under
        ``_access_window.FLEET`` (``""``); ``{}`` before the first computation."""
        return self._ceilings

    def view(self) -> ReuseView | None:
        """The last computed figures (``None`` before the first computation)."""
        return self._view

    def window_stats(self) -> tuple[int, int, int]:
        """``(accesses, chunk ids, accesses cut to MAX_ACCESS_CHUNKS)`` the window holds or
        cut so far."""
        with self._lock:
            w = self._window
            return len(w), w.chunks, w.truncated

    def start(self) -> None:
        """Start the worker thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpool-hub-reuse",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the worker thread. Idempotent."""
        self._stop.set()
        self._fresh.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._fresh.wait()
            if self._stop.is_set():
                return
            self._fresh.clear()
            with self._lock:
                accesses = self._window.snapshot()
                chunks = self._window.chunks
            ceilings = AccessWindow.ceiling(accesses)
            now = time.monotonic()
            if now - self._whatif_at >= self.whatif_refresh_s:
                self._whatif = self._curves(accesses, ceilings)
                self._whatif_at = now
            fleet = ceilings[FLEET]
            models = sorted((m for m in ceilings if m != FLEET),
                            key=lambda m: -ceilings[m].prompt_tokens)[:MAX_REUSE_MODELS]
            self._view = ReuseView(
                ts_ms=time.time() * 1e3, accesses=len(accesses), chunks=chunks,
                prompt_tokens=fleet.prompt_tokens, ceiling_tokens=fleet.hit_tokens,
                models=[self._model_view(m, ceilings[m]) for m in models])
            self._ceilings = ceilings  # one reference swap each: atomic for readers
            self.computed += 1
            self._stop.wait(self.refresh_s)

    def _model_view(self, model: str, c: Ceiling) -> ModelReuse:
        w = self._whatif.get(model)
        return ModelReuse(
            model=model, chunk_size=w.chunk_size if w else 0, prompt_tokens=c.prompt_tokens,
            ceiling_tokens=c.hit_tokens,
            pool_capacity_tokens=w.pool_capacity_tokens if w else 0,
            whatif_ms=w.whatif_ms if w else 0.0, whatif=list(w.whatif) if w else [])

    def _curves(self, accesses: list[_Access],
                ceilings: dict[str, Ceiling]) -> dict[str, ModelReuse]:
        """Each model's what-if curve at its pool capacity (models with none are left out)."""
        out: dict[str, ModelReuse] = {}
        if self._capacity is None:
            return out
        for model in [m for m in ceilings if m != FLEET][:MAX_REUSE_MODELS]:
            size = AccessWindow.main_chunk_size(accesses, model)
            cap = self._capacity(model, size) if size else 0
            if cap <= 0:
                continue
            points = AccessWindow.whatif(accesses, model, cap)
            out[model] = ModelReuse(
                model=model, chunk_size=size, pool_capacity_tokens=cap,
                whatif_ms=time.time() * 1e3,
                whatif=[WhatIfPoint(capacity_tokens=p.capacity_tokens,
                                    lru_hit_rate=min(1.0, p.lru_hit_rate),
                                    min_hit_rate=min(1.0, p.min_hit_rate)) for p in points])
        return out
