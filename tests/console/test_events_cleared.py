"""The Events tab's log says when an alert clears, as its help says ("alerts as they fire and
clear"): a new user saw a stopped engine's alert fire, and nothing when it went away."""

from __future__ import annotations

from collections.abc import Mapping

from fleetdata import NOW_MS, engine
from textual.widgets import RichLog

from kvpool_agent.protocol import EngineState
from kvpool_console.alerts import AlertTracker
from kvpool_console.alerts.alert import make_alert
from kvpool_console.app import KVPoolConsole
from kvpool_console.source import StaticSource


class _Switched(StaticSource):
    """A static fleet the test replaces between ticks."""

    def __init__(self, states: Mapping[str, EngineState]) -> None:
        super().__init__(states)
        self.now = dict(states)

    def fleet(self) -> tuple[Mapping[str, EngineState], Mapping[str, float]]:
        return self.now, {k: s.ts_ms for k, s in self.now.items()}


def test_the_tracker_says_what_cleared() -> None:
    tracker = AlertTracker()
    a = make_alert("stale", "warning", "e", "stale: no report for 4 s", "hint", NOW_MS)
    b = make_alert("pool_watermark", "warning", "P", "pool at 91%", "hint", NOW_MS)
    tracker.update([a, b], NOW_MS)
    assert (tracker.new, tracker.cleared) == ([a, b], [])
    tracker.update([b], NOW_MS + 1)
    assert (tracker.new, tracker.cleared) == ([], [a])
    tracker.update([b], NOW_MS + 2)
    assert (tracker.new, tracker.cleared) == ([], [])


async def test_the_events_log_says_when_an_alert_clears() -> None:
    failing = engine("e", lookup_errors=60)
    src = _Switched(failing)
    app = KVPoolConsole(src, refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("3")  # the Events tab: its log renders once it has a size
        await pilot.pause()
        log = app.query_one("#events-log", RichLog)
        assert [a.rule for a in app.alerts] == ["lookup_errors"]
        src.now = engine("e")
        app.tick()
        await pilot.pause()
        assert app.alerts == []
        lines = [line.text for line in log.lines]
        assert any(" e: 60 of 100 lookups failed" in x and "CRIT" in x for x in lines), lines
        assert any("CLEAR e: lookup_errors (60 of 100 lookups failed" in x for x in lines), lines
