"""Evicted keys a reader's lease kept (``eviction: connector``): which keys a removal batch
carries, and which of them wait for a later one. ``SaveQueue.remove`` runs the batches on the
save thread; this module holds only the waiting list (save thread only, no lock)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from kvpool_agent.vocabulary import ErrorCode

__all__ = ["LEASED_RETRY_S", "MAX_LEASED_REMOVES", "LeasedKeys"]

MAX_LEASED_REMOVES = 65_536
"""Evicted keys a lease kept that are tried again at most (the oldest are dropped: the master
evicts them when a put finds no room)."""

LEASED_RETRY_S = 0.02
"""Shortest pause (s) between two tries of the evicted keys a lease kept."""

_WAIT_REMOVE = (ErrorCode.OBJECT_HAS_LEASE, ErrorCode.REPLICA_IS_NOT_READY)
"""``batch_remove`` results after which the key is tried again later (Mooncake -706 under a
reader's lease, -703 while a put of it runs)."""


class LeasedKeys:
    """The evicted keys waiting for a lease to end, oldest first."""

    def __init__(self) -> None:
        self._keys: dict[str, None] = {}
        self._retry_at = 0.0

    def batch(self, keys: Sequence[str], keep: Sequence[str],
              pinned: Callable[[], AbstractSet[str]] | None) -> list[str]:
        """The keys to remove now: ``keys``, with the waiting ones at most every
        ``LEASED_RETRY_S``; never a key ``pinned()`` holds. ``keep``: waiting keys whose chunk
        the scheduler took back (dropped from the wait)."""
        for k in keep:
            self._keys.pop(k, None)
        now = time.monotonic()
        todo = list(keys)
        if self._keys and now >= self._retry_at:
            todo = list(dict.fromkeys([*self._keys, *keys]))
            self._keys.clear()
            self._retry_at = now + LEASED_RETRY_S
        if todo and pinned is not None:
            held = pinned()
            todo = [k for k in todo if k not in held]
        return todo

    def settle(self, todo: Sequence[str], codes: Sequence[int]) -> tuple[int, int]:
        """Record a batch's ``batch_remove`` results: ``(removed, failed)``; a key a lease or a
        running put kept waits (not counted); OBJECT_NOT_FOUND (never stored, or gone
        already) is neither."""
        removed = failed = 0
        for key, rc in zip(todo, codes, strict=True):
            if rc == 0:
                removed += 1
            elif rc in _WAIT_REMOVE:
                self._keys[key] = None
            elif rc != ErrorCode.OBJECT_NOT_FOUND:
                failed += 1
        while len(self._keys) > MAX_LEASED_REMOVES:
            del self._keys[next(iter(self._keys))]
        return removed, failed
