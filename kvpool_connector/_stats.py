"""The connector's stats in vLLM's own metrics: ``KVConnectorStats`` and ``vllm:kvpool_*``.

vLLM's flow (``KVConnectorBase_V1``, vLLM 0.32): every step each worker's
``get_kv_connector_stats`` returns what happened since its previous call; vLLM merges the
workers' objects with ``aggregate`` (``KVOutputAggregator``), the scheduler adds its own
(``Scheduler.update_from_output``), and the frontend hands the merged ``to_dict()`` to the
connector class's Prometheus metrics (``build_prom_metrics`` -> ``observe``, labels
``model_name`` and ``engine``) and, rebuilt with ``build_kv_connector_stats``, to the periodic
log line (``reduce``).

What one interval carries (``KVPoolConnectorStats.data``, plain types so it crosses processes):

- ``counters``: increments of the connector's own running totals since the previous call:
  the scheduler's ``LookupCounters`` (tokens, lookups) and each worker's ``WorkerCounters``
  (bytes, keys): the int fields the counter catalogue (``kvpool_agent.ledger``) lists as
  counted by that role, each exported as ``vllm:kvpool_<name>``;
- ``errors``: failed transfers by ``"load:NAME"`` / ``"save:NAME"`` (Mooncake error names;
  ``TIMEOUT``/``UNKNOWN`` without one) and skipped saves by ``"save:REASON"``;
- ``lookup_seconds``, ``load_seconds``, ``save_seconds``: one sample per lookup and per
  finished load/save (a worker rank's part of a request's step);
- ``save_queue_depth``: saves in flight on the busiest worker at the end of the interval.

Samples come from ``StatsTap``, which sits between the connector and its agent's reporter and
forwards every event unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvpool_agent.ledger import fact, facts_on
from kvpool_agent.reporter import (
    Event,
    Lookup,
    Reporter,
    SaveSkipped,
    TransferFinished,
    TransferKind,
    TransferStarted,
)
from kvpool_connector._counters import LookupCounters, WorkerCounters

__all__ = [
    "LATENCY_BUCKETS_S",
    "PROM_COUNTERS",
    "KVPoolConnectorStats",
    "KVPoolPromMetrics",
    "StatsCollector",
    "StatsTap",
]

_COUNTED_BY: dict[bool, frozenset[str]] = {
    worker: frozenset(
        f.name for f in facts_on("vllm", "counter")
        if f.counted_by == ("worker" if worker else "scheduler")
        and f.name in {c.name for c in fields(WorkerCounters if worker else LookupCounters)})
    for worker in (False, True)}
"""Per role (``worker``), the running totals its process sends vLLM: the fields of its counters
class the catalogue says it counts, so a fact both roles keep a total of
(``load_failed_tokens``: the scheduler's per request, each worker's per rank) is summed once,
from its owner."""

PROM_COUNTERS: dict[str, tuple[str, str]] = {
    f.name: (f.metric("vllm"), f.help) for f in facts_on("vllm", "counter")
    if f.name in _COUNTED_BY[False] | _COUNTED_BY[True]}
"""Connector counter -> (vLLM metric name without ``_total``, help), from the counter catalogue
(``kvpool_agent.ledger``). Counters are summed over the engine's processes: bytes and keys over
worker ranks, tokens come from the scheduler."""

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)
"""Histogram buckets (seconds): a lookup takes ~0.1-1 ms, a chunk load ms to seconds."""

_SAMPLES = ("lookup_seconds", "load_seconds", "save_seconds")
_MAX_STARTS = 4096


class KVPoolConnectorStats(KVConnectorStats):
    """One interval of the connector's stats (see the module docstring for ``data``)."""

    def reset(self) -> None:
        """Empty the interval."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVPoolConnectorStats:
        """Merge ``other`` (another worker, the scheduler or a later interval) into a new
        object: counters and errors add up, samples concatenate, the queue depth is the
        larger."""
        a, b = self.data, other.data
        out: dict[str, Any] = {}
        for key in ("counters", "errors"):
            merged = dict(a.get(key, {}))
            for name, n in b.get(key, {}).items():
                merged[name] = merged.get(name, 0) + n
            if merged:
                out[key] = merged
        for key in _SAMPLES:
            samples = [*a.get(key, ()), *b.get(key, ())]
            if samples:
                out[key] = samples
        depths = [d["save_queue_depth"] for d in (a, b) if "save_queue_depth" in d]
        if depths:
            out["save_queue_depth"] = max(depths)
        return KVPoolConnectorStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        """The interval for vLLM's log line: non-zero counters, error counts, and per sample
        kind its count and mean in ms."""
        out: dict[str, int | float] = {
            k: v for k, v in sorted(self.data.get("counters", {}).items()) if v}
        for name, n in sorted(self.data.get("errors", {}).items()):
            out[f"errors[{name}]"] = n
        for key in _SAMPLES:
            samples = self.data.get(key, [])
            if samples:
                stem = key.removesuffix("_seconds")
                out[f"{stem}s"] = len(samples)
                out[f"{stem}_mean_ms"] = round(1e3 * sum(samples) / len(samples), 3)
        if "save_queue_depth" in self.data:
            out["save_queue_depth"] = self.data["save_queue_depth"]
        return out

    def is_empty(self) -> bool:
        """Nothing happened and the queue depth did not change."""
        return not self.data


class StatsTap(Reporter):
    """A reporter that forwards every event to ``inner`` (the agent's reporter, or a
    ``NullReporter``) and keeps, for ``StatsCollector``, lookup and transfer durations,
    transfer errors by name and saves in flight.

    It declares no event method of its own: ``Reporter``'s build the events and hand them to
    :meth:`put`, which watches them and forwards. Thread-safe like ``Reporter``: the scheduler
    thread, the load and save threads append to deques (atomic under the GIL);
    ``StatsCollector.take`` drains them.
    """

    def __init__(self, inner: Reporter) -> None:
        super().__init__(capacity=0)
        self.inner = inner
        self.samples: dict[str, deque[float]] = {k: deque() for k in _SAMPLES}
        self.errors: deque[str] = deque()
        self.saves_in_flight = 0
        self._starts: dict[tuple[str, TransferKind], float] = {}

    @property
    def depth(self) -> int:
        """Events queued in the inner reporter."""
        return self.inner.depth

    def drain(self, limit: int = 100_000) -> list[Event]:
        """The inner reporter's events (its agent drains them)."""
        return self.inner.drain(limit)

    def put(self, event: Event) -> None:
        """Keep what vLLM's stats need of ``event``, then forward it unchanged: a lookup's
        latency (a lookup not made has none), when a transfer began, a finished transfer's
        duration and, on failure, its error name, a skipped save's reason."""
        if isinstance(event, Lookup):
            if not event.skipped:
                self.samples["lookup_seconds"].append(event.latency_ms / 1e3)
        elif isinstance(event, TransferStarted):
            self._started((event.req_id, event.kind))
        elif isinstance(event, TransferFinished):
            self._finished(event)
        elif isinstance(event, SaveSkipped):
            self.errors.append(f"save:{event.reason}")
        self.inner.put(event)

    def _started(self, key: tuple[str, TransferKind]) -> None:
        starts = self._starts
        if key not in starts:
            if key[1] == "save":
                self.saves_in_flight += 1
            if len(starts) >= _MAX_STARTS:
                # A transfer whose end was never reported: forget the oldest.
                starts.pop(next(iter(starts)), None)
        starts[key] = time.perf_counter()

    def _finished(self, event: TransferFinished) -> None:
        kind = event.kind
        started = self._starts.pop((event.req_id, kind), None)
        if started is not None:
            self.samples[f"{kind}_seconds"].append(time.perf_counter() - started)
            if kind == "save":
                self.saves_in_flight -= 1
        if not event.ok:
            name = event.error_name or ("TIMEOUT" if event.timed_out else "UNKNOWN")
            self.errors.append(f"{kind}:{name}")


