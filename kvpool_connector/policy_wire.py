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
  viewer and operator keys may subscribe.

Sizes are bounded on decode (``MAX_BATCH_BYTES``, ``MAX_RECORDS``, ``MAX_HASHES``): a batch
over them is dropped whole and counted against its key.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "MAX_BATCH_BYTES",
    "MAX_HASHES",
    "MAX_RECORDS",
    "SNAPSHOT_EVERY_S",
    "WIRE_VERSION",
    "AdmissionSnapshot",
    "PolicyLayout",
    "PolicyRecord",
    "RecordBatch",
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
