"""Helpers shared by the admission and eviction tests: chained chunk hashes of toy prompts and
a list-based exact LRU as the reference the policies are checked against."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def chained(ids: Sequence[int]) -> list[str]:
    """Chunk hashes of a prompt made of blocks ``ids``: hash ``k`` names the first k+1 ids
    (32 hex digits, like ``keys.chunk_hashes``)."""
    return [hashlib.sha256(":".join(map(str, ids[: k + 1])).encode()).hexdigest()[:32]
            for k in range(len(ids))]


def lru_insert(lru: list[str], hashes: Sequence[str], admitted: int) -> None:
    """Refresh every hash ``lru`` (least recent first) holds, append the first ``admitted`` it
    does not, in prompt order; the caller trims to its capacity."""
    for i, h in enumerate(hashes):
        if h in lru:
            lru.remove(h)
            lru.append(h)
        elif i < admitted:
            lru.append(h)
