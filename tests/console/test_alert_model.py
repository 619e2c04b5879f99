"""The one alert model of the TUI and the one-shot modes (``AlertModel``) on fleet states built
from the wire schema, with a frozen clock: pauses explain the loads that waited on them,
counter alerts retire by the agents' error timestamps, evictions raise ``pool_evicting``, and
a one-shot evaluation agrees with one that watched all along. Pauses the agents recorded
themselves (``EngineState.pauses``) explain loads to a model that never watched them."""

from __future__ import annotations

import msgspec
from fleetdata import GB, NOW_MS, engine, pool

from kvpool_agent.protocol import EngineState, ErrorRecord, PauseWindow
from kvpool_console.alerts import AlertModel, evaluate, fmt_ms

MASTER = "127.0.0.1:50051"
POOL = f"mooncake@{MASTER}"

Fleet = dict[str, EngineState]


def _on_master(fleet: Fleet, *, healthy: bool = True, used: float = 6.0,
               evicted: int = 17) -> Fleet:
    p = pool(used=int(used * GB), healthy=healthy)
    p.evicted_keys = evicted
    return {k: msgspec.structs.replace(
        s, source=msgspec.structs.replace(s.source, master=MASTER), pool=p)
        for k, s in fleet.items()}


def _failed_after(fleet: Fleet, engine_id: str, t: float, *, failed: int,
                  max_load_ms: float) -> Fleet:
    """``engine_id``'s workers report ``failed`` LEASE_EXPIRED loads after a hit (recorded at
    ``t``) and a slowest load of ``max_load_ms``."""
    out = dict(fleet)
    for k, s in fleet.items():
        if s.source.engine_id == engine_id and s.source.process_role == "worker":
            tr = msgspec.structs.replace(
                s.transfers, failed_after_hit=failed, loads_failed=failed,
                max_load_ms=max_load_ms,
                errors_by_name={"LEASE_EXPIRED": failed} if failed else {})
            errors = [ErrorRecord(ts_ms=t, where="load", name="LEASE_EXPIRED",
                                  message="load of 4 block(s) failed after a positive lookup")
                      ] if failed else []
            out[k] = msgspec.structs.replace(s, transfers=tr, recent_errors=errors)
    return out


def _seen(fleet: Fleet, t: float, silent: str = "", since: float = 0.0) -> dict[str, float]:
    """Hub receive times at ``t``: every agent just reported, ``silent``'s last at ``since``."""
    return {k: since if s.source.engine_id == silent else t for k, s in fleet.items()}


def _keys(alerts: list) -> list[tuple[str, str, str]]:
    return [(a.rule, a.severity, a.subject) for a in alerts]


def test_fmt_ms_is_ms_below_a_second() -> None:
    assert [fmt_ms(x) for x in (0.4, 20, 999, 1_000, 29_448, 61_000)] == [
        "0 ms", "20 ms", "999 ms", "1.0 s", "29.4 s", "1.0 min"]


def test_loads_that_waited_on_a_paused_master_are_the_pause_not_the_ttl() -> None:
    model = AlertModel()
    healthy = _on_master(engine("a", loads=0))
    assert model.update(healthy, _seen(healthy, NOW_MS), NOW_MS) == []
    # SIGSTOP: the agents' health checks fail from the next check on.
    t = NOW_MS + 2_000
    stopped = _on_master(engine("a", loads=0), healthy=False)
    assert _keys(model.update(stopped, _seen(stopped, t), t)) == [
        ("pool_unhealthy", "critical", POOL)]
    # SIGCONT after 29 s: healthy again, then the loads that waited end (the slowest 29.4 s,
    # 3 failed after their hit: LEASE_EXPIRED).
    t = NOW_MS + 31_000
    assert model.update(healthy, _seen(healthy, t), t) == []
    t += 1_000
    resumed = _failed_after(healthy, "a", t, failed=3, max_load_ms=29_448.0)
    alerts = model.update(resumed, _seen(resumed, t), t)
    assert _keys(alerts) == [("pause_wait", "warning", "a")]
    (a,) = alerts
    assert a.message == (f"6 loads failed after a positive lookup, slowest load 29.4 s while "
                         f"master {MASTER} failed its health check (RPC_FAIL) (29.0 s)")
    assert a.hint == ("master unreachable: check mooncake_master and master_server_address; "
                      "the load waited on it (see pool_unhealthy); default_kv_lease_ttl is not "
                      "the cause")
    # Without the pause the same counters are TTL advice: the model took them off.
    assert {x.rule for x in evaluate(resumed, _seen(resumed, t), t)} == {
        "failed_after_hit", "lease_ttl"}
    # It retires with the pause's aftermath, and the TTL advice does not come back.
    t += 10_500
    assert model.update(resumed, _seen(resumed, t), t) == []
    # A slower load later that overlapped no pause is the TTL's.
    t = NOW_MS + 75_000
    assert model.update(resumed, _seen(resumed, t), t) == []
    t += 5_000
    slower = _failed_after(healthy, "a", t - 60_000, failed=3, max_load_ms=30_000.0)
    assert _keys(model.update(slower, _seen(slower, t), t)) == [
        ("lease_ttl", "critical", "a")]


