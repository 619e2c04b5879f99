"""The hub's Prometheus endpoint: ``/metrics`` over the fleet state the hub already holds.

A custom collector (``prometheus_client``) reads ``Fleet.states()`` at scrape time, so a report
costs the hub nothing extra and a scrape always sees the newest state of every agent. One series
set per engine (labels ``engine``, ``model``, ``role``: the agents of an engine summed, like the
console's engine row) and per pool (labels ``pool``, ``backend``; a pool named as the console
names it, ``kvpool_agent.pool_readings.pool_name``: ``backend@master`` when its agents know
their master). A pool's figures are its trusted reading, not its newest report's
(``kvpool_agent.pool_readings``, issue 42: one agent key reporting a pool healthy with 0 B set
them, so raised ``KvpoolPoolNoSegments``): a store agent's the hub vouches for (its key
neither bound to one engine nor claiming a pool closed to it: ``Fleet.members``), else the
engines' newest readings when they agree on the pool's health, memory and disk capacity;
while they disagree no figure of the pool is exported, only ``kvpool_pool_readings_agree 0``.
Names and units follow Prometheus conventions: counters end in ``_total``, sizes in
``_bytes``, spans in ``_seconds``, instants are ``_timestamp_seconds`` (Unix time), fractions
``_ratio``. Every family's name and help come
from the counter catalogue (``kvpool_agent.ledger``): a family the catalogue does not list
cannot be exported.

Token accounting (the README's "Pool hit rate"): per request, ``prompt`` tokens = ``local``
(vLLM's own prefix cache) + ``loaded`` (written into vLLM's blocks from the pool, counted once
per load when its outcome is known) + ``recomputed`` (the rest, failed loads included);
a pool hit is a loaded token (one counter, ``kvpool_loaded_tokens``): a failed load is never
a hit (``kvpool_load_failed_tokens``).
``kvpool_pool_hit_ratio`` = pool hit / prompt, ``kvpool_local_hit_ratio`` = local / prompt.

Counters are the agents' counters since their start: an agent restart or a forgotten agent
lowers the engine's sum, which Prometheus' ``rate``/``increase`` treat as a counter reset.

Label values are what agents reported: ids are printable words by the wire schema; names
(model, error, segment) may hold tabs and newlines, shown as ``\x09``/``\x0a``
(``protocol.visible``), so no scrape carries a control character to whoever reads it in a
terminal.

Alerts are not exported here: ``config/prometheus/kvpool-rules.yml`` expresses the console's
alert rules over these series, and Prometheus itself exports the firing ones (``ALERTS``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool_agent import ledger
from kvpool_agent._access_window import FLEET, Ceiling
from kvpool_agent._misses import split_not_in_pool
from kvpool_agent.ledger import Fact
from kvpool_agent.pool_readings import newest_readings, pool_name, trusted_reading
from kvpool_agent.protocol import DOWN_AFTER_MS, STALE_AFTER_MS, EngineState, visible

__all__ = [
    "FleetCollector",
    "pool_name",
]

# The console's thresholds: one owner (the wire contract), so a scrape and the console never
# disagree on whether an agent is stale.
_STALE_AFTER_S = STALE_AFTER_MS / 1e3
_DOWN_AFTER_S = DOWN_AFTER_MS / 1e3

_ENGINE = ["engine", "model", "role"]
_AGENT = [*_ENGINE, "agent"]
_POOL = ["pool", "backend"]
_POOL_TIER = [*_POOL, "tier"]
_STATES = ("up", "stale", "down")
_POOL_READERS = ("scheduler", "worker", "store", "replay")
"""Agents whose pool readings weigh (every role: a connector's scheduler reports none)."""


def _recomputed(st: EngineState) -> int:
    lk = st.lookup
    return max(0, lk.prompt_tokens - lk.local_tokens - lk.loaded_tokens)


def _ratio(part: int, whole: int) -> float:
    # Exact: int / int rounds once, however large the sums. At most 1: hits counted without
    # their prompt (an agent's dropped events) never read as more than every token.
    return min(1.0, part / whole) if whole > 0 else 0.0


def _label(name: str) -> str:
    return visible(name, one_line=True)


class _Families:
    """The metric families of one scrape, created on first use, yielded in creation order."""

    def __init__(self) -> None:
        self._by_name: dict[str, Metric] = {}

    def counter(self, name: str, labels: list[str], fact: Fact | None = None
                ) -> CounterMetricFamily:
        """The counter family ``kvpool_<name>`` (``fact``: the catalogue's, else ``name``'s)."""
        fam = self._by_name.get(name)
        if fam is None:
            f = fact or ledger.fact(name)
            fam = self._by_name[name] = CounterMetricFamily(
                f"kvpool_{name}", f.help, labels=labels)
        assert isinstance(fam, CounterMetricFamily)
        return fam

    def gauge(self, name: str, labels: list[str]) -> GaugeMetricFamily:
        """The gauge family ``kvpool_<name>``, with the catalogue's help."""
        fam = self._by_name.get(name)
        if fam is None:
            fam = self._by_name[name] = GaugeMetricFamily(
                f"kvpool_{name}", ledger.fact(name).help, labels=labels)
        assert isinstance(fam, GaugeMetricFamily)
        return fam

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._by_name.values())


