"""The engine detail screen of a silent engine, and what its keys do (a demo user's report):

- the detail screen offered the fleet screen's keys (``/ Filter  x Faults  s Sort  space
  Expand`` in its footer, "Filter engines" in its palette) and ``/`` there opened a filter box
  seen only after ``esc``: those keys are neither shown nor run over the detail, and its own
  commands (health) are for the engine it shows;
- an engine SIGSTOPped (HUNG) still showed its last hit rate, load+save and policy as current
  and its agent rows a CPU share (``26%cpu``) of a stopped process: every such figure now
  says ``last reported ... ago``, the agent rows show no CPU share.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import msgspec
from fleetdata import NOW_MS, engine, sample_fleet
from livefleet import until
from palettekit import palette_entries
from textual.pilot import Pilot
from textual.widgets import Input, Label, Static
from triagekit import standin

from kvpool_agent.protocol import EngineState, PolicySteering
from kvpool_console.app import KVPoolConsole
from kvpool_console.screens import EngineDetailScreen, HealthScreen
from kvpool_console.source import ClientSource, StaticSource
from kvpool_console.widgets import FleetTable

WAIT_S = 30.0


async def _palette_titles(pilot: Pilot[None]) -> set[str]:
    """Open the palette over the current screen and read its entries' titles; closes it."""
    shown = set(await palette_entries(pilot))
    await pilot.press("escape")
    await pilot.pause()
    return shown


async def test_the_detail_screen_offers_and_runs_only_what_works_there() -> None:
    app = KVPoolConsole(StaticSource(sample_fleet()), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index("e:decode-1"))
        await pilot.press("enter")
        assert isinstance(app.screen, EngineDetailScreen)
        shown_keys = {b.binding.key for b in app.screen.active_bindings.values()}
        # The footer: the detail's own key and the app's that work here; none of the fleet's.
        assert {"escape", "q", "question_mark", "h", "p"} <= shown_keys
        assert not {"slash", "x", "s", "r", "space", "1", "2", "3"} & shown_keys, shown_keys
        # Pressed anyway, they do nothing (before: the filter box, faults, the sort...).
        await pilot.press("slash", "x", "s", "r", "space", "2")
        assert isinstance(app.screen, EngineDetailScreen)
        assert (app.filter_text, app.faults_only, app.sort_index, app.sort_reverse,
                app.expanded, app.tab) == ("", False, 0, False, frozenset(), "fleet")
        titles = await _palette_titles(pilot)
        assert {"Back to the fleet", "Health check: selected engine", "Triage: selected engine",
                "Pause / resume", "Quit"} <= titles, titles
        assert not {"Filter engines", "Toggle faults only", "Sort by the next column",
                    "Reverse the sort", "Expand / collapse: selected engine's agents",
                    "Fleet screen", "Pool screen", "Events screen"} & titles, titles
        # Health from the detail is for the engine it shows, wherever the fleet's cursor is.
        fleet_table = app.screen_stack[0].query_one(FleetTable)
        fleet_table.move_cursor(row=fleet_table.get_row_index("e:prefill-0"))
        await pilot.press("h")
        await until(pilot, lambda: isinstance(app.screen, HealthScreen)
                    and app.screen.replies is not None, "health replies")
        assert isinstance(app.screen, HealthScreen) and app.screen.replies is not None
        assert {r.agent_id for r in app.screen.replies} == {
            "decode-1/scheduler", "decode-1/dp0.tp0.pp0", "decode-1/dp0.tp1.pp0"}
        await pilot.press("escape")
        await pilot.press("escape")
        assert not isinstance(app.screen, EngineDetailScreen)
        # Back on the fleet: no filter box appeared, and the keys work again.
        assert not app.query_one("#filter", Input).display
        await pilot.press("slash")
        assert app.query_one("#filter", Input).display
        assert "Filter engines" in await _palette_titles(pilot)


