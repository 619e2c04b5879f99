"""A pool's disk tier and the reads served from each tier (``PoolStats.disk_*``,
``memory_hits``/``disk_hits``) in ``status --json``, on the Pool tab and in the hub's Prometheus
export; a pool without one shows ``-``. The values a real master reports are tested in
tests/replay/test_disk_tier.py."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine, pool
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from textual.widgets import DataTable

from kvpool_agent._metrics import FleetCollector
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


def test_prometheus_exports_both_tiers() -> None:
    states = _fleet(disk_keys=300, disk_used_bytes=600 * MB, disk_total_bytes=4096 * MB,
                    memory_hits=70, disk_hits=30, memory_hit_bytes=140 * MB,
                    disk_hit_bytes=60 * MB)
    reg = CollectorRegistry()
    reg.register(FleetCollector(lambda: {a: (st, NOW_MS) for a, st in states.items()},
                                dict, dict, lambda: NOW_MS))
    got = {(s.name, frozenset(s.labels.items())): s.value
           for fam in text_string_to_metric_families(generate_latest(reg).decode())
           for s in fam.samples}
    pools = {dict(k[1])["pool"] for k in got if k[0] == "kvpool_pool_disk_keys"}
    (name,) = pools  # every agent of the engine reports the same pool: exported once
    lab = {"pool": name, "backend": "mooncake"}

    def value(metric: str, **extra: str) -> float:
        return got[metric, frozenset({**lab, **extra}.items())]

    assert value("kvpool_pool_disk_keys") == 300
    assert value("kvpool_pool_disk_used_bytes") == 600 * MB
    assert value("kvpool_pool_disk_total_bytes") == 4096 * MB
    assert value("kvpool_pool_reads_total", tier="memory") == 70
    assert value("kvpool_pool_reads_total", tier="disk") == 30
    assert value("kvpool_pool_read_bytes_total", tier="memory") == 140 * MB
    assert value("kvpool_pool_read_bytes_total", tier="disk") == 60 * MB


def test_a_disk_tier_over_its_limit_raises_disk_over_limit_and_the_prometheus_rule() -> None:
    """The SSD tier holding more than its limit (Mooncake's file_per_key ignores the limit,
    issue 40) is a warning naming the bytes and the fix; at the limit, none. The Prometheus
    rule of the same id watches the two series the hub exports."""
    from pathlib import Path

    import yaml

    from kvpool_console.alerts import evaluate

    over = evaluate(_fleet(disk_used_bytes=300 * MB, disk_total_bytes=256 * MB), {}, NOW_MS)
    (alert,) = [a for a in over if a.rule == "disk_over_limit"]
    assert alert.severity == "warning"
    assert f"holds {300 * MB} B, over its {256 * MB} B limit" in alert.message
    assert "bucket_storage_backend" in alert.hint
    at = evaluate(_fleet(disk_used_bytes=256 * MB, disk_total_bytes=256 * MB), {}, NOW_MS)
    assert [a for a in at if a.rule == "disk_over_limit"] == []
    rules = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / "prometheus"
                            / "kvpool-rules.yml").read_text())["groups"][0]["rules"]
    (rule,) = [r for r in rules if r["labels"]["rule"] == "disk_over_limit"]
    assert rule["expr"] == ("kvpool_pool_disk_used_bytes > kvpool_pool_disk_total_bytes and "
                            "kvpool_pool_disk_total_bytes > 0")
