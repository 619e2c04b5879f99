"""Operators see the data path (issue 38 item 4), on fleet states built from the wire schema with
a frozen clock: a lease TTL below the load time raises ``lease_ttl`` first (while the load is in
flight, before it fails, never ``stuck_transfer``); a stuck save on an engine whose transfers
failed in the transport names the transport and its fix, not a stopped store; the detail
screen's saves line shows the oldest save, blocks held, bytes staged and transport failures."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine, pool

from kvpool_agent._metrics import FleetCollector
from kvpool_agent.protocol import EngineState, ErrorRecord, PauseWindow, Transfer
from kvpool_console._transport import RPC_HINT, TRANSPORT_HINT, transport_failures
from kvpool_console.alerts import AlertModel, evaluate
from kvpool_console.cli import status_document
from kvpool_console.model import build_view
from kvpool_console.widgets._saves_line import saves_line

Fleet = dict[str, EngineState]


def _with(fleet: Fleet, *, in_flight: list[Transfer] | None = None,
          errors: dict[str, int] | None = None, **stats: object) -> Fleet:
    """Every worker of ``fleet`` with these in-flight transfers, error counts and
    ``TransferStats`` fields."""
    out = dict(fleet)
    for k, s in fleet.items():
        if s.source.process_role != "worker":
            continue
        tr = msgspec.structs.replace(s.transfers, **stats)
        if errors is not None:
            tr.errors_by_name = dict(errors)
        out[k] = msgspec.structs.replace(
            s, transfers=tr, in_flight=list(in_flight) if in_flight is not None else [],
            recent_errors=[ErrorRecord(ts_ms=NOW_MS - 500, where="save", name=n,
                                       message="save of 64 block(s) failed", code=-800)
                           for n in (errors or {})])
    return out


def _rules(alerts: list) -> list[tuple[str, str]]:
    return [(a.rule, a.severity) for a in alerts]


def _load(started_ms: float) -> Transfer:
    return Transfer(req_id="r1", kind="load", blocks=64, bytes=1 << 20, started_ms=started_ms,
                    lease_expires_ms=started_ms + 200)


def test_a_lease_ttl_below_the_load_time_is_the_first_alert() -> None:
    """A 200 ms lease and a load of seconds: ``lease_ttl`` as soon as the load passes 200 ms,
    still the only alert past the stuck floor (2.5 s), and listed first once the load failed
    after its hit."""
    short = engine("e", loads=0, pool_stats=pool(ttl=200))
    model = AlertModel()
    seen = {k: NOW_MS for k in short}
    assert model.update(_with(short), seen, NOW_MS) == []
    # 300 ms into the load: past the lease, far below the stuck floor.
    t = NOW_MS + 300
    fleet = _with(short, in_flight=[_load(NOW_MS)])
    alerts = model.update(fleet, {k: t for k in fleet}, t)
    assert _rules(alerts) == [("lease_ttl", "critical")]
    assert alerts[0].message == ("load of r1 on e/dp0.tp0.pp0 in flight 300 ms >= lease TTL "
                                 "200 ms (default_kv_lease_ttl): its lease ran out before it "
                                 "ended; 1 more loads past it")
    # 4 s into it: a transfer that old is stuck_transfer without the lease; here it is not.
    t = NOW_MS + 4_000
    assert _rules(evaluate(fleet, {k: t for k in fleet}, t)) == [("lease_ttl", "critical")]
    # It failed LEASE_EXPIRED after its hit: the TTL (what to change) comes first.
    ended = _with(short, errors={"LEASE_EXPIRED": 1}, failed_after_hit=1, loads_failed=1,
                  loads_finished=0,
                  max_load_ms=4_000.0)
    assert _rules(evaluate(ended, {k: t for k in ended}, t)) == [
        ("lease_ttl", "critical"), ("failed_after_hit", "critical")]
    # So does the console's model (the TUI, status), which sorted by key alone before.
    assert _rules(model.update(ended, {k: t for k in ended}, t)) == [
        ("lease_ttl", "critical"), ("failed_after_hit", "critical")]


def test_a_load_that_waited_through_its_stopped_process_is_no_ttl_advice() -> None:
    """A 3 s lease and a load in flight 5.1 s, 5 s of it in the worker's own
    ``process_stalled`` window (SIGSTOP of its engine): the pause explains it, neither
    ``lease_ttl`` nor ``stuck_transfer`` (CI at 06a8833 named it TTL advice in the first report
    after the engine resumed). The same load without the window is ``lease_ttl``."""
    fleet = _with(engine("e", loads=0, pool_stats=pool(ttl=3_000)), in_flight=[_load(NOW_MS)])
    t = NOW_MS + 5_100
    assert _rules(evaluate(fleet, {k: t for k in fleet}, t)) == [("lease_ttl", "critical")]
    stalled = PauseWindow(kind="process_stalled", start_ms=NOW_MS + 50, end_ms=NOW_MS + 5_050)
    paused = {k: msgspec.structs.replace(s, pauses=[stalled]) for k, s in fleet.items()}
    assert _rules(evaluate(paused, {k: t for k in paused}, t)) == []


def test_a_long_lease_leaves_a_stuck_load_to_stuck_transfer() -> None:
    fleet = _with(engine("e", loads=0, pool_stats=pool(ttl=60_000)),
                  in_flight=[_load(NOW_MS)])
    t = NOW_MS + 4_000
    assert _rules(evaluate(fleet, {k: t for k in fleet}, t)) == [("stuck_transfer", "critical")]


def _stuck_save() -> Transfer:
    return Transfer(req_id="s1", kind="save", blocks=64, bytes=1 << 20,
                    started_ms=NOW_MS - 30_000)


def test_a_stuck_save_after_transport_failures_names_the_transport() -> None:
    failing = _with(engine("e", loads=0), in_flight=[_stuck_save()],
                    errors={"TRANSFER_FAIL": 12})
    stuck = [a for a in evaluate(failing, {k: NOW_MS for k in failing}, NOW_MS)
             if a.rule == "stuck_transfer"]
    assert len(stuck) == 1
    assert "likely owner: the transport (failed transfers: TRANSFER_FAIL (-800) 24)" in \
        stuck[0].message
    assert stuck[0].hint == TRANSPORT_HINT
    assert "not a stopped store" in stuck[0].hint and "staging_buffer" in stuck[0].hint
    # The same stuck save without transport failures: the store process.
    plain = _with(engine("e", loads=0), in_flight=[_stuck_save()])
    (a,) = [a for a in evaluate(plain, {k: NOW_MS for k in plain}, NOW_MS)
            if a.rule == "stuck_transfer"]
    assert "the store process holding the segments" in a.message
    assert "is not stopped" in a.hint


def test_transport_failures_are_mooncakes_transfer_and_rpc_errors() -> None:
    """Transfer (-800..-899) and RPC (-900..-999) errors are the transport's, named or not by
    this Mooncake release (``ERROR_-901``: a later release's RPC timeout); a missing block or a
    full pool is not; the fix names the master for RPC errors."""
    errors = {"TRANSFER_FAIL": 2, "RPC_FAIL": 3, "ERROR_-901": 1, "ERROR_-801": 4,
              "OBJECT_NOT_FOUND": 5, "NO_AVAILABLE_HANDLE": 6, "ERROR_-1100": 7,
              "TimeoutError": 8}
    fleet = _with(engine("e", loads=0), errors=errors)
    assert transport_failures(s for s in fleet.values()) == {
        "TRANSFER_FAIL": 4, "RPC_FAIL": 6, "ERROR_-901": 2, "ERROR_-801": 8}
    rpc = _with(engine("e", loads=0), in_flight=[_stuck_save()], errors={"RPC_FAIL": 1})
    (a,) = [a for a in evaluate(rpc, {k: NOW_MS for k in rpc}, NOW_MS)
            if a.rule == "stuck_transfer"]
    assert "likely owner: the transport (failed transfers: RPC_FAIL (-900) 2)" in a.message
    assert a.hint == RPC_HINT and "mooncake_master" in a.hint
    both = _with(engine("e", loads=0), errors={"ERROR_-901": 1, "TRANSFER_FAIL": 1},
                 oldest_save_age_ms=0.0, save_blocks_held=0, save_bytes_staged=0)
    assert saves_line("e", both, NOW_MS) == (
        "oldest save none, 0 blocks held, 0B staged; transport failures: ERROR_-901 2, "
        f"TRANSFER_FAIL (-800) 2 ({TRANSPORT_HINT}; {RPC_HINT})")


def test_saves_line_by_value() -> None:
    fleet = engine("e", loads=0)
    assert saves_line("e", fleet, NOW_MS) == ""  # agents before issue 38, no failure
    # A stopped store: two workers each hold 8 MiB in staging, no block; the oldest save
    # started 1.2 s before their report, 300 ms ago.
    stalled = _with(fleet, oldest_save_age_ms=1_200.0, save_blocks_held=0,
                    save_bytes_staged=8 << 20)
    assert saves_line("e", stalled, NOW_MS) == "oldest save 1.5s, 0 blocks held, 16.0M staged"
    idle = _with(fleet, oldest_save_age_ms=0.0, save_blocks_held=0, save_bytes_staged=0)
    assert saves_line("e", idle, NOW_MS) == "oldest save none, 0 blocks held, 0B staged"
    failing = _with(fleet, errors={"TRANSFER_FAIL": 3}, oldest_save_age_ms=0.0,
                    save_blocks_held=32, save_bytes_staged=0)
    assert saves_line("e", failing, NOW_MS) == (
        "oldest save none, 64 blocks held, 0B staged; transport failures: TRANSFER_FAIL "
        f"(-800) 6 ({TRANSPORT_HINT})")
    assert saves_line("other", failing, NOW_MS) == ""


def test_hub_metrics_carry_the_saves_and_transport_failures() -> None:
    """The hub's /metrics: the oldest save's age, blocks held and bytes staged per engine
    (none from agents before issue 38), transport failures in kvpool_transfer_errors_total."""
    old = engine("old", loads=0)
    fleet = {**_with(engine("e", loads=0), errors={"TRANSFER_FAIL": 3},
                     oldest_save_age_ms=1_200.0, save_blocks_held=4,
                     save_bytes_staged=8 << 20), **old}
    scrape = FleetCollector(lambda: {k: (s, NOW_MS) for k, s in fleet.items()}, dict, dict,
                            lambda: NOW_MS)
    got = {(sample.name, sample.labels.get("engine"), sample.labels.get("error")): sample.value
           for m in scrape.collect() for sample in m.samples}
    assert got[("kvpool_oldest_save_age_seconds", "e", None)] == 1.5  # 1.2 s, reported 0.3 s ago
    assert got[("kvpool_save_blocks_held", "e", None)] == 8
    assert got[("kvpool_save_staged_bytes", "e", None)] == 16 << 20
    assert got[("kvpool_transfer_errors_total", "e", "TRANSFER_FAIL")] == 6
    assert ("kvpool_save_blocks_held", "old", None) not in got


def test_status_json_carries_the_saves_and_transport_failures() -> None:
    fleet = {**_with(engine("e", loads=0), errors={"TRANSFER_FAIL": 3},
                     oldest_save_age_ms=1_200.0, save_blocks_held=4,
                     save_bytes_staged=8 << 20), **engine("old", loads=0)}
    doc = status_document(build_view(fleet, {}, NOW_MS, alerts=evaluate(fleet, {}, NOW_MS)))
    saves = {e["engine_id"]: e["saves"] for e in doc["engines"]}
    # The age as of the engine's newest report (its scheduler's and workers' are equal here).
    assert saves["e"] == {"oldest_save_age_ms": 1_200.0, "blocks_held": 8,
                          "bytes_staged": 16 << 20, "transport_failures": {"TRANSFER_FAIL": 6},
                          "told": True}
    assert saves["old"] == {"oldest_save_age_ms": 0.0, "blocks_held": 0, "bytes_staged": 0,
                            "transport_failures": {}, "told": False}


def _on_master(fleet: Fleet, master: str) -> Fleet:
    return {k: msgspec.structs.replace(s, source=msgspec.structs.replace(s.source, master=master))
            for k, s in fleet.items()}


def test_a_stalled_store_is_named_not_the_lease_ttl() -> None:
    """A stopped store (helper 77: ``kill -STOP`` of the demo's ``mooncake_client``): a decode
    engine's load in flight 8 s past a 5 s lease, and a prefill engine's save on the same pool
    stuck. The load is the stall's symptom: no ``lease_ttl`` ("raise default_kv_lease_ttl"),
    ``stuck_transfer`` for both, naming the segments' owner and how to resume it. The same load
    with no stuck save on its pool (another pool's does not count) is still ``lease_ttl``."""
    t = NOW_MS + 8_000
    decode = _with(engine("d", role="decode", tp=1, loads=0, pool_stats=pool(ttl=5_000)),
                   in_flight=[_load(NOW_MS)])
    prefill = _with(engine("p", tp=1, pool_stats=pool(ttl=5_000)),
                    in_flight=[Transfer(req_id="s1", kind="save", blocks=64, bytes=1 << 20,
                                        started_ms=NOW_MS)])
    fleet = _on_master(decode, "10.0.0.1:50051") | _on_master(prefill, "10.0.0.1:50051")
    alerts = evaluate(fleet, {k: t for k in fleet}, t)
    assert [(a.rule, a.subject) for a in alerts] == [("stuck_transfer", "d"),
                                                     ("stuck_transfer", "p")]
    by = {a.subject: a for a in alerts}
    assert "likely owner: the segment owner(s)" in by["d"].message
    assert "likely owner: the store process holding the segments" in by["p"].message
    assert "kill -CONT" in by["p"].hint and "triage" not in by["p"].hint
    # Another pool's stuck save says nothing of this one's lease.
    apart = _on_master(decode, "10.0.0.1:50051") | _on_master(prefill, "10.0.0.2:50051")
    assert [(a.rule, a.subject) for a in evaluate(apart, {k: t for k in apart}, t)] == [
        ("lease_ttl", "d"), ("stuck_transfer", "p")]
