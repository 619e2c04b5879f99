"""``pool_no_segments`` on fleet states built from the wire schema (no sockets): a healthy
Mooncake master holding no memory (its store process gone, its segment dropped after the
master's ``client_ttl``) is one critical alert per pool, in the rules and in the one-shot
``status --json``; ``backend_errors`` NO_AVAILABLE_HANDLE on that pool points at it. The real
master's figures are tested in ``test_pool_no_segments_live.py``."""

from __future__ import annotations

import io

import msgspec
from fleetdata import GB, NOW_MS, engine, pool
from rich.console import Console

from kvpool_agent.protocol import EngineState, MasterView, PoolStats
from kvpool_agent.vocabulary import HINTS
from kvpool_console.alerts import AlertModel, AlertSettings, evaluate
from kvpool_console.alerts.segments import NO_SEGMENTS_HINT
from kvpool_console.cli import _parser, _status, status_document
from kvpool_console.model import build_view
from kvpool_console.source import StaticSource

MASTER = "127.0.0.1:50051"
POOL = f"mooncake@{MASTER}"


def _on(fleet: dict[str, EngineState], p: PoolStats | None) -> dict[str, EngineState]:
    """``fleet`` with every agent on ``MASTER`` reporting ``p``."""
    return {k: msgspec.structs.replace(
        s, source=msgspec.structs.replace(s.source, master=MASTER), pool=p)
        for k, s in fleet.items()}


def _empty(healthy: bool | None = True) -> PoolStats:
    """The master's reading with no segment mounted: 0 B of 0 B, no segment listed."""
    return msgspec.structs.replace(pool(used=0, total=0, keys=0, healthy=healthy), segments=[])


def _no_segments(alerts: list) -> list:
    return [a for a in alerts if a.rule == "pool_no_segments"]


def test_a_healthy_master_without_memory_is_one_critical_alert_per_pool() -> None:
    fleet = _on(engine("a") | engine("b"), _empty())
    (alert,) = _no_segments(evaluate(fleet, {}, NOW_MS))
    assert (alert.severity, alert.subject, alert.key) == (
        "critical", POOL, f"pool_no_segments:{POOL}")
    assert alert.message == (
        f"no store segment is mounted on master {MASTER} (pool {POOL}: 0 B of memory; "
        "engines a, b): the store process holding the pool's memory is gone or stopped (the "
        "master drops a segment client_ttl after its client's last ping, 10 s by default); "
        "every save fails at once with NO_AVAILABLE_HANDLE and lookups find nothing")
    assert alert.hint == NO_SEGMENTS_HINT
    assert "mooncake_client" in alert.hint and "--global_segment_size" in alert.hint


def test_not_raised_while_unhealthy_unread_or_holding_memory() -> None:
    two = engine("a") | engine("b")
    # Master unreachable: pool_unhealthy names it, sizes are 0 because nothing was read.
    down = evaluate(_on(two, _empty(healthy=False)), {}, NOW_MS)
    assert _no_segments(down) == []
    assert [a.rule for a in down if a.subject == POOL] == ["pool_unhealthy"]
    # Not checked yet (an agent's first reading): nothing said about the pool.
    assert [a for a in evaluate(_on(two, _empty(healthy=None)), {}, NOW_MS)
            if a.subject == POOL] == []
    # One worker reads it healthy and empty, another (older) reading failed: unhealthy wins.
    mixed = _on(two, _empty())
    older = "b/dp0.tp0.pp0"
    mixed[older] = msgspec.structs.replace(mixed[older], pool=_empty(healthy=False),
                                           ts_ms=mixed[older].ts_ms - 1_000)
    assert [a.rule for a in evaluate(mixed, {}, NOW_MS) if a.subject == POOL] == [
        "pool_unhealthy"]
    # Memory mounted: nothing, however little is used.
    assert _no_segments(evaluate(_on(two, pool(used=0, total=1 * GB)), {}, NOW_MS)) == []


def test_only_worker_readings_count() -> None:
    """Engines' schedulers hold no pool client, and a store agent beside the master of a pool
    whose memory comes from engines reads 0 B until the first engine mounts its segment."""
    fleet = _on(engine("a", tp=1), pool())
    store = "store-1"
    fleet[store] = msgspec.structs.replace(
        fleet["a/dp0.tp0.pp0"], pool=_empty(), ts_ms=NOW_MS,
        source=msgspec.structs.replace(fleet["a/dp0.tp0.pp0"].source, agent_id=store,
                                       engine_id=store, process_role="store"))
    fleet["a/scheduler"] = msgspec.structs.replace(fleet["a/scheduler"], pool=_empty(),
                                                   ts_ms=NOW_MS)
    assert _no_segments(evaluate(fleet, {}, NOW_MS)) == []
    # The newest worker reading decides: the store stopped after the last one said 1 GB.
    fleet["a/dp0.tp0.pp0"] = msgspec.structs.replace(fleet["a/dp0.tp0.pp0"], pool=_empty())
    assert [a.subject for a in _no_segments(evaluate(fleet, {}, NOW_MS))] == [POOL]


