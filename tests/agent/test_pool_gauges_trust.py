"""Issue 42: the hub's ``kvpool_pool_*`` families were the newest report's, so one agent key
reporting its pool healthy with 0 B (often enough to be the newest) set
``kvpool_pool_total_bytes`` to 0 and raised the Prometheus rule ``KvpoolPoolNoSegments`` for a
pool every other engine read holding 10 GB. They now follow ``kvpool_agent.pool_readings``, the
rule the console's ``pool_no_segments`` follows: the store agent's reading, else the engines'
newest readings when they agree on health, mounted bytes and disk capacity; none exported while
they disagree (``kvpool_pool_readings_agree 0``).

Each test scrapes ``FleetCollector`` as Prometheus does (its text format, parsed by
``prometheus_client``'s parser) and evaluates the rules' own expressions, read from
``config/prometheus/kvpool-rules.yml``, against the scraped samples."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent._metrics import FleetCollector
from kvpool_agent.pool_readings import newest_readings, pool_name, trusted_reading
from kvpool_agent.protocol import STALE_AFTER_MS, EngineState, PoolStats, SegmentUsage, Source
from kvpool_console.alerts.segments import segment_alerts

NOW_MS = 1_780_000_000_000.0
GB = 1 << 30
MASTER = "10.0.0.1:50051"
POOL = f"mooncake@{MASTER}"
RULES = Path(__file__).resolve().parents[2] / "config" / "prometheus" / "kvpool-rules.yml"

Samples = list[tuple[str, dict[str, str], float]]


def _pool(total: int, *, healthy: bool | None = True, used: int = 0) -> PoolStats:
    segs = [SegmentUsage(name="10.0.0.2:15001", used_bytes=used, total_bytes=total)] if total \
        else []
    return PoolStats(backend="mooncake", keys=7 if total else 0, used_bytes=used,
                     total_bytes=total, healthy=healthy, segments=segs)


def _agent(engine_id: str, p: PoolStats, *, role: str = "worker", age_ms: float = 300.0,
           master: str = MASTER) -> dict[str, EngineState]:
    aid = f"{engine_id}/dp0.tp0.pp0" if role == "worker" else engine_id
    src = Source(agent_id=aid, engine_id=engine_id, instance_role="mixed", kv_role="kv_both",
                 process_role=role, backend="mooncake", master=master)  # type: ignore[arg-type]
    return {aid: EngineState(source=src, started_ms=NOW_MS - 3_600_000, ts_ms=NOW_MS - age_ms,
                             pool=p)}


def _honest(total: int) -> dict[str, EngineState]:
    return _agent("a", _pool(total), age_ms=900) | _agent("b", _pool(total), age_ms=600)


def _liar(p: PoolStats) -> dict[str, EngineState]:
    """Engine ``x``'s worker (its own engine-bound key): the pool's newest reading."""
    return _agent("x", p, age_ms=0)


def _scrape(states: dict[str, EngineState],
            own_claims: set[str] | None = None,
            seen_ms: dict[str, float] | None = None) -> Samples:
    """``own_claims``: agent ids the hub does not vouch for (``Fleet.members``' third
    element); ``None``: no key knowledge (no store agent vouched for). ``seen_ms``: agent id
    -> the hub's receive time of its last report (default: its ``ts_ms``)."""
    members = None if own_claims is None else (
        lambda ids: {k: (None, "", k in own_claims) for k in ids})
    seen = seen_ms or {}
    reg = CollectorRegistry()
    reg.register(FleetCollector(lambda: {a: (st, seen.get(a, st.ts_ms))
                                         for a, st in states.items()},
                                dict, dict, lambda: NOW_MS, members=members))
    return [(s.name, dict(s.labels), s.value)
            for fam in text_string_to_metric_families(generate_latest(reg).decode())
            for s in fam.samples]


def _value(samples: Samples, name: str, pool: str = POOL) -> float | None:
    got = [v for n, lab, v in samples if n == name and lab.get("pool") == pool]
    assert len(got) <= 1
    return got[0] if got else None


