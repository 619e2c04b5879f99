"""What the pool's store did to this process, as its agent saw it: the store's pause windows
(``EngineState.store_pauses``) and the segments the master dropped with their values
(``PoolStats.losses``, ``lost_keys``, ``lost_bytes``).

- ``store_stalled``: one of this process's transfers is stuck (``protocol.stuck_after_ms``,
  its process's own stopped time left out) and none ended well for ``STUCK_FLOOR_MS``: the
  store holding the segments, or the transport to it, stopped answering (a
  ``mooncake_client`` stopped with SIGSTOP, or dead; slow loads that keep ending, a lease TTL
  below the load time, are none). It opens at
  the oldest stuck transfer's start and closes once none is stuck and the store answered
  again: a transfer ended well meanwhile, or, with nothing in flight, the master listed memory
  in a reading (a dead store's transfers fail at once and never end well).
- ``pool_no_segments``: the master passes its health check with no memory mounted any more:
  from its last reading with memory, or the first failure since this process's last transfer
  that ended well when earlier (a dead store's transfers fail at once, ``TRANSFER_FAIL``, for
  the ``client_ttl`` its segment lingers), to the next reading with memory (a pool this agent
  never read memory in has lost none: ``pool_no_segments``, the alert, names it).
- a segment listed in one reading of the master and gone from the next is a ``SegmentLoss``:
  the master dropped it (``client_ttl`` after its store's last ping), its values with it.

The agent's loads are matched against these windows as against its own pauses
(``_aggregate.Aggregator``): time in them is not the lease TTL's, so a console attributes a
slow or failed load, and the errors meanwhile, to the store (``pause_wait``), also a one-shot
that did not watch it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvpool_agent._names import count_name
from kvpool_agent.protocol import (
    MAX_BIG_COUNT,
    MAX_COUNT,
    MAX_ID_CHARS,
    MAX_NAMES,
    MAX_SEGMENTS,
    OTHER_NAME,
    RECENT_LOSSES,
    RECENT_PAUSES,
    STUCK_FLOOR_MS,
    ErrorRecord,
    PauseWindow,
    PoolStats,
    SegmentLoss,
    Transfer,
    clip,
    paused_ms,
    stuck_after_ms,
)

__all__ = ["CHECK_MS", "StoreWatch"]

CHECK_MS = 500.0
"""How often (ms, monotonic) the in-flight transfers are checked for a stuck one: the window
starts at the transfer's start whenever it is seen, so this only delays its report."""


def _read(p: PoolStats) -> bool:
    """A reading of a Mooncake master that passed its checks (an HA pool's only while one
    serves): other backends report no segments."""
    return p.backend == "mooncake" and p.healthy is True and (
        not p.masters or any(m.serving for m in p.masters))


