"""One verdict on a silent engine in every view (``kvpool_console.alerts.silence``): a real
stand-in engine (``standin_engine.py``, its agent reporting this host to a real hub) is stopped
with SIGSTOP, then killed. ``kvpool-console status`` (``--json`` and text), the ``stale``
alert, the fleet table's State cell, its totals row and ``kvpool-console triage`` must name it
alike, hung then gone, and critical, from the first look past the stale threshold: status said
a WARNING "hung" for 30 s and the table STALE while triage said CRITICAL (a demo user's
report)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from livefleet import until
from triagekit import run_triage, standin

from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import main
from kvpool_console.source import ClientSource
from kvpool_console.widgets import FleetTable
from kvpool_console.widgets._fleet_cells import AS_LAST_REPORTED

HOST = "127.0.0.1"
WAIT_S = 30.0


def _status(capsys: pytest.CaptureFixture[str], hub: str) -> dict[str, Any]:
    assert main(["status", "--json", "--hub", hub]) == 0
    return json.loads(capsys.readouterr().out)


def _engine(doc: dict[str, Any]) -> dict[str, Any]:
    (e1,) = [e for e in doc["engines"] if e["engine_id"] == "e1"]
    return e1


def _until_silent(capsys: pytest.CaptureFixture[str], hub: str,
                  until_state: str) -> tuple[dict[str, Any], list[str]]:
    """``status --json`` polled until e1's state is ``until_state``: that document and every
    state seen before it."""
    seen: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while True:
        doc = _status(capsys, hub)
        state = _engine(doc)["state"]
        if state == until_state:
            return doc, seen
        seen.append(state)
        assert time.monotonic() < deadline, f"e1 not {until_state} within {WAIT_S} s: {seen}"
        time.sleep(0.2)


def _stale_alert(doc: dict[str, Any]) -> dict[str, Any]:
    (alert,) = [a for a in doc["alerts"] if a["key"] == "stale:e1"]
    return alert


def _agree(capsys: pytest.CaptureFixture[str], hub: str, doc: dict[str, Any],
           verdict: str) -> None:
    """The status document, the text status and triage name e1 ``verdict``, critical."""
    e1 = _engine(doc)
    assert (e1["state"], e1["silence"]) == (verdict.upper(), verdict)
    # The entry and the totals tell one story: silent, neither stale nor down (those are
    # verdicts too), counted once under its verdict; its agent says the same.
    assert (e1["silent"], e1["stale"], e1["down"]) == (True, False, False)
    (agent,) = e1["agents"]
    assert (agent["state"], agent["silent"], agent["stale"], agent["down"]) == (
        verdict.upper(), True, False, False)
    assert doc["totals"]["silent"] == 1
    alert = _stale_alert(doc)
    assert (alert["severity"], alert["verdict"]) == ("critical", verdict)
    assert alert["message"].startswith(f"{verdict}: pid ")
    assert doc["totals"][verdict] == 1 and doc["totals"]["stale"] == doc["totals"]["down"] == 0
    main(["status", "--hub", hub])
    text = capsys.readouterr().out
    (row,) = [line for line in text.splitlines() if "│ e1 " in line]
    assert f"│ {verdict.upper()} " in row, row
    assert f"(1 {verdict}, 0 stale, 0 down)" in text
    assert f"CRITICAL e1: {verdict}: pid " in text
    rc, report, _, err = run_triage(capsys, hub, "e1", "--json")
    assert report is not None, err
    found = [(f.kind, f.severity) for f in report.diagnosis if f.kind in ("hung", "gone")]
    assert found == [(verdict, "critical")], report.diagnosis
    assert rc == 1


def test_stopped_then_killed_engine_is_hung_then_gone_in_status_and_triage(
        capsys: pytest.CaptureFixture[str], hub: str, master: str, tmp_path: Path) -> None:
    with standin(hub, master, tmp_path, HOST) as (proc, _, _):
        os.kill(proc.pid, signal.SIGSTOP)
        doc, before = _until_silent(capsys, hub, "HUNG")
        # Reporting, then hung: never a warning "stale" first for a process seen stopped.
        assert set(before) <= {"OK"}, before
        _agree(capsys, hub, doc, "hung")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        doc, before = _until_silent(capsys, hub, "GONE")
        assert set(before) <= {"HUNG"}, before
        _agree(capsys, hub, doc, "gone")


async def _state_cells(app: KVPoolConsole, pilot: Any, until_state: str) -> list[str]:
    """The State cell of e1's row polled until it reads ``until_state``: every other state
    seen before, ``OK`` left out."""
    table = app.query_one(FleetTable)
    seen: list[str] = []

    def reads() -> bool:
        if "e:e1" not in table.rows:
            return False
        state = str(table.get_cell("e:e1", "state"))
        if state not in (until_state, "OK") and (not seen or seen[-1] != state):
            seen.append(state)
        return state == until_state

    await until(pilot, reads, f"e1 {until_state}", WAIT_S)
    return seen


def _dimmed_figures(table: FleetTable) -> list[str]:
    """Which of e1's figure columns (``AS_LAST_REPORTED``) are drawn dim."""
    return [key for key in AS_LAST_REPORTED
            if "dim" in str(table.get_cell("e:e1", key).style)]  # type: ignore[union-attr]


