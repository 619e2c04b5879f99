"""Byte sizes as Mooncake configs write them: ``1073741824``, ``"1GB"``, ``"512 mb"``, ``"1.5G"``.

The one size parser of the project: the Mooncake backend reads ``global_segment_size`` and
``local_buffer_size`` with it (``MooncakeConfig``) and ``kvpool-config`` checks them with it, so a
size the validator accepts is one the engine accepts, with the same number of bytes.

The grammar is Mooncake's own, as its two readers of these strings define it (repository
``kvcache-ai/Mooncake``): ``_parse_segment_size`` in ``mooncake-wheel/mooncake/mooncake_config.py``
(``MooncakeConfig.from_file`` / ``load_from_env``: mooncake.json and ``MOONCAKE_*`` variables)
and ``string_to_byte_size`` in ``mooncake-store/include/utils.h`` (``mooncake_client
--global_segment_size``)::

    size   = space* number space* [unit] space*        space = " " | TAB | CR | LF
    number = digit+ ["." digit*] | "." digit+
    unit   = B | K | KB | M | MB | G | GB | T | TB       (any letter case)

``K``, ``M``, ``G`` and ``T`` are powers of 1024 (``"1GB"`` is 2**30 bytes), with or without the
``B``. There is no ``i``: ``"1GiB"`` and ``"1Gi"`` are refused, as Mooncake refuses them. Mooncake
reads the number with ``float()`` / ``std::stod``, which also take a sign, an exponent, ``inf``
and ``nan``; those are refused here, since a size is never negative and no config writes them.
The result is exact and truncated to whole bytes (``"1.5K"`` is 1536, ``"0.1K"`` is 102), as
Mooncake truncates.

:data:`SIZE_PATTERN` is the grammar as a regular expression that both Python ``re`` and JSON
Schema (ECMA-262) read, so the published schema checks sizes the same way.
"""

from __future__ import annotations

import math
import re

__all__ = ["SIZE_PATTERN", "parse_size"]

SIZE_PATTERN = r"^[ \t\r\n]*([0-9]+(\.[0-9]*)?|\.[0-9]+)[ \t\r\n]*([KMGTkmgt]?)([Bb]?)[ \t\r\n]*$"
"""A size string (see the module docstring); group 1 is the number, group 3 the unit letter."""

_SIZE = re.compile(SIZE_PATTERN)
_MULTIPLIER = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_FORMS = (
    'write a whole number of bytes (1073741824) or a number and a unit B, K, KB, M, MB, G, GB, '
    'T or TB in any case, e.g. "1GB", "512 MB", "1.5g" (1K = 1024 bytes; no KiB/GiB)'
)


def parse_size(value: int | float | str, *, whole: bool = False) -> int:
    """Bytes in a size as a Mooncake config writes it.

    Args:
        value: a byte count (``int``; a ``float`` is truncated) or a string in the grammar of
            the module docstring, e.g. ``"1GB"``, ``" 512 mb "``, ``"1.5G"``, ``"3355443200"``.
        whole: refuse a size that is not a whole number of bytes (``1.5``, ``"1.5"``,
            ``"0.1K"``) instead of truncating it. Mooncake truncates, so its own keys keep the
            default; a key of this project's own (``staging_buffer``) need not take ``1.5`` as
            1 byte.

    Returns:
        The size in bytes (>= 0).

    Raises:
        ValueError: a bool, a negative or non-finite number, another type, or a string outside
            the grammar (``"1GiB"``, ``"1 gallon"``, ``"-1GB"``, ``"1e9"``); the message names
            the value and the accepted forms; with ``whole``, also a size with a fraction of
            a byte.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{value!r} is not a size: {_FORMS}")
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"{value!r} is not a size: a byte count is a number >= 0")
        if whole and value != int(value):
            raise ValueError(_not_whole(value))
        return int(value)
    match = _SIZE.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not a size: {_FORMS}")
    integer, _, fraction = match.group(1).partition(".")
    # Scaled to an integer so that long byte counts and fractions stay exact.
    scaled = int((integer or "0") + fraction) * _MULTIPLIER[match.group(3).upper()]
    if whole and scaled % 10 ** len(fraction):
        raise ValueError(_not_whole(value))
    return scaled // 10 ** len(fraction)


def _not_whole(value: float | str) -> str:
    """The refusal of a size with a fraction of a byte (``parse_size(..., whole=True)``)."""
    return (f"{value!r} is not a whole number of bytes: write a byte count without a fraction "
            'or a size with a unit, e.g. "256MB"')
