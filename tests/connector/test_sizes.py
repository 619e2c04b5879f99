"""The one size parser: Mooncake's grammar (bytes, or a number and B/K/KB/M/MB/G/GB/T/TB in any
case, powers of 1024); ``"1Gi"`` and ``"1iB"`` are refused."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_connector.sizes import parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1GB", 1 << 30),
        ("1gb", 1 << 30),
        ("1 G", 1 << 30),
        ("512MB", 512 << 20),
        (" 64 mb\n", 64 << 20),
        ("1.5GB", 3 << 29),
        ("0.1K", 102),
        (".5K", 512),
        ("5.", 5),
        ("16B", 16),
        ("2t", 2 << 40),
        ("3355443200", 3355443200),
        ("12345678901234567890123", 12345678901234567890123),
        ("0", 0),
        (1024, 1024),
        (1.9, 1),
    ],
)
def test_mooncake_grammar(value: int | float | str, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "1Gi", "1GiB", "1 GiB", "1iB", "1Ki", "lots", "1PB", "-1GB", "+1GB", "1e9", "inf", "nan",
        "", " ", "1 G B", "1GBB", "1_000", "\uff11GB", "0x10", ".", "1..5G", -5, -0.5,
        float("inf"), float("nan"), True, None, [1],
    ],
)
def test_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"is not a size"):
        parse_size(bad)


def test_message_names_the_value_and_the_forms() -> None:
    with pytest.raises(ValueError) as err:
        parse_size("1Gi")
    assert str(err.value) == (
        "'1Gi' is not a size: write a whole number of bytes (1073741824) or a number and a unit "
        'B, K, KB, M, MB, G, GB, T or TB in any case, e.g. "1GB", "512 MB", "1.5g" '
        "(1K = 1024 bytes; no KiB/GiB)"
    )
