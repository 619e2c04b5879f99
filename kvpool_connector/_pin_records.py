"""The pin records of one layout in the pool, versioned so that no write is lost (issue 40).

Mooncake has no compare-and-swap, but its ``put`` creates only: a put of a key that exists
leaves the value there (the master answers OBJECT_ALREADY_EXISTS, -705, and admits one of
concurrent writers, ``master_service.cpp`` ``PutStart``; the Python client still returns 0, seen
with mooncake-transfer-engine 0.3.13.post1). So every version of a layout's records is a key of
its own, ``<record key>@v<seq>``, written once with ``put`` (hard-pinned, never evicted) and
read back: the writer whose nonce is in it won; a loser reads the new version, applies its
change to it and tries ``seq + 1`` (``RecordStore.update``). Two concurrent pins are both kept,
each unpinnable.

``<record key>@head`` holds the last seq written (a hint, upserted: any pool client can move
it): a reader probes forward from the version it read last, or from the head when the version
it names exists, ``PROBE`` keys per ``batch_is_exist`` and ``MAX_PROBES`` calls a read. A
version is asked its size first (``get_size``): one over ``MAX_RECORD_BYTES``, or not records,
or over ``MAX_RECORD_HASHES`` hashes, is skipped (the newest good one under it is read) and the
next write supersedes it; a version found before that is gone reads as unreadable, never as
"no pins" (round 6: planted records, ``tests/connector/test_pin_records_forged.py``). With a
secret (``pins.pin_secret``, ``KVPOOL_PIN_SECRET``) every version is signed (``Records.mac``)
and only versions signed with it for their key and seq are read. A worker polls
``<record key>@v<seq + 1>`` with one ``batch_is_exist`` of one key (``RecordStore.newer``):
a master RPC and no value moved, the cost of learning a new pin within a poll. The writer of
``seq`` removes versions ``seq - KEEP - PROBE .. seq - KEEP`` (unforced: one a reader leases is
left for the next write). The record key itself holds the records of the unversioned format
(before issue 40): read as version 0 when no version exists, so pins made before survive.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, Protocol

import msgspec

from kvpool_agent.vocabulary import ErrorCode, error_name
from kvpool_connector.backends.base import BackendError

__all__ = ["KEEP", "MAX_PROBES", "MAX_RECORD_BYTES", "MAX_RECORD_HASHES", "PROBE",
           "RECORDS_VERSION", "Newest", "PinRecord", "RecordBackend", "RecordStore", "Records",
           "RecordsTooLarge", "decode"]

log = logging.getLogger(__name__)

KEEP = 2
"""Versions kept, the newest included (a reader that saw the last head still finds one)."""

PROBE = 8
"""Versions one ``batch_is_exist`` probes past the head hint, and removed per write."""

MAX_PROBES = 4
"""``batch_is_exist`` calls one read probes forward at most (a planted chain of versions costs
a reader no more; it goes on from there at its next read)."""

MAX_RECORD_HASHES = 65_536
"""Chunk hashes one version holds at most, all pins together (~4.4 MB of JSON)."""

MAX_RECORD_BYTES = 6 << 20
"""Bytes of one version at most: a larger one is refused when written and skipped unread
(``get_size`` first) when read; under the smallest reader's buffer (the policy service's
16 MB)."""

WRITE_DEADLINE_S = 10.0
"""How long ``update`` tries (s) before it gives up: a writer whose put never ended holds its
version until the master discards it (``put_start_discard_timeout_sec``, 30 s by default)."""

READBACK_WAIT_S = 0.02
"""Pause (s) before a version whose put is still running is read again."""

RECORDS_VERSION = 2


class PinRecord(msgspec.Struct, frozen=True):
    """One pin as the records store it: ``hashes`` its chunks, ``expires_ms`` a soft pin's end
    (epoch ms; 0 for hard). A hard pin's chunks already in the pool hold a soft pin
    (Mooncake cannot hard-pin an existing value) set at ``renewed_ms`` (epoch ms) for
    ``renew_ttl_ms``: set again before it lapses (``pins.Pins.poll``)."""

    pin_id: str
    mode: Literal["soft", "hard"]
    ttl_ms: int
    tokens: int
    hashes: list[str]
    expires_ms: float
    renewed_ms: float = 0.0
    renew_ttl_ms: int = 0


class Records(msgspec.Struct, frozen=True):
    """One version of a layout's records; ``w`` the writer's nonce (the read-back check)."""

    v: int
    pins: list[PinRecord]
    seq: int = 0
    w: str = ""
    mac: str = ""
    """HMAC-SHA256 (hex) of the record key and these records with ``mac`` empty, with the
    fleet's pin secret (``RecordStore`` ``secret``); empty when unsigned."""


