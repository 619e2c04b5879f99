"""The service's fill that follows the master (issue 40: at or above an exact LRU of the whole
pool): ``kvpool-policy serve --fill auto``, the default.

A fixed fill (0.8 of the pool) keeps a fifth of the pool free below the master's watermark
for what the policy does not count: saves in flight before their records arrive, chunks it
evicted that wait for a reader's lease to end (``_remover``), layouts no record named yet.
How much that takes moves with the engines' rate: at conversation 5M tokens, 8 engines, the
master evicted nothing beside the service at 0.8 and 0.9 and started at 0.93
(docs/benchmarks.md), while on the synthetic trace's small pools 0.9 left the master most of
the evicting. So the room is measured rather than guessed: every ``FILL_EVERY_S`` the
master's ``/metrics`` (``master_allocated_bytes``, ``master_total_capacity_bytes``,
``master_evicted_key_count``) are read on a thread of their own (the loop never waits for
HTTP), and ``FillRule`` sets the policy's capacity to

    watermark x total - peak(used - policy's bytes over OTHERS_WINDOW_S) - FILL_MARGIN x total

bounded to ``[FILL_FLOOR, watermark - FILL_MARGIN]`` of the pool (it starts at the floor,
the fixed fill measured before it): raised by at most
``FILL_STEP`` of the pool a reading, lowered at once when the others' bytes grow, and
lowered by ``FILL_BACKOFF`` below that whenever the master evicted since the last reading
(its watermark is the one thing the service must stay under). An empty pool's fill reaches
the ceiling in 16 s: the room is taken back as the saves show it. The master does not export
the watermark it runs with: ``--master-watermark`` says it (mooncake_master's default
``eviction_high_watermark_ratio`` is 0.9).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

import httpx

from kvpool_agent.pool import fetch_mooncake_stats
from kvpool_policy._core import PolicyCore

__all__ = [
    "FILL_BACKOFF", "FILL_EVERY_S", "FILL_FLOOR", "FILL_MARGIN", "FILL_STEP", "OTHERS_WINDOW_S",
    "FillFollower", "FillRule", "MasterReader", "MasterReading",
]

logger = logging.getLogger("kvpool.policy")

FILL_EVERY_S = 2.0
"""Seconds between two readings of the master's ``/metrics`` (a scrape is a few KB)."""

FILL_MARGIN = 0.02
"""Share of the pool kept free below the master's watermark beyond the bytes seen outside the
policy (a reading's age of saves: 2 s of 8 engines' saves in the replays)."""

FILL_FLOOR = 0.8
"""The lowest share of the pool the service fills, and its first: the fixed fill measured
before ``auto`` (docs/benchmarks.md: it loses less than 0.9 where the pool turns over within
the lease). Below it the master's watermark evicts beside the service, as it did at 0.8; a
service holding half the pool while the master evicts anyway would hold less than either."""

FILL_STEP = 0.01
"""Share of the pool the capacity rises at most per reading (0.8 to 0.9 in 20 s)."""

FILL_BACKOFF = 0.02
"""Share of the pool the capacity drops below the target when the master evicted since the
last reading."""

OTHERS_WINDOW_S = 30.0
"""The bytes outside the policy are taken at their peak over this long: a burst of saves
comes back before the next reading shows it."""


@dataclass(frozen=True)
class MasterReading:
    """One read of the master's ``/metrics``: bytes allocated and mounted, keys it evicted
    (a counter since it started)."""

    used_bytes: int
    total_bytes: int
    evicted_keys: int