_CMP: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le,
    ">": operator.gt, "<": operator.lt}
_CLAUSE = re.compile(r"^\s*([a-z_:]+)\s*(==|!=|>=|<=|>|<)\s*([0-9.]+)\s*$")


def _fires(alert: str, samples: Samples) -> list[dict[str, str]]:
    """The label sets ``alert``'s expression (from the rules file) returns over ``samples``:
    PromQL's ``metric OP scalar`` filters (without ``bool``) joined by ``and`` (the left side's
    samples whose label set the right side has), the form the pool rules use; any other form
    fails the test rather than being misread."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    (expr,) = [r["expr"] for g in groups for r in g["rules"] if r["alert"] == alert]
    result: list[dict[str, str]] | None = None
    for clause in str(expr).split(" and "):
        m = _CLAUSE.match(clause)
        assert m, f"{alert}: {clause!r} is not 'metric OP number'"
        name, op, num = m.group(1), _CMP[m.group(2)], float(m.group(3))
        side = [lab for n, lab, v in samples if n == name and op(v, num)]
        result = side if result is None else [lab for lab in result if lab in side]
    assert result is not None
    return result


def _pools_firing(alert: str, samples: Samples) -> set[str]:
    return {lab["pool"] for lab in _fires(alert, samples)}


def test_the_rule_evaluator_reads_the_rules_pool_expressions() -> None:
    """The evaluator agrees with PromQL on the rule's form: ``and`` keeps the left side's
    samples matched by label set."""
    samples: Samples = [("kvpool_pool_healthy", {"pool": "p", "backend": "m"}, 1.0),
                        ("kvpool_pool_total_bytes", {"pool": "p", "backend": "m"}, 0.0),
                        ("kvpool_pool_healthy", {"pool": "q", "backend": "m"}, 1.0),
                        ("kvpool_pool_total_bytes", {"pool": "q", "backend": "m"}, 5.0)]
    assert _pools_firing("KvpoolPoolNoSegments", samples) == {"p"}


def test_one_key_reporting_zero_segments_does_not_drive_the_gauge_to_zero() -> None:
    honest = _honest(10 * GB)
    before = _scrape(honest)
    assert _value(before, "kvpool_pool_total_bytes") == 10 * GB
    assert _value(before, "kvpool_pool_readings_agree") == 1
    assert _pools_firing("KvpoolPoolNoSegments", before) == set()
    attacked = _scrape(honest | _liar(_pool(0)))
    # The liar's reading is the pool's newest, and the newest report used to decide.
    assert _value(attacked, "kvpool_pool_total_bytes") != 0
    assert _value(attacked, "kvpool_pool_healthy") is None
    assert _value(attacked, "kvpool_pool_readings_agree") == 0
    assert _pools_firing("KvpoolPoolNoSegments", attacked) == set()
    assert _pools_firing("KvpoolPoolReadingsDisagree", attacked) == {POOL}


def test_a_genuine_pool_without_segments_fires() -> None:
    """Every engine, the key's own included, reads 0 B: the store is gone."""
    lost = _scrape(_honest(0) | _liar(_pool(0)))
    assert _value(lost, "kvpool_pool_total_bytes") == 0
    assert _value(lost, "kvpool_pool_healthy") == 1
    assert _value(lost, "kvpool_pool_readings_agree") == 1
    assert _pools_firing("KvpoolPoolNoSegments", lost) == {POOL}
    assert _pools_firing("KvpoolPoolReadingsDisagree", lost) == set()


def test_one_keys_forged_memory_does_not_export_a_value_over_a_real_loss() -> None:
    """Every other engine reads 0 B; the key says 10 GB: no value is exported as the pool's,
    and the disagreement rule warns (the console's ``pool_no_segments`` warns alike)."""
    samples = _scrape(_honest(0) | _liar(_pool(10 * GB)))
    assert _value(samples, "kvpool_pool_total_bytes") is None
    assert _pools_firing("KvpoolPoolReadingsDisagree", samples) == {POOL}


