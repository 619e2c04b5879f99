"""Optional per-value integrity check (``kv_connector_extra_config.checksum``, off by default).

With it on, every pool value is its KV bytes followed by ``CHECKSUM_BYTES`` bytes: the XXH3-64
digest of its key and those KV bytes (``xxhash``), written by the saver and verified by the
loader after the bytes landed. A value whose digest does not match is a load error
(``CHECKSUM_MISMATCH``): its blocks are reported through ``get_block_ids_with_load_errors``
and recomputed, never used.

The digests travel zero-copy like the KV: each batch call gets one extra byte range per key,
pointing into ``DigestSlots``, a small buffer registered with the backend. The KV bytes are
read in place, so the caches must be host memory (vLLM's CPU backend); ``KVPoolWorker`` refuses
the option for device caches. Whether values carry a digest is part of the layout digest
(``LayoutFacts.checksum``): engines with it on and off never read each other's values.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import xxhash

__all__ = ["CHECKSUM_BYTES", "CHECKSUM_NAME", "DigestSlots", "digest_of"]

CHECKSUM_BYTES = 8
"""Bytes of the digest appended to each value (XXH3-64)."""

CHECKSUM_NAME = "xxh3-64+key"
"""``LayoutFacts.checksum`` of values that carry a digest."""


def digest_of(key: str, addrs: Sequence[int], sizes: Sequence[int]) -> bytes:
    """XXH3-64 digest (``CHECKSUM_BYTES`` bytes) of the pool key ``key`` followed by the host
    memory ranges, in order; the bytes are read in place (no copy). The key is hashed in so a
    whole value (bytes and digest) found under another key than its own does not check."""
    h = xxhash.xxh3_64(key.encode())
    for addr, size in zip(addrs, sizes, strict=True):
        h.update((ctypes.c_char * size).from_address(addr))
    return h.digest()


class DigestSlots:
    """``capacity`` digest slots of ``CHECKSUM_BYTES`` bytes in one host buffer, the range a
    batch call adds per key (slot ``i`` for the batch's ``i``-th key).

    Args:
        capacity: keys per batch call at most (callers split larger batches).

    The caller registers ``(addr, nbytes)`` with its backend once.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._buf = torch.zeros(capacity * CHECKSUM_BYTES, dtype=torch.uint8)
        self.addr = self._buf.data_ptr()
        self.nbytes = capacity * CHECKSUM_BYTES

    def slot(self, i: int) -> int:
        """Address of slot ``i``."""
        return self.addr + i * CHECKSUM_BYTES

    def write(self, i: int, digest: bytes) -> None:
        """Put ``digest`` into slot ``i`` (before a put)."""
        ctypes.memmove(self.slot(i), digest, CHECKSUM_BYTES)

    def read(self, i: int) -> bytes:
        """The digest a get wrote into slot ``i``."""
        return ctypes.string_at(self.slot(i), CHECKSUM_BYTES)