# Engine counters: (catalogue name, value over one engine's agents).
_ENGINE_COUNTERS: tuple[tuple[str, Callable[[list[EngineState]], float]], ...] = (
    ("lookups", lambda g: sum(s.lookup.lookups for s in g)),
    ("lookup_errors", lambda g: sum(s.lookup.lookup_errors for s in g)),
    ("prompt_tokens", lambda g: sum(s.lookup.prompt_tokens for s in g)),
    ("local_tokens", lambda g: sum(s.lookup.local_tokens for s in g)),
    ("loaded_tokens", lambda g: sum(s.lookup.loaded_tokens for s in g)),
    ("load_failed_tokens", lambda g: sum(s.lookup.load_failed_tokens for s in g)),
    ("lookup_skipped", lambda g: sum(s.lookup.lookup_skipped for s in g)),
    ("recomputed_tokens", lambda g: sum(_recomputed(s) for s in g)),
    ("loads_finished", lambda g: sum(s.transfers.loads_finished for s in g)),
    ("loads_failed", lambda g: sum(s.transfers.loads_failed for s in g)),
    ("loads_timed_out", lambda g: sum(s.transfers.loads_timed_out for s in g)),
    ("failed_after_hit", lambda g: sum(s.transfers.failed_after_hit for s in g)),
    ("saves_finished", lambda g: sum(s.transfers.saves_finished for s in g)),
    ("saves_failed", lambda g: sum(s.transfers.saves_failed for s in g)),
    ("saves_skipped", lambda g: sum(s.transfers.saves_skipped for s in g)),
    ("loaded_bytes", lambda g: sum(s.transfers.loaded_bytes for s in g)),
    ("saved_bytes", lambda g: sum(s.transfers.saved_bytes for s in g)),
)