class StoreWatch:
    """The store's pause windows and the segment losses of one agent (agent thread only)."""

    def __init__(self, recent_errors: Iterable[ErrorRecord] = ()) -> None:
        self._recent = recent_errors
        """The agent's recent error records (its ``Aggregator.recent_errors``): a window that
        opens counts those since its start (``PauseWindow.errors``)."""
        self.windows: deque[PauseWindow] = deque(maxlen=RECENT_PAUSES)
        self.losses: deque[SegmentLoss] = deque(maxlen=RECENT_LOSSES)
        self.lost_keys = 0
        self.lost_bytes = 0
        self._stall: PauseWindow | None = None
        self._answered = False
        self._ok_ms: float | None = None
        self._since_ok: dict[str, int] = {}
        """Errors (name -> count) since this process's last transfer that ended well: a dead
        store's window counts them all, also those a flood pushed out of ``_recent``."""
        self._first_fail_ms: float | None = None
        """The first of them (epoch ms); None: none since."""
        self._empty: PauseWindow | None = None
        self._last: tuple[float, PoolStats] | None = None
        self._memory_ms: float | None = None
        self._next_check_ms = 0.0

    def due(self, mono_ms: float) -> bool:
        """Whether :meth:`check` is due at ``mono_ms`` (monotonic ms): every ``CHECK_MS``."""
        if mono_ms < self._next_check_ms:
            return False
        self._next_check_ms = mono_ms + CHECK_MS
        return True

    def check(self, now_ms: float, in_flight: Iterable[Transfer], load_bytes_per_s: float,
              save_bytes_per_s: float, stopped: Iterable[PauseWindow]) -> bool:
        """Open ``store_stalled`` at the oldest stuck transfer's start, or close it at
        ``now_ms`` once none is stuck and the store answered. ``stopped``: this process's own
        pause windows (time stopped is no transfer's). True when a window opened or closed."""
        stopped = [w for w in stopped if w.kind == "process_stalled"]
        stuck = None
        # Nothing of this process ended well for the stuck floor: slow transfers that keep
        # ending (a lease TTL below the load time) are no stall, whatever their age.
        if self._ok_ms is None or now_ms - self._ok_ms > STUCK_FLOOR_MS:
            for t in in_flight:
                limit = stuck_after_ms(t.kind, t.bytes, load_bytes_per_s, save_bytes_per_s)
                if now_ms - t.started_ms - paused_ms(stopped, t.started_ms, now_ms) > limit \
                        and (stuck is None or t.started_ms < stuck):
                    stuck = t.started_ms
        if stuck is not None:
            if self._stall is None:
                self._stall = self._open("store_stalled", stuck)
                self._answered = False
                return True
            return False
        if self._stall is not None and self._answered:
            self._stall.end_ms = now_ms
            self._stall = None
            return True
        return False

    def _open(self, kind: str, start_ms: float, detail: str = "") -> PauseWindow:
        """A new window of ``kind`` from ``start_ms``, with the errors recorded since."""
        w = PauseWindow(kind=kind, start_ms=start_ms, detail=detail)  # type: ignore[arg-type]
        for e in self._recent:
            if e.ts_ms >= start_ms:
                count_name(w.errors, e.name)
        self.windows.append(w)
        return w

    def failed(self, name: str, ts_ms: float) -> None:
        """A failed transfer or skipped save of error ``name`` at ``ts_ms``: counted in the
        windows it falls in, and among the errors since the last transfer that ended well."""
        count_name(self._since_ok, name)
        if self._first_fail_ms is None or ts_ms < self._first_fail_ms:
            self._first_fail_ms = ts_ms
        for w in self.windows:
            if w.start_ms <= ts_ms and (w.end_ms is None or ts_ms <= w.end_ms):
                count_name(w.errors, name)

    def finished(self, ok: bool, ts_ms: float) -> None:
        """A transfer of this process ended at ``ts_ms`` (``ok``: well: the store answered
        it)."""
        if ok:
            self._ok_ms = ts_ms if self._ok_ms is None else max(self._ok_ms, ts_ms)
            self._since_ok = {}
            self._first_fail_ms = None
            if self._stall is not None:
                self._answered = True

    def reading(self, stats: PoolStats, checked_ms: float, idle: bool) -> bool:
        """A reading of the pool (``Aggregator.set_pool``) that ended at ``checked_ms``;
        ``idle``: nothing of this process in flight. Records the segments it no longer lists
        and opens or closes ``pool_no_segments``; True when anything changed."""
        if not _read(stats):
            return False
        changed = False
        last, self._last = self._last, (checked_ms, stats)
        if last is not None and len(last[1].segments) < MAX_SEGMENTS:
            seen_ms, prev = last
            names = {s.name for s in stats.segments}
            for seg in prev.segments:
                if seg.name in names:
                    continue
                share = seg.used_bytes / prev.used_bytes if prev.used_bytes else 0.0
                loss = SegmentLoss(segment=clip(seg.name, MAX_ID_CHARS), seen_ms=seen_ms,
                                   ts_ms=checked_ms, keys=round(prev.keys * min(share, 1.0)),
                                   bytes=seg.used_bytes)
                self.losses.append(loss)
                self.lost_keys += loss.keys
                self.lost_bytes += loss.bytes
                changed = True
        if stats.total_bytes > 0:
            self._memory_ms = checked_ms
            if self._empty is not None:
                self._empty.end_ms = checked_ms
                self._empty = None
                changed = True
            if idle and self._stall is not None:
                self._answered = True
        elif self._empty is None and self._memory_ms is not None:
            prev_segments = last[1].segments if last is not None else []
            # From the last reading with memory, or from the first failure since the last
            # transfer that ended well when earlier: a dead store's transfers fail at once
            # (TRANSFER_FAIL) for the client_ttl its segment still lingers in the master.
            start = self._memory_ms if self._first_fail_ms is None else min(
                self._first_fail_ms, self._memory_ms)
            self._empty = self._open(
                "pool_no_segments", start,
                clip(", ".join(s.name for s in prev_segments[:4]), MAX_ID_CHARS))
            # Every error since the last transfer that ended well is in it (start is at or
            # before the first of them), also those no longer among the recent records.
            errors = self._empty.errors
            for name, n in self._since_ok.items():
                key = name if name in errors or len(errors) < MAX_NAMES - 1 else OTHER_NAME
                errors[key] = max(errors.get(key, 0), n)
            changed = True
        return changed

    def pool(self, stats: PoolStats) -> PoolStats:
        """``stats`` with the losses recorded so far (in place; sums within the schema)."""
        stats.lost_keys = min(self.lost_keys, MAX_COUNT)
        stats.lost_bytes = min(self.lost_bytes, MAX_BIG_COUNT)
        stats.losses = list(self.losses)
        return stats
