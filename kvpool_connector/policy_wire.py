"""The pool-wide policy service's wire (issue 40 item 1): engines' access records in, the
admission snapshot out.

Lives in the connector because both sides import it: the service (``kvpool_policy.service``)
imports the connector, never the other way round (import-linter's layers).

Two CURVE sockets of the service, at ``policy_service`` (``tcp://HOST:P``):

* ``P``, records (PULL; engines PUSH): one ``RecordBatch`` per message, msgpack. Only the
  fleet's ``agent`` keys may connect (the hub's ``authorized_keys/agent/``); each key has a
  budget of records per second (``kvpool_policy.service``).
* ``P+1``, snapshots (PUB; engines SUB): one ``AdmissionSnapshot`` per message, msgpack, at
  least every ``SNAPSHOT_EVERY_S`` and whenever the doorkeeper's decision changed. Agent,
  viewer and operator keys may subscribe. A whole snapshot carries the doorkeeper's Bloom
  filter (up to 4 MiB); between two, at most ``FULL_EVERY_S`` apart, a *delta* carries only
  the filter's 64-bit words changed since the snapshot before it (``base``): a subscriber
  applies it on the filter of version ``base`` (``apply_delta``), and one that missed a
  message keeps its filter until the next whole snapshot. A delta's ``bits`` is 0, so a
  subscriber before deltas saves every chunk on it.

Sizes are bounded on decode (``MAX_BATCH_BYTES``, ``MAX_RECORDS``, ``MAX_HASHES``): a batch
over them is dropped whole and counted against its key.
"""

from __future__ import annotations

import sys
from array import array

import msgspec

__all__ = [
    "FULL_EVERY_S",
    "MAX_BATCH_BYTES",
    "MAX_HASHES",
    "MAX_RECORDS",
    "SNAPSHOT_EVERY_S",
    "WIRE_VERSION",
    "AdmissionSnapshot",
    "DeltaError",
    "PolicyLayout",
    "PolicyRecord",
    "RecordBatch",
    "SnapshotReader",
    "apply_delta",
    "changed_words",
    "policy_ports",
]

WIRE_VERSION = 1
"""``RecordBatch.v`` and ``AdmissionSnapshot.v``; a message of another version is dropped."""

MAX_RECORDS = 512
"""Records in one batch at most."""

MAX_HASHES = 8_192
"""Chunk hashes in one record at most (2M tokens at chunk 256)."""

MAX_BATCH_BYTES = 4 << 20
"""Bytes of one encoded batch at most (ZMQ's ``MAXMSGSIZE`` on the records socket)."""

SNAPSHOT_EVERY_S = 0.5
"""Seconds between two snapshots at most: an engine that heard none for its
``policy_stale_ms`` takes the service for down."""

FULL_EVERY_S = 10.0
"""Seconds between two whole snapshots at most (deltas between): how long a subscriber that
missed a delta (a slow one, ZMQ's high-water mark) admits from an older filter."""


class PolicyLayout(msgspec.Struct, array_like=True, frozen=True):
    """Where a layout's chunks live: every shard's key prefix (``keys.shard_prefix``) and the
    layer numbers of layer-wise keys (empty: whole-chunk keys). The service removes a chunk
    as ``keys.chunk_keys(prefixes, [hash], layers)``: every TP/PP rank's keys together."""

    digest: str
    prefixes: list[str]
    layers: list[int] = []


class PolicyRecord(msgspec.Struct, array_like=True, frozen=True):
    """One scheduled request (``kvpool_policy.AccessRecord``): its layout digest, its prompt's
    chained chunk hashes, bytes of one chunk in the pool (every rank's keys, bytes) and the
    leading chunks the engine saves (``wants``)."""

    digest: str
    hashes: list[str]
    chunk_bytes: int
    wants: int


class RecordBatch(msgspec.Struct, array_like=True, frozen=True):
    """One message on the records socket.

    Attributes:
        v: ``WIRE_VERSION``.
        engine: the sender's engine id (counts only).
        seq: this sender's batch number, from 0 (a gap is batches lost on the way).
        dropped: records this sender dropped so far because the service was slow or away.
        layouts: the layouts the records name (each digest once).
        records: the access records, in schedule order.
    """

    v: int
    engine: str
    seq: int
    dropped: int
    layouts: list[PolicyLayout]
    records: list[PolicyRecord]


