"""The hub's pool-wide memory of saved and asked chunks: what tells "evicted" from "never saved"
from "first use" (issue 41).

Workers report the chunks their saves left stored (``Report.saves``: ``protocol.chunk_id`` ids,
under the worker's model and layout digest); schedulers report the chunks each lookup asked for
(``Report.accesses``). ``SavedChunks`` remembers each (chunk id, layout) pair with the time it
was last reported saved, and in a second table of the same size the time it was last asked
for, each a direct-mapped table of ``slots`` entries: a pair's slot is its id mixed with its
layout's index, a newer pair landing on the same slot replaces it. A lookup's chunk that the
pool did not hold (``not_in_pool``) is then:

* ``evicted``: saved under the looking engine's own layout before the lookup, and gone (the
  master's watermark eviction, the policy service, a flush, an unpin, a master restart:
  the pool does not say which);
* ``other_digest``: saved before the lookup only under another layout digest of the same
  model (another weight fingerprint, dtype or parallel layout holds the chunk: layouts split);
* ``never_saved``: asked for under the engine's layout by an earlier lookup (any engine's),
  never saved: the admission did not admit it (a doorkeeper saves a chunk from its second
  request on), its save was skipped or failed, its save was still in flight, or no engine of
  that layout saves (``kv_consumer``);
* ``first_use``: no earlier lookup asked for it: a compulsory miss, which no pool size or
  policy serves.

Error, stated: (1) a pair is forgotten when a later pair takes its slot in its table: of ``s``
distinct pairs saved (asked) after it, it survives with probability ``(1 - 1/slots)**s ~
exp(-s/slots)`` (the default 2**19 slots: 0.83 after 100,000 later saves, 0.37 after 524,288);
a forgotten save's miss reads ``never_saved`` or ``first_use``, a forgotten ask's
``first_use`` (so ``evicted``, ``other_digest`` and ``never_saved`` are low, never high). (2) a
false "saved" or "asked" needs a 64-bit id equal in the slot: about ``2**-64`` a probe. (3) a
save is stamped with its report's time (the agent reports every ``HEARTBEAT_MS`` or sooner), so
a chunk saved less than one report interval before a lookup can read ``never_saved``; the stamp
has 1 s resolution, rounded up for the same reason. An ask is stamped with its lookup's time
in ms (a pair keeps its earliest ask) and counts for lookups after it, whichever report came
first (a P/D pair's decode engine asks for its prefill engine's chunks within the same second:
with whole seconds, as first built, the prefill engine's first uses read ``never_saved``
whenever the decode engine's report came first); engines' clocks that differ by more than the
time between two lookups of a chunk misorder them. Asks are remembered only for engines whose
layout digest the hub knows (before it, their lookups stay ``not_in_pool``). (4)
``other_digest`` probes at most ``PROBE_LAYOUTS`` of the model's other layouts (the most
recently saved).

Memory: 14 bytes a slot (id, layout index, stamp in ``array``\\ s) in the saved table and 18
in the asked one (a ms stamp): 16 MiB at the default 2**19 slots, allocated once; the layouts
table holds at most ``MAX_LAYOUTS`` (model, digest) pairs (past it a new layout's saves and
asks are not remembered: counted in ``layouts_full``), and a layout counts against the budget of
the key whose report named it first (``owner``: the agent key itself, its public key, so a key
authorized again under the same name starts afresh; ``cap``: 64 layouts for a key bound to one
engine, 1,024 for any other agent key, fleet-wide or bound to a pool only,
``MAX_LAYOUTS_PER_ENGINE_KEY``, ``MAX_LAYOUTS_PER_FLEET_KEY``): past it the key's new layouts
are not remembered either (``layouts_over_budget``), so one borrowed key takes at most its
budget of the table, not all of it. Layouts are never forgotten while the hub runs: an engine
whose weights changed 64 times under one key (each version its own digest) splits its new
layouts' misses again after a hub restart.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

__all__ = [
    "EVICTED", "FIRST_USE", "MAX_LAYOUTS", "MAX_LAYOUTS_PER_ENGINE_KEY",
    "MAX_LAYOUTS_PER_FLEET_KEY", "NEVER_SAVED", "OTHER_DIGEST", "PROBE_LAYOUTS", "SAVED_SLOTS",
    "SavedChunks",
]

SAVED_SLOTS = 1 << 19
"""(chunk, layout) pairs each of the hub's two tables holds at most (a power of two)."""