class RecordBackend(Protocol):
    """What the records need of a store client (``MooncakeBackend``)."""

    def batch_exists(self, keys: Sequence[str]) -> list[int]: ...

    def batch_remove(self, keys: Sequence[str]) -> list[int]: ...

    def read_record(self, key: str) -> bytes: ...

    def record_size(self, key: str) -> int: ...

    def write_record(self, key: str, data: bytes) -> int: ...

    def create_record(self, key: str, data: bytes) -> int: ...


class RecordsTooLarge(ValueError):
    """Records over ``MAX_RECORD_HASHES`` hashes or ``MAX_RECORD_BYTES`` bytes: not written."""


class Newest(NamedTuple):
    """What ``RecordStore.latest`` found: ``top`` the newest version that exists (the next
    write is ``top + 1``), ``seq`` the newest version at or below it that reads as records and
    ``data`` its bytes. ``data`` ``None``: nothing readable now (``final``: the versions found
    are oversized or not records, waiting will not help; else a put still runs, or the
    version this reader read last is gone with none found after it)."""

    top: int
    seq: int
    data: bytes | None
    final: bool = False


_BAD = object()
"""A version that will never read as records (oversized or undecodable)."""


class RecordStore:
    """The versions of one layout's pin records at ``key`` (module docstring)."""

    def __init__(self, backend: RecordBackend, key: str, secret: bytes | None = None) -> None:
        self.backend, self.key, self.secret = backend, key, secret or None

    def _mac(self, records: Records) -> str:
        """The HMAC of ``records`` as they decode (an int in a float field reads back as a
        float: the signer and the reader sign the same bytes)."""
        assert self.secret is not None
        canonical = decode(msgspec.json.encode(msgspec.structs.replace(records, mac="")))
        body = msgspec.json.encode(canonical)
        return hmac.new(self.secret, self.key.encode() + b"\n" + body, hashlib.sha256).hexdigest()

    def _bad(self, data: bytes, seq: int) -> bool:
        """Whether version ``seq``'s ``data`` is not records, over ``MAX_RECORD_HASHES``
        hashes, or, with a secret, not signed by it for this key and seq (an unsigned or
        another layout's or version's records: planted)."""
        try:
            records = decode(data)
        except msgspec.DecodeError:
            return True
        if sum(len(p.hashes) for p in records.pins) > MAX_RECORD_HASHES:
            return True
        if self.secret is None:
            return False
        return records.seq != seq or not hmac.compare_digest(records.mac, self._mac(records))

    def version_key(self, seq: int) -> str:
        return f"{self.key}@v{seq}"

    @property
    def head_key(self) -> str:
        return f"{self.key}@head"

    def newer(self, seq: int) -> bool:
        """Whether a version after ``seq`` exists (one ``batch_is_exist`` of one key)."""
        return self._exists([self.version_key(seq + 1)]) == [1]

    def _head(self) -> int:
        """The head hint, -1 when there is none or it is not a seq (any pool client can upsert
        it: only a hint, used when the version it names exists)."""
        data = self._get(self.head_key, 32)
        if not isinstance(data, bytes) or not data:
            return -1
        try:
            return max(0, int(data))
        except ValueError:
            return -1

    def _scan(self, start: int) -> list[int]:
        """The versions at or after ``start``, probed forward ``PROBE`` keys per
        ``batch_is_exist``, at most ``MAX_PROBES`` of them (a planted chain costs no more)."""
        seen: set[int] = set()
        for _ in range(MAX_PROBES):
            probe = [start + i for i in range(PROBE)]
            found = self._exists([self.version_key(s) for s in probe])
            hit = [s for s, rc in zip(probe, found, strict=True) if rc == 1]
            seen.update(hit)
            if not hit or hit[-1] < probe[-1]:
                break
            start = probe[-1]
        return sorted(seen)

    def latest(self, since: int = -1) -> Newest:
        """The newest version that reads as records, probed forward from ``since`` (the
        version this reader applied last; -1: none), or from the head hint when the version it
        names exists and is newer. A head naming no version is ignored. Versions over
        ``MAX_RECORD_BYTES`` (asked with ``get_size`` before a read) or not records are
        skipped: the newest good one before them is the answer (``top`` stays the newest, so
        the next write supersedes them). No version found: the unversioned record (seq 0)
        for a reader that never read one and found no head; ``data=None`` otherwise (never
        "no pins": the pins read last hold).

        Raises:
            BackendError: the store failed.
        """
        start = max(since, 0)
        head = self._head()
        read: dict[int, bytes | object] = {}
        if head > start and self._exists([self.version_key(head)]) == [1]:
            read[head] = self._get(self.version_key(head), MAX_RECORD_BYTES)
            good = read[head]
            if isinstance(good, bytes) and good and not self._bad(good, head):
                start = head  # a head naming a version that is not records is ignored too
        seen = self._scan(start)
        if not seen:
            if since > 0 or head >= 0:
                return Newest(start, start, None)  # what was read last is gone: unreadable
            if self.secret is not None:
                return Newest(0, 0, b"")  # the unversioned format is unsigned: not read
            data = self._get(self.key, MAX_RECORD_BYTES)
            if data is _BAD or (isinstance(data, bytes) and data and self._bad(data, 0)):
                return Newest(0, 0, None, final=True)
            return Newest(0, 0, data if isinstance(data, bytes) else b"")
        top = seen[-1]
        for s in reversed(seen):
            data = read[s] if s in read else self._get(self.version_key(s), MAX_RECORD_BYTES)
            if data is _BAD:
                continue
            if not data:
                if s == top and not self._wait_readable(s):
                    return Newest(top, top, None)  # its put still runs
                continue  # removed since the probe, or not put yet
            assert isinstance(data, bytes)
            if self._bad(data, s):
                continue
            return Newest(top, s, data)
        return Newest(top, top, None, final=True)

    def _exists(self, keys: list[str]) -> list[int]:
        """``batch_is_exist``: 1 or 0 per key.

        Raises:
            BackendError: another code (RPC_FAIL, INTERNAL_ERROR: the master did not answer).
                Read as "not there", a dead master's answer was "no pins" (measured on 0.3.13:
                the empty set), which frees every pinned chunk to eviction.
        """
        found = self.backend.batch_exists(keys)
        bad = [rc for rc in found if rc not in (0, 1)]
        if bad:
            raise BackendError(f"pin records at {self.key}: batch_is_exist answered "
                               f"{error_name(bad[0])}", bad[0])
        return found

    def _size(self, key: str) -> int:
        """``get_size`` of ``key``; 0 when there is none (OBJECT_NOT_FOUND) or its put still
        runs (REPLICA_IS_NOT_READY).

        Raises:
            BackendError: another negative code (the master did not answer: ``_exists``).
        """
        size = self.backend.record_size(key)
        if size in (ErrorCode.OBJECT_NOT_FOUND, ErrorCode.REPLICA_IS_NOT_READY):
            return 0
        if size < 0:
            raise BackendError(f"pin records at {self.key}: get_size of {key} answered "
                               f"{error_name(size)}", size)
        return size

    def _get(self, key: str, most: int) -> bytes | object:
        """The value at ``key``: ``b""`` none (or not readable yet), ``_BAD`` over ``most``
        bytes (``get_size`` first: a value over the reader's buffer never reads).

        Raises:
            BackendError: the master did not answer (``_size``).
        """
        size = self._size(key)
        if size > most:
            log.warning("kvpool pins: %s holds %d bytes, over %d: skipped", key, size, most)
            return _BAD
        return self.backend.read_record(key) if size > 0 else b""

    def _wait_readable(self, seq: int) -> bool:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            time.sleep(READBACK_WAIT_S)  # its put is still running (REPLICA_IS_NOT_READY)
            if self._size(self.version_key(seq)) > 0:
                return True
        return False

    def read(self, seq: int) -> bytes:
        """The bytes of version ``seq`` (``b""``: gone, still being put, or oversized)."""
        data = self._get(self.version_key(seq), MAX_RECORD_BYTES)
        return data if isinstance(data, bytes) else b""

    def _read(self, seq: int) -> bytes:
        end = time.monotonic() + 1.0
        while not (data := self.read(seq)) and time.monotonic() < end:
            time.sleep(READBACK_WAIT_S)  # its put is still running (REPLICA_IS_NOT_READY)
        return data

    def update(self, change: Callable[[int, bytes | None], list[PinRecord] | None], *,
               since: int = -1) -> int | None:
        """Write ``change(top, newest good bytes)`` as version ``top + 1``, again on the newer
        version while another writer wins; ``since`` the version the caller applied last
        (``latest``). The bytes are ``None`` when every version found is oversized or not
        records and the caller read one before (``since >= 0``): ``change`` builds on what it
        holds, and the write supersedes them (with ``since < 0`` it waits, then raises).
        ``change`` returns ``None`` to write nothing, or raises to give up. Returns the seq
        written, ``None`` when nothing was.

        Raises:
            RecordsTooLarge: the records ``change`` made are over the bounds (not written).
            BackendError: the store failed, or no write won within ``WRITE_DEADLINE_S``.
        """
        end = time.monotonic() + WRITE_DEADLINE_S
        seq, data = self._newest(end, since)
        while True:
            pins = change(seq, data)
            if pins is None:
                return None
            hashes = sum(len(p.hashes) for p in pins)
            records = Records(RECORDS_VERSION, pins, seq + 1, secrets.token_hex(8))
            if self.secret is not None:
                records = msgspec.structs.replace(records, mac=self._mac(records))
            body = msgspec.json.encode(records)
            if hashes > MAX_RECORD_HASHES or len(body) > MAX_RECORD_BYTES:
                raise RecordsTooLarge(
                    f"pin records at {self.key}: {len(pins)} pins, {hashes} hashes, "
                    f"{len(body):,} bytes: over {MAX_RECORD_HASHES} hashes or "
                    f"{MAX_RECORD_BYTES:,} bytes")
            rc = self.backend.create_record(self.version_key(seq + 1), body)
            if rc < 0:
                raise BackendError(f"pin records {self.version_key(seq + 1)} not written", rc)
            if self._read(seq + 1) == body:
                self._settle(seq + 1)
                return seq + 1
            if time.monotonic() > end:
                raise BackendError(f"pin records at {self.key}: no write won in "
                                   f"{WRITE_DEADLINE_S:.0f} s (another writer's put hangs)")
            since = seq
            seq, data = self._newest(end, since)  # another writer won: change its records

    def _newest(self, end: float, since: int) -> tuple[int, bytes | None]:
        """``latest``, waiting out a version not readable yet: a change made without its
        records would drop its pins. Versions that never read (``final``) give ``None``."""
        while True:
            n = self.latest(since)
            if n.data is not None or (n.final and since >= 0):
                # Every version found never reads: a writer that read one before builds on
                # what it holds; one that never did would drop the pins, and waits.
                return n.top, n.data
            if time.monotonic() > end:
                raise BackendError(f"pin records at {self.key}: version {n.top} not readable")
            time.sleep(READBACK_WAIT_S)

    def _settle(self, seq: int) -> None:
        """After version ``seq`` is in: the head hint, and the versions no reader needs."""
        self.backend.write_record(self.head_key, str(seq).encode())
        old = [self.version_key(s) for s in range(max(1, seq - KEEP - PROBE), seq - KEEP + 1)]
        if old:
            self.backend.batch_remove(old)  # leased ones stay for the next write


def decode(data: bytes) -> Records:
    """One version's records (the unversioned format reads as seq 0).

    Raises:
        msgspec.DecodeError: not records.
    """
    return msgspec.json.decode(data, type=Records)
