"""Operators see versions (issue 39 item 5): the engine detail screen's identity line and
``status --json``'s ``layout.fingerprint``, on a fleet of one model over two weight versions
and an engine without a content identity; each engine's LoRA adapters by content
(``engines[].adapters``, the identity line) and the info alert for one name over two adapters,
also through a real hub."""

from __future__ import annotations

import html
import json
import re
import time

import msgspec
import pytest
from fleetdata import NOW_MS, engine
from livefleet import LiveFleet
from textual.widgets import DataTable, Static

from kvpool_agent.protocol import EngineState
from kvpool_console.alerts import evaluate
from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import main as console_main
from kvpool_console.cli import status_document
from kvpool_console.model import build_view
from kvpool_console.screens import EngineDetailScreen
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable
from kvpool_console.widgets._identity import identity_line

V1, V2 = "safetensors:" + "1" * 32, "safetensors:" + "2" * 32
LONE = "unshared:" + "3" * 32


def _described(eid: str, fingerprint: str, model: str = "m") -> dict[str, EngineState]:
    """Engine ``eid`` whose workers report ``fingerprint`` (its scheduler reports no layout)."""
    out = {}
    for k, s in engine(eid, model=model).items():
        facts = ({"model": model, "block_size": 16, "fingerprint": fingerprint}
                 if s.source.process_role == "worker" else {})
        out[k] = msgspec.structs.replace(s, source=msgspec.structs.replace(
            s.source, model=model, layout_digest="d" + fingerprint[-1] if facts else "",
            layout=facts))
    return out


def _fleet() -> dict[str, EngineState]:
    return (_described("a", V1) | _described("b", V2) | _described("c", V2)
            | _described("x", LONE) | _described("other", V1, model="n"))


def test_the_identity_line_names_the_weights_and_who_shares_them() -> None:
    fleet = _fleet()
    rows = {r.engine_id: r for r in build_view(fleet, {}, NOW_MS).engines}
    assert identity_line(rows["b"], fleet) == (
        f"weights {V2}, as c; other weights of m: {V1} on a; {LONE} on x (never shared with "
        "these)")
    # Engine "other" runs V1 too, but another model: not listed under m.
    assert identity_line(rows["a"], fleet) == (
        f"weights {V1}; other weights of m: {V2} on b, c; {LONE} on x (never shared with "
        "these)")
    assert identity_line(rows["x"], fleet).startswith(
        f"weights {LONE} (shares with no engine: set model_fingerprint")
    assert identity_line(rows["other"], fleet) == f"weights {V1}"
    # Before the workers registered their KV caches: no line.
    bare = engine("y")
    assert identity_line(build_view(bare, {}, NOW_MS).engines[0], bare) == ""


def test_status_json_carries_each_engines_fingerprint() -> None:
    fleet = _fleet()
    doc = status_document(build_view(fleet, {}, NOW_MS, alerts=evaluate(fleet, {}, NOW_MS)))
    got = {e["engine_id"]: e["layout"].get("fingerprint") for e in doc["engines"]}
    assert got == {"a": V1, "b": V2, "c": V2, "x": LONE, "other": V1}
    assert {a["rule"] for a in doc["alerts"]} >= {"model_versions", "unshared_identity"}


async def test_the_detail_screen_shows_it() -> None:
    app = KVPoolConsole(StaticSource(_fleet(), address="tcp://hub:7600"), refresh_s=3600,
                        clock=lambda: NOW_MS)
    async with app.run_test(size=(220, 60)) as pilot:
        await pilot.pause()
        table = app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index("e:b"))
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, EngineDetailScreen)
        svg = app.export_screenshot()
        text = html.unescape("".join(re.findall(r">([^<]*)</text>", svg))).replace("\xa0", " ")
        assert f"identity: weights {V2}, as c; other weights of m: {V1} on a;" in text


LORA1, LORA2 = "lora:" + "a" * 32, "lora:" + "b" * 32


def _serving(fleet: dict[str, EngineState], eid: str, adapters: dict[str, str]
             ) -> dict[str, EngineState]:
    """``fleet`` with engine ``eid``'s scheduler reporting ``adapters``."""
    s = fleet[f"{eid}/scheduler"]
    return fleet | {f"{eid}/scheduler": msgspec.structs.replace(
        s, lookup=msgspec.structs.replace(s.lookup, adapters=adapters))}