MAX_LAYOUTS = 4_096
"""(model, layout digest) pairs the memory knows at most."""

MAX_LAYOUTS_PER_ENGINE_KEY = 64
"""Layouts one agent key bound to one engine may name first: an engine has one layout digest
per weights, dtype and parallel layout it ran (a version a rolling update)."""

MAX_LAYOUTS_PER_FLEET_KEY = 1_024
"""Layouts one fleet-wide agent key may name first: every model version and layout of a
fleet that shares one key, a quarter of ``MAX_LAYOUTS``."""

PROBE_LAYOUTS = 16
"""Other layouts of a model a lookup's chunk is probed under at most."""

NEVER_SAVED = "never_saved"
EVICTED = "evicted"
OTHER_DIGEST = "other_digest"
FIRST_USE = "first_use"

_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads consecutive layout indices
_MASK64 = (1 << 64) - 1


class _Stamps:
    """One direct-mapped table of (chunk id, layout index) -> a time stamp (``stamp_type``:
    ``"I"`` epoch seconds, ``"Q"`` epoch ms)."""

    def __init__(self, slots: int, stamp_type: str) -> None:
        self.mask = slots - 1
        self.ids = array("Q", bytes(8 * slots))
        self.layout = array("H", bytes(2 * slots))  # layout index + 1; 0: an empty slot
        self.stamp = array(stamp_type, bytes(array(stamp_type).itemsize * slots))

    @property
    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in (self.ids, self.layout, self.stamp))

    def _slot(self, cid: int, layout: int) -> int:
        return ((cid ^ (layout * _GOLDEN)) & _MASK64) & self.mask

    def put(self, ids: Sequence[int], layout: int, stamp: int, *, earliest: bool = False
            ) -> None:
        """Hold each pair with ``stamp``; with ``earliest`` a pair already held keeps the
        smaller stamp (a report that came late never hides an earlier one)."""
        for cid in ids:
            s = self._slot(cid, layout)
            if earliest and self.ids[s] == cid and self.layout[s] == layout:
                self.stamp[s] = min(self.stamp[s], stamp)
                continue
            self.ids[s] = cid
            self.layout[s] = layout
            self.stamp[s] = stamp

    def before(self, cid: int, layout: int, bound: float) -> bool:
        """The pair is held with a stamp of at most ``bound``."""
        s = self._slot(cid, layout)
        return (self.layout[s] == layout and self.ids[s] == cid
                and self.stamp[s] <= bound)


