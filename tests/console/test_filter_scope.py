"""The fleet filter (``/``) belongs to the fleet tab: shown in the status bar while set,
cleared on leaving the tab (coming back shows every engine) and by Escape in its box."""

from __future__ import annotations

from fleetdata import NOW_MS, sample_fleet
from textual.widgets import Input, Static

from kvpool_console.app import KVPoolConsole
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable

ALL = ["e:decode-0", "e:decode-1", "e:prefill-0", "e:prefill-1", "e:prefill-2", "__totals__"]


def _shown(app: KVPoolConsole) -> list[str]:
    return [str(row.key.value) for row in app.query_one(FleetTable).ordered_rows]


def _bar(app: KVPoolConsole) -> str:
    return str(app.query_one("#status-bar", Static).content)


async def test_filter_is_shown_and_cleared_when_leaving_the_fleet_tab() -> None:
    app = KVPoolConsole(StaticSource(sample_fleet()), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 40)) as pilot:
        assert _shown(app) == ALL
        await pilot.press("slash", *"decode", "enter")
        await pilot.pause()
        assert _shown(app) == ["e:decode-0", "e:decode-1", "__totals__"]
        assert "filter 'decode'" in _bar(app)
        await pilot.press("3", "1")
        await pilot.pause()
        assert _shown(app) == ALL
        assert "filter" not in _bar(app)
        box = app.query_one("#filter", Input)
        assert (box.value, box.display) == ("", False)
        # Escape in the box: cleared, back in the table.
        await pilot.press("slash", *"zz")
        await pilot.pause()
        assert _shown(app) == ["__totals__"] and "filter 'zz'" in _bar(app)
        await pilot.press("escape")
        await pilot.pause()
        assert _shown(app) == ALL and "filter" not in _bar(app)
        assert not box.display and app.focused is app.query_one(FleetTable)
