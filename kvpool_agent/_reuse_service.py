"""The hub's reuse figures (issue 41): the access window fed by reports, computed off the
socket thread.

``ReuseService.add`` runs on the hub's socket thread for each accepted report: O(chunk ids of
the report) to copy them into the window (``kvpool_agent._access_window``). A worker thread
recomputes the live reuse ceiling at most every ``refresh_s`` seconds, only after new
accesses came, and the what-if curves (LRU and MIN at ``CURVE_FACTORS`` x each model's pool
capacity: the costly part, O(factors x chunks log chunks)) at most every ``whatif_refresh_s``
(a model with no curve yet sooner, ``refresh_s`` then doubling: its pool stats came late), on
a snapshot of the window: a scrape or a console reads the last ``ReuseView`` and never waits
for a computation.

The pool capacity of a model (``pool_capacity_tokens``), stated as an estimate: the pool's
``high_watermark x total_bytes`` (where its eviction starts) divided by the bytes one chunk
takes, that is the pool's average key (``used_bytes / keys``) times the keys one chunk has (an
engine's worker agents: one key per rank), times ``chunk_size`` tokens. It is off when the
pool's keys differ in size (several models: the average) and high for layouts whose ranks
share a key (MLA ``kv_share``: fewer keys per chunk than workers).

The ``not_in_pool`` split (``split``): workers' ``Report.saves`` feed the saved-chunk
memory (``kvpool_agent._saved_chunks``, its error stated there); each scheduler lookup's chunks
past ``Access.served`` are looked up in it under the engine's layout digest (learnt from its
workers' reports) and their tokens counted per engine as ``evicted``, ``other_digest``,
``never_saved`` or ``first_use`` since that scheduler agent started; then all of the lookup's
chunks are remembered as asked for (a new ``started_ms`` restarts its counts,
as the agent's own counters restart). Lookups of an engine whose digest no worker reported yet,
cut past ``MAX_ACCESS_CHUNKS`` or dropped before the hub stay ``not_in_pool``
(``kvpool_agent._misses.split_not_in_pool``). Cost on the socket thread: O(chunk ids x (1 +
other layouts probed)) a report, at most ``REPORT_ACCESS_CHUNKS`` ids (an agent sends no more;
a forged report's accesses past them are not split).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TypeVar

from kvpool_agent._access_window import FLEET, WINDOW_CHUNKS, AccessWindow, Ceiling, _Access
from kvpool_agent._saved_chunks import MAX_LAYOUTS, SAVED_SLOTS, SavedChunks
from kvpool_agent.protocol import (
    MAX_REUSE_MODELS,
    MAX_SPLIT_ENGINES,
    REPORT_ACCESS_CHUNKS,
    Access,
    EngineState,
    ModelReuse,
    Report,
    ReuseView,
    WhatIfPoint,
)

__all__ = [
    "MAX_ENGINES", "REUSE_REFRESH_S", "WHATIF_REFRESH_S", "ReuseService",
    "pool_capacity_tokens",
]

_V = TypeVar("_V")

MAX_ENGINES = 16_384
"""Engines whose layout digest and miss split the service keeps at most (the least recently
reporting leave first): ~300 bytes each, ~5 MB in all."""

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
        saved_slots: slots of the saved-chunk memory (``_saved_chunks.SAVED_SLOTS``).

    Attributes:
        computed: computations done so far (read from any thread).
        unsplit_accesses: accesses of reports past ``REPORT_ACCESS_CHUNKS`` chunk ids, left
            unsplit (``_attribute``).
    """

    def __init__(self, max_chunks: int = WINDOW_CHUNKS,
                 refresh_s: float = REUSE_REFRESH_S,
                 whatif_refresh_s: float = WHATIF_REFRESH_S,
                 capacity: Callable[[str, int], int] | None = None,
                 saved_slots: int = SAVED_SLOTS) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.refresh_s = refresh_s
        self.whatif_refresh_s = whatif_refresh_s
        self._capacity = capacity
        self._whatif: dict[str, ModelReuse] = {}
        self._whatif_at = float("-inf")
        self._retry_at = float("-inf")  # monotonic s: models without a curve tried again
        self._retry_s = refresh_s
        self._view: ReuseView | None = None
        self._window = AccessWindow(max_chunks)
        self._lock = threading.Lock()
        self._fresh = threading.Event()  # accesses came since the last computation
        self._stop = threading.Event()
        self._ceilings: dict[str, Ceiling] = {}
        self._thread: threading.Thread | None = None
        self.computed = 0
        self.saved = SavedChunks(saved_slots)
        self.unsplit_accesses = 0
        self._digest: OrderedDict[str, str] = OrderedDict()  # engine id -> layout digest
        # engine id -> (its scheduler's started_ms, not_in_pool tokens by reason)
        self._split: OrderedDict[str, tuple[float, dict[str, int]]] = OrderedDict()

    def split(self, rep: Report, key: str = "", cap: int = MAX_LAYOUTS) -> int:
        """One accepted report (the hub's socket thread, next to ``add``): its saves into the
        saved-chunk memory, its lookups' ``not_in_pool`` chunks split (module docstring).
        ``key`` (the agent key that sent it: its public key) may name ``cap`` new layouts in all
        (``_saved_chunks``); returns the report's chunk ids not remembered for that budget."""
        src = rep.state.source
        with self._lock:
            over = self.saved.layouts_over_budget
            if src.layout_digest:
                _touch(self._digest, src.engine_id, src.layout_digest)
                self.saved.add(src.model, src.layout_digest, rep.saves, rep.state.ts_ms,
                               key, cap)
            digest = self._digest.get(src.engine_id, "")
            if rep.accesses and digest:
                self._attribute(src.engine_id, rep.state.started_ms, src.model, digest,
                                rep.accesses, rep.state.ts_ms, key, cap)
            return self.saved.layouts_over_budget - over

    def _attribute(self, engine: str, started_ms: float, model: str, digest: str,
                   accesses: list[Access], report_ms: float, key: str, cap: int) -> None:
        """Count the tokens of each access's chunks past ``served`` (up to its prompt's
        length) by the memory's reason, for ``engine`` (caller holds the lock). At most
        ``REPORT_ACCESS_CHUNKS`` chunk ids of one report (what an agent sends): the accesses
        past them are neither split (they stay ``not_in_pool``) nor remembered as asked, and
        counted in ``unsplit_accesses`` (a report of 2M one-byte ids held the hub's socket
        thread 1-3 s)."""
        prev = self._split.get(engine)
        counts = prev[1] if prev is not None and prev[0] == started_ms else {}
        budget = REPORT_ACCESS_CHUNKS
        for k, a in enumerate(accesses):
            budget -= len(a.chunks)
            if budget < 0:
                self.unsplit_accesses += len(accesses) - k
                break
            size = a.chunk_size
            covered = min(len(a.chunks) * size, a.tokens)
            first = a.served // size
            # Chunk i's tokens past ``served`` and within the prompt (the last may be partial).
            spans = [min((i + 1) * size, covered) - max(i * size, a.served)
                     for i in range(first, len(a.chunks))]
            spans = [n for n in spans if n > 0]
            whys = self.saved.reasons(model, digest, a.chunks[first:first + len(spans)],
                                      a.ts_ms or report_ms)
            for why, tokens in zip(whys, spans, strict=True):
                counts[why] = counts.get(why, 0) + tokens
            # After judging: a lookup's own ask never makes its chunks "asked before".
            self.saved.add_asked(model, digest, a.chunks, a.ts_ms or report_ms, key, cap)
        _touch(self._split, engine, (started_ms, counts))

    def not_in_pool(self) -> dict[str, dict[str, int]]:
        """Per engine id: its ``not_in_pool`` tokens split by reason, since its scheduler
        agent started (a copy; any thread)."""
        with self._lock:
            return {e: dict(c) for e, (_, c) in self._split.items()}

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
            elif now >= self._retry_at and (
                    missing := [m for m in ceilings if m != FLEET and m not in self._whatif]):
                # Models without a curve (their pool stats came after the last pass: a fleet
                # starting) are tried again refresh_s later, then at doubling intervals up to
                # whatif_refresh_s (a model whose pool never reports costs a few passes);
                # only their curves are computed.
                self._whatif = {**self._whatif, **self._curves(accesses, ceilings, missing)}
                self._retry_at = now + self._retry_s
                self._retry_s = min(2 * self._retry_s, self.whatif_refresh_s)
            split = self.not_in_pool()
            top = sorted(split, key=lambda e: -sum(split[e].values()))[:MAX_SPLIT_ENGINES]
            fleet = ceilings[FLEET]
            models = sorted((m for m in ceilings if m != FLEET),
                            key=lambda m: -ceilings[m].prompt_tokens)[:MAX_REUSE_MODELS]
            self._view = ReuseView(
                ts_ms=time.time() * 1e3, accesses=len(accesses), chunks=chunks,
                prompt_tokens=fleet.prompt_tokens, ceiling_tokens=fleet.hit_tokens,
                models=[self._model_view(m, ceilings[m]) for m in models],
                not_in_pool={e: split[e] for e in top if split[e]})
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

    def _curves(self, accesses: list[_Access], ceilings: dict[str, Ceiling],
                models: list[str] | None = None) -> dict[str, ModelReuse]:
        """Each model's (of ``models``, default every model's) what-if curve at its pool
        capacity (models with none are left out)."""
        out: dict[str, ModelReuse] = {}
        if self._capacity is None:
            return out
        if models is None:
            models = [m for m in ceilings if m != FLEET]
        for model in models[:MAX_REUSE_MODELS]:
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


def _touch(d: OrderedDict[str, _V], key: str, value: _V) -> None:
    """``d[key] = value`` as the most recent entry; past ``MAX_ENGINES`` the oldest leaves."""
    d[key] = value
    d.move_to_end(key)
    if len(d) > MAX_ENGINES:
        d.popitem(last=False)
