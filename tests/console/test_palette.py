"""The command palette (``ctrl+p``) offers every action a key runs where it is opened, by the
name the docs' key table gives it (``ACTION_HELP``), and an entry does what its key does: the
palette read from the running console, as an operator sees it."""

from __future__ import annotations

from fleetdata import NOW_MS, sample_fleet
from textual.binding import Binding
from textual.command import CommandList, CommandPalette
from textual.pilot import Pilot

from kvpool_console.app import KVPoolConsole
from kvpool_console.screens import EngineDetailScreen, FlushScreen
from kvpool_console.screens._help import ACTION_HELP
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable


def _app(*, can_flush: bool = False) -> KVPoolConsole:
    return KVPoolConsole(StaticSource(sample_fleet(), can_flush=can_flush), refresh_s=3600,
                         clock=lambda: NOW_MS)


async def _palette(pilot: Pilot[None]) -> dict[str, str]:
    """Open the palette and read its entries as shown: title -> help line."""
    await pilot.press("ctrl+p")
    shown: dict[str, str] = {}
    for _ in range(50):  # the palette gathers its entries in a worker
        await pilot.pause(0.05)
        palette = pilot.app.screen
        assert isinstance(palette, CommandPalette)
        options = palette.query_one(CommandList)
        now = {}
        for i in range(options.option_count):
            title, _, help_line = str(options.get_option_at_index(i).prompt).partition("\n")
            now[title] = help_line
        if now and now == shown:
            break
        shown = now
    return shown


async def _choose(pilot: Pilot[None], title: str) -> None:
    """Open the palette, type the start of ``title`` and run its entry once it is the first
    shown."""
    await pilot.press("ctrl+p")
    await pilot.press(*title[:10])
    first = ""
    for _ in range(100):
        await pilot.pause(0.02)
        options = pilot.app.screen.query_one(CommandList)
        if options.option_count:
            first = str(options.get_option_at_index(0).prompt).partition("\n")[0]
            if first == title:
                break
    assert first == title, (first, title)
    await pilot.press("enter")
    await pilot.pause(0.1)


async def test_every_bound_action_is_in_the_palette_by_its_name() -> None:
    app = _app()
    async with app.run_test(size=(120, 40)) as pilot:
        shown = await _palette(pilot)
    bound = [b.action for b in Binding.make_bindings(KVPoolConsole.BINDINGS)] + ["detail"]
    for action in bound:
        assert action in ACTION_HELP, f"no palette name for action {action!r} (ACTION_HELP)"
        name = ACTION_HELP[action].title
        assert name in shown, f"action {action!r} ({name!r}) is missing from the palette"
    # Each with its keys, as the help table shows them; one entry per action, Textual's own
    # quit replaced by the console's (q, ctrl+c: --demo stops what it started).
    assert shown["Triage: selected engine"].endswith("(key t)")
    assert shown["Quit"] == "quit (--demo stops everything it started) (keys q, ^c)"
    assert shown["Sort by the next column"] == "key s"
    assert len([t for t in shown if t == "Quit"]) == 1
    # A read-only console lists the operator's actions too, saying why they are refused.
    assert shown["Flush pool entries"].startswith("read-only console: flush needs the operator")


async def test_an_entry_does_what_its_key_does() -> None:
    app = _app()
    async with app.run_test(size=(120, 40)) as pilot:
        await _choose(pilot, "Sort by the next column")
        assert app.sort_index == 1
        await _choose(pilot, "Pool screen")
        assert app.tab == "pool"
        await _choose(pilot, "Fleet screen")
        table = app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index("e:decode-1"))
        await _choose(pilot, "Expand / collapse: selected engine's agents")
        assert app.expanded == {"decode-1"}
        await _choose(pilot, "Flush pool entries")  # read-only: says why, opens nothing
        assert not isinstance(app.screen, FlushScreen)
        assert any("flush needs the operator key" in str(n.message)
                   for n in app._notifications)
        await _choose(pilot, "Engine detail: selected engine")
        assert isinstance(app.screen, EngineDetailScreen)
        assert app.screen.engine_id == "decode-1"
        # Over the detail screen: its own key too.
        shown = await _palette(pilot)
        assert "Back to the fleet" in shown and "Triage: selected engine" in shown
        await pilot.press("escape")
        await pilot.pause()
        await _choose(pilot, "Back to the fleet")
        assert not isinstance(app.screen, EngineDetailScreen)


async def test_over_a_dialog_the_palette_lists_the_dialogs_keys() -> None:
    app = _app(can_flush=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f")
        await pilot.pause()
        assert isinstance(app.screen, FlushScreen)
        shown = await _palette(pilot)
        # The fleet's keys do not reach past a dialog: only its own and quit (ctrl+c).
        assert {"Dry run: count what the flush would remove", "Close without flushing",
                "Quit"} <= set(shown)
        assert "Flush pool entries" not in shown and "Sort by the next column" not in shown
        assert shown["Quit"].endswith("(key ^c)")
        await pilot.press("escape")
        await pilot.pause()
        await _choose(pilot, "Close without flushing")
        assert not isinstance(app.screen, FlushScreen)
