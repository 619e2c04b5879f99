"""The hot loops of ``kvpool_connector.keys``, in C (``_chunk_hash.c``)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def token_bytes(token_ids: Sequence[int], count: int, /) -> bytes:
    """The first ``count`` token ids as uint32 little-endian, 4 bytes each.

    Raises:
        OverflowError: an id outside [0, 2**32).
        TypeError: an id that is not an int (nor has ``__index__``).
        ValueError: ``count`` outside [0, ``len(token_ids)``].
    """

def prefixed_keys(prefixes: Sequence[str], names: Sequence[str],
                  suffixes: Sequence[str] | None = None, /) -> list[str]:
    """``[p + n + s for n in names for p in prefixes for s in suffixes]`` (``suffixes``
    ``None``: ``[""]``), one allocation and copy per key.

    Raises:
        TypeError: an item that is not a ``str``.
    """

def sha256_chain(data: Buffer, step: int, parent: Buffer, /) -> tuple[list[str], bytes]:
    """Chained SHA-256 over the whole ``step``-byte chunks of ``data``.

    Chain value ``i`` is SHA-256 of chain value ``i - 1`` followed by chunk ``i``; chain value
    ``-1`` is ``parent``. A trailing partial chunk is not hashed. Inputs of 1 MiB or more are
    hashed with the GIL released.

    Returns:
        ``(names, values)``: one 32-hex-digit name per chunk (its chain value's first 16
        bytes) and the chain values, 32 bytes each, concatenated.

    Raises:
        ValueError: ``step`` <= 0.
    """