def test_a_stopped_engines_old_reading_does_not_weigh() -> None:
    """An engine silent past ``STALE_AFTER_MS`` before the pool's newest reading: its last
    reading (memory) neither blocks a real loss nor counts as agreement."""
    stale = _agent("old", _pool(10 * GB), age_ms=STALE_AFTER_MS + 1_000)
    samples = _scrape(_honest(0) | stale)
    assert _value(samples, "kvpool_pool_total_bytes") == 0
    assert _pools_firing("KvpoolPoolNoSegments", samples) == {POOL}


def test_an_unchecked_reading_does_not_disagree() -> None:
    """A reading before its first health check (``healthy`` None, sizes 0) says nothing."""
    samples = _scrape(_honest(10 * GB) | _liar(_pool(0, healthy=None)))
    assert _value(samples, "kvpool_pool_total_bytes") == 10 * GB
    assert _value(samples, "kvpool_pool_readings_agree") == 1


def test_agreeing_readings_export_the_newest_figures() -> None:
    """Readings agreeing on the shape differ in the figures that move (keys, bytes used):
    the newest reading's are exported."""
    states = (_agent("a", _pool(10 * GB, used=1 * GB), age_ms=900)
              | _agent("b", _pool(10 * GB, used=2 * GB), age_ms=100))
    samples = _scrape(states)
    assert _value(samples, "kvpool_pool_used_bytes") == 2 * GB


def test_the_store_agents_reading_is_the_pools_when_its_key_is_not_engine_bound() -> None:
    """Rule 2: a store agent beside the master, of a key not bound to one engine, reads the
    master itself: its reading is the pool's. A store claimed by an engine-bound key (any
    agent may say ``process_role="store"``) weighs as its engine does."""
    store = _agent("store@m1", _pool(10 * GB), role="store", age_ms=500)
    states = _agent("a", _pool(0)) | _liar(_pool(0)) | store
    vouched = _scrape(states, own_claims={"x/dp0.tp0.pp0"})
    assert _value(vouched, "kvpool_pool_total_bytes") == 10 * GB
    assert _pools_firing("KvpoolPoolNoSegments", vouched) == set()
    claimed = _scrape(states, own_claims={"store@m1"})
    assert _value(claimed, "kvpool_pool_total_bytes") is None
    # Without the hub's key knowledge no store agent is vouched for.
    assert _value(_scrape(states), "kvpool_pool_total_bytes") is None


def test_the_console_and_the_hub_weigh_the_same_readings() -> None:
    """One owner: the console's ``pool_no_segments`` counts :func:`newest_readings` of the
    workers, the hub's families every role's; both name the pool alike."""
    states = _honest(10 * GB) | _liar(_pool(0)) | _agent(
        "gone", _pool(0), age_ms=STALE_AFTER_MS + 1_000)
    readings = newest_readings(states.values())
    assert list(readings) == [POOL]
    assert sorted(readings[POOL]) == ["a", "b", "x"]
    assert trusted_reading(POOL, readings[POOL]).by == "disagree"
    assert {pool_name(st) for st in states.values()} == {POOL}


@pytest.mark.parametrize("master", ["", MASTER])
def test_a_pool_without_a_master_is_named_by_its_segments(master: str) -> None:
    st = next(iter(_agent("a", _pool(10 * GB), master=master).values()))
    assert pool_name(st) == (POOL if master else "mooncake:10.0.0.2:15001")
    empty = next(iter(_agent("a", _pool(0), master=master).values()))
    assert pool_name(empty) == (POOL if master else "mooncake:a")


def test_a_reading_of_another_backend_keeps_its_own_pool() -> None:
    p = msgspec.structs.replace(_pool(10 * GB), backend="yuanrong")
    samples = _scrape(_agent("y", p, master=""))
    assert _value(samples, "kvpool_pool_total_bytes", "yuanrong:10.0.0.2:15001") == 10 * GB


SKEW_MS = 3_500.0
"""Attack A3: the honest hosts' clocks run this far behind the hub's (over ``STALE_AFTER_MS``)."""