def test_a_paused_engine_is_stale_fast_and_its_slow_load_is_the_pause() -> None:
    model = AlertModel()
    fleet = _on_master(engine("a", loads=0) | engine("b", loads=0))
    assert model.update(fleet, _seen(fleet, NOW_MS), NOW_MS) == []
    # b is SIGSTOPped: silent for > 3 s is stale (three missed heartbeats).
    t = NOW_MS + 2_900
    assert model.update(fleet, _seen(fleet, t, "b", NOW_MS), t) == []
    t = NOW_MS + 3_100
    alerts = model.update(fleet, _seen(fleet, t, "b", NOW_MS), t)
    assert _keys(alerts) == [("stale", "warning", "b")]
    assert alerts[0].message == "stale: no report for 3.1 s"
    # SIGCONT after 20 s: its first report carries the load that waited.
    t = NOW_MS + 20_000
    resumed = _failed_after(fleet, "b", t, failed=1, max_load_ms=19_800.0)
    (a,) = model.update(resumed, _seen(resumed, t), t)
    assert (a.rule, a.severity, a.subject) == ("pause_wait", "warning", "b")
    assert a.message == ("2 loads failed after a positive lookup, slowest load 19.8 s while "
                         "engine b sent no report (stopped or stalled) (20.0 s)")
    assert a.hint.startswith("the engine process was stopped or stalled (SIGSTOP, ")
    assert a.hint.endswith("`kvpool-console triage b` if it recurs; default_kv_lease_ttl is "
                           "not the cause")


def test_a_short_gap_between_looks_is_a_pause_too() -> None:
    # Silent 2.8 s: no refresh (1 s apart) saw it stale, but the receive time jumped while
    # the console looked every second.
    model = AlertModel()
    fleet = _on_master(engine("b", loads=0))
    for dt in (0, 1_000, 2_000):
        assert model.update(fleet, _seen(fleet, NOW_MS + dt, "b", NOW_MS), NOW_MS + dt) == []
    t = NOW_MS + 3_000
    resumed = _failed_after(fleet, "b", t, failed=0, max_load_ms=2_900.0)
    assert _keys(model.update(resumed, _seen(resumed, t - 200), t)) == [
        ("pause_wait", "warning", "b")]
    # The console's own gap (no look for 8 s) is not the engine's.
    model = AlertModel()
    model.update(fleet, _seen(fleet, NOW_MS), NOW_MS)
    t = NOW_MS + 8_000
    assert model.update(resumed, _seen(resumed, t), t) == []


def test_counter_alerts_retire_by_the_agents_error_times() -> None:
    # A TIMEOUT a minute old: the one-shot (no history) retires it as the TUI does.
    fleet = engine("e", loads=0, errors={"TIMEOUT": 2})
    fresh = evaluate(fleet, {}, NOW_MS)
    assert _keys(fresh) == [("backend_errors", "warning", "e")]
    later = NOW_MS + 60_000
    assert evaluate(fleet, dict.fromkeys(fleet, later), later) == []
    tui = AlertModel()
    assert _keys(tui.update(fleet, dict.fromkeys(fleet, NOW_MS), NOW_MS)) == _keys(fresh)
    assert tui.update(fleet, dict.fromkeys(fleet, later), later) == []