def _steered(age_ms: float) -> dict[str, EngineState]:
    """Engine ``svc`` (hit rate 37% over the last minute) whose scheduler says the policy
    service steers it, reported ``age_ms`` before ``NOW_MS``."""
    states = engine("svc", role="mixed", hit_1m=0.37, age_ms=age_ms)
    key = "svc/scheduler"
    states[key] = msgspec.structs.replace(states[key], policy=PolicySteering(
        ts_ms=NOW_MS - age_ms, in_charge="service", service="tcp://10.0.0.5:5600",
        silent_ms=400.0, stale_ms=3_000.0, records_connected=True, records_sent=40))
    return states


def _detail_texts(app: KVPoolConsole) -> tuple[str, str, str, str]:
    """The detail screen's summary, hit rate and load+save labels and in-flight heading."""
    screen = app.screen
    return (str(screen.query_one("#detail-summary", Static).visual),
            str(screen.query_one("#hit-label", Label).visual),
            str(screen.query_one("#tp-label", Label).visual),
            str(screen.query_one("#inflight-label", Label).visual))


async def test_a_silent_engines_rates_and_policy_say_when_they_were_reported() -> None:
    clock = [NOW_MS]
    app = KVPoolConsole(StaticSource(_steered(300.0)), refresh_s=0.25, clock=lambda: clock[0])
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(FleetTable)
        await until(pilot, lambda: "e:svc" in table.rows, "svc's row")
        table.move_cursor(row=table.get_row_index("e:svc"))
        await pilot.press("enter")
        assert isinstance(app.screen, EngineDetailScreen)
        await until(pilot, lambda: _detail_texts(app)[1] == "hit rate (1 min): 37%",
                    "the current hit rate")
        summary, _, tp, inflight = _detail_texts(app)
        assert tp == "load+save: 6.0M/s" and inflight == "In-flight transfers"
        assert "policy: service; service tcp://10.0.0.5:5600" in summary
        assert "silent" not in summary
        # 74 s later without a report: DOWN (another host); nothing reads as current.
        clock[0] = NOW_MS + 73_700.0
        await until(pilot, lambda: "last reported" in _detail_texts(app)[1], "a stale label")
        summary, hit, tp, inflight = _detail_texts(app)
        assert hit == "hit rate (1 min), last reported 74s ago: 37%"
        assert tp == "load+save, last reported 74s ago: 6.0M/s"
        assert inflight == "In-flight transfers (last reported 74s ago)"
        assert "DOWN  silent: every figure is as last reported 74s ago" in summary
        assert "policy: service (last reported 74s ago); service tcp://" in summary


async def test_a_stopped_engines_detail_and_agent_rows_are_not_current(
        hub: str, master: str, tmp_path: Path) -> None:
    """A real engine process (``standin_engine.py``) reporting to a real hub, SIGSTOPped."""
    with standin(hub, master, tmp_path, "127.0.0.1") as (proc, _, _):
        app = KVPoolConsole(ClientSource(hub, pump=True), refresh_s=0.25)
        async with app.run_test(size=(160, 40)) as pilot:
            table = app.query_one(FleetTable)
            await until(pilot, lambda: "e:e1" in table.rows
                        and str(table.get_cell("e:e1", "state")) == "OK", "e1 OK", WAIT_S)
            table.move_cursor(row=table.get_row_index("e:e1"))
            await pilot.press("space")
            await until(pilot, lambda: "a:e1/scheduler" in table.rows, "e1's agent row")
            assert str(table.get_cell("a:e1/scheduler", "pool")).endswith("%cpu")
            await pilot.press("enter")
            assert isinstance(app.screen, EngineDetailScreen)
            await until(pilot, lambda: _detail_texts(app)[1].startswith("hit rate (1 min): "),
                        "e1's hit rate")
            os.kill(proc.pid, signal.SIGSTOP)
            await until(pilot, lambda: "HUNG" in _detail_texts(app)[0], "e1 HUNG", WAIT_S)
            summary, hit, tp, _ = _detail_texts(app)
            assert "HUNG  silent: every figure is as last reported " in summary
            assert hit.startswith("hit rate (1 min), last reported "), hit
            assert tp.startswith("load+save, last reported "), tp
            await pilot.press("escape")
            await until(pilot, lambda: str(table.get_cell("a:e1/scheduler", "state")) == "HUNG",
                        "the agent row HUNG")
            assert str(table.get_cell("a:e1/scheduler", "pool")) == "-"
