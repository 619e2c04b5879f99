"""The policy service's removals: every rank's keys of each chunk the pool-wide policy evicts,
never by force, never a pinned chunk, under the connector's removal rule
(``kvpool_connector.removal_rule``: a key refused under a reader's lease, -706, is tried again
no sooner than the transfer timeout after the refusal).

A key not in the pool yet (-704 OBJECT_NOT_FOUND) is tried again too (``ABSENT_RETRY_S``): an
engine sends a request's access record when the request is first scheduled, before its KV is
computed and saved, so the policy may evict a chunk whose save is still to come (one batch of
three prompts over a capacity of five chunks: its first chunks evicted while their saves were
in the worker's queue). Dropping the key at its first absence would leave that save in the pool
for good, uncounted by the policy.

What the new tries cost is bounded (``AbsentKeys``), as an agent key's records of chunks it
never saves, each pushed out by the next, make every evicted key absent: at most
``ABSENT_TRIES_PER_PASS`` keys are tried again a pass (every 50 ms), earliest due first, found
without scanning the waiting keys; past ``MAX_ABSENT`` waiting keys, the layout holding the most
gives up its oldest, so one layout's flood does not give up another's late saves. Before, the
table was trimmed one key at a time from the front of a dict (quadratic in the excess): 25,000
such chunks a second of two keys took the remover 1.7 s of CPU a second (0.06 s with one try),
a live service under 45,000 hashes a second of them applied 520 of the 2,640 records sent in
15 s (all of them with one try), and an honest engine's late save was left in the pool (its
waiting key given up for the flood's) (``tests/policy/test_service_absent_flood.py``)."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvpool_agent.vocabulary import ErrorCode
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_connector.keys import chunk_keys
from kvpool_connector.pins import pinned_chunks
from kvpool_connector.policy_wire import PolicyLayout
from kvpool_connector.removal_rule import LeasedKeys

logger = logging.getLogger("kvpool.policy")

PIN_REFRESH_S = 1.0
"""How often the pin records of each layout are read again (s)."""

MAX_LAYOUTS = 64
"""Layouts the service steers at most (one ``PolicyLayout`` and its pins' chunk hashes each);
records of further layouts are dropped and counted."""

MAX_DEFERRED = 1 << 16
"""Keys held back at most because their layout's pins are not read yet (or could not be read
last time): past it, the oldest are dropped (the master's watermark evicts them)."""

ABSENT_RETRY_S = (0.25, 0.5, 1.0, 2.0) + (4.0,) * 15
"""Waits (s) before each new try of a key found absent: 63.75 s in all, past the store
client's transfer timeout (60 s) that bounds a put once started (a save that starts later
still is left to the master's watermark); at most 4 s apart, so a save that lands late is
removed within 4 s (doubling to 32 s left a real engine's late save in the pool 30 s more
under a loaded test run)."""

MAX_ABSENT = 1 << 16
"""Absent keys waiting for a new try at most (past it, the layout holding the most gives up its
oldest: ``AbsentKeys.trim``)."""

ABSENT_TRIES_PER_PASS = 2_048
"""Absent keys tried again in one removal pass at most (the service's pass runs every 50 ms:
40,960 a second; ``MAX_ABSENT`` of them every 1.6 s); the rest wait for the next pass, earliest
due first. Keys evicted now are not counted here (their first try is what the record budget
bounds)."""

PolicyKey = tuple[str, str]


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


class Remover:
    """Removes evicted chunks from the pool (module docstring).

    Args:
        backend: the service's own Mooncake store client (``MooncakeBackend``: ``batch_remove``
            unforced, and the pin records' ``read_record``).
        grace_s: the wait after a refusal under a lease (s): the store client's transfer
            timeout (``grace_s_of``).
        clock: monotonic seconds.

    Attributes:
        removed: keys removed; failed: keys the store failed to remove (not leased, not
            absent).
        layouts: digest -> its ``PolicyLayout``, as the engines first sent it (never
            replaced: a differing layout of a known digest is refused, ``learn``).
        deferred_dropped: keys not removed because their layout's pins stayed unread.
    """

    def __init__(self, backend: MooncakeBackend, grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self._leased = LeasedKeys(grace_s, clock)
        self.layouts: dict[str, PolicyLayout] = {}
        # Digest -> the chunk hashes its pins held when last read, and their keys.
        self._pins: dict[str, frozenset[str]] = {}
        self._pins_ok: set[str] = set()  # digests whose pins were read at the last try
        self._pins_read = -float("inf")
        self._clock = clock
        self._todo: list[str] = []
        self._keep: list[str] = []
        # Absent keys waiting for a new try: module docstring.
        self._absent = AbsentKeys()
        self.removed = self.failed = self.deferred_dropped = 0

    def keys_of(self, chunks: Sequence[PolicyKey]) -> list[str]:
        """Every rank's (and layer's) keys of ``chunks`` whose layout is known."""
        out: list[str] = []
        for digest, h in chunks:
            lay = self.layouts.get(digest)
            if lay is not None:
                out += chunk_keys(lay.prefixes, [h], lay.layers or None)
        return out

    def learn(self, layout: PolicyLayout) -> bool:
        """Take a layout an engine sent (checked by the caller). A known digest keeps the layout
        it was first learned with: ``False`` when ``layout`` differs from it (a forged
        redeclaration would make pins be read, and keys removed, under another model), or when
        ``MAX_LAYOUTS`` are known already and this one is new. A new layout's pins are read at
        the next ``pinned``; until then none of its keys is removed."""
        known = self.layouts.get(layout.digest)
        if known is not None:
            return known == layout
        if len(self.layouts) >= MAX_LAYOUTS:
            return False
        self.layouts[layout.digest] = layout
        self._pins_read = -float("inf")
        return True

    def forget(self, digest: str) -> None:
        """Stop steering ``digest`` (an idle layout; ``PolicyCore``)."""
        self.layouts.pop(digest, None)
        self._pins.pop(digest, None)
        self._pins_ok.discard(digest)

    def pinned(self) -> dict[str, frozenset[str]]:
        """Digest -> chunk hashes some pin of the layout holds (``pins.pinned_chunks``), the
        records read again at most every ``PIN_REFRESH_S``; a layout whose records cannot be
        read now keeps the pins read last (an empty answer would free them), and none of its
        keys is removed until they are read again (``step``)."""
        now = self._clock()
        if now - self._pins_read < PIN_REFRESH_S:
            return dict(self._pins)
        self._pins_read = now
        for digest, layout in self.layouts.items():
            model = layout.prefixes[0].split("@")[1]
            try:
                # chunk_size 1: the loosest bound on what one pin may claim (the service
                # does not know the layout's chunk size).
                self._pins[digest] = pinned_chunks(self.backend, model, digest, 1)
                self._pins_ok.add(digest)
            except Exception as exc:  # any failure: remove nothing of it (step)
                self._pins_ok.discard(digest)
                logger.warning("kvpool policy: pin records of %s not read: %s", digest, exc)
        return dict(self._pins)

    def _pinned_keys(self) -> frozenset[str]:
        """Every key of a pinned chunk, under the layouts as known now."""
        return frozenset(self.keys_of([(d, h) for d, hs in self._pins.items() for h in hs]))

    def evict(self, chunks: Sequence[PolicyKey]) -> None:
        """Queue ``chunks`` for removal (the next ``step``)."""
        self._todo += self.keys_of(chunks)

    def keep(self, chunks: Sequence[PolicyKey]) -> None:
        """``chunks`` are resident again: a removal still waiting (a lease, a save to come)
        is dropped."""
        keys = self.keys_of(chunks)
        self._keep += keys
        for key in keys:
            self._absent.pop(key)

    @property
    def waiting(self) -> int:
        """Keys waiting for a new try: a reader's lease to end, or a save to come."""
        return len(self._leased) + len(self._absent)

    def _due_absent(self) -> list[str]:
        """Absent keys whose wait ended, ``ABSENT_TRIES_PER_PASS`` at most (their try count
        kept for ``_settle_absent``)."""
        return self._absent.due(self._clock(), ABSENT_TRIES_PER_PASS)

    def _settle_absent(self, todo: Sequence[str], codes: Sequence[int]) -> None:
        """Keys found absent wait their next ``ABSENT_RETRY_S``, given up after the last; any
        other answer ends their wait."""
        now = self._clock()
        for key, rc in zip(todo, codes, strict=True):
            tries = self._absent.pop(key)
            if rc == ErrorCode.OBJECT_NOT_FOUND and tries < len(ABSENT_RETRY_S):
                self._absent.wait(key, now, tries)
        self._absent.trim(MAX_ABSENT)

    def step(self) -> int:
        """Remove what is queued and what waited out its grace (a reader's lease, a save to
        come: module docstring); keys removed now. Keys of a
        layout whose pins were not read at the last try wait (at most ``MAX_DEFERRED``); a
        layout learned since the last read has its pins read now, not at the service's next
        refresh (up to ``PIN_REFRESH_S`` later: a replay's pool of 300,000 tokens fills in
        half that, and the master's watermark evicted 474 keys before the first removal)."""
        if any(key.split("@")[2] not in self._pins_ok for key in self._todo):
            self.pinned()  # reads only a layout never read, or after PIN_REFRESH_S
        ready: list[str] = []
        held: list[str] = []
        for key in self._todo:
            (ready if key.split("@")[2] in self._pins_ok else held).append(key)
        if len(held) > MAX_DEFERRED:
            self.deferred_dropped += len(held) - MAX_DEFERRED
            held = held[-MAX_DEFERRED:]
        due = self._due_absent()
        todo = self._leased.batch([*ready, *due], self._keep, self._pinned_keys)
        self._todo, self._keep = held, []
        tried = set(todo)
        for key in due:  # pinned now, or waiting out a lease: no longer absent's to try
            if key not in tried:
                self._absent.pop(key)
        if not todo:
            return 0
        try:
            codes = self.backend.batch_remove(todo)
        except Exception as exc:  # the store failed: the master's watermark evicts them
            logger.warning("kvpool policy: %d keys not removed: %s", len(todo), exc)
            self.failed += len(todo)
            return 0
        removed, failed = self._leased.settle(todo, codes)
        self._settle_absent(todo, codes)
        self.removed += removed
        self.failed += failed
        return removed
