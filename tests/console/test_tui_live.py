"""The TUI against a live fleet: real hub, real agents over real sockets, real Mooncake pool,
driven with Textual's Pilot."""

from __future__ import annotations

import asyncio
import time

from livefleet import LEASE_TTL_MS, LiveFleet, until
from textual.widgets import Button, RadioSet, Static

from kvpool_agent.protocol import FlushArgs
from kvpool_console.alerts import AlertSettings
from kvpool_console.app import KVPoolConsole
from kvpool_console.screens import ConfirmScreen, FlushScreen, HealthScreen
from kvpool_console.source import ClientSource
from kvpool_console.widgets import FleetTable


def _feed(fleet: LiveFleet) -> None:
    """Prefill p0 (scheduler + 2 TP workers) and decode d0 with known numbers."""
    p0 = fleet.add_engine("p0", "prefill", "kv_producer")
    d0 = fleet.add_engine("d0", "decode", "kv_consumer")
    p0[0].reporter.lookup("r1", 1000, 0, 700, 1.5)
    p0[0].reporter.lookup("r2", 1000, 100, 600, 2.5)
    for rid, tokens in (("r1", 700), ("r2", 600)):  # hits are what the loads brought in
        p0[0].reporter.loaded(rid, tokens)
    for w in p0[1:]:
        w.reporter.transfer_started("r1", "load", 3, 3 * 4096, layers_total=32,
                                    lease_expires_ms=time.time() * 1e3 + LEASE_TTL_MS)
        w.reporter.transfer_progress("r1", "load", 10)
        w.reporter.transfer_started("r0", "load", 2, 8192)
        w.reporter.transfer_finished("r0", "load", False, 0, "LEASE_EXPIRED", 2, after_hit=True)
    d0[0].reporter.lookup("r9", 500, 0, 0, 1.0)
    for w in d0[1:]:
        w.reporter.transfer_started("r9", "save", 1, 4096)


def _cell(table: FleetTable, key: str, column: str) -> str:
    return str(table.get_cell(key, column))


def _shown(table: FleetTable) -> list[str]:
    """The table's row keys, top to bottom."""
    return [str(row.key.value) for row in table.ordered_rows]


async def test_rows_show_reported_numbers_and_stale(live_fleet: LiveFleet) -> None:
    _feed(live_fleet)
    live_fleet.wait_agents(6)
    # d0's save stays in flight: past the 2.5 s floor it would be stuck_transfer (critical),
    # and a loaded machine took longer than that to reach the row's "OK" (CI, two burners).
    app = KVPoolConsole(ClientSource(live_fleet.address, pump=True), refresh_s=0.25,
                        alert_settings=AlertSettings(stale_after_ms=1500,
                                                     stuck_after_ms=600_000))
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(FleetTable)
        await until(pilot, lambda: app.view is not None and len(app.view.engines) == 2
                     and app.view.engines[1].prompt_tokens == 2000
                     and app.view.engines[1].loads_failed == 2, "both engines reported")
        assert app.view is not None
        p0 = next(r for r in app.view.engines if r.engine_id == "p0")
        assert (p0.role, p0.kv_role, p0.ranks, p0.workers) == ("prefill", "kv_producer",
                                                               "dp0 tp0-1 pp0", 2)
        assert (p0.prompt_tokens, p0.loaded_tokens, p0.lookups) == (2000, 1300, 2)
        assert p0.loads_in_flight == 1 and p0.failed_after_hit == 2
        assert p0.next_lease_expiry_ms is not None
        assert 0 < p0.next_lease_expiry_ms - app.clock() <= LEASE_TTL_MS
        await until(pilot, lambda: _cell(table, "e:p0", "hit") == "65%", "p0 row drawn")
        assert _cell(table, "e:p0", "tokens") == "1.3k/2.0k"
        assert _cell(table, "e:p0", "loads") == "1"
        assert _cell(table, "e:p0", "fail") == "2"
        assert _cell(table, "e:p0", "kv_role") == "kv_producer"
        assert _cell(table, "e:d0", "saves") == "1"
        assert _cell(table, "e:d0", "state") == "OK"
        # d0's lookup may reach the hub after p0's reports: the totals row sums both.
        await until(pilot, lambda: _cell(table, "__totals__", "tokens") == "1.3k/2.5k",
                    "totals of both engines")
        # Expand p0: its scheduler and two worker rows appear under it.
        table.move_cursor(row=table.get_row_index("e:p0"))
        await pilot.press("space")
        await until(pilot, lambda: "a:p0/dp0.tp1.pp0" in table.rows, "worker rows")
        assert _cell(table, "a:p0/dp0.tp1.pp0", "loads") == "1"
        # Engine detail: layer progress of the in-flight layer-wise load, error with its hint.
        table.move_cursor(row=table.get_row_index("e:p0"))
        await pilot.press("enter")
        await until(pilot, lambda: app.screen.query("#inflight").first().row_count == 2,
                     "detail in-flight rows")
        await pilot.pause()
        # Loaded tokens once per request (700 + 600, from the scheduler's load outcomes), not
        # once per worker that loaded its shard of r1: prompt 2000 = local 100 + pool 1300 +
        # recomputed 600.
        summary = str(app.screen.query_one("#detail-summary", Static).visual)
        assert "hit 65.0% (1m 65.0%) of 2000 tok, loaded 1300 tok;" in summary
        assert "prompt 2000 tok = local 100 (5.0%) + pool 1300 + recomputed 600;" in summary
        inflight = app.screen.query_one("#inflight")
        assert str(inflight.get_row_at(0)[5]).startswith("10/32 ")
        errors = app.screen.query_one("#errors")
        assert errors.row_count == 2
        assert str(errors.get_row_at(0)[1]) == "LEASE_EXPIRED"
        assert {str(errors.get_row_at(i)[2]) for i in range(2)} == {"dp0.tp0.pp0",
                                                                    "dp0.tp1.pp0"}
        assert "failed after a positive lookup" in str(errors.get_row_at(0)[4])
        assert "default_kv_lease_ttl" in str(errors.get_row_at(0)[5])
        await pilot.press("escape")
        # d0 goes silent: it stays listed, marked with its stale alert's verdict (its agents
        # name pid 4242 on this host: gone, or stale when that pid runs unproven).
        for h in live_fleet.engines["d0"]:
            h.stop()
        await until(pilot, lambda: any(a.key == "stale:d0" for a in app.alerts)
                    and _cell(table, "e:d0", "state") != "OK", "d0 silent")
        (silent,) = [a for a in app.alerts if a.key == "stale:d0"]
        assert _cell(table, "e:d0", "state") == silent.verdict.upper() in ("GONE", "STALE")
        # Every finished load of p0 failed after a positive lookup: critical (waited for: on
        # a loaded machine p0's own next report can come after the stale threshold too, and
        # STALE outranks CRIT until it does; CI saw it once).
        await until(pilot, lambda: _cell(table, "e:p0", "state") == "CRIT", "p0 critical")
        # The hub itself goes away: the status bar says so, the last rows stay visible.
        live_fleet.hub.stop()
        await until(pilot, lambda: "HUB SILENT" in str(
            app.query_one("#status-bar", Static).content), "hub silent", 15)
        assert "e:p0" in table.rows


