"""The command palette (``ctrl+p``) as a test reads and drives it: its entries once they stop
changing, and one entry run by its title (``test_palette``, ``test_palette_attacks``,
``test_detail_silent``)."""

from __future__ import annotations

from textual.command import CommandList, CommandPalette
from textual.pilot import Pilot


async def palette_entries(pilot: Pilot[None]) -> dict[str, str]:
    """Open the palette and read its entries as shown: title -> help line. The palette
    gathers them in a worker: read until two reads agree."""
    await pilot.press("ctrl+p")
    shown: dict[str, str] = {}
    for _ in range(50):
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


async def choose(pilot: Pilot[None], title: str) -> None:
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