def _skewed(states: dict[str, EngineState]) -> tuple[dict[str, EngineState], dict[str, float]]:
    """``states`` as the hub holds them when their hosts' clocks run ``SKEW_MS`` behind its
    own: their ``ts_ms`` that far back, received (``last_seen_ms``) as fresh as they were."""
    out = {a: msgspec.structs.replace(st, ts_ms=st.ts_ms - SKEW_MS) for a, st in states.items()}
    return out, {a: st.ts_ms for a, st in states.items()}


def test_honest_engines_whose_clocks_run_behind_are_not_dropped_for_a_key_stamping_ahead() -> None:
    """Attack A3: a key stamps its reports ahead (the hub clamps them to its now, so its
    ``ts_ms`` is the pool's newest), the honest engines' clocks run 3.5 s behind the hub's.
    Judged by the agents' stamps the honest readings were stale, and the forged 0 B was the
    pool's one reading: ``total_bytes 0, healthy 1, agree 1``, ``KvpoolPoolNoSegments``.
    Judged by the hub's receive times all three are fresh and disagree."""
    honest, seen = _skewed(_honest(64 << 20))
    liar = _liar(_pool(0))
    seen |= {a: NOW_MS for a in liar}
    attacked = _scrape(honest | liar, seen_ms=seen)
    assert _value(attacked, "kvpool_pool_total_bytes") is None
    assert _value(attacked, "kvpool_pool_readings_agree") == 0
    assert _pools_firing("KvpoolPoolNoSegments", attacked) == set()
    assert _pools_firing("KvpoolPoolReadingsDisagree", attacked) == {POOL}
    # The stamps alone (what the rule judged by before) drop the honest engines.
    by_stamp = _scrape(honest | liar)
    assert _value(by_stamp, "kvpool_pool_total_bytes") == 0
    readings = newest_readings((honest | liar).values(), seen_ms=seen)
    assert sorted(readings[POOL]) == ["a", "b", "x"]


def test_a_vouched_store_agent_whose_clock_runs_behind_stays_the_pools_reading() -> None:
    """Attack A3 with the pool's store agent (a key not bound to an engine, vouched): its clock
    3.5 s behind the hub's, the forged 0 B stamped ahead; the store's reading is the pool's."""
    store, seen = _skewed(_agent("store@m1", _pool(64 << 20), role="store", age_ms=500)
                          | _honest(64 << 20))
    liar = _liar(_pool(0))
    seen |= {a: NOW_MS for a in liar}
    samples = _scrape(store | liar, own_claims=set(liar), seen_ms=seen)
    assert _value(samples, "kvpool_pool_total_bytes") == 64 << 20
    assert _pools_firing("KvpoolPoolNoSegments", samples) == set()


def test_a_silent_engine_is_stale_by_the_hubs_receive_time_whatever_its_stamp() -> None:
    """The other side: an engine whose last report the hub received over ``STALE_AFTER_MS``
    before the pool's newest is stale, even stamped ahead (clamped to the hub's now then)."""
    gone = _agent("gone", _pool(10 * GB), age_ms=0)
    seen = {a: NOW_MS - STALE_AFTER_MS - 1_000 for a in gone}
    samples = _scrape(_honest(0) | gone, seen_ms=seen)
    assert _value(samples, "kvpool_pool_total_bytes") == 0
    assert _pools_firing("KvpoolPoolNoSegments", samples) == {POOL}


def test_the_consoles_pool_no_segments_judges_freshness_by_the_hubs_receive_time() -> None:
    """Attack A3 on the console: the forged 0 B stamped ahead, the honest engines' clocks
    3.5 s behind: a warning naming both sides, not the critical alert."""
    honest, seen = _skewed(_honest(64 << 20))
    liar = _liar(_pool(0))
    seen |= {a: NOW_MS for a in liar}
    alerts = segment_alerts(honest | liar, NOW_MS, seen)
    assert [(a.rule, a.severity) for a in alerts] == [("pool_no_segments", "warning")]
    # Judged by the stamps, the forged reading was the pool's only one: critical.
    assert [a.severity for a in segment_alerts(honest | liar, NOW_MS)] == ["critical"]
