"""Save admission: how many leading chunks of a request the connector saves to the pool.

``kv_connector_extra_config.admission`` picks the policy (``KVPoolConfig.admission``):

* ``all`` (default): every whole chunk of every prompt is saved (the behaviour before issue 24).
* ``adaptive``: two candidate policies are simulated on ghost caches (keys only) of the pool's
  capacity (``admission_pool_tokens``), and the one that would have hit more recently decides:

  - *all*: save every chunk;
  - *doorkeeper*: save only the chunks some earlier request already asked for (W-TinyLFU's
    doorkeeper, Einziger et al., "TinyLFU", ACM TOS 2017): a chunk asked for once is never saved,
    so one long prompt that nobody repeats cannot flush a small pool.

  A small pool fills with chunks that are never asked for again, and the doorkeeper wins (on the
  conversation trace at 1M tokens it holds 1.6x the hits of an exact LRU); a pool that holds the
  working set loses the second use of every chunk to the doorkeeper, and *all* wins. Which is the
  case depends on capacity and traffic, so the ghosts decide, with scores that decay by half every
  ``half_life`` requests (recent traffic counts most).

Chunk hashes are chained (``keys.chunk_hashes``: hash ``i`` names tokens ``[0, (i + 1) *
chunk_size)``), so the chunks of a prompt that were asked for before form a prefix of it, and so
do the chunks any policy admits: a policy answers with a count of leading chunks.

Not used for ``kv_producer`` engines: a prefill engine's saves are the hand-over to its decode
engine (``kv_consumer`` with ``consumer_is_to_load``), which finds nothing unless every chunk is
saved (``admission_for``). With ``admission: service`` a producer still sends its access
records (``PolicyClient`` with ``admit_all``) and saves every chunk.

Memory: the doorkeeper is two generations of a Bloom filter of ``8 x capacity`` chunks each
(10 bits per chunk, 4 probes: ~1.2% false positives; a full generation becomes the old one, after
TinyLFU's reset); each ghost holds at most ``max_ghost_keys`` 64-bit keys. A pool of more chunks
is simulated on a hash-sampled subset of its chunks, the capacity scaled by the same rate
(Waldspurger et al., "Efficient MRC construction with SHARDS", FAST'15).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal, Protocol

__all__ = [
    "AdaptiveAdmission",
    "AdmissionMode",
    "AdmissionPolicy",
    "AdmitAll",
    "admission_for",
    "doorkeeper_seen",
]

AdmissionMode = Literal["all", "adaptive", "service"]
"""Values of ``kv_connector_extra_config.admission`` (``service``: the pool-wide policy
service's snapshot, ``kvpool_connector.policy_client``; every chunk until it is reached)."""

_KEY_SPACE = 1 << 64


class AdmissionPolicy(Protocol):
    """Decides, once per request, how many leading chunks of its prompt are saved."""

    def admit(self, hashes: Sequence[str]) -> int:
        """Leading chunks of ``hashes`` (a prompt's chained chunk hashes) to save; also
        records that the request asked for them."""
        ...


class AdmitAll:
    """Every chunk is saved (``admission: all``)."""

    def admit(self, hashes: Sequence[str]) -> int:
        return len(hashes)


def _probes(h: str, bits: int) -> list[int]:
    v = int(h[:32], 16)
    return [((v >> (32 * i)) & 0xFFFFFFFF) % bits for i in range(_Doorkeeper._PROBES)]


def doorkeeper_seen(bloom: bytes, bits: int, hashes: Sequence[str]) -> int:
    """Leading ``hashes`` a doorkeeper snapshot (``AdaptiveAdmission.doorkeeper_snapshot``:
    ``bits`` bits in ``bloom``) has seen: what the doorkeeper admits of them.

    Raises:
        ValueError: ``bloom`` holds fewer than ``bits`` bits, or ``bits`` < 1.
    """
    if bits < 1 or len(bloom) * 8 < bits:
        raise ValueError(f"doorkeeper snapshot of {len(bloom)} bytes cannot hold {bits} bits")
    n = 0
    for h in hashes:
        if not all(bloom[p >> 3] & (1 << (p & 7)) for p in _probes(h, bits)):
            break
        n += 1
    return n


class _Doorkeeper:
    """Chunks asked for recently: two generations of a Bloom filter of ``entries`` each.

    Probes come from the chunk hash itself (uniform: it is SHA-256 or XXH3-128 output).
    """

    _PROBES = 4
    _BITS_PER_ENTRY = 10

    def __init__(self, entries: int, track_changes: bool = False) -> None:
        self.entries = entries
        self.bits = entries * self._BITS_PER_ENTRY
        self._current = bytearray(-(-self.bits // 8))
        self._previous = bytearray(len(self._current))
        self._added = 0
        # 64-bit words of the snapshot set since ``changes`` was last called; None when not
        # tracked. Past an eighth of the words (or at a rotation, which clears bits) only
        # "everything changed" is kept: the set never grows past that.
        self._dirty: set[int] | None = set() if track_changes else None
        self._dirty_cap = max(1, len(self._current) // 64)
        self._all_changed = False

    def changes(self) -> set[int] | None:
        """The 64-bit words of ``snapshot`` that may differ from its value at the last call
        (``None``: too many to name, or a generation rotated: take the whole snapshot), and
        start again. Only with ``track_changes``."""
        if self._dirty is None:
            raise RuntimeError("the doorkeeper does not track its changes")
        out = None if self._all_changed else self._dirty
        self._dirty, self._all_changed = set(), False
        return out

    def _positions(self, h: str) -> list[int]:
        return _probes(h, self.bits)

    def snapshot(self) -> bytes:
        """Both generations OR-ed: the chunks ``seen`` answers for (``doorkeeper_seen``)."""
        n = len(self._current)
        return (int.from_bytes(self._current, "little")
                | int.from_bytes(self._previous, "little")).to_bytes(n, "little")

    @staticmethod
    def _has(bits: bytearray, pos: list[int]) -> bool:
        return all(bits[p >> 3] & (1 << (p & 7)) for p in pos)

    def seen(self, h: str) -> bool:
        pos = self._positions(h)
        return self._has(self._current, pos) or self._has(self._previous, pos)

    def add(self, h: str) -> None:
        pos = self._positions(h)
        if self._has(self._current, pos):
            return
        for p in pos:
            self._current[p >> 3] |= 1 << (p & 7)
        if self._dirty is not None and not self._all_changed:
            self._dirty.update(p >> 6 for p in pos)
            if len(self._dirty) > self._dirty_cap:
                self._all_changed = True
                self._dirty.clear()
        self._added += 1
        if self._added >= self.entries:
            self._previous, self._current = self._current, bytearray(len(self._current))
            self._added = 0
            self._all_changed = True  # the old generation's bits left the snapshot


class _Ghost:
    """An exact LRU of chunk keys (no values): what the pool would hold under one policy."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def leading(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int], admitted: int) -> None:
        """Refresh every key present; insert the first ``admitted`` keys that are not."""
        for i, k in enumerate(keys):
            if k in self.keys:
                self.keys.move_to_end(k)
            elif i < admitted:
                self.keys[k] = None
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


class AdaptiveAdmission:
    """``admission: adaptive`` (module docstring): ghosts of *all* and *doorkeeper* at the
    pool's capacity; the one with the higher decayed score of leading hits decides.

    Args:
        capacity_chunks: chunks the pool holds (``admission_pool_tokens / chunk_size``), > 0.
        half_life: requests after which a ghost's past hits count half (> 0).
        max_ghost_keys: most keys per ghost; above it ghosts run on a hash-sampled subset.
        track_changes: keep the doorkeeper's changed words for ``doorkeeper_changes`` (the
            policy service's delta snapshots).

    Attributes:
        doorkeeper_active: the policy used for the last request was the doorkeeper.
        decisions: requests decided so far, per policy (``all``, ``doorkeeper``).
    """

    def __init__(self, capacity_chunks: int, half_life: int = 200,
                 max_ghost_keys: int = 65_536, track_changes: bool = False) -> None:
        if capacity_chunks < 1 or half_life < 1 or max_ghost_keys < 1:
            raise ValueError(
                f"capacity_chunks, half_life and max_ghost_keys must be >= 1, got "
                f"{capacity_chunks}, {half_life}, {max_ghost_keys}")
        rate = min(1.0, max_ghost_keys / capacity_chunks)
        self._threshold = int(rate * _KEY_SPACE)
        ghost_cap = max(1, round(capacity_chunks * rate))
        self._all = _Ghost(ghost_cap)
        self._door = _Ghost(ghost_cap)
        self._seen = _Doorkeeper(max(4096, 8 * capacity_chunks), track_changes)
        self._decay = 0.5 ** (1.0 / half_life)
        self._score_all = 0.0
        self._score_door = 0.0
        self.doorkeeper_active = False
        self.decisions = {"all": 0, "doorkeeper": 0}

    def doorkeeper_snapshot(self) -> tuple[int, bytes]:
        """``(bits, bloom)``: the doorkeeper's chunks asked for recently, for
        ``doorkeeper_seen`` in another process (the pool-wide policy service's snapshot:
        10 bits a chunk of ``8 x capacity_chunks``, at least 4,096 chunks)."""
        return self._seen.bits, self._seen.snapshot()

    def doorkeeper_changes(self) -> set[int] | None:
        """The 64-bit words (index ``i``: bytes ``8i`` to ``8i + 8`` of the bloom) of
        ``doorkeeper_snapshot`` that may have changed since the last call, ``None`` when the
        whole filter may have (``_Doorkeeper.changes``).

        Raises:
            RuntimeError: built without ``track_changes``.
        """
        return self._seen.changes()

    def _sampled(self, hashes: Sequence[str]) -> list[int]:
        keys = (int(h[:16], 16) for h in hashes)
        return [k for k in keys if k < self._threshold]

    def admit(self, hashes: Sequence[str]) -> int:
        keys = self._sampled(hashes)
        self._score_all = self._score_all * self._decay + self._all.leading(keys)
        self._score_door = self._score_door * self._decay + self._door.leading(keys)
        self.doorkeeper_active = self._score_door > self._score_all
        seen = 0
        for h in hashes:
            if not self._seen.seen(h):
                break
            seen += 1
        # Sampled keys seen before: a prefix of the sampled keys, as the chunks are chained.
        seen_keys = sum(1 for h in hashes[:seen] if int(h[:16], 16) < self._threshold)
        self._all.insert(keys, len(keys))
        self._door.insert(keys, seen_keys)
        for h in hashes:
            self._seen.add(h)
        if self.doorkeeper_active:
            self.decisions["doorkeeper"] += 1
            return seen
        self.decisions["all"] += 1
        return len(hashes)


def admission_for(mode: AdmissionMode, kv_role: str, pool_tokens: int | None,
                  chunk_size: int) -> AdmissionPolicy:
    """The policy an engine uses: ``AdmitAll`` for ``all`` and for every ``kv_producer`` (its
    saves are what its decode engine loads), and for ``service`` until the connector has its
    ``PolicyClient`` (after the workers' handshake), else ``AdaptiveAdmission`` at
    ``pool_tokens // chunk_size`` chunks.

    Raises:
        ValueError: ``adaptive`` without ``pool_tokens`` (``KVPoolConfig`` checks this first).
    """
    if mode in ("all", "service") or kv_role == "kv_producer":
        return AdmitAll()
    if not pool_tokens:
        raise ValueError("kv_connector_extra_config.admission_pool_tokens: adaptive admission "
                         "needs the pool's capacity in tokens of this model, e.g. 2000000")
    return AdaptiveAdmission(max(1, pool_tokens // chunk_size))
