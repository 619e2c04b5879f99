"""A pool's disk tier and the reads served from each tier (``PoolStats.disk_*``,
``memory_hits``/``disk_hits``) in ``status --json`` and on the Pool tab; a pool without one shows
``-``. The values a real master reports are tested in tests/replay/test_disk_tier.py."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine, pool
from textual.widgets import DataTable

from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import status_document
from kvpool_console.model import build_view
from kvpool_console.source import StaticSource

MB = 1 << 20


def _fleet(**disk: int) -> dict:
    stats = msgspec.structs.replace(pool(), **disk)
    return engine("p0", tp=1, pool_stats=stats)


def test_status_json_carries_both_tiers() -> None:
    states = _fleet(disk_keys=300, disk_used_bytes=600 * MB, disk_total_bytes=4096 * MB,
                    memory_hits=70, disk_hits=30, memory_hit_bytes=140 * MB,
                    disk_hit_bytes=60 * MB)
    view = build_view(states, {a: NOW_MS for a in states}, NOW_MS)
    (row,) = status_document(view)["pools"]
    assert {k: row[k] for k in ("disk_keys", "disk_used_bytes", "disk_total_bytes",
                                "memory_hits", "disk_hits", "memory_hit_bytes",
                                "disk_hit_bytes")} == {
        "disk_keys": 300, "disk_used_bytes": 600 * MB, "disk_total_bytes": 4096 * MB,
        "memory_hits": 70, "disk_hits": 30, "memory_hit_bytes": 140 * MB,
        "disk_hit_bytes": 60 * MB}
    assert view.pools[0].disk_hit_share == 0.3


async def _pool_row(states: dict) -> dict[str, str]:
    app = KVPoolConsole(StaticSource(states), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(200, 40)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        table = app.query_one("#pool-table", DataTable)
        labels = [str(c.label) for c in table.columns.values()]
        return dict(zip(labels, (str(c) for c in table.get_row_at(0)), strict=True))


async def test_pool_tab_shows_disk_and_hits_per_tier() -> None:
    row = await _pool_row(_fleet(disk_keys=300, disk_used_bytes=600 * MB,
                                 disk_total_bytes=4096 * MB, memory_hits=70, disk_hits=30))
    assert row["Disk"] == "600M/4.0G (300)"
    assert row["Hits mem/disk"] == "70/30 (30% disk)"


async def test_pool_tab_without_disk_tier_or_reads() -> None:
    row = await _pool_row(_fleet(disk_keys=0, disk_used_bytes=0, disk_total_bytes=0,
                                 memory_hits=0, disk_hits=0))
    assert (row["Disk"], row["Hits mem/disk"]) == ("-", "-")