def test_adapters_by_content_in_status_json_the_identity_line_and_an_info_alert() -> None:
    """One LoRA name over two adapters across engines of one model: each engine's adapters in
    ``status --json`` and on its identity line, and the ``model_versions`` info alert naming
    which engines hold which; the same name on another model is not compared."""
    fleet = _serving(_serving(_serving(_fleet(), "a", {"sql": LORA1, "chat": LORA2}), "b",
                              {"sql": LORA2}), "other", {"sql": LORA2})
    alerts = evaluate(fleet, {}, NOW_MS)
    doc = status_document(build_view(fleet, {}, NOW_MS, alerts=alerts))
    got = {e["engine_id"]: e["adapters"] for e in doc["engines"]}
    assert got == {"a": {"chat": LORA2, "sql": LORA1}, "b": {"sql": LORA2}, "c": {}, "x": {},
                   "other": {"sql": LORA2}}
    rows = {r.engine_id: r for r in build_view(fleet, {}, NOW_MS).engines}
    assert identity_line(rows["b"], fleet).endswith(
        f"(never shared with these); adapters: sql={LORA2}")
    assert identity_line(rows["a"], fleet).endswith(f"; adapters: chat={LORA2}, sql={LORA1}")
    assert identity_line(rows["c"], fleet) == f"weights {V2}, as b; other weights of m: " \
        f"{V1} on a; {LONE} on x (never shared with these)"
    (lora,) = [a for a in doc["alerts"] if a["subject"] == "m lora sql"]
    assert (lora["rule"], lora["severity"]) == ("model_versions", "info")
    assert lora["message"] == (f"engines of m serve LoRA adapter sql in 2 versions ({LORA1}: a; "
                               f"{LORA2}: b): engines of different versions never share its KV")
    assert "kvpool-config fingerprint --adapter" in lora["hint"]
    assert not [a for a in alerts if "chat" in a.subject or a.subject.startswith("n ")]
    # An info alert marks no engine: a, b and c stay as their other alerts leave them.
    weights = [a for a in alerts if a.rule == "model_versions" and a.subject == "m"]
    assert [a.severity for a in weights] == ["info"]
    assert {e["engine_id"]: e["state"] for e in doc["engines"]}["b"] == "OK"
    # Adapters only, before any worker reported its weights' fingerprint.
    bare = _serving(engine("y"), "y", {"sql": LORA1})
    assert identity_line(build_view(bare, {}, NOW_MS).engines[0], bare) == \
        f"adapters: sql={LORA1}"


async def test_the_detail_screen_status_bar_and_events_show_adapters_and_info_alerts() -> None:
    fleet = _serving(_serving(_fleet(), "a", {"sql": LORA1}), "b", {"sql": LORA2})
    app = KVPoolConsole(StaticSource(fleet, address="tcp://hub:7600"), refresh_s=3600,
                        clock=lambda: NOW_MS)
    async with app.run_test(size=(220, 60)) as pilot:
        await pilot.pause()
        infos = sorted(a.subject for a in app.alerts if a.severity == "info")
        assert infos == ["m", "m lora sql"]
        warns = sum(a.severity == "warning" for a in app.alerts)
        crits = sum(a.severity == "critical" for a in app.alerts)
        assert f"alerts {crits}C/{warns}W/2I " in str(app.query_one("#status-bar", Static).visual)
        await pilot.press("3")
        await pilot.pause()
        table = app.query_one("#alerts-table", DataTable)
        labels = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        assert labels.count("INFO") == 2
        await pilot.press("1")
        await pilot.pause()
        fleet_table = app.query_one(FleetTable)
        fleet_table.move_cursor(row=fleet_table.get_row_index("e:b"))
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, EngineDetailScreen)
        svg = app.export_screenshot()
        text = html.unescape("".join(re.findall(r">([^<]*)</text>", svg))).replace("\xa0", " ")
        assert f"adapters: sql={LORA2}" in re.sub(r"\s+", " ", text)


def test_adapters_reach_status_json_through_a_real_hub(
        live_fleet: LiveFleet, capsys: pytest.CaptureFixture[str]) -> None:
    """An engine's scheduler reporter -> its agent -> a real keyed hub -> ``status --json``:
    each engine's adapters, and the info alert for one LoRA name over two adapters."""
    for eid, identity in (("p0", LORA1), ("p1", LORA2)):
        sched = live_fleet.add_engine(eid, "prefill", "kv_producer", tp=1)[0]
        sched.reporter.adapter_served("sql", identity)
    live_fleet.wait_agents(4)
    deadline = time.monotonic() + 10
    while sum(bool(s.lookup.adapters) for s, _ in live_fleet.hub.fleet().values()) < 2:
        assert time.monotonic() < deadline, "the hub never saw both engines' adapters"
        time.sleep(0.05)
    assert console_main(["status", "--json", "--hub", live_fleet.address]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {e["engine_id"]: e["adapters"] for e in doc["engines"]} == {
        "p0": {"sql": LORA1}, "p1": {"sql": LORA2}}
    (alert,) = [a for a in doc["alerts"] if a["rule"] == "model_versions"]
    assert (alert["severity"], alert["subject"]) == ("info", f"{live_fleet.model} lora sql")
    assert f"({LORA1}: p0; {LORA2}: p1)" in alert["message"]