async def test_the_fleet_table_states_the_alerts_verdict(hub: str, master: str,
                                                        tmp_path: Path) -> None:
    with standin(hub, master, tmp_path, HOST) as (proc, _, _):
        app = KVPoolConsole(ClientSource(hub, pump=True), refresh_s=0.25)
        async with app.run_test(size=(160, 30)) as pilot:
            table = app.query_one(FleetTable)
            await until(pilot, lambda: "e:e1" in table.rows
                        and str(table.get_cell("e:e1", "state")) == "OK", "e1 OK", WAIT_S)
            assert _dimmed_figures(table) == []
            os.kill(proc.pid, signal.SIGSTOP)
            assert await _state_cells(app, pilot, "HUNG") == []
            # Its figures are its last report's, as the detail screen says: every one dimmed
            # (they read as current before), in the view that drew HUNG.
            assert _dimmed_figures(table) == list(AS_LAST_REPORTED)
            (alert,) = [a for a in app.alerts if a.key == "stale:e1"]
            assert (alert.severity, alert.verdict) == ("critical", "hung")
            assert str(table.get_cell("__totals__", "state")) == "1 HUNG"
            table.move_cursor(row=table.get_row_index("e:e1"))
            await pilot.press("space")  # expand: its agent's row says the same
            await until(pilot, lambda: "a:e1/scheduler" in table.rows, "e1's agent row")
            assert str(table.get_cell("a:e1/scheduler", "state")) == "HUNG"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            assert await _state_cells(app, pilot, "GONE") in ([], ["HUNG"])
            (alert,) = [a for a in app.alerts if a.key == "stale:e1"]
            assert (alert.severity, alert.verdict) == ("critical", "gone")
            assert str(table.get_cell("__totals__", "state")) == "1 GONE"
            assert _dimmed_figures(table) == list(AS_LAST_REPORTED)


def test_status_without_a_verdict_says_stale_then_down(
        capsys: pytest.CaptureFixture[str], hub: str, master: str, tmp_path: Path) -> None:
    """An engine the console cannot look at (another host): stale (a warning) in the table,
    the alert and the totals alike."""
    with standin(hub, master, tmp_path, "192.0.2.7") as (proc, _, _):
        os.kill(proc.pid, signal.SIGSTOP)
        doc, _ = _until_silent(capsys, hub, "STALE")
        e1, alert = _engine(doc), _stale_alert(doc)
        assert e1["silence"] == "stale"
        assert (e1["silent"], e1["stale"], e1["down"]) == (True, True, False)
        assert doc["totals"]["silent"] == doc["totals"]["stale"] == 1
        assert (alert["severity"], alert["verdict"]) == ("warning", "stale")
        assert doc["totals"]["stale"] == 1 and doc["totals"]["hung"] == 0
        os.kill(proc.pid, signal.SIGCONT)
