"""The hub's saved-chunk memory (``kvpool_agent._saved_chunks``): a not-in-pool chunk is
evicted, saved under another digest, asked for before and never saved, or a first use, and the
memory's stated error holds."""

from __future__ import annotations

import math
import random

import pytest

from kvpool_agent._saved_chunks import (
    EVICTED,
    FIRST_USE,
    MAX_LAYOUTS,
    MAX_LAYOUTS_PER_ENGINE_KEY,
    NEVER_SAVED,
    OTHER_DIGEST,
    SAVED_SLOTS,
    SavedChunks,
)

A, B = "a" * 12, "b" * 12


def test_reasons_by_hand() -> None:
    m = SavedChunks(slots=1 << 10)
    m.add("llama", A, [11, 12], ts_ms=10_000.0)
    m.add("llama", B, [13], ts_ms=10_000.0)
    m.add("qwen", B, [14], ts_ms=10_000.0)
    assert m.reason("llama", A, 11, ts_ms=20_000.0) == EVICTED
    assert m.reason("llama", B, 11, ts_ms=20_000.0) == OTHER_DIGEST
    assert m.reason("llama", A, 13, ts_ms=20_000.0) == OTHER_DIGEST
    # Another model's save of the same chunk hash is not this model's.
    assert m.reason("llama", A, 14, ts_ms=20_000.0) == FIRST_USE
    assert m.reason("llama", A, 99, ts_ms=20_000.0) == FIRST_USE
    # A lookup before the save's report (1 s stamps, rounded up) never counts it saved.
    assert m.reason("llama", A, 11, ts_ms=9_999.0) == FIRST_USE
    m.add("llama", A, [15], ts_ms=30_000.5)
    assert m.reason("llama", A, 15, ts_ms=30_500.0) == FIRST_USE
    assert m.reason("llama", A, 15, ts_ms=31_000.0) == EVICTED
    assert m.saved == 5
    # Asked for at 40.7 s and not saved: never_saved for lookups after it (to the ms), under
    # its own layout only; a save still wins (evicted).
    m.add_asked("llama", A, [99, 14, 11], ts_ms=40_700.0)
    assert m.reasons("llama", A, [99, 14, 11], ts_ms=40_701.0) == [
        NEVER_SAVED, NEVER_SAVED, EVICTED]
    assert m.reason("llama", A, 99, ts_ms=40_700.0) == FIRST_USE  # the same ms: not before
    # A lookup earlier in the same second, judged after the later one's report came (a P/D
    # pair: the decode engine asks right after its prefill engine): a first use.
    assert m.reason("llama", A, 99, ts_ms=40_300.0) == FIRST_USE
    assert m.reason("llama", B, 99, ts_ms=50_000.0) == FIRST_USE
    assert m.reason("qwen", A, 99, ts_ms=50_000.0) == FIRST_USE
    # A later ask of the same pair keeps the earlier stamp (a late report hides nothing).
    m.add_asked("llama", A, [99], ts_ms=60_000.0)
    assert m.reason("llama", A, 99, ts_ms=45_000.0) == NEVER_SAVED
    assert m.asked == 4


def test_memory_and_bounds() -> None:
    assert SavedChunks().nbytes == (14 + 18) * SAVED_SLOTS == 16 * 2**20
    with pytest.raises(ValueError, match="power of two"):
        SavedChunks(slots=1000)
    m = SavedChunks(slots=16)
    for i in range(MAX_LAYOUTS):
        m.add("m", f"{i:012x}", [1], ts_ms=0.0)
    m.add("m", "f" * 12, [1, 2, 3], ts_ms=0.0)
    assert m.layouts_full == 3 and m.saved == MAX_LAYOUTS


def test_a_key_names_at_most_its_budget_of_layouts() -> None:
    """A key's new layouts past its ``cap`` are not remembered and counted; the layouts it
    named stay, another key's new layout is still taken, and a layout another key named first
    is shared by the key over its budget (it adds no layout)."""
    m = SavedChunks(slots=1 << 10)
    cap = MAX_LAYOUTS_PER_ENGINE_KEY
    for i in range(cap):
        m.add("m", f"{i:012x}", [i], ts_ms=1_000.0, owner="atk", cap=cap)
    m.add("m", "f" * 12, [7, 8], ts_ms=1_000.0, owner="atk", cap=cap)
    m.add_asked("m", "e" * 12, [9], ts_ms=1_000.0, owner="atk", cap=cap)
    assert (m.layouts_over_budget, m.layouts_full, m.saved, m.asked) == (3, 0, cap, 0)
    assert m.reason("m", "f" * 12, 7, ts_ms=5_000.0) == FIRST_USE
    assert m.reason("m", f"{cap - 1:012x}", cap - 1, ts_ms=5_000.0) == EVICTED
    m.add("llama", A, [1], ts_ms=1_000.0, owner="victim", cap=cap)
    m.add("llama", A, [2], ts_ms=1_000.0, owner="atk", cap=cap)
    assert m.layouts_over_budget == 3
    assert m.reasons("llama", A, [1, 2], ts_ms=5_000.0) == [EVICTED, EVICTED]


def test_forgetting_matches_the_stated_error() -> None:
    """Of chunks saved before ``s`` later distinct saves, ``exp(-s/slots)`` are remembered
    (the module's error (1)); never a false "saved" for chunks never added."""
    slots, s = 1 << 14, 1 << 14
    rng = random.Random(41)
    m = SavedChunks(slots=slots)
    first = [rng.getrandbits(64) for _ in range(5_000)]
    m.add("m", A, first, ts_ms=0.0)
    m.add("m", A, [rng.getrandbits(64) for _ in range(s)], ts_ms=0.0)
    kept = sum(m.reason("m", A, c, ts_ms=1e3) == EVICTED for c in first) / len(first)
    # The i-th of the first n chunks has n - 1 - i later saves of its own batch, then s.
    n = len(first)
    expected = sum(math.exp(-(s + n - 1 - i) / slots) for i in range(n)) / n
    assert kept == pytest.approx(expected, abs=0.02)
    assert all(m.reason("m", A, rng.getrandbits(64), ts_ms=1e3) == FIRST_USE
               for _ in range(5_000))
