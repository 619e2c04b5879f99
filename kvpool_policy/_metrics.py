"""The policy service's Prometheus endpoint (``kvpool-policy serve --metrics-port``, issue 40):
``/metrics`` over what the service already counts, beside the master's and the hub's.

A custom collector (``prometheus_client``) reads the service's ``ServiceCounters``, its
``PoolPolicy``'s gauges and its ``Remover``'s counts at scrape time, on the HTTP server's
thread: the service's loop does no work for a scrape and takes no lock. The loop owns every
value; the collector only reads ints and ``len()`` of containers (each one step under the GIL)
and copies each dict it walks (``over_cap_by_key``, ``records_over_cap_by_key``) in one
``dict()`` call first, so a scrape never iterates a dict the loop is growing. A scrape may see
one batch half counted (its records applied, its evictions not yet): the next scrape has the
rest.

Every family's name, kind and help come from the counter catalogue (``kvpool_agent.ledger``,
the facts shown on ``"policy"``): ``kvpool_policy_<what>``, counters with ``_total``; sizes are
bytes, counts are records, batches, chunks (a chunk: every rank's keys of one chunk hash) or
keys (one Mooncake key each). The endpoint has no authentication: it binds 127.0.0.1 unless
``--metrics-host`` names another address.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool_agent import ledger
from kvpool_agent.protocol import visible
from kvpool_policy.service import PolicyCore, ServiceCounters

__all__ = ["LOST_CAUSES", "ServiceCollector"]

LOST_CAUSES = ("sender_dropped", "over_budget", "malformed")
"""The ``cause`` label values of ``kvpool_policy_records_lost_total``: the ``ServiceCounters``
fields whose sum is the snapshot's ``dropped``."""

# Unlabelled counters: (catalogue name, its value from the service's counters).
_COUNTERS: tuple[tuple[str, Callable[[ServiceCounters], int]], ...] = (
    ("policy_records_applied", lambda c: c.records),
    ("policy_batches_lost", lambda c: c.lost_batches),
    ("policy_batches_wrong_engine", lambda c: c.wrong_engine),
    ("policy_layouts_refused", lambda c: c.layouts_refused),
    ("policy_share_capped_chunks", lambda c: c.share_capped),
    ("policy_admission_capped_records", lambda c: c.admission_capped),
    ("policy_errors", lambda c: c.errors),
    ("policy_snapshots_published", lambda c: c.snapshots),
    ("policy_snapshots_on_subscription", lambda c: c.snapshots_on_subscription),
    ("policy_snapshot_deltas", lambda c: c.snapshot_deltas),
    ("policy_snapshot_bytes", lambda c: c.snapshot_bytes),
    ("policy_evicted_chunks", lambda c: c.evicted_chunks),
    ("policy_evicted_bytes", lambda c: c.evicted_bytes),
)


def _counter(name: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    f = ledger.fact(name)
    assert f.kind == "counter" and "policy" in f.surfaces, name
    return CounterMetricFamily(f.metric("policy"), f.help, labels=list(labels))


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    f = ledger.fact(name)
    assert f.kind == "gauge" and "policy" in f.surfaces, name
    return GaugeMetricFamily(f.metric("policy"), f.help, value=value)


class ServiceCollector(Collector):
    """Prometheus collector over one policy service (module docstring).

    Args:
        core: the service's ``PolicyCore``: its counters, its policy and its remover (removal
            counts are 0 without one).
        connections: connections open on the snapshot port now
            (``PolicyService.snapshot_connections``); called once per scrape.
    """

    def __init__(self, core: PolicyCore, connections: Callable[[], int] = lambda: 0) -> None:
        self.core = core
        self.connections = connections

    def collect(self) -> Iterator[Metric]:
        c, policy, remover = self.core.counters, self.core.policy, self.core.remover
        for name, value in _COUNTERS:
            fam = _counter(name)
            fam.add_metric([], value(c))
            yield fam
        lost = _counter("policy_records_lost", ("cause",))
        for cause in LOST_CAUSES:
            lost.add_metric([cause], getattr(c, cause))
        yield lost
        for name, by_key in (("policy_subscribers_refused", c.over_cap_by_key),
                             ("policy_records_connections_refused", c.records_over_cap_by_key)):
            refused = _counter(name, ("key",))
            for key, n in sorted(dict(by_key).items()):  # one copy, then walked
                refused.add_metric([visible(key, one_line=True)], n)
            yield refused
        removed = remover.removed if remover is not None else 0
        failed = remover.failed if remover is not None else 0
        abandoned = remover.deferred_dropped if remover is not None else 0
        for name, count in (("policy_removed_keys", removed),
                            ("policy_remove_failed_keys", failed),
                            ("policy_remove_abandoned_keys", abandoned)):
            fam = _counter(name)
            fam.add_metric([], count)
            yield fam
        yield _gauge("policy_capacity_bytes", policy.capacity_bytes)
        yield _gauge("policy_used_bytes", policy.used_bytes)
        yield _gauge("policy_resident_chunks", len(policy))
        yield _gauge("policy_pinned_chunks", policy.pinned_chunks)
        yield _gauge("policy_doorkeeper_active", 1 if policy.doorkeeper_active else 0)
        yield _gauge("policy_layouts", len(remover.layouts) if remover is not None else 0)
        yield _gauge("policy_remove_waiting_keys", remover.waiting if remover is not None else 0)
        yield _gauge("policy_snapshot_connections", self.connections())
