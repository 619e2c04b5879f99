"""The agent's cache models (``kvpool_agent.reuse``) over compact int chunk ids, as the hub keeps
them, and the what-if capacity curve. The models' own rules are checked in
tests/replay/test_cache_models.py (they are kvpool_replay's reference too)."""

from __future__ import annotations

import pytest

from kvpool_agent.reuse import (
    CURVE_FACTORS,
    CurvePoint,
    belady_hits,
    capacity_curve,
    lru_hits,
    prefix_ceiling,
)


def _accesses() -> list[tuple[int, list[int]]]:
    # Three prompts of 4-token chunks sharing a 2-chunk system prefix (ids 1, 2), cycled.
    prompts = [[1, 2, 10, 11], [1, 2, 20, 21], [1, 2, 30, 31]]
    return [(17, prompts[i % 3]) for i in range(12)]


def test_int_ids_give_the_figures_worked_by_hand() -> None:
    acc = _accesses()
    # Unbounded: the first round hits the prefix twice (8 tokens each), later rounds 16 each.
    assert prefix_ceiling(acc, 4).per_request == [0, 8, 8] + [16] * 9
    # Room for 4 chunks: LRU cycling over 3 prompts of 2 private chunks keeps only the
    # shared prefix in time for its next use.
    assert lru_hits(acc, 4, capacity_tokens=16).per_request == [0] + [8] * 11
    # MIN at the same size keeps one prompt's private chunks for its next use.
    assert belady_hits(acc, 4, capacity_tokens=16).hit_tokens > 8 * 11


def test_capacity_curve_is_lru_and_min_at_each_multiple() -> None:
    acc = _accesses()
    points = capacity_curve(acc, 4, capacity_tokens=16)
    assert [p.capacity_tokens for p in points] == [4, 8, 16, 32, 64, 128]
    assert len(points) == len(CURVE_FACTORS)
    for p in points:
        assert p == CurvePoint(p.capacity_tokens,
                               lru_hits(acc, 4, p.capacity_tokens).hit_rate,
                               belady_hits(acc, 4, p.capacity_tokens).hit_rate)
        assert p.min_hit_rate >= p.lru_hit_rate
    # At 8x everything fits: both reach the ceiling.
    ceiling = prefix_ceiling(acc, 4).hit_rate
    assert points[-1].lru_hit_rate == points[-1].min_hit_rate == ceiling
    assert points[2].lru_hit_rate == pytest.approx(88 / (12 * 17))


def test_capacity_curve_refuses_a_negative_factor() -> None:
    with pytest.raises(ValueError, match="factors"):
        capacity_curve(_accesses(), 4, 16, factors=(1.0, -0.5))
