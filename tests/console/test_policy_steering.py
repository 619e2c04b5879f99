"""Who steers the engines configured for the policy service (``EngineState.policy``, issue 40
item 1) in ``status --json``, on the Pool tab and as the ``policy_master`` warning; engines
without it show nothing. The live path (a real service, agent and hub) is
tests/policy/test_policy_console_live.py."""

from __future__ import annotations

import io
import json
import time

import msgspec
import pytest
from fleetdata import NOW_MS, engine
from rich.console import Console
from textual.widgets import Static

from kvpool_agent.protocol import EngineState, PolicySteering
from kvpool_console.alerts import evaluate
from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import _parser, _status, status_document
from kvpool_console.model import build_view
from kvpool_console.screens import EngineDetailScreen
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable

SERVICE = "tcp://10.0.0.5:5600"


def _steered(engine_id: str, in_charge: str, silent_ms: float, *, sent: int = 40,
             dropped: int = 0, age_ms: float = 300.0, removed: int = 0
             ) -> dict[str, EngineState]:
    states = engine(engine_id, role="mixed", age_ms=age_ms)
    key = f"{engine_id}/scheduler"
    states[key] = msgspec.structs.replace(states[key], policy=PolicySteering(
        ts_ms=NOW_MS - age_ms, in_charge=in_charge,  # type: ignore[arg-type]
        service=SERVICE, silent_ms=silent_ms, stale_ms=3_000.0,
        records_connected=in_charge == "service", records_sent=sent, records_dropped=dropped,
        service_removed_keys=removed))
    return states


def _fleet() -> dict[str, EngineState]:
    # svc-b heard the service last 12 s ago (fewer keys removed then): the service's count is
    # the largest its engines report.
    return {**_steered("svc-a", "service", 400.0, removed=26_541),
            **_steered("svc-b", "master", 12_000.0, sent=70, dropped=9, removed=11_706),
            **engine("plain", role="mixed")}


def _doc(states: dict[str, EngineState]) -> dict:
    seen = {a: NOW_MS for a in states}
    return status_document(build_view(states, seen, NOW_MS,
                                      alerts=evaluate(states, seen, NOW_MS)))


def test_status_json_says_who_steers_each_engine_configured_for_the_service() -> None:
    doc = _doc(_fleet())
    rows = {e["engine_id"]: e for e in doc["engines"]}
    keys = ("policy", "policy_in_charge", "policy_service", "policy_silent_ms",
            "policy_records_sent", "policy_records_dropped", "policy_removed_keys")
    assert {k: rows["svc-a"][k] for k in keys} == {
        "policy": "service", "policy_in_charge": "service", "policy_service": SERVICE,
        "policy_silent_ms": 400.0, "policy_records_sent": 40, "policy_records_dropped": 0,
        "policy_removed_keys": 26_541}
    assert {k: rows["svc-b"][k] for k in keys} == {
        "policy": "service_silent", "policy_in_charge": "master",
        "policy_service": SERVICE, "policy_silent_ms": 12_000.0, "policy_records_sent": 70,
        "policy_records_dropped": 9, "policy_removed_keys": 11_706}
    assert {k: rows["plain"][k] for k in keys} == {
        "policy": "", "policy_in_charge": "", "policy_service": "", "policy_silent_ms": 0.0,
        "policy_records_sent": 0, "policy_records_dropped": 0, "policy_removed_keys": 0}
    (alert,) = [a for a in doc["alerts"] if a["rule"] == "policy_master"]
    assert alert["severity"] == "warning"
    # One alert for the pool (named by its segments: no master address in this fleet).
    assert alert["subject"] == "mooncake:127.0.0.1:15001,127.0.0.1:15002"
    assert [p["name"] for p in doc["pools"]] == [alert["subject"]]
    assert alert["message"] == (
        f"the master is in charge of 1 engine(s) configured for the policy service (svc-b): "
        f"{SERVICE} silent 12.0 s; every chunk is saved and the master's watermark evicts")
    assert "`kvpool-policy serve`" in alert["hint"] and "docs/policy.md" in alert["hint"]


def test_no_warning_before_the_stale_time_nor_for_a_silent_engine() -> None:
    # Just started (no snapshot yet, 1.2 s of a 3 s stale time): shown, not alerted.
    young = _steered("young", "master", 1_200.0)
    doc = _doc(young)
    assert doc["engines"][0]["policy"] == "records_not_connected"
    assert [a for a in doc["alerts"] if a["rule"] == "policy_master"] == []
    # An engine silent past the stale threshold: its report is old, ``stale`` names it.
    old = _steered("old", "master", 60_000.0, age_ms=10_000.0)
    seen = {a: NOW_MS - 10_000.0 for a in old}
    rules = {a.rule for a in evaluate(old, seen, NOW_MS)}
    assert "stale" in rules and "policy_master" not in rules


def test_status_json_policy_is_a_machine_value_the_screens_say_in_words(
        capsys: pytest.CaptureFixture[str]) -> None:
    # status --json as the command prints it: ``policy`` one of four values, never the
    # screens' label, and no other key than the documented ones (policy_value is the row's).
    fleet = {**_fleet(), **_steered("young", "master", 1_200.0)}
    assert _status(_parser().parse_args(["status", "--json"]), _reporting(fleet),
                   Console(file=io.StringIO())) == 0
    engines = {e["engine_id"]: e for e in json.loads(capsys.readouterr().out)["engines"]}
    assert {eid: e["policy"] for eid, e in engines.items()} == {
        "svc-a": "service", "svc-b": "service_silent", "young": "records_not_connected",
        "plain": ""}
    assert not any("policy_value" in e for e in engines.values())
    # The words the screens show say the same: the master's reason is the value in words.
    rows = {r.engine_id: r for r in build_view(fleet, {a: NOW_MS for a in fleet}, NOW_MS).engines}
    for eid, e in engines.items():
        label = rows[eid].policy
        if e["policy"] in ("", "service"):
            assert label == (e["policy"] and "policy: service"), eid
        else:
            assert label.startswith(f"policy: master ({e['policy'].replace('_', ' ')}"), eid