class FillRule:
    """The capacity (bytes) the policy fills after each reading (module docstring).

    Args:
        watermark: the master's ``eviction_high_watermark_ratio``, in (0, 1].
        floor, margin, step, backoff: shares of the pool (the module's constants).
        window_s: the others' bytes are taken at their peak over this long (s).
    """

    def __init__(self, watermark: float, *, floor: float = FILL_FLOOR,
                 margin: float = FILL_MARGIN, step: float = FILL_STEP,
                 backoff: float = FILL_BACKOFF, window_s: float = OTHERS_WINDOW_S) -> None:
        self.watermark = watermark
        self.ceiling = max(watermark - margin, 0.0)
        self.floor = min(floor, self.ceiling)
        self.margin, self.step, self.backoff, self.window_s = margin, step, backoff, window_s
        self._others: collections.deque[tuple[float, int]] = collections.deque()
        self._evicted: int | None = None
        self.backoffs = 0
        """Readings after which the master had evicted (the capacity lowered for it)."""

    def start(self, total_bytes: int) -> int:
        """The capacity before the first reading: the floor's share of ``total_bytes``."""
        return max(1, int(total_bytes * self.floor))

    def next(self, capacity: int, reading: MasterReading, policy_bytes: int,
             now: float) -> int:
        """The capacity after ``reading``, taken at ``now`` (monotonic s), while the policy
        holds ``policy_bytes`` and fills ``capacity``; ``capacity`` itself while the pool has
        no segment mounted."""
        total = reading.total_bytes
        evicted = (self._evicted is not None and reading.evicted_keys > self._evicted)
        # A restarted master counts from 0 again: the next reading compares with its count.
        self._evicted = reading.evicted_keys
        others = max(0, reading.used_bytes - policy_bytes)
        self._others.append((now, others))
        while self._others and self._others[0][0] < now - self.window_s:
            self._others.popleft()
        if total <= 0:
            return capacity
        peak = max(n for _, n in self._others)
        low, high = int(total * self.floor), int(total * self.ceiling)
        target = min(high, int(total * (self.watermark - self.margin)) - peak)
        if evicted:
            self.backoffs += 1
            target = min(target, capacity) - int(total * self.backoff)
        elif target > capacity:
            target = min(target, capacity + int(total * self.step))
        return max(1, max(low, min(high, target)))


class MasterReader:
    """Reads the master's ``/metrics`` every ``every_s`` on a daemon thread of its own;
    ``latest`` is the newest healthy reading and ``reads`` counts them (a loop applies each
    once). An HA pool's comma-separated admin URLs are read from the serving leader
    (``fetch_mooncake_stats``). Never raises: a master that does not answer leaves
    ``latest`` as it was.

    Args:
        admin_url: the master's admin URL(s) (``--admin-url``).
        every_s: seconds between two readings.
    """

    def __init__(self, admin_url: str, every_s: float = FILL_EVERY_S) -> None:
        self.admin_url, self.every_s = admin_url, every_s
        self.latest: MasterReading | None = None
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-policy-fill",
                                        daemon=True)

    def start(self) -> MasterReader:
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=1.0) as http:
            while not self._stop.is_set():
                stats = fetch_mooncake_stats(self.admin_url, client=http)
                if stats.healthy:
                    self.latest = MasterReading(stats.used_bytes, stats.total_bytes,
                                                stats.evicted_keys)
                    self.reads += 1
                self._stop.wait(self.every_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


class FillFollower:
    """Applies each new reading of ``reader`` to a ``PolicyCore``'s capacity (``FillRule``);
    ``step`` runs in the service's loop and never waits.

    Args:
        rule: the fill's rule.
        reader: the master's readings.
    """

    def __init__(self, rule: FillRule, reader: MasterReader) -> None:
        self.rule, self.reader = rule, reader
        self._applied = 0
        self._logged: tuple[int, int] | None = None  # (capacity, pool bytes) last logged
        self._backoffs = 0

    def step(self, core: PolicyCore, now: float) -> None:
        """Resize ``core`` after a reading it has not seen yet (``now``: monotonic s)."""
        reading, reads = self.reader.latest, self.reader.reads
        if reading is None or reads == self._applied:
            return
        self._applied = reads
        before = core.policy.capacity_bytes
        after = self.rule.next(before, reading, core.policy.used_bytes, now)
        if after == before:
            return
        gone = core.resize(after)
        total = reading.total_bytes
        share = after / total
        # A line when the fill moved two points (of a hundred: in whole percents, float sums
        # missed 0.81 -> 0.83), reached a bound (the last step to the ceiling is one point) or
        # the pool's size changed since the last one, or the master evicted.
        backoff, self._backoffs = self.rule.backoffs > self._backoffs, self.rule.backoffs
        bound = after in (int(total * self.rule.floor), int(total * self.rule.ceiling))
        last = self._logged
        if (last is None or last[1] != total or backoff or bound
                or abs(round(100 * share) - round(100 * last[0] / last[1])) >= 2):
            self._logged = (after, total)
            logger.info("kvpool policy: fill %.3f of the pool's %d bytes (%d bytes; master "
                        "used %d, evicted %d keys; %d chunks removed to fit)", share,
                        reading.total_bytes, after, reading.used_bytes, reading.evicted_keys,
                        gone)