class StatsCollector:
    """Turns a process's running counters and its ``StatsTap`` into interval stats.

    Args:
        counters: returns the process's counters object (a dataclass: ``LookupCounters`` or
            ``WorkerCounters``); its int fields the catalogue says this role counts are diffed
            between calls.
        tap: the process's ``StatsTap``.
        worker: whether this is a worker (reports ``save_queue_depth``).
    """

    def __init__(self, counters: Callable[[], object], tap: StatsTap, *, worker: bool) -> None:
        self._counters = counters
        self._own = _COUNTED_BY[worker]
        self._tap = tap
        self._worker = worker
        self._last: dict[str, int] = {}
        self._last_depth = 0

    def _snapshot(self) -> dict[str, int]:
        c = self._counters()
        values = {f.name: getattr(c, f.name) for f in fields(c)}  # type: ignore[arg-type]
        return {k: v for k, v in values.items() if k in self._own and type(v) is int}

    def take(self) -> KVPoolConnectorStats | None:
        """What happened since the previous call; ``None`` when nothing did."""
        now = self._snapshot()
        data: dict[str, Any] = {}
        counters = {k: v - self._last.get(k, 0) for k, v in now.items()
                    if v != self._last.get(k, 0)}
        self._last = now
        if counters:
            data["counters"] = counters
        errors: dict[str, int] = {}
        while self._tap.errors:
            name = self._tap.errors.popleft()
            errors[name] = errors.get(name, 0) + 1
        if errors:
            data["errors"] = errors
        for key, dq in self._tap.samples.items():
            out = []
            while dq:
                out.append(dq.popleft())
            if out:
                data[key] = out
        if self._worker:
            depth = max(0, self._tap.saves_in_flight)
            if depth != self._last_depth or (data and depth):
                data["save_queue_depth"] = depth
            self._last_depth = depth
        return KVPoolConnectorStats(data=data) if data else None


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvpool_*`` series in vLLM's Prometheus registry (labels ``model_name``,
    ``engine``; errors also ``kind`` and ``error``): the counters of ``PROM_COUNTERS``,
    ``vllm:kvpool_transfer_errors_total``, histograms ``vllm:kvpool_lookup_seconds``,
    ``vllm:kvpool_load_seconds``, ``vllm:kvpool_save_seconds`` and the gauge
    ``vllm:kvpool_save_queue_depth``. Built by vLLM through
    ``KVPoolConnector.build_prom_metrics``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM's metric classes (prometheus_client's, or its multiprocess-aware subclasses).
        counter_cls: Any = self._counter_cls
        histogram_cls: Any = self._histogram_cls
        gauge_cls: Any = self._gauge_cls
        self._counters: dict[str, Any] = {
            key: counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in PROM_COUNTERS.items()
        }
        errors = fact("transfer_errors")
        self._errors = counter_cls(
            name=errors.metric("vllm"), documentation=errors.help,
            labelnames=[*labelnames, "kind", "error"])
        self._histograms: dict[str, Any] = {
            f.name: histogram_cls(
                name=f.metric("vllm"), documentation=f.help, labelnames=labelnames,
                buckets=list(LATENCY_BUCKETS_S))
            for f in facts_on("vllm", "histogram")
        }
        depth = fact("save_queue_depth")
        self._depth = gauge_cls(
            name=depth.metric("vllm"), documentation=depth.help,
            multiprocess_mode="mostrecent", labelnames=labelnames)
        # Every series exists from the start (at 0), so rate() and alerts see it at once.
        for values in per_engine_labelvalues.values():
            for m in (*self._counters.values(), *self._histograms.values(), self._depth):
                m.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval (``KVPoolConnectorStats.data``) of engine ``engine_idx``."""
        values = self.per_engine_labelvalues[engine_idx]
        for key, n in transfer_stats_data.get("counters", {}).items():
            metric = self._counters.get(key)
            if metric is not None and n > 0:
                metric.labels(*values).inc(n)
        for name, n in transfer_stats_data.get("errors", {}).items():
            kind, _, error = name.partition(":")
            self._errors.labels(*values, kind, error).inc(n)
        for key, hist in self._histograms.items():
            child = hist.labels(*values)
            for s in transfer_stats_data.get(key, ()):
                child.observe(s)
        if "save_queue_depth" in transfer_stats_data:
            self._depth.labels(*values).set(transfer_stats_data["save_queue_depth"])
