"""The hub's reuse figures (issue 41): the access window fed by reports, computed off the
socket thread.

``ReuseService.add`` runs on the hub's socket thread for each accepted report: O(chunk ids of
the report) to copy them into the window (``kvpool_agent._access_window``). A worker thread
recomputes the live reuse ceiling at most every ``refresh_s`` seconds, only after new
accesses came, on a snapshot of the window: a scrape or a console reads the last result and
never waits for a computation.
"""

from __future__ import annotations

import threading

from kvpool_agent._access_window import WINDOW_CHUNKS, AccessWindow, Ceiling
from kvpool_agent.protocol import Access

__all__ = ["REUSE_REFRESH_S", "ReuseService"]

REUSE_REFRESH_S = 5.0
"""Seconds between two computations of the reuse figures at most (one after new accesses)."""


class ReuseService:
    """The window and its last computed figures (module docstring).

    Args:
        max_chunks: chunk ids the window keeps (``WINDOW_CHUNKS``).
        refresh_s: seconds between two computations at most (> 0).

    Attributes:
        computed: computations done so far (read from any thread).
    """

    def __init__(self, max_chunks: int = WINDOW_CHUNKS,
                 refresh_s: float = REUSE_REFRESH_S) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.refresh_s = refresh_s
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
            self._ceilings = AccessWindow.ceiling(accesses)  # one reference swap: atomic
            self.computed += 1
            self._stop.wait(self.refresh_s)