def test_one_shot_and_watching_model_agree() -> None:
    # Usage swings around the 0.90 watermark of a pool that evicted, and a TIMEOUT ages:
    # a model that watched every step and one fresh at each step say the same.
    tui = AlertModel()
    steps = [(9.2, 0), (8.7, 20_000), (8.6, 40_000), (9.1, 59_500), (8.8, 61_000),
             (8.4, 70_000)]
    for used, dt in steps:
        t = NOW_MS + dt
        fleet = _on_master(engine("e", loads=0, errors={"TIMEOUT": 2}), used=used)
        seen = dict.fromkeys(fleet, t)
        watched = [(a.rule, a.subject, a.message) for a in tui.update(fleet, seen, t)]
        once = [(a.rule, a.subject, a.message) for a in AlertModel().update(fleet, seen, t)]
        assert watched == once, (used, dt)
        assert ("pool_watermark" in {r for r, _, _ in once}) == (used > 8.5), (used, dt)
        assert ("backend_errors" in {r for r, _, _ in once}) == (dt < 59_000), (used, dt)


def test_eviction_starts_an_event_and_retires() -> None:
    model = AlertModel()
    t = NOW_MS
    fleet = _on_master(engine("e", loads=0), used=9.3, evicted=17)
    assert [a.rule for a in model.update(fleet, dict.fromkeys(fleet, t), t)] == [
        "pool_watermark"]
    t += 1_000
    evicting = _on_master(engine("e", loads=0), used=9.0, evicted=57)
    alerts = model.update(evicting, dict.fromkeys(evicting, t), t)
    (ev,) = [a for a in alerts if a.rule == "pool_evicting"]
    assert [a.rule for a in model.new] == ["pool_evicting"]
    assert ev.subject == POOL and ev.severity == "warning"
    assert ev.message == ("pool evicting: 40 keys (0 B) evicted since 0 ms ago (90% used, "
                          "eviction_high_watermark_ratio 0.90)")
    assert "add segment memory" in ev.hint
    t += 61_000
    assert [a.rule for a in model.update(evicting, dict.fromkeys(evicting, t), t)] == [
        "pool_watermark"]


def _agent_paused(fleet: Fleet, engine_id: str, t: float, window: PauseWindow, *,
                  failed: int, explained: int, max_load_ms: float,
                  unpaused_ms: float) -> Fleet:
    """``engine_id``'s workers as ``_failed_after`` has them, and each reports ``window`` as
    its own pause, ``explained`` of its ``failed`` loads as the window's and a slowest load of
    ``unpaused_ms`` without the time paused."""
    out = _failed_after(fleet, engine_id, t, failed=failed, max_load_ms=max_load_ms)
    for k, s in out.items():
        if s.source.engine_id == engine_id and s.source.process_role == "worker":
            tr = msgspec.structs.replace(
                s.transfers, max_unpaused_load_ms=unpaused_ms,
                paused_after_hit={"LEASE_EXPIRED": explained} if explained else {})
            out[k] = msgspec.structs.replace(s, transfers=tr, pauses=[window])
    return out


def test_a_one_shot_takes_the_pause_an_agent_recorded_not_ttl_advice() -> None:
    start, end = NOW_MS - 30_000, NOW_MS - 1_000
    window = PauseWindow(kind="pool_unhealthy", start_ms=start, end_ms=end, detail="RPC_FAIL",
                         loads=2, max_load_ms=29_448.0, failed_after_hit=3)
    t = NOW_MS
    fleet = _agent_paused(_on_master(engine("a", loads=0)), "a", t, window, failed=3,
                          explained=3, max_load_ms=29_448.0, unpaused_ms=400.0)
    # Without the agents' windows the counters are TTL advice; a fresh model takes them off.
    assert {x.rule for x in evaluate(fleet, _seen(fleet, t), t)} == {
        "failed_after_hit", "lease_ttl"}
    (a,) = AlertModel().update(fleet, _seen(fleet, t), t)
    assert (a.rule, a.severity, a.subject) == ("pause_wait", "warning", "a")
    assert a.message == (f"6 loads failed after a positive lookup, slowest load 29.4 s while "
                         f"master {MASTER} failed its health check (RPC_FAIL) (29.0 s)")
    assert a.hint == ("master unreachable: check mooncake_master and master_server_address; "
                      "the load waited on it (see pool_unhealthy); default_kv_lease_ttl is not "
                      "the cause")
    # The window's aftermath over, nothing: no pause_wait, and no TTL advice comes back.
    t = end + 10_500
    assert AlertModel().update(fleet, _seen(fleet, t), t) == []
    # A later load slower than the TTL without any pause is the TTL's, although the slowest
    # load since start (the paused one, 29.4 s) is still slower.
    slower = _agent_paused(_on_master(engine("a", loads=0)), "a", t, window, failed=3,
                           explained=3, max_load_ms=29_448.0, unpaused_ms=12_000.0)
    (a,) = AlertModel().update(slower, _seen(slower, t), t)
    assert (a.rule, a.severity, a.message) == (
        "lease_ttl", "critical", "slowest load 12.0 s >= lease TTL 11.0 s (default_kv_lease_ttl)")


