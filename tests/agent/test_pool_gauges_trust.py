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

import bisect
import functools
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
_CLAUSE = re.compile(r"^\s*(?:(avg_over_time|last_over_time)\(([a-z_:]+)\[(\d+)([sm])\]\)"
                     r"|([a-z_:]+))\s*(==|!=|>=|<=|>|<)\s*([0-9.]+)\s*$")
Scrapes = list[tuple[float, Samples]]
"""Scrapes of one target: (time in s, its samples), in time order."""


@functools.cache
def _expr(alert: str) -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    (expr,) = [r["expr"] for g in groups for r in g["rules"] if r["alert"] == alert]
    return str(expr)


@functools.cache
def _for_s(alert: str) -> float:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    (hold,) = [str(r.get("for", "0s")) for g in groups for r in g["rules"] if r["alert"] == alert]
    return float(hold[:-1]) * {"s": 1, "m": 60}[hold[-1]]


def _select(name: str, fn: str | None, window_s: float, scrapes: Scrapes, t: float
            ) -> list[tuple[dict[str, str], float]]:
    """PromQL at time ``t`` over ``scrapes``: ``name`` alone is each series in the newest scrape
    at or before ``t`` (a series absent from it is stale: Prometheus marks it so); ``fn`` over
    ``name[window]`` is per series its samples in ``(t - window, t]``, averaged or the last,
    however many scrapes lacked it."""
    times = [ts for ts, _ in scrapes]
    hi = bisect.bisect_right(times, t)
    if fn is None:
        return [(lab, v) for n, lab, v in scrapes[hi - 1][1] if n == name] if hi else []
    series: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for _, smp in scrapes[bisect.bisect_right(times, t - window_s):hi]:
        for n, lab, v in smp:
            if n == name:
                series.setdefault(tuple(sorted(lab.items())), []).append(v)
    pick: Callable[[list[float]], float] = (
        (lambda vs: sum(vs) / len(vs)) if fn == "avg_over_time" else (lambda vs: vs[-1]))
    return [(dict(k), pick(vs)) for k, vs in series.items()]


def _fires_at(alert: str, scrapes: Scrapes, t: float) -> list[dict[str, str]]:
    """The label sets ``alert``'s expression (from the rules file) returns at time ``t``:
    ``metric OP scalar``, ``avg_over_time(metric[w]) OP scalar`` or
    ``last_over_time(metric[w]) OP scalar`` filters (without ``bool``) joined by ``and`` (the
    left side's samples whose label set the right side has), the forms the pool rules use; any
    other form fails the test rather than being misread."""
    expr = _expr(alert)
    result: list[dict[str, str]] | None = None
    for clause in expr.split(" and "):
        m = _CLAUSE.match(clause)
        assert m, f"{alert}: {clause!r} is not '[fn(]metric[w][)] OP number'"
        fn, ranged, num_w, unit, plain, op_s, num = m.groups()
        name = ranged or plain
        window_s = float(num_w) * {"s": 1, "m": 60}[unit] if fn else 0.0
        op = _CMP[op_s]
        side = [lab for lab, v in _select(name, fn, window_s, scrapes, t)
                if op(v, float(num))]
        result = side if result is None else [lab for lab in result if lab in side]
    assert result is not None
    return result


def _fires(alert: str, samples: Samples) -> list[dict[str, str]]:
    """``alert``'s expression over one scrape (each range function sees its one sample)."""
    return _fires_at(alert, [(0.0, samples)], 0.0)


def _firing_since(alert: str, scrapes: Scrapes, pool: str = POOL, every_s: float = 2.0
                  ) -> float | None:
    """When ``alert`` first fires for ``pool`` as Prometheus evaluates it every ``every_s`` from
    the first scrape: pending while its expression returns the pool at each evaluation (one
    evaluation without it resets it), firing once pending for the rule's ``for``; ``None``:
    never."""
    hold = _for_s(alert)
    t, end = scrapes[0][0], scrapes[-1][0]
    pending: float | None = None
    while t <= end:
        if any(lab.get("pool") == pool for lab in _fires_at(alert, scrapes, t)):
            pending = t if pending is None else pending
            if t - pending >= hold:
                return t
        else:
            pending = None
        t += every_s
    return None


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


