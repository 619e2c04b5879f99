"""The hub's pool-wide memory of saved chunks: what tells "evicted" from "never saved" (issue 41).

Workers report the chunks their saves left stored (``Report.saves``: ``protocol.chunk_id`` ids,
under the worker's model and layout digest). ``SavedChunks`` remembers each (chunk id, layout)
pair with the time it was last reported saved, in a direct-mapped table of ``slots`` entries:
a pair's slot is its id mixed with its layout's index, a newer pair landing on the same slot
replaces it. A lookup's chunk that the pool did not hold (``not_in_pool``) is then:

* ``evicted``: saved under the looking engine's own layout before the lookup, and gone (the
  master's watermark eviction, the policy service, a flush, an unpin, a master restart:
  the pool does not say which);
* ``other_digest``: saved before the lookup only under another layout digest of the same
  model (another weight fingerprint, dtype or parallel layout holds the chunk: layouts split);
* ``never_saved``: neither.

Error, stated: (1) a pair is forgotten when a later saved pair takes its slot: of ``s`` distinct
pairs saved after it, it survives with probability ``(1 - 1/slots)**s ~ exp(-s/slots)`` (the
default 2**19 slots: 0.83 after 100,000 later saves, 0.37 after 524,288); a forgotten chunk's
miss reads ``never_saved`` (so ``evicted`` and ``other_digest`` are low, never high). (2) a
false "saved" needs a 64-bit id equal in the slot: about ``2**-64`` a probe. (3) a save is
stamped with its report's time (the agent reports every ``HEARTBEAT_MS`` or sooner), so a
chunk saved less than one report interval before a lookup can read ``never_saved``; the stamp
has 1 s resolution, rounded up for the same reason. (4) ``other_digest`` probes at most
``PROBE_LAYOUTS`` of the model's other layouts (the most recently saved).

Memory: 14 bytes a slot (id, layout index, stamp in ``array``\\ s): 7 MiB at the default 2**19
slots, allocated once; the layouts table holds at most ``MAX_LAYOUTS`` (model, digest) pairs
(past it a new layout's saves are not remembered: counted in ``layouts_full``).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

__all__ = [
    "EVICTED", "MAX_LAYOUTS", "NEVER_SAVED", "OTHER_DIGEST", "PROBE_LAYOUTS", "SAVED_SLOTS",
    "SavedChunks",
]

SAVED_SLOTS = 1 << 19
"""(chunk, layout) pairs the hub's memory holds at most (a power of two)."""

MAX_LAYOUTS = 4_096
"""(model, layout digest) pairs the memory knows at most."""

PROBE_LAYOUTS = 16
"""Other layouts of a model a lookup's chunk is probed under at most."""

NEVER_SAVED = "never_saved"
EVICTED = "evicted"
OTHER_DIGEST = "other_digest"

_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads consecutive layout indices
_MASK64 = (1 << 64) - 1


class SavedChunks:
    """The saved-chunk memory (module docstring). Not thread-safe: one thread adds and asks.

    Args:
        slots: entries of the table (a power of two >= 1).

    Attributes:
        saved: pairs recorded so far; ``layouts_full``: chunk ids not recorded because the
            layouts table was full.
    """

    def __init__(self, slots: int = SAVED_SLOTS) -> None:
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two >= 1, got {slots}")
        self._mask = slots - 1
        self._ids = array("Q", bytes(8 * slots))
        self._layout = array("H", bytes(2 * slots))  # layout index + 1; 0: an empty slot
        self._stamp = array("I", bytes(4 * slots))  # epoch seconds of the save's report
        self._index: dict[tuple[str, str], int] = {}
        self._of_model: dict[str, list[str]] = {}  # model -> its digests, last saved last
        self.saved = 0
        self.layouts_full = 0

    @property
    def slots(self) -> int:
        return self._mask + 1

    @property
    def nbytes(self) -> int:
        """Bytes of the table (the arrays; the layouts table is not counted)."""
        return sum(a.itemsize * len(a) for a in (self._ids, self._layout, self._stamp))

    def _slot(self, cid: int, layout: int) -> int:
        return ((cid ^ (layout * _GOLDEN)) & _MASK64) & self._mask

    def add(self, model: str, digest: str, ids: Sequence[int], ts_ms: float) -> None:
        """Chunks ``ids`` were stored under (``model``, ``digest``) as of ``ts_ms`` (epoch ms:
        the report's time, an upper bound of the saves' ends)."""
        if not ids or not digest:
            return
        key = (model, digest)
        idx = self._index.get(key)
        if idx is None:
            if len(self._index) >= MAX_LAYOUTS:
                self.layouts_full += len(ids)
                return
            idx = self._index[key] = len(self._index) + 1
        digests = self._of_model.setdefault(model, [])
        if not digests or digests[-1] != digest:
            if digest in digests:
                digests.remove(digest)
            digests.append(digest)
        stamp = min(math.ceil(max(0.0, ts_ms) / 1e3), 0xFFFFFFFF)
        for cid in ids:
            s = self._slot(cid, idx)
            self._ids[s] = cid
            self._layout[s] = idx
            self._stamp[s] = stamp
        self.saved += len(ids)

    def _saved_before(self, cid: int, idx: int, before_s: float) -> bool:
        s = self._slot(cid, idx)
        return (self._layout[s] == idx and self._ids[s] == cid
                and self._stamp[s] <= before_s)

    def reason(self, model: str, digest: str, cid: int, ts_ms: float) -> str:
        """Why chunk ``cid``, looked up at ``ts_ms`` (epoch ms) by an engine of ``model`` under
        ``digest``, was not in the pool: ``EVICTED``, ``OTHER_DIGEST`` or ``NEVER_SAVED``."""
        return self.reasons(model, digest, [cid], ts_ms)[0]

    def reasons(self, model: str, digest: str, ids: Sequence[int], ts_ms: float) -> list[str]:
        """``reason`` of each of ``ids``, all looked up at ``ts_ms`` (the layouts probed are
        found once)."""
        before_s = ts_ms / 1e3
        own = self._index.get((model, digest))
        others = [self._index[(model, d)] for d in self._of_model.get(model, ())
                  if d != digest][-PROBE_LAYOUTS:]
        out = []
        for cid in ids:
            if own is not None and self._saved_before(cid, own, before_s):
                out.append(EVICTED)
            elif any(self._saved_before(cid, idx, before_s) for idx in others):
                out.append(OTHER_DIGEST)
            else:
                out.append(NEVER_SAVED)
        return out
