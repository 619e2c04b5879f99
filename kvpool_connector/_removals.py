"""When the product may remove a key a reader may still be copying (issue 39 item 4).

A Mooncake read holds a lease (``default_kv_lease_ttl``, 5-10 s), not a reference: once the
lease lapsed an unforced remove succeeds and frees the value's memory, which the next put may
reuse, yet the reader's transfer may still be copying it. The store client fails a transfer
only after its transfer timeout (``MooncakeConfig.transfer_timeout_ms``, 60 s:
``backends.mooncake.TRANSFER_TIMEOUT_MS``). Two rules together keep a removal from tearing a
read the product uses:

* remover side (here): every removal is unforced (a leased key is refused: Mooncake -706
  OBJECT_HAS_LEASE), and a key seen refused under a lease is tried again no sooner than the
  transfer timeout after it was last seen so (``REMOVAL_GRACE``): the reader that held that
  lease has finished or failed its transfer by then. Connector eviction (``LeasedKeys``, on the
  save thread), unpin (``pins.Pins.unpin``) and the reset flush
  (``operations.BackendOperations.reset_flush``) follow it;
* reader side (``_transfers``): a get that lasted the lease or longer is failed
  (``LEASE_EXPIRED``, recomputed). That is the proof a reader is done for leases no remover
  saw: Mooncake 0.3.13 publishes no lease end (``/batch_query_keys`` has none; a query grants
  a lease of its own), so a lease taken and lapsed between two removal tries is invisible to
  the remover, and only the reader can tell its copy outlived it.

What neither covers is stated in docs/connector/index.md (flush modes): ``flush --force
--accept-torn-reads``, the pool's own eviction, and readers that are not kvpool connectors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from kvpool_agent.vocabulary import ErrorCode
from kvpool_connector.backends.mooncake import TRANSFER_TIMEOUT_MS

__all__ = ["MAX_DEFERRED_ROUNDS", "MAX_LEASED_REMOVES", "NOT_READY_RETRY_S", "REMOVAL_GRACE",
           "LeasedKeys", "grace_s_of", "remove_later"]

logger = logging.getLogger(__name__)

MAX_LEASED_REMOVES = 65_536
"""Evicted keys a lease kept that are tried again at most (the oldest are dropped: the master
evicts them when a put finds no room)."""

REMOVAL_GRACE = "transfer timeout after the key was last seen under a lease"
"""The remover-side rule, as the docs and log lines name it."""

NOT_READY_RETRY_S = 0.02
"""Shortest pause (s) before a key whose put was still running (-703 REPLICA_IS_NOT_READY) is
tried again: no reader holds it, so no grace is owed."""


MAX_DEFERRED_ROUNDS = 10
"""Tries ``remove_later`` makes of a key readers keep leasing (10 x 60 s by default) before it
leaves it in the pool with a warning (the pool's own eviction takes it once unleased)."""


def grace_s_of(transfer_timeout_ms: int) -> float:
    """The wait (s) after a key was seen under a lease: the backend's transfer timeout
    (``Backend.transfer_timeout_ms``, ms)."""
    return max(0, transfer_timeout_ms) / 1e3


class LeasedKeys:
    """Evicted keys waiting for their readers (``eviction: connector``, save thread only, no
    lock): each with the earliest time (``clock``, s) it may be tried again.

    Args:
        grace_s: the wait after a key was refused under a lease (s); default the Mooncake
            store client's transfer timeout (60 s).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, grace_s: float = TRANSFER_TIMEOUT_MS / 1e3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self._due: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._due)

    def keys(self) -> list[str]:
        """The keys waiting now (a copy)."""
        return list(self._due)

    def batch(self, keys: Sequence[str], keep: Sequence[str],
              pinned: Callable[[], AbstractSet[str]] | None) -> list[str]:
        """The keys to remove now: ``keys`` and the waiting keys whose wait ended, never one
        still waiting (a chunk evicted again within its grace waits on) nor one ``pinned()``
        holds. ``keep``: waiting keys whose chunk the scheduler took back (dropped)."""
        for k in keep:
            self._due.pop(k, None)
        now = self._clock()
        due = self._due
        ready = [k for k, t in due.items() if t <= now]
        for k in ready:
            del due[k]
        todo = list(dict.fromkeys([*ready, *(k for k in keys if k not in due)]))
        if todo and pinned is not None:
            held = pinned()
            todo = [k for k in todo if k not in held]
        return todo

    def settle(self, todo: Sequence[str], codes: Sequence[int]) -> tuple[int, int]:
        """Record a batch's ``batch_remove`` results: ``(removed, failed)``. A key a lease
        kept (-706) waits ``grace_s`` from now, one a running put kept (-703)
        ``NOT_READY_RETRY_S`` (neither counted); OBJECT_NOT_FOUND (never stored, or gone
        already) is neither."""
        removed = failed = 0
        now = self._clock()
        for key, rc in zip(todo, codes, strict=True):
            if rc == 0:
                removed += 1
            elif rc == ErrorCode.OBJECT_HAS_LEASE:
                self._due[key] = now + self.grace_s
            elif rc == ErrorCode.REPLICA_IS_NOT_READY:
                self._due[key] = now + NOT_READY_RETRY_S
            elif rc != ErrorCode.OBJECT_NOT_FOUND:
                failed += 1
        while len(self._due) > MAX_LEASED_REMOVES:
            del self._due[next(iter(self._due))]
        return removed, failed


def remove_later(remove: Callable[[list[str]], list[int]], keys: Sequence[str], grace_s: float,
                 what: str, rounds: int = MAX_DEFERRED_ROUNDS) -> threading.Timer | None:
    """Remove ``keys`` (refused under a lease) on a timer thread, ``grace_s`` seconds from now
    and again ``grace_s`` after each refusal, at most ``rounds`` tries; for a removal whose
    caller does not wait the grace out (``Pins.unpin``). ``remove`` is an unforced
    ``batch_remove`` (per key 0 or a negative ``ErrorCode``); ``what`` names the removal in
    log lines. Returns the timer (``None``: nothing to do); never raises into the timer."""
    todo = list(keys)
    if not todo or rounds < 1:
        return None

    def attempt() -> None:
        try:
            codes = remove(todo)
        except Exception as exc:  # a store error: the keys stay, the pool evicts them later
            logger.warning("kvpool %s: %d keys not removed: %s", what, len(todo), exc)
            return
        left = [k for k, rc in zip(todo, codes, strict=True)
                if rc == ErrorCode.OBJECT_HAS_LEASE]
        if left and rounds > 1:
            remove_later(remove, left, grace_s, what, rounds - 1)
        elif left:
            logger.warning("kvpool %s: %d keys still leased by readers at the last try "
                           "(tries %.0f s apart): left in the pool", what, len(left), grace_s)

    timer = threading.Timer(grace_s, attempt)
    timer.daemon = True
    timer.start()
    return timer
