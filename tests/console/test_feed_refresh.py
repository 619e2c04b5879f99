"""The console on a live hub feed: it asks the hub for the update tier of its refresh
interval, builds each batch's alerts and view on the feed thread as the batch arrives, and
its ticks show those batches (alerts fired on the feed thread reach the events log). Real hub
with keys, real agents, Pilot."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from livefleet import LiveFleet, until
from textual.widgets import RichLog

from kvpool_agent.agent import AgentHandle
from kvpool_agent.reporter import Reporter
from kvpool_console.alerts import rules as alert_rules
from kvpool_console.app import KVPoolConsole
from kvpool_console.source import ClientSource, tier_for
from kvpool_console.widgets import FleetTable


def _console_on_prefill(live_fleet: LiveFleet
                        ) -> tuple[list[AgentHandle], ClientSource, KVPoolConsole]:
    """A prefill engine ``p0`` (scheduler + 2 workers) and a console on its hub's feed at
    0.5 s refresh (the 500 ms tier)."""
    p0 = live_fleet.add_engine("p0", "prefill", "kv_producer")
    live_fleet.wait_agents(3)
    src = ClientSource(live_fleet.address, pump=True)
    return p0, src, KVPoolConsole(src, refresh_s=0.5)


def _fail_load_after_hit(reporter: Reporter) -> None:
    """Report a load of request ``r1`` that failed (LEASE_EXPIRED) after a positive lookup."""
    reporter.transfer_started("r1", "load", 2, 8192)
    reporter.transfer_finished("r1", "load", False, 0, "LEASE_EXPIRED", 2, after_hit=True)


def test_tier_for_refresh() -> None:
    # The slowest tier that still gives each redraw an update of its own.
    assert [tier_for(s) for s in (0.25, 0.5, 1.0, 2.0, 5.0, 10.0)] == [
        None, 500, 1000, 2000, 2000, 2000]


async def test_batches_drive_the_ticks_on_the_tier_of_the_refresh(live_fleet: LiveFleet) -> None:
    p0, src, app = _console_on_prefill(live_fleet)
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(FleetTable)
        await until(pilot, lambda: src.client.every_ms == 500, "tier 500 subscribed")
        await until(pilot, lambda: "e:p0" in table.rows, "p0 shown")
        # A failed load after a hit, reported now: its alert is evaluated on the feed thread
        # and shown by a tick that takes that batch.
        _fail_load_after_hit(p0[1].reporter)
        await until(pilot, lambda: str(table.get_cell("e:p0", "fail")) == "1", "failure shown")
        assert app.batches_shown >= 1 and app.last_sample_ms > 0
        assert any(a.rule == "failed_after_hit" for a in app.alerts)
        await pilot.press("3")  # the Events tab: its log renders once it has a size
        log = app.query_one("#events-log", RichLog)
        await until(pilot, lambda: any("failed after a positive lookup" in line.text
                                        for line in log.lines), "the alert in the events log")
        await pilot.press("1")
        # A faster refresh moves to a faster tier; one faster than every tier to the hub's
        # full-rate stream.
        await pilot.press("plus")
        assert app.refresh_s == 0.25
        await until(pilot, lambda: src.client.every_ms is None, "full-rate stream")
        shown = app.batches_shown
        await until(pilot, lambda: app.batches_shown > shown, "a batch of the full-rate stream")
        await pilot.press("minus", "minus")
        assert app.refresh_s == 1.0
        await until(pilot, lambda: src.client.every_ms == 1000, "tier 1000")


async def test_a_sample_failing_on_the_feed_thread_keeps_the_screen_live(
        live_fleet: LiveFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    # A bug in the alert rules hit only on the feed thread must not stop the feed: each tick
    # samples again on the UI thread and the screen keeps following the fleet.
    real = alert_rules.evaluate
    failed: list[str] = []

    def evaluate_off_main(*args: Any, **kw: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            failed.append(threading.current_thread().name)
            raise RuntimeError("rule bug")
        return real(*args, **kw)

    monkeypatch.setattr(alert_rules, "evaluate", evaluate_off_main)
    p0, src, app = _console_on_prefill(live_fleet)
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(FleetTable)
        await until(pilot, lambda: "e:p0" in table.rows, "p0 shown")
        await until(pilot, lambda: len(failed) >= 2, "two batches failing on the feed thread")
        _fail_load_after_hit(p0[1].reporter)
        await until(pilot, lambda: str(table.get_cell("e:p0", "fail")) == "1",
                     "a report after the failures shown")
        assert src._pump is not None and src._pump.is_alive()
        assert app.batches_shown == 0 and set(failed) == {"kvpool-console-feed"}
