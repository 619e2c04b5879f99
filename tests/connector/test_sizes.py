"""One size parser for the engine and ``kvpool-config``: Mooncake's grammar (bytes, or a number and
B/K/KB/M/MB/G/GB/T/TB in any case, powers of 1024), and a property test that the validator's size
check and the Mooncake backend's ``MooncakeConfig.load`` accept and reject exactly the same
strings, with the same number of bytes. The two strings of issue 9 (``"1Gi"`` passed the
validator but the engine refused it; ``"1iB"`` was read as 1 byte at runtime) are refused by
both."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_config.rules import check_global_segment_size, check_size
from kvpool_connector.backends.mooncake import MooncakeConfig
from kvpool_connector.sizes import parse_size

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
}
_MIN_SEGMENT = 16 << 20
_SPACE = st.text(" \t\r\n", max_size=2)


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


@st.composite
def _valid(draw: st.DrawFn) -> tuple[str, int]:
    """A size string in Mooncake's grammar and its bytes, worked out independently."""
    whole = draw(st.text("0123456789", max_size=12))
    fraction = draw(st.none() | st.text("0123456789", min_size=0 if whole else 1, max_size=6))
    number = (whole or "0") if fraction is None else f"{whole}.{fraction}"
    unit = draw(st.sampled_from(sorted(_UNITS)))
    cased = "".join(c.upper() if draw(st.booleans()) else c for c in unit)
    text = draw(_SPACE) + number + draw(_SPACE) + cased + draw(_SPACE)
    return text, math.floor(Fraction(number) * _UNITS[unit])


_SIZE_LIKE = st.one_of(
    _valid().map(lambda pair: pair[0]),
    # Near misses: the characters sizes are made of, in any order.
    st.text(" \t0123456789.+-_eEiIbBkKmMgGtTpPxX", max_size=10),
    st.text(max_size=8),
    st.sampled_from(["1Gi", "1GiB", "1iB", "1 GiB", "1e3GB", "-1GB", "inf", "1PB", "1 G B"]),
)


def _runtime(field: str, value: Any, monkeypatch: pytest.MonkeyPatch) -> int | None:
    """``field`` of the Mooncake backend's config loaded with ``value``; None when refused."""
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", raising=False)
    inline = {"master_server_address": "127.0.0.1:50051", field: value}
    try:
        config = MooncakeConfig.load({"mooncake": inline})
    except ValueError:
        return None
    size: int = getattr(config, field)
    return size


def _assert_agree(value: Any) -> None:
    with pytest.MonkeyPatch.context() as mp:
        buffer = _runtime("local_buffer_size", value, mp)
        segment = _runtime("global_segment_size", value, mp)
    checked, finding = check_size("global_segment_size", value, path="$.x", rule="segment-size")
    assert checked == buffer
    assert (finding is None) == (buffer is not None)
    # The segment has the runtime's minimum on top of the grammar (0 = standalone).
    if buffer is None or 0 < buffer < _MIN_SEGMENT:
        assert segment is None
    else:
        assert segment == buffer
    rule = check_global_segment_size(value, path="$.x", fabric_mem=False, npu=False)
    unreadable = rule is not None and "is not a size" in rule.message
    assert unreadable == (buffer is None)


@settings(max_examples=400, deadline=None, database=None)
@given(_valid())
def test_generated_sizes_have_mooncakes_value(pair: tuple[str, int]) -> None:
    text, expected = pair
    assert parse_size(text) == expected
    _assert_agree(text)


@settings(max_examples=600, deadline=None, database=None)
@given(_SIZE_LIKE)
def test_validator_and_runtime_agree_on_every_string(text: str) -> None:
    _assert_agree(text)


@settings(max_examples=200, deadline=None, database=None)
@given(st.integers(min_value=-(1 << 62), max_value=1 << 62) | st.floats() | st.booleans())
def test_validator_and_runtime_agree_on_numbers(value: float) -> None:
    _assert_agree(value)


@settings(max_examples=300, deadline=None, database=None)
@given(_valid())
def test_whole_takes_exactly_the_sizes_of_whole_bytes(pair: tuple[str, int]) -> None:
    """``whole=True`` (``staging_buffer``) refuses a size with a fraction of a byte instead of
    truncating it ("1.5" was 1 byte), and takes every other with the same bytes."""
    text, _ = pair
    parts = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    assert parts is not None
    exact = Fraction(parts[1]) * _UNITS[parts[2].lower()]
    if exact.denominator == 1:
        assert parse_size(text, whole=True) == exact
    else:
        with pytest.raises(ValueError, match="is not a whole number of bytes"):
            parse_size(text, whole=True)


@pytest.mark.parametrize(("value", "expected"), [(2.0, 2), (1.5, None), ("1.5", None),
                                                  ("0.1K", None), ("1.5K", 1536), (1024, 1024)])
def test_whole_numbers(value: float | str, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match=r'is not a whole number of bytes.*"256MB"'):
            parse_size(value, whole=True)
    else:
        assert parse_size(value, whole=True) == expected