async def test_filter_sort_pause(live_fleet: LiveFleet) -> None:
    _feed(live_fleet)
    p1 = live_fleet.add_engine("p1", "prefill", "kv_producer", tp=1)[0].reporter
    p1.lookup("x", 1000, 0, 900, 1.0)
    p1.loaded("x", 900)
    live_fleet.wait_agents(8)
    app = KVPoolConsole(ClientSource(live_fleet.address, pump=True), refresh_s=0.25)
    async with app.run_test(size=(120, 30)) as pilot:
        table = app.query_one(FleetTable)
        await until(pilot, lambda: _shown(table) == ["e:d0", "e:p0", "e:p1", "__totals__"]
                     and _cell(table, "e:p1", "hit") == "90%", "three engines")
        # Sort by hit rate (s: engine -> role -> hit), highest first with r.
        await pilot.press("s", "s", "r")
        await until(pilot, lambda: _shown(table)[:3] == ["e:p1", "e:p0", "e:d0"], "hit sort")
        await pilot.press("slash")
        await pilot.press(*"prefill")
        await until(pilot, lambda: _shown(table) == ["e:p1", "e:p0", "__totals__"], "filter")
        await pilot.press("enter")
        assert "filter 'prefill'" in str(app.query_one("#status-bar", Static).content)
        await pilot.press("x")  # faults only: p0 has failed loads after hits
        await until(pilot, lambda: _shown(table) == ["e:p0", "__totals__"], "faults only")
        await pilot.press("p")
        assert app.paused and "PAUSED" in str(app.query_one("#status-bar", Static).content)
        frames = app.frames
        await pilot.pause(0.6)
        assert app.frames == frames
        await pilot.press("p", "x")
        await until(pilot, lambda: not app.paused and _shown(table) == [
            "e:p1", "e:p0", "__totals__"], "resumed")
        await pilot.press("minus")
        assert app.refresh_s == 0.5


