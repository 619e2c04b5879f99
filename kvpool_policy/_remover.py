"""The policy service's removals: every rank's keys of each chunk the pool-wide policy evicts,
never by force, never a pinned chunk, under the connector's removal rule
(``kvpool_connector.removal_rule``: a key refused under a reader's lease, -706, is tried again
no sooner than the transfer timeout after the refusal).

A key not in the pool yet (-704 OBJECT_NOT_FOUND) is tried again too (``ABSENT_RETRY_S``): an
engine sends a request's access record when the request is first scheduled, before its KV is
computed and saved, so the policy may evict a chunk whose save is still to come (one batch of
three prompts over a capacity of five chunks: its first chunks evicted while their saves were
in the worker's queue). Dropping the key at its first absence would leave that save in the pool
for good, uncounted by the policy."""

from __future__ import annotations

import logging
import time
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
"""Absent keys waiting for a new try at most (past it, the oldest are given up)."""

PolicyKey = tuple[str, str]


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
        # Absent key -> (when it is tried again, tries made): module docstring.
        self._absent: dict[str, tuple[float, int]] = {}
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
            self._absent.pop(key, None)

    @property
    def waiting(self) -> int:
        """Keys waiting for a new try: a reader's lease to end, or a save to come."""
        return len(self._leased) + len(self._absent)

    def _due_absent(self) -> list[str]:
        """Absent keys whose wait ended (their try count kept for ``_settle_absent``)."""
        now = self._clock()
        return [k for k, (due, _) in self._absent.items() if due <= now]

    def _settle_absent(self, todo: Sequence[str], codes: Sequence[int]) -> None:
        """Keys found absent wait their next ``ABSENT_RETRY_S``, given up after the last; any
        other answer ends their wait."""
        now = self._clock()
        for key, rc in zip(todo, codes, strict=True):
            tries = self._absent.pop(key, (0.0, 0))[1]
            if rc == ErrorCode.OBJECT_NOT_FOUND and tries < len(ABSENT_RETRY_S):
                self._absent[key] = (now + ABSENT_RETRY_S[tries], tries + 1)
        while len(self._absent) > MAX_ABSENT:
            del self._absent[next(iter(self._absent))]

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
                del self._absent[key]
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