def test_an_ha_pool_without_a_serving_leader_is_no_leader_only() -> None:
    m0, m1 = "http://10.0.0.1:9003", "http://10.0.0.2:9003"
    warming = _empty()
    warming.masters = [
        MasterView(admin_url=m0, reachable=False, error="connection refused"),
        MasterView(admin_url=m1, reachable=True, role="leader", ha_state="leader_warmup",
                   serving=False, view_version=3, leader_address="10.0.0.2:50051")]
    alerts = evaluate(_on(engine("a"), warming), {}, NOW_MS)
    assert [a.rule for a in alerts if a.subject == POOL] == ["no_leader"]
    # Once the new leader serves, a leader no store has mounted on yet is without memory.
    warming.masters[1] = msgspec.structs.replace(warming.masters[1], serving=True,
                                                 ha_state="leader")
    assert [a.subject for a in _no_segments(evaluate(_on(engine("a"), warming), {},
                                                     NOW_MS))] == [POOL]


def test_backend_errors_no_available_handle_point_at_it() -> None:
    errors = {"NO_AVAILABLE_HANDLE": 5, "TRANSFER_FAIL": 9}
    empty = evaluate(_on(engine("a", errors=errors), _empty()), {}, NOW_MS)
    (backend,) = [a for a in empty if a.rule == "backend_errors"]
    assert backend.message == "backend errors: TRANSFER_FAIL 18, NO_AVAILABLE_HANDLE 10"
    assert backend.hint == ("the pool has no store segment mounted (see pool_no_segments): "
                            + NO_SEGMENTS_HINT)
    # The cause is listed first among the critical alerts (before kv_role_mismatch, whose
    # key sorts first), the symptom's warning after them.
    swapped = engine("a", role="prefill", kv_role="kv_consumer", errors=errors)
    ranked = [a.rule for a in evaluate(_on(swapped, _empty()), {}, NOW_MS)]
    assert ranked[:2] == ["pool_no_segments", "kv_role_mismatch"]
    # A pool with memory: NO_AVAILABLE_HANDLE is a full pool, the top error's own fix.
    full = evaluate(_on(engine("a", errors={"NO_AVAILABLE_HANDLE": 5}), pool()), {}, NOW_MS)
    (backend,) = [a for a in full if a.rule == "backend_errors"]
    assert backend.hint == HINTS["NO_AVAILABLE_HANDLE"]
    mixed = evaluate(_on(engine("a", errors=errors), pool()), {}, NOW_MS)
    assert [a.hint for a in mixed if a.rule == "backend_errors"] == [HINTS["TRANSFER_FAIL"]]


def test_the_one_shot_status_json_lists_it() -> None:
    """``kvpool-console status --json`` runs the TUI's alert model once (``_view``)."""
    fleet = _on(engine("a"), _empty())
    seen = dict.fromkeys(fleet, NOW_MS)
    alerts = AlertModel(AlertSettings()).update(fleet, seen, NOW_MS)
    doc = status_document(build_view(fleet, seen, NOW_MS, alerts=alerts))
    (row,) = [a for a in doc["alerts"] if a["rule"] == "pool_no_segments"]
    assert (row["severity"], row["subject"], row["hint"]) == ("critical", POOL,
                                                              NO_SEGMENTS_HINT)


def test_a_store_agent_is_a_store_row_not_an_engine() -> None:
    """``kvpool-agent store`` reports under an engine identity of its own (``store@HOST``): the
    view shows its row as a store (role ``store``, no KV role) and counts it apart from the
    engines (``1 engines`` with a store beside it, not ``2``)."""
    fleet = _on(engine("a", tp=1), pool())
    store = "store@m1"
    fleet[store] = msgspec.structs.replace(
        fleet["a/dp0.tp0.pp0"], ts_ms=NOW_MS,
        source=msgspec.structs.replace(fleet["a/dp0.tp0.pp0"].source, agent_id=store,
                                       engine_id=store, process_role="store"))
    view = build_view(fleet, {}, NOW_MS)
    rows = {r.engine_id: (r.role, r.kv_role) for r in view.engines}
    assert rows[store] == ("store", "-") and rows["a"][0] != "store"
    assert (view.totals.engines, view.totals.stores, view.totals.agents) == (1, 1, 3)
    assert status_document(view)["totals"]["stores"] == 1
    out = Console(file=io.StringIO(), width=300)
    _status(_parser().parse_args(["status"]), StaticSource(fleet), out)
    (row,) = [line for line in out.file.getvalue().splitlines()  # type: ignore[attr-defined]
              if line.count("│") > 8 and line.split("│")[1].strip() == store]
    assert [c.strip() for c in row.split("│")[6:8]] == ["-", "-"], row  # no hit rate, no looks
