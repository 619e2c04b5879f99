"""Token ids for trace requests, derived from their ``hash_ids``.

The Mooncake traces publish no text, only one id per 512-token block. Each id becomes 512 token
ids drawn from a numpy generator seeded with the id, so equal ids give equal blocks in every
process, and equal leading ids give equal chained chunk hashes (``kvpool_connector.keys``).
A partial last block takes the first ``input_length % 512`` tokens of its id's block.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from kvpool_replay._trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["DEFAULT_VOCAB_SIZE", "block_tokens", "request_tokens"]

DEFAULT_VOCAB_SIZE = 32_000
"""Token ids are drawn from ``[0, vocab_size)``; pick the model's vocabulary for real engines."""


@lru_cache(maxsize=8192)
def _block(hash_id: int, vocab_size: int) -> np.ndarray:
    # PCG64 seeded by the id: same stream on every platform and process, independent of
    # PYTHONHASHSEED.
    rng = np.random.default_rng(hash_id)
    arr = rng.integers(0, vocab_size, size=TRACE_BLOCK_TOKENS, dtype=np.int64)
    arr.flags.writeable = False
    return arr


def block_tokens(hash_id: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> np.ndarray:
    """The 512 token ids (int64 array, read-only) of trace block ``hash_id``.

    Raises:
        ValueError: ``hash_id`` < 0 or ``vocab_size`` < 2.
    """
    if hash_id < 0:
        raise ValueError(f"hash_id must be >= 0, got {hash_id}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return _block(hash_id, vocab_size)


def request_tokens(
    req: TraceRequest | tuple[Sequence[int], int], vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[int]:
    """The prompt token ids of a trace request: ``input_length`` ints.

    Args:
        req: a ``TraceRequest`` or ``(hash_ids, input_length)``.
        vocab_size: ids are in ``[0, vocab_size)``.

    Raises:
        ValueError: ``hash_ids`` cannot cover ``input_length`` tokens.
    """
    hash_ids: Sequence[int]
    if isinstance(req, TraceRequest):
        hash_ids, n = req.hash_ids, req.input_length
    else:
        hash_ids, n = req
    if len(hash_ids) * TRACE_BLOCK_TOKENS < n:
        raise ValueError(
            f"{len(hash_ids)} hash_ids cover {len(hash_ids) * TRACE_BLOCK_TOKENS} tokens, "
            f"input_length is {n}"
        )
    need = -(-n // TRACE_BLOCK_TOKENS)
    parts = [block_tokens(h, vocab_size) for h in hash_ids[:need]]
    return np.concatenate(parts)[:n].tolist()