class SavedChunks:
    """The saved- and asked-chunk memory (module docstring). Not thread-safe: one thread adds
    and asks.

    Args:
        slots: entries of each table (a power of two >= 1).

    Attributes:
        saved: pairs recorded saved so far; ``asked``: pairs recorded asked for;
            ``layouts_full``: chunk ids not recorded because the layouts table was full;
            ``layouts_over_budget``: chunk ids not recorded because their layout was new and
            the key naming it had named its ``cap`` of layouts.
    """

    def __init__(self, slots: int = SAVED_SLOTS) -> None:
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two >= 1, got {slots}")
        self._saved = _Stamps(slots, "I")  # report time, whole seconds rounded up
        self._asked = _Stamps(slots, "Q")  # lookup time, ms
        self._index: dict[tuple[str, str], int] = {}
        self._of_model: dict[str, list[str]] = {}  # model -> its digests, last saved last
        self._owned: dict[str, int] = {}  # owner (a key) -> layouts it named first
        self.saved = 0
        self.asked = 0
        self.layouts_full = 0
        self.layouts_over_budget = 0

    @property
    def slots(self) -> int:
        return self._saved.mask + 1

    @property
    def nbytes(self) -> int:
        """Bytes of both tables (the arrays; the layouts table is not counted)."""
        return self._saved.nbytes + self._asked.nbytes

    def _layout(self, model: str, digest: str, ids: Sequence[int], owner: str, cap: int
                ) -> int | None:
        """The index of (``model``, ``digest``), made on first use and charged to ``owner``;
        ``None`` when the layouts table is full (``ids`` counted in ``layouts_full``) or
        ``owner`` named ``cap`` layouts already (``layouts_over_budget``)."""
        key = (model, digest)
        idx = self._index.get(key)
        if idx is None:
            if len(self._index) >= MAX_LAYOUTS:
                self.layouts_full += len(ids)
                return None
            if (named := self._owned.get(owner, 0)) >= cap:
                self.layouts_over_budget += len(ids)
                return None
            self._owned[owner] = named + 1
            idx = self._index[key] = len(self._index) + 1
        return idx

    def add(self, model: str, digest: str, ids: Sequence[int], ts_ms: float,
            owner: str = "", cap: int = MAX_LAYOUTS) -> None:
        """Chunks ``ids`` were stored under (``model``, ``digest``) as of ``ts_ms`` (epoch ms:
        the report's time, an upper bound of the saves' ends), reported by ``owner`` (a key)
        that may name ``cap`` layouts first."""
        if not ids or not digest:
            return
        idx = self._layout(model, digest, ids, owner, cap)
        if idx is None:
            return
        digests = self._of_model.setdefault(model, [])
        if not digests or digests[-1] != digest:
            if digest in digests:
                digests.remove(digest)
            digests.append(digest)
        self._saved.put(ids, idx, min(math.ceil(max(0.0, ts_ms) / 1e3), 0xFFFFFFFF))
        self.saved += len(ids)

    def add_asked(self, model: str, digest: str, ids: Sequence[int], ts_ms: float,
                  owner: str = "", cap: int = MAX_LAYOUTS) -> None:
        """A lookup of an engine of (``model``, ``digest``) at ``ts_ms`` (epoch ms) asked for
        chunks ``ids``: recorded once that lookup's own chunks were judged (``reasons``);
        ``owner`` and ``cap`` as for ``add``."""
        if not ids or not digest:
            return
        idx = self._layout(model, digest, ids, owner, cap)
        if idx is None:
            return
        self._asked.put(ids, idx, int(max(0.0, ts_ms)), earliest=True)
        self.asked += len(ids)

    def reason(self, model: str, digest: str, cid: int, ts_ms: float) -> str:
        """Why chunk ``cid``, looked up at ``ts_ms`` (epoch ms) by an engine of ``model`` under
        ``digest``, was not in the pool: ``EVICTED``, ``OTHER_DIGEST``, ``NEVER_SAVED`` or
        ``FIRST_USE``."""
        return self.reasons(model, digest, [cid], ts_ms)[0]

    def reasons(self, model: str, digest: str, ids: Sequence[int], ts_ms: float) -> list[str]:
        """``reason`` of each of ``ids``, all looked up at ``ts_ms`` (the layouts probed are
        found once)."""
        before_s = ts_ms / 1e3
        asked_by = math.ceil(ts_ms) - 1  # asked strictly before the lookup's ms
        own = self._index.get((model, digest))
        others = [self._index[(model, d)] for d in self._of_model.get(model, ())
                  if d != digest][-PROBE_LAYOUTS:]
        out = []
        for cid in ids:
            if own is not None and self._saved.before(cid, own, before_s):
                out.append(EVICTED)
            elif any(self._saved.before(cid, idx, before_s) for idx in others):
                out.append(OTHER_DIGEST)
            elif own is not None and self._asked.before(cid, own, asked_by):
                out.append(NEVER_SAVED)
            else:
                out.append(FIRST_USE)
        return out
