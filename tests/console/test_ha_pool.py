"""An HA pool in the console, on fleet states built from the wire schema with a frozen clock:
``no_leader`` while no master serves, ``master_behind`` for a master that is down or follows
an older election, the model's ``pool_failover`` event with the time the pool had no leader,
and the Pool tab's masters table (hidden for a single-master fleet)."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine, pool, sample_fleet

from kvpool_agent.protocol import EngineState, MasterView
from kvpool_console.alerts import AlertModel, AlertSettings, evaluate
from kvpool_console.app import KVPoolConsole
from kvpool_console.source import StaticSource
from kvpool_console.widgets._masters import MastersTable

ETCD = "etcd://127.0.0.1:2379"
POOL = f"mooncake@{ETCD}"
M1, M2 = "http://127.0.0.1:9101", "http://127.0.0.1:9102"

Fleet = dict[str, EngineState]


def _leader(url: str, address: str, view: int) -> MasterView:
    return MasterView(admin_url=url, reachable=True, role="leader", ha_state="serving",
                      serving=True, leader_address=address, view_version=view)


def _standby(url: str, leader: str, view: int) -> MasterView:
    return MasterView(admin_url=url, reachable=True, role="standby", ha_state="standby",
                      leader_address=leader, view_version=view)


DOWN = MasterView(admin_url=M1, error="All connection attempts failed")


def _fleet(*masters: MasterView) -> Fleet:
    fleet = {**engine("p0", role="prefill"), **engine("d0", role="decode")}
    p = msgspec.structs.replace(pool(), masters=list(masters))
    return {k: msgspec.structs.replace(s, source=msgspec.structs.replace(s.source, master=ETCD),
                                       pool=p) for k, s in fleet.items()}


def _ha(alerts: list) -> list[tuple[str, str, str]]:
    return [(a.rule, a.severity, a.subject) for a in alerts
            if a.rule in ("no_leader", "master_behind", "pool_failover")]


def test_a_leader_with_a_following_standby_raises_nothing() -> None:
    fleet = _fleet(_leader(M1, "127.0.0.1:50051", 2), _standby(M2, "127.0.0.1:50051", 2))
    assert _ha(evaluate(fleet, {}, NOW_MS)) == []


def test_no_serving_master_is_no_leader_naming_every_master() -> None:
    warming = MasterView(admin_url=M2, reachable=True, role="leader",
                         ha_state="leader_warmup", leader_address="127.0.0.1:50052",
                         view_version=3)
    alerts = evaluate(_fleet(DOWN, warming), {}, NOW_MS)
    assert _ha(alerts) == [("no_leader", "critical", POOL)]
    (a,) = [a for a in alerts if a.rule == "no_leader"]
    assert f"{M1} unreachable, {M2} leader/leader_warmup" in a.message
    assert "engines d0, p0" in a.message and "--etcd_endpoints" in a.hint


def test_a_dead_or_stale_master_beside_a_leader_is_behind() -> None:
    down = evaluate(_fleet(DOWN, _leader(M2, "127.0.0.1:50052", 3)), {}, NOW_MS)
    assert _ha(down) == [("master_behind", "warning", f"{POOL} {M1}")]
    (a,) = [a for a in down if a.rule == "master_behind"]
    assert a.message == (f"master {M1} of pool {POOL} does not answer /health (All connection "
                         "attempts failed)")
    assert "--enable_oplog" in a.hint
    stale = evaluate(_fleet(_standby(M1, "127.0.0.1:50051", 2),
                            _leader(M2, "127.0.0.1:50052", 3)), {}, NOW_MS)
    (b,) = [a for a in stale if a.rule == "master_behind"]
    assert b.message == (f"master {M1} of pool {POOL} has seen election view 2 (leader "
                         "127.0.0.1:50051), the leader view 3 (127.0.0.1:50052)")


def test_the_model_reports_a_failover_with_its_duration_then_retires_it() -> None:
    model = AlertModel(AlertSettings(window_ms=60_000))
    before = _fleet(_leader(M1, "127.0.0.1:50051", 2), _standby(M2, "127.0.0.1:50051", 2))
    during = _fleet(DOWN, _standby(M2, "127.0.0.1:50051", 2))
    after = _fleet(DOWN, _leader(M2, "127.0.0.1:50052", 3))
    assert _ha(model.update(before, {}, NOW_MS)) == []
    assert _ha(model.update(during, {}, NOW_MS + 1_000)) == [("no_leader", "critical", POOL)]
    model.update(during, {}, NOW_MS + 5_000)
    alerts = model.update(after, {}, NOW_MS + 10_600)
    assert _ha(alerts) == [("master_behind", "warning", f"{POOL} {M1}"),
                           ("pool_failover", "warning", POOL)]
    (fo,) = [a for a in alerts if a.rule == "pool_failover"]
    assert fo.message.startswith("failover: leader 127.0.0.1:50051 -> 127.0.0.1:50052 after "
                                 "9.6 s without a serving leader")
    assert "pool_failover" in [a.rule for a in model.new]
    assert _ha(model.update(after, {}, NOW_MS + 80_000)) == [
        ("master_behind", "warning", f"{POOL} {M1}")]


async def _masters_rows(states: Fleet) -> tuple[bool, list[list[str]]]:
    app = KVPoolConsole(StaticSource(states), refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        table = app.query_one(MastersTable)
        rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
        return table.display, rows


async def test_the_pool_tab_lists_the_masters_and_who_leads() -> None:
    shown, rows = await _masters_rows(
        _fleet(DOWN, _leader(M2, "127.0.0.1:50052", 3)))
    assert shown
    assert rows == [[POOL, M1, "unreachable", "-", "-", "0", "All connection attempts failed"],
                    [POOL, M2, "leader", "serving", "127.0.0.1:50052", "3", "-"]]
    assert await _masters_rows(sample_fleet()) == (False, [])
