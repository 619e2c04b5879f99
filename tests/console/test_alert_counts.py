"""The status bar's alert counts are the Events tab's rows, on a fleet with several alerts of
each severity, pool alerts (one per pool) and watermark hysteresis across refreshes."""

from __future__ import annotations

import re

import msgspec
from fleetdata import GB, NOW_MS, engine, pool, sample_fleet
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from kvpool_agent.protocol import EngineState
from kvpool_console.app import KVPoolConsole
from kvpool_console.source import StaticSource


def _fleet(shared_used_gb: float) -> dict[str, EngineState]:
    """``sample_fleet`` (3 critical, 2 warning engine alerts) on one shared pool at
    ``shared_used_gb`` of 10 GB (watermark 0.90), plus engine ``x`` on a second pool that is
    99% full and fails its health check (2 critical pool alerts)."""
    shared = pool(used=int(shared_used_gb * GB), total=10 * GB)
    fleet = {k: msgspec.structs.replace(
        s, source=msgspec.structs.replace(s.source, master="10.0.0.1:50051"), pool=shared)
        for k, s in sample_fleet().items()}
    sick = pool(used=int(9.9 * GB), total=10 * GB, healthy=False)
    fleet |= {k: msgspec.structs.replace(
        s, source=msgspec.structs.replace(s.source, master="10.0.0.2:50051"))
        for k, s in engine("x", pool_stats=sick).items()}
    return fleet


def _header_counts(app: KVPoolConsole) -> tuple[int, int]:
    line = str(app.query_one("#status-bar", Static).visual)
    m = re.search(r"alerts (\d+)C/(\d+)W", line)
    assert m is not None, line
    return int(m.group(1)), int(m.group(2))


async def _events_counts(app: KVPoolConsole, pilot: Pilot[None]) -> tuple[int, int]:
    await pilot.press("3")
    await pilot.pause()
    table = app.query_one("#alerts-table", DataTable)
    sev = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
    await pilot.press("1")
    await pilot.pause()
    assert set(sev) <= {"CRIT", "WARN"}
    return sev.count("CRIT"), sev.count("WARN")


class _Changing(StaticSource):
    """A fleet the test replaces between refreshes."""

    def __init__(self, states: dict[str, EngineState]) -> None:
        super().__init__(states)
        self.states = states

    def fleet(self) -> tuple[dict[str, EngineState], dict[str, float]]:
        return self.states, {k: s.ts_ms for k, s in self.states.items()}


async def test_header_alert_counts_equal_the_events_tab() -> None:
    source = _Changing(_fleet(9.2))
    app = KVPoolConsole(source, refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 40)) as pilot:
        # Usage of the shared pool over refreshes: over the watermark, inside the 0.05
        # hysteresis margin (stays), below it (clears), over again.
        for used, pool_warning in ((9.2, 1), (8.7, 1), (8.4, 0), (9.3, 1)):
            source.states = _fleet(used)
            app.tick()
            await pilot.pause()
            # Engine alerts: 3 critical, 2 warning; pool x: watermark 99% and unhealthy.
            expected = (3 + 2, 2 + pool_warning)
            assert _header_counts(app) == expected, used
            assert await _events_counts(app, pilot) == expected, used
            rules = [(a.rule, a.subject) for a in app.alerts]
            assert rules.count(("pool_watermark", "mooncake@10.0.0.1:50051")) == pool_warning
            assert rules.count(("pool_watermark", "mooncake@10.0.0.2:50051")) == 1
            assert rules.count(("pool_unhealthy", "mooncake@10.0.0.2:50051")) == 1
