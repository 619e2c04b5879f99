"""Key handling on a frozen fleet: tabs, help, palette entries, detail navigation (and the
layout digest it shows), Ctrl-C."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, sample_fleet
from textual.widgets import Static

from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import status_document
from kvpool_console.model import build_view
from kvpool_console.screens import EngineDetailScreen, HealthScreen, HelpScreen
from kvpool_console.source import StaticSource
from kvpool_console.widgets import TOTALS, AgentKey, EngineKey, FleetTable


def _app() -> KVPoolConsole:
    return KVPoolConsole(StaticSource(sample_fleet()), refresh_s=3600, clock=lambda: NOW_MS)


async def test_navigation_and_ctrl_c_quits() -> None:
    app = _app()
    async with app.run_test(size=(100, 30)) as pilot:
        tabs = app.query_one("#tabs")
        for key, tab in (("2", "pool"), ("3", "events"), ("1", "fleet")):
            await pilot.press(key)
            assert tabs.active == tab  # type: ignore[attr-defined]
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        table = app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index("e:decode-1"))
        await pilot.press("enter")
        assert isinstance(app.screen, EngineDetailScreen)
        assert app.screen.engine_id == "decode-1"
        await pilot.press("escape")
        # Health on a recorded fleet: every agent of the engine answers "no live agents".
        await pilot.press("h")
        await pilot.pause(0.3)
        assert isinstance(app.screen, HealthScreen) and app.screen.replies is not None
        assert {r.agent_id for r in app.screen.replies} == {
            "decode-1/scheduler", "decode-1/dp0.tp0.pp0", "decode-1/dp0.tp1.pp0"}
        assert not any(r.ok for r in app.screen.replies)
        await pilot.press("escape")
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert "Flush pool entries" in titles and "Health check: all engines" in titles
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running


async def test_typed_row_keys_and_choosing_an_agent_row() -> None:
    app = _app()
    async with app.run_test(size=(100, 30)) as pilot:
        table = app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index("e:decode-1"))
        assert table.selected_key == EngineKey("decode-1")
        await pilot.press("space")
        assert app.expanded == {"decode-1"}
        table.move_cursor(row=table.get_row_index("a:decode-1/dp0.tp1.pp0"))
        assert table.selected_key == AgentKey("decode-1", "decode-1/dp0.tp1.pp0")
        assert table.selected_engine_id == "decode-1"
        # Enter on an agent row opens its engine's detail.
        await pilot.press("enter")
        assert isinstance(app.screen, EngineDetailScreen)
        assert app.screen.engine_id == "decode-1"
        await pilot.press("escape")
        # The totals row stands for no engine: enter opens nothing, health asks everyone.
        table.move_cursor(row=table.row_count - 1)
        assert table.selected_key == TOTALS and table.selected_engine_id is None
        await pilot.press("enter")
        assert not isinstance(app.screen, EngineDetailScreen)
        await pilot.press("h")
        await pilot.pause(0.3)
        assert isinstance(app.screen, HealthScreen) and app.screen.replies is not None
        assert len(app.screen.replies) == len(sample_fleet())


async def test_columns_grow_when_values_get_wider() -> None:
    from fleetdata import engine

    app = KVPoolConsole(StaticSource(engine("e")), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(120, 30)) as pilot:
        table = app.query_one(FleetTable)
        await pilot.pause()
        col = next(c for k, c in table.columns.items() if k.value == "fail")
        assert str(table.get_cell("e:e", "fail")) == "0" and col.content_width == len("Fail")
        app.source = StaticSource(engine("e", load_errors=123_456))
        app.tick()
        await pilot.pause()
        assert str(table.get_cell("e:e", "fail")) == "246912"  # 2 workers
        assert col.content_width == len("246912")


async def test_detail_shows_the_layout_digest_and_what_it_hashes() -> None:
    layout: dict[str, str | int] = {"dtype": "bfloat16", "block_size": 32, "cache": "2x [odd]"}
    fleet = {aid: msgspec.structs.replace(st, source=msgspec.structs.replace(
                 st.source, layout_digest="0123456789ab", layout=layout))
             if st.source.process_role == "worker" and st.source.engine_id == "prefill-0" else st
             for aid, st in sample_fleet().items()}
    app = KVPoolConsole(StaticSource(fleet), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(FleetTable)
        for engine, shown in (("prefill-0", True), ("decode-0", False)):
            table.move_cursor(row=table.get_row_index(f"e:{engine}"))
            await pilot.press("enter")
            assert isinstance(app.screen, EngineDetailScreen)
            text = str(app.screen.query_one("#detail-summary", Static).visual)
            # Values are shown as they are (no markup parsed from them).
            assert ("layout 0123456789ab: dtype=bfloat16 block_size=32 cache=2x [odd]"
                    in text) is shown
            assert ("layout" in text) is shown
            await pilot.press("escape")


async def test_detail_and_status_name_the_kv_cache_groups_and_mla() -> None:
    groups = ("sliding_window(64):SlidingWindowSpec x3 b32 | "
              "full:FullAttentionSpec x1 b32")
    layouts: dict[str, dict[str, str | int]] = {
        "prefill-0": {"attn_backend": "CPU_ATTN", "groups": groups},
        "decode-0": {"attn_backend": "CPU_MLA"},
    }
    fleet = {aid: msgspec.structs.replace(st, source=msgspec.structs.replace(
                 st.source, layout_digest="0123456789ab",
                 layout=layouts[st.source.engine_id]))
             if st.source.process_role == "worker" and st.source.engine_id in layouts else st
             for aid, st in sample_fleet().items()}
    # prefill-0's workers moved bytes by group: summed over its workers.
    for aid, st in fleet.items():
        if st.source.engine_id == "prefill-0" and st.source.process_role == "worker":
            fleet[aid] = msgspec.structs.replace(st, transfers=msgspec.structs.replace(
                st.transfers, loaded_bytes_by_group={"g0": 1 << 20, "g1": 4 << 20},
                saved_bytes_by_group={"g1": 2 << 20}))
    n_workers = sum(1 for st in fleet.values() if st.source.engine_id == "prefill-0"
                    and st.source.process_role == "worker")
    view = build_view(fleet, {aid: NOW_MS for aid in fleet}, NOW_MS)
    rows = {e.engine_id: e for e in view.engines}
    assert (rows["prefill-0"].kv_groups, rows["prefill-0"].mla) == (
        ["sliding_window(64):SlidingWindowSpec x3 b32", "full:FullAttentionSpec x1 b32"], False)
    assert (rows["decode-0"].kv_groups, rows["decode-0"].mla) == (["full"], True)
    assert rows["prefill-0"].loaded_bytes_by_group == {
        "g0": n_workers << 20, "g1": 4 * n_workers << 20}
    assert rows["decode-0"].loaded_bytes_by_group == {}
    doc = status_document(view)
    assert [(e["kv_groups"], e["saved_bytes_by_group"]) for e in doc["engines"]
            if e["engine_id"] == "prefill-0"] == [
        (rows["prefill-0"].kv_groups, {"g1": 2 * n_workers << 20})]
    app = KVPoolConsole(StaticSource(fleet), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(FleetTable)
        for engine, line in (
                ("prefill-0", "KV-cache groups: sliding_window(64):SlidingWindowSpec x3 b32; "
                              "full:FullAttentionSpec x1 b32"),
                ("decode-0", "KV-cache groups: full; MLA: one copy for every TP rank")):
            table.move_cursor(row=table.get_row_index(f"e:{engine}"))
            await pilot.press("enter")
            await pilot.pause()  # the row's choice is a message; under load it lands later
            text = str(app.screen.query_one("#detail-summary", Static).visual)
            assert line in text
            assert "groups=" not in text
            assert ("bytes by group: g0 loaded" in text) is (engine == "prefill-0")
            await pilot.press("escape")


async def test_health_modal_lists_each_failed_check_with_the_backend_error() -> None:
    from textual.widgets import DataTable

    from kvpool_agent.protocol import PROTOCOL_VERSION, CommandReply, HealthCheck, HealthResult

    class MasterDown(StaticSource):
        def command(self, command: str, **kw: object) -> list[CommandReply]:
            return [CommandReply(
                v=PROTOCOL_VERSION, seq=1, request_id="r", agent_id="decode-1/dp0.tp0.pp0",
                ok=False, health=HealthResult(checks=[
                    HealthCheck(name="master", ok=False, latency_ms=2.0,
                                detail="master unreachable: connection refused", code=2),
                    HealthCheck(name="probe_put", ok=False, latency_ms=1.0,
                                detail="RPC_FAIL")]))]

    app = KVPoolConsole(MasterDown(sample_fleet()), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("h")
        await pilot.pause(0.3)
        assert isinstance(app.screen, HealthScreen)
        table = app.screen.query_one("#health-table", DataTable)
        rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
        assert rows == [
            ["decode-1/dp0.tp0.pp0", "master", "FAIL", "2.0",
             "master unreachable: connection refused (code 2)"],
            ["decode-1/dp0.tp0.pp0", "probe_put", "FAIL", "1.0", "RPC_FAIL"]]


async def test_a_click_selects_the_row_clicked_where_other_rows_read_the_same() -> None:
    """Cells that read the same share one render (FleetTable._render_cell); each keeps its
    own row for mouse clicks."""
    app = _app()
    async with app.run_test(size=(160, 30)) as pilot:
        table = app.query_one(FleetTable)
        await pilot.pause()
        order = [str(k.value) for k in table.columns]
        x = sum(table.columns[k].get_render_width(table)
                for k in list(table.columns)[:order.index("fail")]) + 1
        row = table.get_row_index("e:prefill-2")
        assert str(table.get_cell("e:prefill-2", "fail")) == "0"
        assert [str(table.get_cell_at((r, order.index("fail")))) for r in range(row)].count(
            "0") >= 2
        for target in (row, 0, row):
            await pilot.click(FleetTable, offset=(x, 1 + target))  # line 0 is the header
            await pilot.pause()
            assert table.cursor_row == target
            assert table.selected_engine_id == table.selected_key.engine_id  # type: ignore[union-attr]
        assert table.selected_key == EngineKey("prefill-2")


async def test_rows_below_the_screen_are_current_once_scrolled_to() -> None:
    """Only rows near the screen are updated each refresh; the others when they come into
    view (FleetTable.show)."""
    from fleetdata import engine

    def fleet(errors: int) -> dict:
        out: dict = {}
        for i in range(60):
            out |= engine(f"e{i:02d}", load_errors=errors if i == 59 else 0)
        return out

    app = KVPoolConsole(StaticSource(fleet(0)), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(100, 20)) as pilot:
        table = app.query_one(FleetTable)
        await pilot.pause()
        assert str(table.get_cell("e:e59", "fail")) == "0"
        app.source = StaticSource(fleet(7))
        app.tick()
        await pilot.pause()
        assert str(table.get_cell("e:e00", "fail")) == "0"
        # The cursor moved down (scrolls the table), or the table scrolled: both catch up.
        table.move_cursor(row=table.get_row_index("e:e59"), animate=False)
        await pilot.pause()
        assert str(table.get_cell("e:e59", "fail")) == "14"  # 2 workers
        assert str(table.get_cell("__totals__", "fail")) == "14"
        app.source = StaticSource(fleet(9))
        app.tick()
        await pilot.pause()
        assert str(table.get_cell("e:e59", "fail")) == "18"  # in view: updated at once
        table.scroll_home(animate=False)
        await pilot.pause()
        app.source = StaticSource(fleet(11))
        app.tick()
        table.scroll_end(animate=False)
        await pilot.pause()
        assert str(table.get_cell("e:e59", "fail")) == "22"


async def test_a_cell_whose_text_stays_but_style_changes_is_redrawn() -> None:
    """A row going stale keeps its engine id and dims it (rich Text equality ignores
    styles)."""
    from fleetdata import engine

    app = KVPoolConsole(StaticSource(engine("e", age_ms=300)), refresh_s=3600,
                        clock=lambda: NOW_MS)
    async with app.run_test(size=(120, 30)) as pilot:
        table = app.query_one(FleetTable)
        await pilot.pause()
        assert table.get_cell("e:e", "engine").style == ""  # type: ignore[union-attr]
        app.source = StaticSource(engine("e", age_ms=9_000))
        app.tick()
        await pilot.pause()
        assert str(table.get_cell("e:e", "engine")) == "▸ e"
        assert table.get_cell("e:e", "engine").style == "dim"  # type: ignore[union-attr]