async def test_flush_needs_confirmation_and_removes_keys(live_fleet: LiveFleet) -> None:
    _feed(live_fleet)
    mine = live_fleet.put_keys(live_fleet.model, 3)
    other_model = live_fleet.model + "-other"
    others = live_fleet.put_keys(other_model, 2)
    live_fleet.wait_agents(6)
    app = KVPoolConsole(ClientSource(live_fleet.address, keys_dir=str(live_fleet.keys.root),
                                     pump=True),
                        refresh_s=0.25)
    logged: list[str] = []
    log_event = app.log_event

    def logging(message: str, style: str = "") -> None:
        logged.append(message)
        log_event(message, style)
    app.log_event = logging  # type: ignore[method-assign]
    async with app.run_test(size=(120, 36)) as pilot:
        table = app.query_one(FleetTable)
        await until(pilot, lambda: "e:p0" in table.rows, "p0")
        # The header says which key it holds and where, for one-shot commands beside it.
        assert app.sub_title == (f"{live_fleet.address}  ·  operator key, "
                                 f"KVPOOL_KEYS_DIR={live_fleet.keys.root}")
        table.move_cursor(row=table.get_row_index("e:p0"))
        await pilot.press("f")
        await until(pilot, lambda: isinstance(app.screen, FlushScreen), "flush modal")
        screen = app.screen
        assert isinstance(screen, FlushScreen)
        assert screen.query_one("#go", Button).disabled  # nothing to confirm before a dry run
        # Opened on an engine row, the dialog starts on that engine's scope (the narrowest).
        assert screen.query_one("#scope", RadioSet).pressed_button.name == "engine"
        await pilot.click("#scope-model")
        assert screen.query_one("#scope", RadioSet).pressed_button.name == "model"
        # batch_exists below takes Mooncake leases on the keys: only a forced flush removes them.
        await pilot.click("#force")
        await pilot.click("#dry")
        await until(pilot, lambda: screen.dry is not None, "dry run", 15)
        assert screen.dry is not None and screen.dry.keys == 6
        assert "would remove 6 keys" in str(screen.query_one("#flush-status", Static).content)
        assert live_fleet.present(mine) == [1] * 6  # a dry run removes nothing
        await pilot.click("#go")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "confirmation")
        await pilot.click("#no")
        await until(pilot, lambda: app.screen is screen, "back to flush modal")
        assert live_fleet.present(mine) == [1] * 6
        await pilot.click("#go")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "confirmation 2")
        await pilot.click("#yes")
        await until(pilot, lambda: screen.result is not None, "flush result", 15)
        assert screen.result is not None and screen.result.removed_keys == 6
        assert "removed 6 of 6 keys" in str(screen.query_one("#flush-status", Static).content)
    # The events log says what each did (a dry run read "ok, removed 0" before).
    flushes = [m.rpartition(": ")[2] for m in logged if m.startswith("flush ")]
    assert flushes == ["ok, would remove 6 keys", "ok, removed 6 of 6 keys"]
    assert live_fleet.present(mine) == [0] * 6
    assert live_fleet.present(others) == [1] * 4  # another model's keys are untouched
    audit = (live_fleet.keys.root.parent.parent / "audit.jsonl").read_text()
    assert '"flush"' in audit


async def test_read_only_console_refuses_flush(live_fleet: LiveFleet) -> None:
    _feed(live_fleet)
    mine = live_fleet.put_keys(live_fleet.model, 2)
    live_fleet.wait_agents(6)
    src = ClientSource(live_fleet.address, pump=True)
    assert not src.can_flush
    app = KVPoolConsole(src, refresh_s=0.25)
    async with app.run_test(size=(120, 30)) as pilot:
        table = app.query_one(FleetTable)
        await until(pilot, lambda: "e:p0" in table.rows, "p0")
        assert "READ-ONLY" in str(app.query_one("#status-bar", Static).content)
        assert app.sub_title.startswith(f"{live_fleet.address}  ·  ")
        assert "operator key" not in app.sub_title
        assert app.check_action("flush", ()) is None  # disabled, shown dimmed in the footer
        await pilot.press("f")
        await pilot.pause(0.3)
        assert not isinstance(app.screen, FlushScreen)
        app.action_flush()  # what the command palette entry runs: says why, opens nothing
        await pilot.pause(0.1)
        assert not isinstance(app.screen, FlushScreen)
        assert any("flush needs the operator key" in str(n.message)
                   for n in app._notifications)
        # Health needs no key and shows its results in place.
        table.move_cursor(row=table.get_row_index("e:p0"))
        await pilot.press("h")
        await until(pilot, lambda: isinstance(app.screen, HealthScreen)
                     and app.screen.replies is not None, "health replies", 20)
        assert isinstance(app.screen, HealthScreen) and app.screen.replies is not None
        assert sorted(r.agent_id for r in app.screen.replies) == [
            "p0/dp0.tp0.pp0", "p0/dp0.tp1.pp0", "p0/scheduler"]
    # The plain command port refuses a real flush even when asked directly.
    with live_fleet.client(operator=False) as plain:
        replies = await asyncio.to_thread(
            plain.command, "flush", flush=FlushArgs(scope="model", model=live_fleet.model,
                                                    dry_run=False))
    assert replies and not any(r.ok for r in replies)
    assert "unauthorised" in (replies[0].error or "")
    assert live_fleet.present(mine) == [1] * 4
