"""The pin records of one layout in the pool, versioned so that no write is lost (issue 40).

Mooncake has no compare-and-swap, but its ``put`` creates only: a put of a key that exists
leaves the value there (the master answers OBJECT_ALREADY_EXISTS, -705, and admits one of
concurrent writers, ``master_service.cpp`` ``PutStart``; the Python client still returns 0, seen
with mooncake-transfer-engine 0.3.13.post1). So every version of a layout's records is a key of
its own, ``<record key>@v<seq>``, written once with ``put`` (hard-pinned, never evicted) and
read back: the writer whose nonce is in it won; a loser reads the new version, applies its
change to it and tries ``seq + 1`` (``RecordStore.update``). Two concurrent pins are both kept,
each unpinnable.

``<record key>@head`` holds the last seq written (a hint, upserted): a reader probes from it
forward with one ``batch_is_exist`` (``PROBE`` keys) to the newest version. A worker polls
``<record key>@v<seq + 1>`` with one ``batch_is_exist`` of one key (``RecordStore.newer``):
a master RPC and no value moved, the cost of learning a new pin within a poll. The writer of
``seq`` removes versions ``seq - KEEP - PROBE .. seq - KEEP`` (unforced: one a reader leases is
left for the next write). The record key itself holds the records of the unversioned format
(before issue 40): read as version 0 when no version exists, so pins made before survive.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import msgspec

from kvpool_connector.backends.base import BackendError

__all__ = ["KEEP", "PROBE", "RECORDS_VERSION", "PinRecord", "RecordBackend", "RecordStore",
           "Records", "decode"]

KEEP = 2
"""Versions kept, the newest included (a reader that saw the last head still finds one)."""

PROBE = 8
"""Versions one ``batch_is_exist`` probes past the head hint, and removed per write."""

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


class RecordBackend(Protocol):
    """What the records need of a store client (``MooncakeBackend``)."""

    def batch_exists(self, keys: Sequence[str]) -> list[int]: ...

    def batch_remove(self, keys: Sequence[str]) -> list[int]: ...

    def read_record(self, key: str) -> bytes: ...

    def write_record(self, key: str, data: bytes) -> int: ...

    def create_record(self, key: str, data: bytes) -> int: ...


class RecordStore:
    """The versions of one layout's pin records at ``key`` (module docstring)."""

    def __init__(self, backend: RecordBackend, key: str) -> None:
        self.backend, self.key = backend, key

    def version_key(self, seq: int) -> str:
        return f"{self.key}@v{seq}"

    @property
    def head_key(self) -> str:
        return f"{self.key}@head"

    def newer(self, seq: int) -> bool:
        """Whether a version after ``seq`` exists (one ``batch_is_exist`` of one key)."""
        return self.backend.batch_exists([self.version_key(seq + 1)]) == [1]

    def latest(self) -> tuple[int, bytes | None]:
        """The newest version's seq and bytes: the unversioned record as seq 0 when no version
        exists (``b""``: no pins; also when no version is left at or after the head hint, as
        when a pool writer removed them); ``None``: the newest version exists but cannot be
        read now (its put still running).

        Raises:
            BackendError: the store failed.
        """
        data = self.backend.read_record(self.head_key)
        try:
            seq = max(0, int(data)) if data else 0
        except ValueError:
            seq = 0  # a head another writer mangled: probed from the start
        while True:
            probe = [seq + i for i in range(PROBE)]
            found = self.backend.batch_exists([self.version_key(s) for s in probe])
            seen = [s for s, rc in zip(probe, found, strict=True) if rc == 1]
            if not seen or seen[-1] < probe[-1]:
                break
            seq = probe[-1]
        if not seen:
            return (seq, self.backend.read_record(self.key)) if seq == 0 else (seq, b"")
        return seen[-1], self._read(seen[-1]) or None

    def read(self, seq: int) -> bytes:
        """The bytes of version ``seq`` (``b""``: gone or still being put)."""
        return self.backend.read_record(self.version_key(seq))

    def _read(self, seq: int) -> bytes:
        end = time.monotonic() + 1.0
        while not (data := self.read(seq)) and time.monotonic() < end:
            time.sleep(READBACK_WAIT_S)  # its put is still running (REPLICA_IS_NOT_READY)
        return data

    def update(self, change: Callable[[int, bytes], list[PinRecord] | None]) -> int | None:
        """Write ``change(seq, newest bytes)`` as version ``seq + 1``, again on the newer
        version while another writer wins. ``change`` returns ``None`` to write nothing, or
        raises to give up. Returns the seq written, ``None`` when nothing was.

        Raises:
            BackendError: the store failed, or no write won within ``WRITE_DEADLINE_S``.
        """
        end = time.monotonic() + WRITE_DEADLINE_S
        seq, data = self._newest(end)
        while True:
            pins = change(seq, data)
            if pins is None:
                return None
            body = msgspec.json.encode(Records(RECORDS_VERSION, pins, seq + 1,
                                               secrets.token_hex(8)))
            rc = self.backend.create_record(self.version_key(seq + 1), body)
            if rc < 0:
                raise BackendError(f"pin records {self.version_key(seq + 1)} not written", rc)
            if self._read(seq + 1) == body:
                self._settle(seq + 1)
                return seq + 1
            if time.monotonic() > end:
                raise BackendError(f"pin records at {self.key}: no write won in "
                                   f"{WRITE_DEADLINE_S:.0f} s (another writer's put hangs)")
            seq, data = self._newest(end)  # another writer won seq + 1: change its records

    def _newest(self, end: float) -> tuple[int, bytes]:
        """``latest``, waiting out a version not readable yet: a change made without its
        records would drop its pins."""
        while True:
            seq, data = self.latest()
            if data is not None:
                return seq, data
            if time.monotonic() > end:
                raise BackendError(f"pin records at {self.key}: version {seq} not readable")
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
