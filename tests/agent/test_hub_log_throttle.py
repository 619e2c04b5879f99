"""The hub's log of refusals and bad messages is rate-limited by time, per key: a flood of
324,237 refused reports of one key in 10 s logged 656 lines when it was limited by count
(helper 61's attack); now a key's first 3 refusals, then one line per 10 s with the count
not logged. Counting is never limited."""

from __future__ import annotations

import logging

import pytest

from kvpool_agent import _hub_counters
from kvpool_agent._hub_counters import HubCounters


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_refusal_flood_logs_three_lines_then_one_per_10_s_per_key(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    monkeypatch.setattr(_hub_counters.time, "monotonic", clock)
    counters = HubCounters()
    with caplog.at_level(logging.WARNING, logger="kvpool.hub"):
        for _ in range(100_000):
            counters.refuse("agent/flood", "pool: bound to another pool")
        counters.refuse("viewer/other", "busy")  # another key's first line is its own
        for _ in range(50_000):
            counters.bad("agents", "undecodable")
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if "key agent/flood" in m]) == 3
    assert len([m for m in lines if "key viewer/other" in m]) == 1
    assert len([m for m in lines if "bad message" in m]) == 3
    assert counters.refused_by_key == {"agent/flood": 100_000, "viewer/other": 1}
    assert counters.bad_messages == 50_000
    caplog.clear()
    clock.now += 9.9
    counters.refuse("agent/flood", "again")
    assert caplog.records == []
    clock.now += 0.1
    with caplog.at_level(logging.WARNING, logger="kvpool.hub"):
        counters.refuse("agent/flood", "again")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("kvpool hub: refused #100002 of key agent/flood (99998 more not "
                           "logged since the last line)"), line
