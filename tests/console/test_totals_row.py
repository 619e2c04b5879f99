"""The fleet table's totals row says what it counts in its columns' words: under State the
engines silent past the down and stale thresholds (``1 DOWN 1 STALE``, as those rows read),
nothing when none is; no abbreviation (it printed ``1st 0dn``, and ``15ag`` under Role)."""

from __future__ import annotations

from fleetdata import NOW_MS, engine, sample_fleet

from kvpool_agent.protocol import EngineState
from kvpool_console.app import KVPoolConsole
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable


async def _cells(fleet: dict[str, EngineState]) -> tuple[dict[str, str], list[str]]:
    """The totals row's cells by column key and the engine rows' State cells, as the real
    console draws them over ``fleet``."""
    app = KVPoolConsole(StaticSource(fleet), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 30)) as pilot:
        await pilot.pause()
        table = app.query_one(FleetTable)
        keys = [str(c.key.value) for c in table.ordered_columns]
        totals = dict(zip(keys, (str(c) for c in table.get_row("__totals__")), strict=True))
        states = [str(table.get_cell(f"e:{r.engine_id}", "state"))
                  for r in app.visible_rows()]
    return totals, states


async def test_state_counts_down_and_stale_engines_in_the_state_columns_words() -> None:
    # sample_fleet's prefill-2 is 9 s silent (stale); gone-0 a minute (down).
    fleet = sample_fleet() | engine("gone-0", age_ms=60_000)
    totals, states = await _cells(fleet)
    assert states.count("DOWN") == 1 and states.count("STALE") == 1
    assert totals["state"] == "1 DOWN 1 STALE"
    assert totals["engine"] == "Σ 6 engines"
    assert totals["role"] == ""


async def test_state_is_empty_when_every_engine_reports() -> None:
    # decode-1 has an alert (CRIT): the totals cell counts silence only, so it must not say
    # "ok" under it either.
    fleet = {a: s for a, s in sample_fleet().items() if not a.startswith("prefill-2/")}
    totals, states = await _cells(fleet)
    assert "CRIT" in states and "STALE" not in states
    assert totals["state"] == ""
    stale_only = fleet | engine("quiet-0", age_ms=9_000) | engine("quiet-1", age_ms=9_000)
    assert (await _cells(stale_only))[0]["state"] == "2 STALE"
