"""Keys the policy service found absent at their removal, waiting for a new try
(``kvpool_policy._remover``'s module docstring says why: a save may still come, and what the
new tries cost is bounded).
"""

from __future__ import annotations

import itertools
from collections import deque

__all__ = ["ABSENT_RETRY_S", "AbsentKeys", "PolicyKey"]

PolicyKey = tuple[str, str]
"""A chunk: (layout digest, chunk hash)."""

ABSENT_RETRY_S = (0.25, 0.5, 1.0, 2.0) + (4.0,) * 15
"""Waits (s) before each new try of a key found absent: 63.75 s in all, past the store
client's transfer timeout (60 s) that bounds a put once started (a save that starts later
still is left to the master's watermark); at most 4 s apart, so a save that lands late is
removed within 4 s (doubling to 32 s left a real engine's late save in the pool 30 s more
under a loaded test run)."""


def _digest(key: str) -> str:
    return key.split("@")[2]


class AbsentKeys:
    """Absent keys waiting for a new try (``Remover``): per layout digest, key -> (when it is
    tried again, tries made), in the order they were last tried; and, per wait of
    ``ABSENT_RETRY_S``, a queue of (due, digest, key) in the order they were set to wait, so
    due in order: the keys due are found without a scan of them all (queue entries of keys
    tried or given up since are skipped when they come up)."""

    def __init__(self) -> None:
        self._by_digest: dict[str, dict[str, tuple[float, int]]] = {}
        self._queues: dict[float, deque[tuple[float, str, str]]] = {}
        self._n = 0
        self.given_up = 0
        """Keys dropped past ``MAX_ABSENT``."""

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._by_digest.get(_digest(key), {})

    def queued(self) -> int:
        """Queue entries, live and stale: at most 4 x the ``trim`` cap after a trim."""
        return sum(len(q) for q in self._queues.values())

    def keys(self) -> list[str]:
        """Every key waiting."""
        return [k for keys in self._by_digest.values() for k in keys]

    def per_digest(self) -> dict[str, int]:
        """Digest -> its keys waiting."""
        return {d: len(keys) for d, keys in self._by_digest.items()}

    def pop(self, key: str) -> int:
        """Stop waiting for ``key``; the tries it made (0: it was not waiting)."""
        d = _digest(key)
        keys = self._by_digest.get(d)
        got = keys.pop(key, None) if keys is not None else None
        if got is None:
            return 0
        self._n -= 1
        if not keys:
            del self._by_digest[d]
        return got[1]

    def wait(self, key: str, now: float, tries: int) -> None:
        """``key`` (not waiting now) is tried again ``ABSENT_RETRY_S[tries]`` after ``now``,
        ``tries + 1`` made by then."""
        wait_s = ABSENT_RETRY_S[tries]
        d = _digest(key)
        self._by_digest.setdefault(d, {})[key] = (now + wait_s, tries + 1)
        self._n += 1
        self._queues.setdefault(wait_s, deque()).append((now + wait_s, d, key))

    def due(self, now: float, limit: int) -> list[str]:
        """At most ``limit`` waiting keys due by ``now``, earliest first (they stay waiting
        until ``pop``)."""
        out: dict[str, None] = {}
        live = self._live
        queues = [q for q in self._queues.values() if q]
        while queues and len(out) < limit:
            for q in queues:  # entries of keys tried or given up since go first
                while q and not live(q[0]):
                    q.popleft()
            queues = [q for q in queues if q and q[0][0] <= now]
            if not queues:
                break
            q = min(queues, key=lambda q: q[0][0])
            out[q.popleft()[2]] = None
        return list(out)

    def _live(self, entry: tuple[float, str, str]) -> bool:
        got = self._by_digest.get(entry[1], {}).get(entry[2])
        return got is not None and got[0] == entry[0]

    def trim(self, cap: int) -> int:
        """Give up keys past ``cap``: the layout holding the most gives up its oldest first
        (one layout's flood takes its own keys, not another layout's below its count); keys
        given up now."""
        dropped = 0
        while self._n > cap:
            sizes = sorted(((len(v), d) for d, v in self._by_digest.items()), reverse=True)
            most, d = sizes[0]
            n = min(self._n - cap, max(1, most - (sizes[1][0] if len(sizes) > 1 else 0)))
            keys = self._by_digest[d]
            # One pass from the front (deleting one key at a time through a new iterator
            # rescans the holes the deleted ones leave: quadratic).
            for k in list(itertools.islice(keys, n)):
                del keys[k]
            if not keys:
                del self._by_digest[d]
            self._n -= n
            dropped += n
        self.given_up += dropped
        if self.queued() > 4 * max(cap, 1):  # given-up keys' entries: amortised O(1) a key
            for wait_s, q in self._queues.items():
                self._queues[wait_s] = deque(e for e in q if self._live(e))
        return dropped
