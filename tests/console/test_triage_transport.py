"""SSH triage names a transport failure as one (issue 38 item 4): an engine whose transfers
failed with Mooncake's TRANSFER_FAIL (-800), its processes running and reporting, is diagnosed
as a transport failure with what to change, never as hung or stopped; Mooncake's transport lines
in the engine's log say the same. Reports built by hand (the SSH checks are test_triage's)."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine

from kvpool_agent.protocol import ErrorRecord
from kvpool_console._transport import TRANSPORT_HINT
from kvpool_console.triage._diagnose import diagnose, exit_status, transport_facts
from kvpool_console.triage._model import HostReport, LogTail, ProcessCheck, TriageReport


def _report(*, logs: list[LogTail] | None = None, failures: dict[str, int] | None = None,
            last: str = "") -> TriageReport:
    """Engine e on node1: one running process whose agents report."""
    host = HostReport(host="node1", logs=logs or [], processes=[ProcessCheck(
        pid=1000, agents=["e/dp0.tp0.pp0"], state="running", letter="S", name="python")])
    return TriageReport(engine_id="e", ts_ms=NOW_MS, reporting=True, hosts=[host],
                        transport_failures=failures or {}, transport_error=last)


def test_transport_failures_from_the_agents() -> None:
    fleet = engine("e", loads=0)
    for k, s in list(fleet.items()):
        if s.source.process_role == "worker":
            tr = msgspec.structs.replace(s.transfers, errors_by_name={"TRANSFER_FAIL": 5,
                                                                      "LEASE_EXPIRED": 2})
            fleet[k] = msgspec.structs.replace(s, transfers=tr, recent_errors=[ErrorRecord(
                ts_ms=NOW_MS - 100 * s.source.tp_rank, where="save", name="TRANSFER_FAIL",
                message=f"save of 64 block(s) failed (tp{s.source.tp_rank})", code=-800)])
    failures, last = transport_facts("e", fleet)
    assert (failures, last) == ({"TRANSFER_FAIL": 10},
                                "TRANSFER_FAIL: save of 64 block(s) failed (tp0)")
    assert transport_facts("other", fleet) == ({}, "")
    report = _report(failures=failures, last=last)
    findings = diagnose(report)
    assert [(f.kind, f.severity) for f in findings] == [("transport", "critical"),
                                                        ("ok", "info")]
    assert findings[0].text == (
        "transport failure: transfers failed with TRANSFER_FAIL (-800) 10 (last: TRANSFER_FAIL: "
        f"save of 64 block(s) failed (tp0)); fix: {TRANSPORT_HINT}")
    assert "not a stopped store" in findings[0].text
    assert exit_status(msgspec.structs.replace(report, diagnosis=findings)) == 1


def test_transport_lines_in_the_log() -> None:
    line = ("E1205 11:20:01.1 123 transfer_task.cpp:412] Failed to complete transfers after "
            "60000 milliseconds")
    report = _report(logs=[LogTail(path="/var/log/engine.log",
                                   lines=["I1205 starting", line])])
    (transport, ok) = diagnose(report)
    assert (transport.kind, ok.kind) == ("transport", "ok")
    assert transport.text == (f"transport failure in the log on node1 (1 lines, last: {line}); "
                              f"fix: {TRANSPORT_HINT}")


def test_no_transport_failure_no_finding() -> None:
    assert [f.kind for f in diagnose(_report())] == ["ok"]