def _lost(p: PoolStats, keys: int, nbytes: int) -> PoolStats:
    return msgspec.structs.replace(p, lost_keys=keys, lost_bytes=nbytes)


def test_lost_keys_and_bytes_are_exported_as_the_reading_that_saw_most() -> None:
    """``PoolStats.lost_keys``/``lost_bytes`` (segments the master dropped) were not on
    ``/metrics``. Each agent counts them since it started reading the master: the counters
    are the fresh agreeing reading that saw most (engine ``a``, not the newer ``b``, which
    started after the loss), the vouched store agent's when there is one, none while the
    readings disagree."""
    states = (_agent("a", _lost(_pool(10 * GB), 4_000, 400 << 20), age_ms=900)
              | _agent("b", _pool(10 * GB), age_ms=300))
    samples = _scrape(states)
    assert _value(samples, "kvpool_pool_lost_keys_total") == 4_000
    assert _value(samples, "kvpool_pool_lost_bytes_total") == 400 << 20
    store = _agent("store@m1", _lost(_pool(10 * GB), 1_000, 100 << 20), role="store",
                   age_ms=500)
    vouched = _scrape(states | store, own_claims=set())
    assert _value(vouched, "kvpool_pool_lost_keys_total") == 1_000
    assert _value(vouched, "kvpool_pool_lost_bytes_total") == 100 << 20
    disagree = _scrape(states | _liar(_lost(_pool(0), 9, 9)))
    assert _value(disagree, "kvpool_pool_readings_agree") == 0
    assert _value(disagree, "kvpool_pool_lost_keys_total") is None


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


# Attack A6 and the rules over time: each scenario is a series of scrapes of the hub (its real
# FleetCollector) every ``scrape_s``, evaluated as Prometheus does every 2 s.

MIB64 = 64 << 20
BOUND_S = 6 * 60 + 4.0
"""One of ``KvpoolPoolNoSegments``/``KvpoolPoolReadingsDisagree`` fires at most this long after
a key starts flapping over a real loss (docs/operating.md): NoSegments stays silent only while
every agreeing stretch is shorter than 30 s (its pending minute minus its 30 s look-back) and
each is broken by a disagreement over 30 s, so over half of every 5-minute window disagrees
once the flapping has run 5 minutes, Disagree's average is then below 0.9 at every
evaluation, and it fires a minute later (plus two evaluations)."""
START_S = 300.0
"""Each scenario's pool is healthy and agreed (10 GB) before this, filling the 5-min window."""


def _pool_scrapes(totals: Callable[[float], tuple[int, ...]], end_s: float,
                  scrape_s: float = 2.0) -> Scrapes:
    """Scrapes from 0 to ``end_s``: at time t engines a and b (and x, the attacker's own
    engine-bound key, when ``totals`` gives three) read the pool healthy with ``totals(t)``
    bytes mounted."""
    memo: dict[tuple[int, ...], Samples] = {}
    out: Scrapes = []
    t = 0.0
    while t <= end_s:
        key = totals(t)
        if key not in memo:
            states: dict[str, EngineState] = {}
            for engine, total, age in zip("abx", key, (900, 600, 0), strict=False):
                states |= _agent(engine, _pool(total), age_ms=age)
            memo[key] = [smp for smp in _scrape(states) if smp[0].startswith("kvpool_pool_")]
        out.append((t, memo[key]))
        t += scrape_s
    return out


def _first_alert(scrapes: Scrapes) -> dict[str, float | None]:
    return {a: _firing_since(a, scrapes)
            for a in ("KvpoolPoolNoSegments", "KvpoolPoolReadingsDisagree")}


