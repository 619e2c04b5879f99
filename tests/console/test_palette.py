"""The command palette (``ctrl+p``) offers every action a key runs where it is opened, by the
name the docs' key table gives it (``ACTION_HELP``), and an entry does what its key does: the
palette read from the running console, as an operator sees it."""

from __future__ import annotations

from fleetdata import NOW_MS, sample_fleet
from palettekit import choose, palette_entries
from textual.binding import Binding

from kvpool_console.app import KVPoolConsole
from kvpool_console.screens import EngineDetailScreen, FlushScreen
from kvpool_console.screens._help import ACTION_HELP
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable


def _app(*, can_flush: bool = False) -> KVPoolConsole:
    return KVPoolConsole(StaticSource(sample_fleet(), can_flush=can_flush), refresh_s=3600,
                         clock=lambda: NOW_MS)


async def test_every_bound_action_is_in_the_palette_by_its_name() -> None:
    app = _app()
    async with app.run_test(size=(120, 40)) as pilot:
        shown = await palette_entries(pilot)
    bound = [b.action for b in Binding.make_bindings(KVPoolConsole.BINDINGS)] + ["detail"]
    for action in bound:
        assert action in ACTION_HELP, f"no palette name for action {action!r} (ACTION_HELP)"
        name = ACTION_HELP[action].title
        assert name in shown, f"action {action!r} ({name!r}) is missing from the palette"
    # Each with its keys, as the help table shows them; one entry per action, Textual's own
    # quit replaced by the console's (q, ctrl+c: --demo stops what it started).
    assert shown["Triage: selected engine"].endswith("(key t)")
    assert shown["Quit"] == "quit (--demo stops everything it started) (keys q, ^c)"
    assert shown["Sort by the next column"] == (
        "sort by the next column in turn: engine, role, hit, tokens, loads, errors, usage, "
        "lease, age (the status bar shows which; a click on a header sorts by it) (key s)")
    assert shown["Reverse the sort"].startswith("reverse the sort: ascending")
    # Every entry has a help line, not its keys alone (sort and reverse had none).
    bare = [t for t, h in shown.items() if h.startswith("key ")]
    assert bare == [], bare
    assert len([t for t in shown if t == "Quit"]) == 1
    # A read-only console lists the operator's actions too, saying why they are refused.
    assert shown["Flush pool entries"].startswith("read-only console: flush needs the operator")


async def test_an_entry_does_what_its_key_does() -> None:
    app = _app()
    async with app.run_test(size=(120, 40)) as pilot:
        await choose(pilot, "Sort by the next column")
        assert app.sort_index == 1
        await choose(pilot, "Pool screen")
        assert app.tab == "pool"
        await choose(pilot, "Fleet screen")
        table = app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index("e:decode-1"))
        await choose(pilot, "Expand / collapse: selected engine's agents")
        assert app.expanded == {"decode-1"}
        await choose(pilot, "Flush pool entries")  # read-only: says why, opens nothing
        assert not isinstance(app.screen, FlushScreen)
        assert any("flush needs the operator key" in str(n.message)
                   for n in app._notifications)
        await choose(pilot, "Engine detail: selected engine")
        assert isinstance(app.screen, EngineDetailScreen)
        assert app.screen.engine_id == "decode-1"
        # Over the detail screen: its own key too.
        shown = await palette_entries(pilot)
        assert "Back to the fleet" in shown and "Triage: selected engine" in shown
        await pilot.press("escape")
        await pilot.pause()
        await choose(pilot, "Back to the fleet")
        assert not isinstance(app.screen, EngineDetailScreen)


async def test_over_a_dialog_the_palette_lists_the_dialogs_keys() -> None:
    app = _app(can_flush=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f")
        await pilot.pause()
        assert isinstance(app.screen, FlushScreen)
        shown = await palette_entries(pilot)
        # The fleet's keys do not reach past a dialog: only its own and quit (ctrl+c).
        assert {"Dry run: count what the flush would remove", "Close without flushing",
                "Quit"} <= set(shown)
        assert "Flush pool entries" not in shown and "Sort by the next column" not in shown
        assert shown["Quit"].endswith("(key ^c)")
        await pilot.press("escape")
        await pilot.pause()
        await choose(pilot, "Close without flushing")
        assert not isinstance(app.screen, FlushScreen)
