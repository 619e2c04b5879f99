"""The pool-wide eviction order on disk, so a restarted service keeps it (issue 40).

Without it a restarted ``kvpool-policy serve`` knows the pool's chunks only from the master's
``/get_all_keys`` listing, in the listing's order, which says nothing of their use: it then
evicts chunks the fleet used a second before its restart as readily as cold ones.
``kvpool-policy serve --order-file PATH`` writes the order (``PolicyCore.order``: unpinned
resident chunks, least recently used first, the chunks found at start whose layout no record
named yet before them) every ``--order-every-s`` seconds (default ``ORDER_EVERY_S``) and at a
clean exit, and reads it at start (``order_found``):

* chunks the pool holds that the file names keep the file's order;
* chunks the pool holds that the file does not name are newer than every chunk in it (saved
  after its last write, or while the service was down and engines saved everything) and go
  after them, in the listing's order;
* chunks the file names that the pool no longer holds are dropped.

A file that cannot be read, is not this format or is of another version is logged in one line
and the service starts in listing order, as without a file. Since only chunks the pool holds
are ordered, a file can change which of them go first, never what the service holds.

Format: msgpack, ``OrderFile`` (a layout digest once, each chunk as its digest's index and its
hash). Size: 68 bytes a chunk with sha256 hashes (the connector's default ``hash_algo``; 36
bytes with ``xxh3_128``): 36 MB for 524,288 chunks (a 1 TiB pool of 2 MiB chunks), encoded in
0.15 s on this machine; encoded and written on a thread of its own (``OrderWriter``; the
service's loop only copies the order) to a temporary file renamed over the last one, mode
0600.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import msgspec

from kvpool_policy.policy import PolicyKey

__all__ = ["ORDER_EVERY_S", "ORDER_VERSION", "OrderFile", "OrderWriter", "order_found",
           "read_order"]

logger = logging.getLogger("kvpool.policy")

ORDER_EVERY_S = 30.0
"""Seconds between two writes of the order at most (``--order-every-s``): what a SIGKILLed
service loses of it at most (chunks saved since then count as newer than every chunk in it)."""

ORDER_VERSION = 1


class OrderFile(msgspec.Struct, array_like=True, frozen=True):
    """The order on disk.

    Attributes:
        v: ``ORDER_VERSION``.
        written_ms: when it was written (epoch ms).
        digests: the layout digests its chunks name, each once.
        chunks: ``(index into digests, chunk hash)``, least recently used first.
    """

    v: int
    written_ms: float
    digests: list[str]
    chunks: list[tuple[Annotated[int, msgspec.Meta(ge=0)], str]]


def _encode(order: Sequence[PolicyKey]) -> bytes:
    index: dict[str, int] = {}
    chunks = [(index.setdefault(d, len(index)), h) for d, h in order]
    return msgspec.msgpack.encode(OrderFile(v=ORDER_VERSION, written_ms=time.time() * 1e3,
                                            digests=list(index), chunks=chunks))


def read_order(path: Path) -> list[PolicyKey]:
    """The order ``path`` holds, least recently used first; ``[]`` for no file, and for a
    file that cannot be read or decoded or is of another version (one line logged)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("kvpool policy: order file %s not read (%s): the pool's chunks start "
                       "in the listing's order", path, exc)
        return []
    try:
        body = msgspec.msgpack.decode(raw, type=OrderFile)
        if body.v != ORDER_VERSION:
            raise ValueError(f"version {body.v}, this service reads {ORDER_VERSION}")
        return [(body.digests[i], h) for i, h in body.chunks]
    except (msgspec.DecodeError, ValueError, IndexError) as exc:
        logger.warning("kvpool policy: order file %s ignored (%s): the pool's chunks start in "
                       "the listing's order", path, exc)
        return []


def order_found(found: dict[str, list[str]], order: Sequence[PolicyKey]
                ) -> dict[str, list[str]]:
    """``found`` (digest -> chunk hashes the pool holds, in listing order) with each digest's
    hashes least recently used first by ``order`` (module docstring): those ``order`` names in
    its order, then the others in listing order."""
    rank = {key: i for i, key in enumerate(order)}
    out = {}
    for digest, hashes in found.items():
        known = sorted((h for h in hashes if (digest, h) in rank),
                       key=lambda h: rank[(digest, h)])
        out[digest] = known + [h for h in hashes if (digest, h) not in rank]
    return out


class OrderWriter:
    """Writes the order to ``path`` every ``every_s`` seconds at most, on a thread of its own.

    Args:
        path: the order file (its directory must exist).
        every_s: seconds between two writes at most (> 0).
        clock: monotonic seconds.

    Attributes:
        written: orders written so far; ``failed``: writes that raised (logged).
    """

    def __init__(self, path: Path, every_s: float = ORDER_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.path, self.every_s, self._clock = path, every_s, clock
        self._last = float("-inf")
        self._thread: threading.Thread | None = None
        self.written = self.failed = 0

    def due(self) -> bool:
        """A write is due and the last one finished."""
        busy = self._thread is not None and self._thread.is_alive()
        return not busy and self._clock() - self._last >= self.every_s

    def write_soon(self, order: list[PolicyKey]) -> None:
        """Write ``order`` (a copy the caller no longer changes) on the writer's thread; an
        empty order is not written (a service that could not list the pool at start would
        otherwise drop the last file's order while the pool still holds those chunks) and
        leaves the write due, so the first order the service holds is written at once."""
        if not order:
            return
        self._last = self._clock()
        self._thread = threading.Thread(target=self.write, args=(order,),
                                        name="kvpool-policy-order", daemon=True)
        self._thread.start()

    def write(self, order: Sequence[PolicyKey]) -> None:
        """Write ``order`` now (atomically: a reader sees the last file or this one)."""
        try:
            data = _encode(order)
            fd, tmp = tempfile.mkstemp(prefix=".order-", dir=self.path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            self.failed += 1
            logger.warning("kvpool policy: order file %s not written (%s)", self.path, exc)
            return
        self.written += 1

    def close(self, order: Sequence[PolicyKey], timeout_s: float = 10.0) -> None:
        """Wait for a write in flight (at most ``timeout_s``), then write ``order`` (none when
        empty: an empty order would only drop the last file's)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        if order:
            self.write(order)