def test_the_evaluator_reads_range_functions_as_promql_does() -> None:
    """``avg_over_time`` averages the samples in the window, ``last_over_time`` takes the last
    one however many scrapes lacked the series; a bare series absent from the newest scrape is
    stale."""
    lab = {"pool": POOL, "backend": "mooncake"}
    scrapes: Scrapes = [(0.0, [("m", lab, 1.0)]), (10.0, [("m", lab, 0.0)]), (20.0, []),
                        (30.0, [])]
    assert _select("m", "avg_over_time", 60.0, scrapes, 30.0) == [(lab, 0.5)]
    assert _select("m", "last_over_time", 15.0, scrapes, 20.0) == [(lab, 0.0)]
    assert _select("m", "last_over_time", 15.0, scrapes, 30.0) == []
    assert _select("m", None, 0.0, scrapes, 20.0) == []
    assert _select("m", None, 0.0, scrapes, 15.0) == [(lab, 0.0)]


def _flapping(disagree_s: float, agree_s: float) -> Callable[[float], tuple[int, ...]]:
    """The pool really loses its memory at ``START_S`` (both honest engines read 0 B); from
    then on the attacker's key reports 64 MiB for ``disagree_s``, then 0 B for ``agree_s``, and
    again."""
    def totals(t: float) -> tuple[int, ...]:
        if t < START_S:
            return (10 * GB, 10 * GB, 10 * GB)
        lying = (t - START_S) % (disagree_s + agree_s) < disagree_s
        return (0, 0, MIB64 if lying else 0)
    return totals


@pytest.mark.parametrize(("disagree_s", "agree_s"), [
    (45, 8),     # attack A6 as run: 82 evaluations, neither rule fired under the old rules
    (32, 26), (34, 2), (60, 28), (120, 20), (240, 28), (10, 10), (2, 50)])
def test_flapping_disagreement_cannot_keep_both_pool_rules_silent(disagree_s: float,
                                                                  agree_s: float) -> None:
    scrapes = _pool_scrapes(_flapping(disagree_s, agree_s), START_S + BOUND_S + 10)
    fired = [t for t in _first_alert(scrapes).values() if t is not None]
    assert fired and min(fired) - START_S <= BOUND_S, (disagree_s, agree_s, fired)


@pytest.mark.parametrize("scrape_s", [2.0, 15.0])
def test_a_real_loss_without_an_attacker_fires_no_segments(scrape_s: float) -> None:
    """Attack A6's control: the store is gone, every engine reads 0 B (one of them a poll
    later than the other: honest readings differ for one 2 s interval)."""
    def totals(t: float) -> tuple[int, ...]:
        if t < START_S:
            return (10 * GB, 10 * GB)
        return (0, 10 * GB if t < START_S + 2 else 0)
    fired = _first_alert(_pool_scrapes(totals, START_S + 120, scrape_s))
    no_segments = fired["KvpoolPoolNoSegments"]
    assert no_segments is not None and no_segments - START_S <= 60 + 2 * scrape_s + 2
    assert fired["KvpoolPoolReadingsDisagree"] is None


@pytest.mark.parametrize("scrape_s", [2.0, 15.0])
def test_honest_segment_changes_raise_nothing(scrape_s: float) -> None:
    """A segment mounts or drops every 3 minutes: one engine reads the new capacity a poll
    (2 s) before the other. Over 15 minutes neither pool rule fires."""
    def totals(t: float) -> tuple[int, ...]:
        n, since = divmod(t, 180.0)
        new = (10 + int(n) % 2) * GB
        old = (10 + int(n + 1) % 2) * GB
        return (new, old if n and since < 2 else new)
    fired = _first_alert(_pool_scrapes(totals, 900.0, scrape_s))
    assert fired == {"KvpoolPoolNoSegments": None, "KvpoolPoolReadingsDisagree": None}