def test_a_stall_an_agent_recorded_names_the_process_and_leaves_the_rest() -> None:
    t = NOW_MS
    window = PauseWindow(kind="process_stalled", start_ms=t - 9_000, end_ms=t - 1_000,
                         loads=1, max_load_ms=8_100.0, failed_after_hit=2)
    # Of 3 failed-after-hit loads per worker the stall explains 2: one is still TTL advice.
    fleet = _agent_paused(_on_master(engine("b", loads=0)), "b", t, window, failed=3,
                          explained=2, max_load_ms=8_100.0, unpaused_ms=100.0)
    alerts = AlertModel().update(fleet, _seen(fleet, t), t)
    assert _keys(alerts) == [("failed_after_hit", "warning", "b"), ("pause_wait", "warning", "b")]
    assert alerts[0].message == ("2 loads failed after a positive lookup (LEASE_EXPIRED 2, "
                                 "OBJECT_NOT_FOUND 0)")
    assert alerts[1].message == ("4 loads failed after a positive lookup, slowest load 8.1 s "
                                 "while process b/dp0.tp0.pp0 was stopped or stalled (8.0 s)")
    assert alerts[1].hint.startswith("the engine process was stopped or stalled (SIGSTOP, ")
    assert alerts[1].hint.endswith("`kvpool-console triage b` if it recurs; "
                                   "default_kv_lease_ttl is not the cause")
    # A window whose loads were quick and did not fail explains nothing worth an alert.
    quiet = msgspec.structs.replace(window, max_load_ms=300.0, failed_after_hit=0)
    fleet = _agent_paused(_on_master(engine("b", loads=0)), "b", t, quiet, failed=0,
                          explained=0, max_load_ms=300.0, unpaused_ms=100.0)
    assert AlertModel().update(fleet, _seen(fleet, t), t) == []


def test_a_watching_model_counts_a_pause_its_agents_recorded_once() -> None:
    model = AlertModel()
    healthy = _on_master(engine("a", loads=0))
    stopped = _on_master(engine("a", loads=0), healthy=False)
    assert model.update(healthy, _seen(healthy, NOW_MS), NOW_MS) == []
    t = NOW_MS + 2_000
    assert _keys(model.update(stopped, _seen(stopped, t), t)) == [
        ("pool_unhealthy", "critical", POOL)]
    t = NOW_MS + 31_000
    assert model.update(healthy, _seen(healthy, t), t) == []
    t += 1_000
    window = PauseWindow(kind="pool_unhealthy", start_ms=NOW_MS + 1_000, end_ms=NOW_MS + 30_500,
                         detail="RPC_FAIL", loads=2, max_load_ms=29_448.0, failed_after_hit=3)
    resumed = _agent_paused(healthy, "a", t, window, failed=3, explained=3,
                            max_load_ms=29_448.0, unpaused_ms=400.0)
    alerts = model.update(resumed, _seen(resumed, t), t)
    assert _keys(alerts) == [("pause_wait", "warning", "a")]
    assert alerts[0].message.startswith("6 loads failed after a positive lookup, slowest load "
                                        "29.4 s while master ")
    # What a fresh one-shot says at the same moment, but for the rules only watching sees.
    once = AlertModel().update(resumed, _seen(resumed, t), t)
    assert _keys(once) == _keys(alerts)
