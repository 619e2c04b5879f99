"""Whole admission snapshots or deltas: what the service publishes next (issue 40: a compact
snapshot; ``kvpool_connector.policy_wire`` has the wire).

A whole snapshot carries the doorkeeper's Bloom filter, 10 bits x 8 x the pool's chunks: up to
4 MiB, every ``SNAPSHOT_EVERY_S`` (0.5 s) to every subscriber was 8 MiB/s each. Between two
whole snapshots a delta carries the filter's 64-bit words set since the last message sent:
12 bytes a word, a few per chunk asked for since. A whole snapshot goes out when one is asked
for (new subscribers: they have no filter to apply a delta on), the first time, when the
filter's size changed, a generation rotated (bits were cleared: the doorkeeper's changes say
"everything"), more than an eighth of the filter's words changed since the last call (the
doorkeeper stops naming them), the delta would be half the filter or more, or
``FULL_EVERY_S`` passed (a subscriber that missed a delta has the current filter again). So a
flood of new chunks (about 33,000 a second at the 4 MiB filter, within one agent key's record
budget) makes every publication whole again: the cost before deltas, not more.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import msgspec

from kvpool_connector.policy_wire import FULL_EVERY_S, AdmissionSnapshot, changed_words

__all__ = ["SnapshotDeltas"]

_DELTA_BYTES_PER_WORD = 12  # uint32 index + uint64 value


class SnapshotDeltas:
    """Chooses between a whole snapshot and a delta for each publication (module docstring).
    One thread (the service's loop).

    Args:
        full_every_s: seconds between two whole snapshots at most.
        clock: monotonic seconds.
    """

    def __init__(self, full_every_s: float = FULL_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.full_every_s, self._clock = full_every_s, clock
        self._sent_version = 0
        self._sent_bits = 0
        self._pending: set[int] = set()
        self._whole = True
        self._whole_at = -math.inf

    def message(self, snap: AdmissionSnapshot, changes: set[int] | None, *,
                whole: bool = False) -> AdmissionSnapshot:
        """What to send for ``snap`` (a whole snapshot): itself, or a delta on the last sent
        message. ``changes``: the filter's words changed since the last call
        (``PoolPolicy.doorkeeper_changes``; ``None``: all); ``whole``: a whole snapshot is
        wanted (new subscribers). Call ``sent`` once it went out."""
        if changes is None:
            self._whole = True
        else:
            self._pending |= changes
        if (whole or self._whole or not snap.bits or snap.bits != self._sent_bits
                or self._clock() - self._whole_at >= self.full_every_s
                or _DELTA_BYTES_PER_WORD * len(self._pending) * 2 >= len(snap.bloom)):
            return snap
        words, values = changed_words(snap.bloom, self._pending)
        return msgspec.structs.replace(snap, bits=0, bloom=b"", base=self._sent_version,
                                       words=words, values=values)

    def sent(self, msg: AdmissionSnapshot) -> None:
        """``msg`` (from ``message``) went out: the next delta applies on it."""
        self._sent_version = msg.version
        if not msg.base:
            self._sent_bits = msg.bits
            self._whole_at = self._clock()
        self._pending.clear()
        self._whole = False