class AdmissionSnapshot(msgspec.Struct, array_like=True, frozen=True):
    """What the service publishes: its admission decision, versioned.

    Attributes:
        v: ``WIRE_VERSION``.
        service: this run of the service (random per start): a new one is a restart.
        version: snapshots published by this run so far.
        doorkeeper: the pool-wide policy admits through the doorkeeper now; engines save the
            leading chunks ``bloom`` has seen (``admission.doorkeeper_seen``), else all.
        bits: bits of ``bloom`` (0 before the first record).
        bloom: the doorkeeper's chunks asked for recently (``AdaptiveAdmission``).
        capacity_bytes: the pool bytes the service steers (bytes).
        used_bytes: bytes of chunks resident by its account (bytes).
        records: records applied by this run; dropped: records lost (the senders' drops,
            over budget, malformed; batches lost on the way are counted by the service apart,
            ``ServiceCounters.lost_batches``).
        removed: keys removed from the pool by this run.
        pinned: chunks the service holds pinned (never removed), from the layouts' pin
            records.
    """

    v: int
    service: str
    version: int
    doorkeeper: bool
    bits: int
    bloom: bytes
    capacity_bytes: int
    used_bytes: int
    records: int
    dropped: int
    removed: int
    pinned: int = 0
    base: int = 0
    """0: a whole snapshot. Else a delta: ``version`` is the filter of version ``base`` of
    this run with ``words`` set to ``values``; ``bits`` is 0 and ``bloom`` empty."""
    words: bytes = b""
    """A delta's changed 64-bit words of the filter: their indices, uint32 little-endian
    (word ``i`` is bytes ``8i`` to ``8i + 8`` of ``bloom``, the last one clipped)."""
    values: bytes = b""
    """The changed words' new values, uint64 little-endian, in ``words``' order."""


class DeltaError(ValueError):
    """A delta that does not fit its filter (a word past its end, or lengths that differ)."""


def changed_words(bloom: bytes, words: set[int]) -> tuple[bytes, bytes]:
    """``(words, values)`` of a delta: the indices in ``words`` (sorted) of 64-bit words of
    ``bloom`` and their values in it (the last word zero-padded)."""
    order = sorted(w for w in words if 8 * w < len(bloom))
    idx = array("I", order)
    vals = array("Q", (int.from_bytes(bloom[8 * w:8 * w + 8], "little") for w in order))
    if sys.byteorder != "little":
        idx.byteswap()
        vals.byteswap()
    return idx.tobytes(), vals.tobytes()


def apply_delta(bloom: bytes, words: bytes, values: bytes) -> bytes:
    """``bloom`` with a delta's ``words`` set to ``values`` (``changed_words``).

    Raises:
        DeltaError: a word index past the filter, or ``words``/``values`` of lengths that do
            not pair up.
    """
    if len(words) % 4 or len(values) % 8 or len(words) // 4 != len(values) // 8:
        raise DeltaError(f"delta of {len(words)} index bytes and {len(values)} value bytes")
    idx, vals = array("I"), array("Q")
    idx.frombytes(words)
    vals.frombytes(values)
    if sys.byteorder != "little":
        idx.byteswap()
        vals.byteswap()
    out = bytearray(bloom)
    n = len(out)
    for w, v in zip(idx, vals, strict=True):
        start = 8 * w
        if start >= n:
            raise DeltaError(f"delta word {w} past a filter of {n} bytes")
        end = min(start + 8, n)
        out[start:end] = v.to_bytes(8, "little")[:end - start]
    return bytes(out)


def policy_ports(address: str) -> tuple[str, str]:
    """``(records, snapshots)`` endpoints of ``policy_service`` ``tcp://HOST:P``: ``P`` and
    ``P+1``.

    Raises:
        ValueError: not ``tcp://HOST:PORT`` with a port below 65535 (names the fix).
    """
    head, _, port = address.rpartition(":")
    if address.startswith("tcp://") and port.isdigit() and int(port) == 65535:
        raise ValueError(f"policy_service: {address!r}: port 65535 leaves no PORT+1 for the "
                         "snapshots (ports go up to 65535): use a PORT up to 65534, e.g. "
                         "tcp://10.0.0.5:5600")
    if not address.startswith("tcp://") or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"policy_service: {address!r} is not tcp://HOST:PORT (records on PORT, "
                         "snapshots on PORT+1), e.g. tcp://10.0.0.5:5600")
    return address, f"{head}:{int(port) + 1}"


class SnapshotReader:
    """The service's messages as whole snapshots: a delta applied on the filter of its ``base``
    (``apply_delta``); a delta whose base was missed (or a bad one) keeps the last filter of
    the same run until the next whole snapshot (``missed``); with no filter of that run, none
    (``bits`` 0: every chunk saved). One thread."""

    def __init__(self) -> None:
        # The filter deltas apply on: (service run, version, bits, bloom).
        self._filter: tuple[str, int, int, bytes] = ("", 0, 0, b"")
        self.missed = 0

    def take(self, snap: AdmissionSnapshot) -> AdmissionSnapshot:
        """``snap`` (whole or a delta) as a whole snapshot of its version."""
        if not snap.base:
            self._filter = (snap.service, snap.version, snap.bits, snap.bloom)
            return snap
        run, version, bits, bloom = self._filter
        if run == snap.service and version == snap.base and bits:
            try:
                bloom = apply_delta(bloom, snap.words, snap.values)
                self._filter = (run, snap.version, bits, bloom)
            except DeltaError:
                self.missed += 1
        else:
            self.missed += 1
            if run != snap.service:
                bits, bloom = 0, b""
        return msgspec.structs.replace(snap, bits=bits, bloom=bloom, base=0, words=b"",
                                       values=b"")
