"""Snapshot tests of every screen at 80x24 and 160x48 on a frozen fleet and clock.

Regenerate after an intended UI change with
``.venv/bin/python -m pytest tests/console/test_snapshots.py --snapshot-update`` and review the
SVGs in ``tests/console/__snapshots__``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fleetdata import NOW_MS, sample_fleet, sample_reuse
from textual.pilot import Pilot
from textual.widgets import RichLog

from kvpool_console.app import KVPoolConsole
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable

SIZES = [(80, 24), (160, 48)]


def _app(*, can_flush: bool = False) -> KVPoolConsole:
    # One sample per run (the timer never fires in time) keeps trends and ages fixed.
    return KVPoolConsole(StaticSource(sample_fleet(misses=True, versions=True), address="tcp://hub:7600",
                                      can_flush=can_flush, reuse=sample_reuse()),
                         refresh_s=3600, clock=lambda: NOW_MS)


def _select(engine_id: str) -> Callable[[Pilot], object]:
    async def run(pilot: Pilot) -> None:
        table = pilot.app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index(f"e:{engine_id}"))
        await pilot.pause()

    return run


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fleet(snap_compare: Callable[..., bool], size: tuple[int, int]) -> None:
    assert snap_compare(_app(), terminal_size=size, run_before=_select("prefill-1"),
                        press=["space"])


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pool(snap_compare: Callable[..., bool], size: tuple[int, int]) -> None:
    assert snap_compare(_app(), terminal_size=size, press=["2", "_", "_"])


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_events(snap_compare: Callable[..., bool], size: tuple[int, int]) -> None:
    assert snap_compare(_app(), terminal_size=size, run_before=_settled_events)


async def _settled_events(pilot: Pilot) -> None:
    # The log renders its deferred lines once the tab gives it a width, then auto-scrolls:
    # under load a capture could land between the two. Pin the end position first.
    await pilot.press("3")
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    pilot.app.query_one("#events-log", RichLog).scroll_end(animate=False, immediate=True)
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_engine_detail(snap_compare: Callable[..., bool], size: tuple[int, int]) -> None:
    assert snap_compare(_app(), terminal_size=size, run_before=_select("prefill-1"),
                        press=["enter", "_"])


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_help(snap_compare: Callable[..., bool], size: tuple[int, int]) -> None:
    assert snap_compare(_app(), terminal_size=size, press=["question_mark"])


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_flush_modal(snap_compare: Callable[..., bool], size: tuple[int, int]) -> None:
    assert snap_compare(_app(can_flush=True), terminal_size=size,
                        run_before=_select("prefill-0"), press=["f"])


def test_filter_faults_paused_80x24(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(_app(), terminal_size=(80, 24),
                        press=["slash", *"prefill", "enter", "x", "p"])


async def _dry_run(pilot: Pilot) -> None:
    table = pilot.app.query_one(FleetTable)
    table.move_cursor(row=table.get_row_index("e:prefill-0"))
    await pilot.press("f")
    await pilot.pause()
    await pilot.press("d")
    await pilot.pause(0.3)


def test_flush_modal_after_dry_run_40x12(snap_compare: Callable[..., bool]) -> None:
    # The smallest terminal an operator may have over SSH: buttons and the result stay on screen.
    assert snap_compare(_app(can_flush=True), terminal_size=(40, 12), run_before=_dry_run)
