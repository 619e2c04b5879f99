"""Attacks on the command palette (``ctrl+p``), each asserted to have no effect: on a read-only
console (no operator key) every mutating entry (flush, pin, unpin) runs from the palette only to
say why it is refused: no dialog opens and no command reaches the source; an engine whose id
and host are hostile text (Rich markup, terminal escapes, a newline) neither breaks the palette
nor becomes one of its entries."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine, sample_fleet
from palettekit import choose, palette_entries

from kvpool_agent.protocol import CommandReply, EngineState
from kvpool_console.app import KVPoolConsole
from kvpool_console.screens import FlushScreen, PinScreen, UnpinScreen
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable

HOSTILE = "[bold red]x[/] \x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\nhub[link=file:///etc]"


class _Recording(StaticSource):
    """A read-only source that records every command asked of it."""

    def __init__(self, states: dict[str, EngineState]) -> None:
        super().__init__(states, can_flush=False)
        self.asked: list[str] = []

    def command(self, command, **kwargs):  # type: ignore[no-untyped-def, override]
        self.asked.append(command)
        result: list[CommandReply] = super().command(command, **kwargs)
        return result


async def test_a_read_only_palette_runs_no_mutation() -> None:
    states = sample_fleet()
    for key, state in engine(HOSTILE, role="mixed").items():
        states[key] = msgspec.structs.replace(
            state, source=msgspec.structs.replace(state.source, host=HOSTILE))
    source = _Recording(states)
    app = KVPoolConsole(source, refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index("e:prefill-0"))  # an engine with a model
        shown = await palette_entries(pilot)
        assert not any(HOSTILE[:8] in t or "\x1b" in t for t in shown), shown
        for title, name in (("Flush pool entries", "flush"),
                            ("Pin a prefix: selected engine's model", "pin"),
                            ("Unpin a prefix: selected engine's model", "unpin")):
            assert shown[title].startswith(f"read-only console: {name} needs the operator")
            await pilot.press("escape")
            await pilot.pause()
            await choose(pilot, title)
            assert not isinstance(app.screen, FlushScreen | PinScreen | UnpinScreen), title
            assert any(f"{name} needs the operator key" in str(n.message)
                       for n in app._notifications), name
        # The hostile engine's row is there, and selecting it changes nothing of the above.
        table.move_cursor(row=table.get_row_index(f"e:{HOSTILE}"))
        await choose(pilot, "Pin a prefix: selected engine's model")
        assert not isinstance(app.screen, PinScreen)
    assert [c for c in source.asked if c in ("flush", "pin", "unpin")] == []
