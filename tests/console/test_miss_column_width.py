"""The fleet table's Top miss column is laid out at its final width in the first frame: before,
it was sized to the first frame's cells (``-`` or ``not_in_pool 60%``) and widened when the
hub's miss split arrived (``other_digest 33%``), that frame drawn clipped."""

from __future__ import annotations

from fleetdata import NOW_MS, sample_fleet, sample_reuse
from textual.widgets.data_table import ColumnKey

from kvpool_agent.protocol import ReuseView
from kvpool_console.app import KVPoolConsole
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable
from kvpool_console.widgets._fleet_cells import MISS_WIDTH


class _LateSplit(StaticSource):
    """A fleet whose hub has not sent its miss split yet (``split`` set later)."""

    split: ReuseView | None = None

    def reuse(self) -> ReuseView | None:
        return self.split


async def test_top_miss_column_keeps_its_first_frame_width() -> None:
    src = _LateSplit(sample_fleet(misses=True), address="tcp://hub:7600")
    app = KVPoolConsole(src, refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        table = app.query_one(FleetTable)
        column = table.columns[ColumnKey("miss")]

        def shown() -> tuple[int, list[str]]:
            return column.get_render_width(table), [
                str(table.get_cell(k, "miss")) for k in ("e:prefill-0", "e:prefill-1")]

        first = shown()
        assert first == (MISS_WIDTH + 2 * table.cell_padding,
                         ["not_in_pool 25%", "not_in_pool 48%"])
        src.split = sample_reuse()
        app.tick()
        await pilot.pause()
        assert shown() == (first[0], ["evicted 15%", "other_digest 32%"])