class FleetCollector(Collector):
    """Prometheus collector over the hub's fleet state.

    Args:
        states: ``Fleet.states``: agent id -> (latest ``EngineState``, hub receive time of its
            last message in epoch ms); called once per scrape, from the HTTP thread.
        report_gaps: agent id -> reports the hub never received.
        hub_counters: the hub's own counters by name (``reports``, ``bad_messages``...),
            exported as ``kvpool_hub_<name>_total``.
        clock_ms: wall clock in epoch ms (tests freeze it).
        reuse_ceilings: the hub's last live reuse ceilings (``ReuseService.ceilings``: model
            -> ``Ceiling``, the fleet's under ``""``); ``None``: none exported.
        miss_split: per engine id, its ``not_in_pool`` tokens split by the hub's saved-chunk
            memory (``ReuseService.not_in_pool``: ``evicted``, ``other_digest``,
            ``never_saved``, ``first_use``), applied to ``kvpool_miss_tokens_total`` with
            ``_misses.split_not_in_pool``; ``None``: ``not_in_pool`` is exported unsplit.
        hub_labelled: the hub's counters by label (``HubCounters.by_label``: family ->
            (label, value -> count)), exported as ``kvpool_<family>_total{label}``; ``None``:
            none.
        members: ``Fleet.members`` with the pools closed to other keys: agent ids -> (source,
            identity, whether what it reports is its own claim: an engine-bound key, or a
            pool closed to its key). A store agent's reading is the pool's value only when
            not (``pool_readings``, rule 2). ``None``: no store agent is vouched for, every
            pool's value is its agreed reading (rule 3).
    """

    def __init__(
        self,
        states: Callable[[], Mapping[str, tuple[EngineState, float]]],
        report_gaps: Callable[[], Mapping[str, int]],
        hub_counters: Callable[[], Mapping[str, int]],
        clock_ms: Callable[[], float],
        reuse_ceilings: Callable[[], Mapping[str, Ceiling]] | None = None,
        miss_split: Callable[[], Mapping[str, Mapping[str, int]]] | None = None,
        members: Callable[[list[str]], Mapping[str, tuple[object, str, bool]]] | None = None,
        hub_labelled: Callable[[], Mapping[str, tuple[str, Mapping[str, int]]]] | None = None,
    ) -> None:
        self._members = members
        self._hub_labelled = hub_labelled
        self._states = states
        self._miss_split = miss_split
        self._reuse_ceilings = reuse_ceilings
        self._report_gaps = report_gaps
        self._hub_counters = hub_counters
        self._clock_ms = clock_ms

    def collect(self) -> Iterator[Metric]:
        """One scrape: every family below, built from one read of the fleet."""
        fams = _Families()
        now_ms = self._clock_ms()
        states = self._states()
        gaps = self._report_gaps()
        groups: dict[str, list[tuple[EngineState, float]]] = {}
        for st, seen in states.values():
            groups.setdefault(st.source.engine_id, []).append((st, seen))
        fleet = {"prompt": 0, "local": 0, "pool": 0}
        agent_states = dict.fromkeys(_STATES, 0)
        split = self._miss_split() if self._miss_split is not None else {}
        for engine_id in sorted(groups):
            self._engine(fams, engine_id, groups[engine_id], now_ms, gaps, fleet, agent_states,
                         split.get(engine_id))
        self._pools(fams, [st for st, _ in states.values()],
                    {st.source.agent_id: seen for st, seen in states.values()})
        fams.gauge("fleet_engines", []).add_metric([], len(groups))
        agents = fams.gauge("fleet_agents", ["state"])
        for name in _STATES:
            agents.add_metric([name], agent_states[name])
        fams.gauge("fleet_pool_hit_ratio", []).add_metric(
            [], _ratio(fleet["pool"], fleet["prompt"]))
        fams.gauge("fleet_local_hit_ratio", []).add_metric(
            [], _ratio(fleet["local"], fleet["prompt"]))
        if self._reuse_ceilings is not None:
            self._reuse(fams, self._reuse_ceilings())
        for name, value in sorted(self._hub_counters().items()):
            fams.counter(f"hub_{name}", [], ledger.HUB_COUNTERS).add_metric([], value)
        if self._hub_labelled is not None:
            for family, (label, counts) in self._hub_labelled().items():
                fam = fams.counter(family, [label])
                for value_, n in sorted(counts.items()):
                    fam.add_metric([visible(value_, one_line=True)], n)
        return iter(fams)

    @staticmethod
    def _reuse(fams: _Families, ceilings: Mapping[str, Ceiling]) -> None:
        """The live reuse ceiling (``kvpool_agent._access_window``): per model and fleet-wide,
        the share of the window's looked-up prompt tokens an unbounded pool would have hit."""
        per_model = fams.gauge("reuse_ceiling_ratio", ["model"])
        for model, c in sorted(ceilings.items()):
            if model == FLEET:
                fams.gauge("fleet_reuse_ceiling_ratio", []).add_metric(
                    [], c.hit_rate)
            else:
                per_model.add_metric([_label(model)], c.hit_rate)

    def _engine(
        self,
        fams: _Families,
        engine_id: str,
        group: list[tuple[EngineState, float]],
        now_ms: float,
        gaps: Mapping[str, int],
        fleet: dict[str, int],
        agent_states: dict[str, int],
        split: Mapping[str, int] | None,
    ) -> None:
        # The scheduler names the engine's model and role, like the console's engine row.
        group.sort(key=lambda x: (x[0].source.process_role != "scheduler", x[0].source.agent_id))
        head = group[0][0].source
        labels = [engine_id, _label(head.model), head.instance_role]
        sts = [st for st, _ in group]
        digests = sorted({s.source.layout_digest for s in sts if s.source.layout_digest})
        fams.gauge("engine_info", [*_ENGINE, "kv_role", "backend", "layout_digest"]).add_metric(
            [*labels, head.kv_role, head.backend, ",".join(digests)], 1)
        for name, value in _ENGINE_COUNTERS:
            fams.counter(name, _ENGINE).add_metric(labels, value(sts))
        prompt = sum(s.lookup.prompt_tokens for s in sts)
        local = sum(s.lookup.local_tokens for s in sts)
        pool_hits = sum(s.lookup.loaded_tokens for s in sts)
        fleet["prompt"] += prompt
        fleet["local"] += local
        fleet["pool"] += pool_hits
        fams.gauge("pool_hit_ratio", _ENGINE).add_metric(labels, _ratio(pool_hits, prompt))
        fams.gauge("local_hit_ratio", _ENGINE).add_metric(labels, _ratio(local, prompt))
        errors: dict[str, int] = {}
        for s in sts:
            for err, n in s.transfers.errors_by_name.items():
                errors[err] = errors.get(err, 0) + n
        fam = fams.counter("transfer_errors", [*_ENGINE, "error"])
        for err in sorted(errors):
            fam.add_metric([*labels, _label(err)], errors[err])
        misses: dict[str, int] = {}
        for s in sts:
            for reason, n in s.lookup.miss_tokens.items():
                misses[reason] = misses.get(reason, 0) + n
        misses = split_not_in_pool(misses, split)
        fam = fams.counter("miss_tokens", [*_ENGINE, "reason"])
        for reason in sorted(misses):
            fam.add_metric([*labels, _label(reason)], misses[reason])
        for kind in ("load", "save"):
            fams.gauge(f"{kind}s_in_flight", _ENGINE).add_metric(
                labels, len({t.req_id for s in sts for t in s.in_flight if t.kind == kind}))
        fams.gauge("max_load_seconds", _ENGINE).add_metric(
            labels, max(s.transfers.max_load_ms for s in sts) / 1e3)
        told = [s for s in sts if s.transfers.oldest_save_age_ms is not None]
        if told:  # agents since issue 38 item 4; an age is as of its report, plus the time since
            fams.gauge("oldest_save_age_seconds", _ENGINE).add_metric(labels, max(
                           (s.transfers.oldest_save_age_ms or 0.0)
                           + (max(0.0, now_ms - s.ts_ms) if s.transfers.oldest_save_age_ms
                              else 0.0) for s in told) / 1e3)
            fams.gauge("save_blocks_held", _ENGINE).add_metric(
                labels, sum(s.transfers.save_blocks_held or 0 for s in told))
            fams.gauge("save_staged_bytes", _ENGINE).add_metric(
                labels, sum(s.transfers.save_bytes_staged or 0 for s in told))
        leases = [t.lease_expires_ms for s in sts for t in s.in_flight
                  if t.lease_expires_ms is not None]
        if leases:
            fams.gauge("lease_expiry_timestamp_seconds", _ENGINE).add_metric(
                labels, min(leases) / 1e3)
        pooled = [s for s in sts if s.pool is not None]
        if pooled:
            # The newest pool report, as the console's engine row takes it.
            pool = max(pooled, key=lambda s: s.ts_ms).pool
            assert pool is not None
            fams.gauge("lease_ttl_seconds", _ENGINE).add_metric(labels, pool.lease_ttl_ms / 1e3)
        newest = max(seen for _, seen in group)
        fams.gauge("report_age_seconds", _ENGINE).add_metric(
            labels, max(0.0, now_ms - newest) / 1e3)
        state_fam = fams.gauge("agent_state", [*_AGENT, "state"])
        for st, seen in group:
            age_s = max(0.0, now_ms - seen) / 1e3
            state = "down" if age_s > _DOWN_AFTER_S else "stale" if age_s > _STALE_AFTER_S else "up"
            agent_states[state] += 1
            alabels = [*labels, st.source.agent_id]
            for name in _STATES:
                state_fam.add_metric([*alabels, name], 1 if name == state else 0)
            fams.gauge("agent_report_age_seconds", _AGENT).add_metric(alabels, age_s)
            fams.counter("agent_report_gaps", _AGENT).add_metric(
                alabels, gaps.get(st.source.agent_id, 0))
            fams.counter("agent_events_dropped", _AGENT).add_metric(alabels, st.process.dropped)

    def _pools(self, fams: _Families, states: list[EngineState],
               seen_ms: Mapping[str, float]) -> None:
        """Each pool's trusted reading (``kvpool_agent.pool_readings``, fresh by the hub's
        receive times ``seen_ms``, agent id -> ms, not the agents' clocks): its figures, and
        ``pool_readings_agree`` 1; readings that disagree: ``pool_readings_agree`` 0 alone."""
        stores = [st.source.agent_id for st in states if st.source.process_role == "store"]
        vouched = ({k for k, (_, _, own) in self._members(stores).items() if not own}
                   if self._members is not None and stores else set())

        def store(st: EngineState) -> bool:
            return st.source.process_role == "store" and st.source.agent_id in vouched

        readings = newest_readings(states, _POOL_READERS, seen_ms)
        for name in sorted(readings):
            trusted = trusted_reading(name, readings[name], store, seen_ms)
            labels = [_label(name), trusted.backend]
            fams.gauge("pool_readings_agree", _POOL).add_metric(
                labels, 0 if trusted.stats is None else 1)
            p = trusted.stats
            if p is None:
                continue
            fams.gauge("pool_keys", _POOL).add_metric(labels, p.keys)
            fams.gauge("pool_used_bytes", _POOL).add_metric(labels, p.used_bytes)
            fams.gauge("pool_total_bytes", _POOL).add_metric(labels, p.total_bytes)
            fams.gauge("pool_high_watermark_ratio", _POOL).add_metric(
                labels, p.high_watermark)
            fams.counter("pool_evicted_keys", _POOL).add_metric(labels, p.evicted_keys)
            fams.counter("pool_evicted_bytes", _POOL).add_metric(labels, p.evicted_bytes)
            # Each agent counts the losses it saw since it started reading the master: the
            # fresh reading that saw most (the console's Pool tab's rule), not the newest,
            # which would flap between agents' counts; the store agent's when it vouches.
            lost = p if trusted.by == "store" else max(
                (st.pool for st in readings[name].values() if st.pool is not None),
                key=lambda q: (q.lost_bytes, q.lost_keys))
            fams.counter("pool_lost_keys", _POOL).add_metric(labels, lost.lost_keys)
            fams.counter("pool_lost_bytes", _POOL).add_metric(labels, lost.lost_bytes)
            fams.gauge("pool_disk_keys", _POOL).add_metric(labels, p.disk_keys)
            fams.gauge("pool_disk_used_bytes", _POOL).add_metric(labels, p.disk_used_bytes)
            fams.gauge("pool_disk_total_bytes", _POOL).add_metric(labels, p.disk_total_bytes)
            reads = fams.counter("pool_reads", _POOL_TIER)
            read_bytes = fams.counter("pool_read_bytes", _POOL_TIER)
            for tier, hits, nbytes in (("memory", p.memory_hits, p.memory_hit_bytes),
                                       ("disk", p.disk_hits, p.disk_hit_bytes)):
                reads.add_metric([*labels, tier], hits)
                read_bytes.add_metric([*labels, tier], nbytes)
            if p.healthy is not None:
                fams.gauge("pool_healthy", _POOL).add_metric(
                    labels, 1 if p.healthy else 0)