async def test_pool_tab_names_who_steers() -> None:
    app = KVPoolConsole(StaticSource(_fleet()), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(200, 40)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        summary = str(app.query_one("#pool-summary", Static).render())
    line = summary.splitlines()[-1]
    # The service's removals: the pool row's Evicted column counts the master's only.
    assert line == ("policy: the service steers 1 engine(s) (svc-a), removed 26,541 keys; the "
                    "master steers 1: svc-b (service silent 12.0 s)")


def _reporting(fleet: dict[str, EngineState]) -> StaticSource:
    """``fleet`` as a source whose every agent reported just now (``status`` ages the reports
    by the wall clock: the fixtures' ``NOW_MS`` would make every engine silent)."""
    return StaticSource(fleet, {a: time.time() * 1e3 for a in fleet})


def _status_text(fleet: dict[str, EngineState]) -> str:
    """``kvpool-console status``'s text view of ``fleet``, on a wide terminal (every agent
    reported just now)."""
    out = Console(file=io.StringIO(), width=300)
    _status(_parser().parse_args(["status"]), _reporting(fleet), out)
    return out.file.getvalue()  # type: ignore[attr-defined]


def test_status_text_names_who_steers() -> None:
    """The status text carries the Pool tab's policy line (one owner: ``steering_summary``)."""
    assert _status_text(_fleet()).count(
        "policy: the service steers 1 engine(s) (svc-a), removed 26,541 keys; the master "
        "steers 1: svc-b (service silent 12.0 s)") == 1
    assert "policy:" not in _status_text(engine("plain", role="mixed"))


async def test_pool_tab_without_service_engines_has_no_policy_line() -> None:
    app = KVPoolConsole(StaticSource(engine("plain", role="mixed")), refresh_s=3600,
                        clock=lambda: NOW_MS)
    async with app.run_test(size=(200, 40)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        summary = str(app.query_one("#pool-summary", Static).render())
    assert "policy" not in summary


async def test_detail_screen_names_who_steers_only_for_service_engines() -> None:
    app = KVPoolConsole(StaticSource(_fleet()), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(FleetTable)
        seen = {}
        for eid in ("svc-b", "plain"):
            table.move_cursor(row=table.get_row_index(f"e:{eid}"))
            await pilot.press("enter")
            await pilot.pause()  # the row's choice is a message; under load it lands later
            assert isinstance(app.screen, EngineDetailScreen)
            seen[eid] = str(app.screen.query_one("#detail-summary", Static).visual)
            await pilot.press("escape")
            await pilot.pause()
    assert seen["svc-b"].splitlines()[-1] == (
        f"policy: master (service silent 12.0 s); service {SERVICE}, records sent 70 "
        f"dropped 9")
    assert "policy" not in seen["plain"]


def _silent_svc_a() -> tuple[dict[str, EngineState], dict[str, float]]:
    """``_fleet`` where svc-a (the service steered it) has sent nothing for 74 s (killed, or
    stopped with the service): its states and the hub's receive times."""
    fleet = _fleet()
    return fleet, {a: NOW_MS - (74_000.0 if a.startswith("svc-a/") else 300.0) for a in fleet}


async def test_a_silent_engine_is_not_counted_as_steered() -> None:
    """A demo user's report: the policy line and ``status --json`` counted an engine gone for
    a minute as steered by the service, which had stopped too. Its last report says who
    steered then, not now: counted apart, ``engine_silent`` in ``status --json``."""
    fleet, seen = _silent_svc_a()
    view = build_view(fleet, seen, NOW_MS, alerts=evaluate(fleet, seen, NOW_MS))
    doc = status_document(view)
    rows = {e["engine_id"]: e for e in doc["engines"]}
    assert rows["svc-a"]["state"] == "DOWN" and rows["svc-a"]["silent"] is True
    assert (rows["svc-a"]["policy"], rows["svc-a"]["policy_in_charge"]) == (
        "engine_silent", "service")
    assert rows["svc-b"]["policy"] == "service_silent"
    out = Console(file=io.StringIO(), width=300)
    _status(_parser().parse_args(["status"]), StaticSource(fleet, {
        a: time.time() * 1e3 - (NOW_MS - t) for a, t in seen.items()}), out)
    text = out.file.getvalue()  # type: ignore[attr-defined]
    line = ("policy: the service steers 0 engine(s), removed 26,541 keys; the master steers 1: "
            "svc-b (service silent 12.0 s); silent 1: svc-a (last said service)")
    assert text.count(line) == 1, text
    # Nor is it counted as reporting the pool now (its last reading is old).
    (pool,) = doc["pools"]
    assert (pool["reported_by"], pool["silent_by"]) == (6, 3)
    assert "reported by 6 agent(s) (3 more silent)" in text
    app = KVPoolConsole(StaticSource(fleet, seen), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(240, 40)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        summary = str(app.query_one("#pool-summary", Static).render())
    assert summary.splitlines()[-1] == line
