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
  (bytes, keys); every int field, so counters added to those classes are carried as they are
  and reach Prometheus once listed in ``PROM_COUNTERS``;
- ``errors``: failed transfers by ``"load:NAME"`` / ``"save:NAME"`` (Mooncake error names;
  ``TIMEOUT``/``UNKNOWN`` without one) and skipped saves by ``"save:REASON"``;
- ``lookup_seconds``, ``load_seconds``, ``save_seconds``: one sample per lookup and per
  finished load/save (a worker rank's part of a request's step);
- ``save_queue_depth``: saves in flight on the busiest worker at the end of the interval.

Samples come from ``StatsTap``, which sits between the connector and its agent's reporter and
forwards every event unchanged.
"""

from __future__ import annotations

import inspect
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

from kvpool_agent.reporter import Event, Reporter, TransferKind

__all__ = [
    "LATENCY_BUCKETS_S",
    "PROM_COUNTERS",
    "KVPoolConnectorStats",
    "KVPoolPromMetrics",
    "StatsCollector",
    "StatsTap",
]

PROM_COUNTERS: dict[str, tuple[str, str]] = {
    "lookups": ("vllm:kvpool_lookups", "Prefix lookups of the pool."),
    "lookup_errors": ("vllm:kvpool_lookup_errors", "Prefix lookups that failed."),
    "lookup_skipped": ("vllm:kvpool_lookup_skipped", "Prefix lookups not made."),
    "prompt_tokens": ("vllm:kvpool_lookup_tokens",
                      "Prompt tokens of requests the scheduler was asked about."),
    "local_tokens": ("vllm:kvpool_local_hit_tokens",
                     "Prompt tokens vLLM's prefix cache already held."),
    "loaded_tokens": ("vllm:kvpool_loaded_tokens",
                      "Prompt tokens loaded from the pool: the pool's hits (a failed load is "
                      "none)."),
    "load_failed_tokens": ("vllm:kvpool_load_failed_tokens",
                           "Tokens accepted to load whose load failed (recomputed)."),
    "saves_scheduled_chunks": ("vllm:kvpool_save_scheduled_chunks",
                               "Chunks scheduled for saving."),
    "loaded_bytes": ("vllm:kvpool_loaded_bytes", "Bytes loaded from the pool (all ranks)."),
    "saved_bytes": ("vllm:kvpool_saved_bytes", "Bytes saved to the pool (all ranks)."),
    "loaded_keys": ("vllm:kvpool_loaded_keys", "Pool values loaded (all ranks)."),
    "saved_keys": ("vllm:kvpool_saved_keys", "Pool values written (all ranks)."),
    "load_failed_keys": ("vllm:kvpool_load_failed_keys", "Pool values that failed to load."),
    "save_failed_keys": ("vllm:kvpool_save_failed_keys", "Pool values that failed to save."),
    "save_skipped_keys": ("vllm:kvpool_save_skipped_keys", "Pool values whose save was skipped."),
    "load_failed_blocks": ("vllm:kvpool_load_failed_blocks",
                           "vLLM blocks reported failed (recomputed)."),
    "layer_timeouts": ("vllm:kvpool_layer_timeouts", "Layer-wise load waits that timed out."),
    "evicted_keys": ("vllm:kvpool_evicted_keys",
                     "Pool values removed by the connector's eviction (eviction: connector)."),
    "evict_failed_keys": ("vllm:kvpool_evict_failed_keys",
                          "Pool values the connector's eviction failed to remove."),
    "handover_waits": ("vllm:kvpool_handover_waits",
                       "Lookups answered later: a P/D hand-over was not all in the pool yet."),
    "handover_short": ("vllm:kvpool_handover_short",
                       "P/D hand-overs run with fewer tokens than promised (recomputed)."),
}
"""Connector counter -> (vLLM metric name without ``_total``, help). Counters are summed over
the engine's processes: bytes and keys over worker ranks, tokens come from the scheduler."""

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

    Thread-safe like ``Reporter``: the scheduler thread, the load and save threads append to
    deques (atomic under the GIL); ``StatsCollector.take`` drains them.
    """

    def __init__(self, inner: Reporter) -> None:
        super().__init__(capacity=0)
        self.inner = inner
        self.samples: dict[str, deque[float]] = {k: deque() for k in _SAMPLES}
        self.errors: deque[str] = deque()
        self.saves_in_flight = 0
        self._starts: dict[tuple[str, TransferKind], float] = {}
        # An event method Reporter gains later goes straight to the inner reporter, never into
        # this object's own (zero-capacity) buffer.
        for name, _ in inspect.getmembers(Reporter, inspect.isfunction):
            if not name.startswith("_") and name not in StatsTap.__dict__:
                setattr(self, name, getattr(inner, name))

    @property
    def depth(self) -> int:
        """Events queued in the inner reporter."""
        return self.inner.depth

    def drain(self, limit: int = 100_000) -> list[Event]:
        """The inner reporter's events (its agent drains them)."""
        return self.inner.drain(limit)

    def lookup(self, req_id: str, prompt_tokens: int, local_tokens: int, pool_tokens: int,
               latency_ms: float, error: str | None = None, skipped: str | None = None,
               chunk_size: int = 0, chunks: list[str] | None = None) -> None:
        """Keep the lookup's latency (a lookup not made has none), then forward."""
        if not skipped:
            self.samples["lookup_seconds"].append(latency_ms / 1e3)
        self.inner.lookup(req_id, prompt_tokens, local_tokens, pool_tokens, latency_ms, error,
                          skipped, chunk_size, chunks)

    def loaded(self, req_id: str, tokens: int, failed_tokens: int = 0) -> None:
        """Forward."""
        self.inner.loaded(req_id, tokens, failed_tokens)

    def transfer_started(self, req_id: str, kind: TransferKind, blocks: int, nbytes: int,
                         layers_total: int = 0, lease_expires_ms: float | None = None) -> None:
        """Note when the transfer began, then forward."""
        starts = self._starts
        if (req_id, kind) not in starts:
            if kind == "save":
                self.saves_in_flight += 1
            if len(starts) >= _MAX_STARTS:
                # A transfer whose end was never reported: forget the oldest.
                starts.pop(next(iter(starts)), None)
        starts[(req_id, kind)] = time.perf_counter()
        self.inner.transfer_started(req_id, kind, blocks, nbytes, layers_total,
                                    lease_expires_ms)

    def transfer_progress(self, req_id: str, kind: TransferKind, layers_done: int) -> None:
        """Forward."""
        self.inner.transfer_progress(req_id, kind, layers_done)

    def transfer_finished(self, req_id: str, kind: TransferKind, ok: bool, nbytes: int = 0,
                          error_name: str | None = None, failed_blocks: int = 0,
                          after_hit: bool = False, timed_out: bool = False,
                          bytes_by_group: dict[int, int] | None = None) -> None:
        """Keep the duration and, on failure, the error name; then forward."""
        started = self._starts.pop((req_id, kind), None)
        if started is not None:
            self.samples[f"{kind}_seconds"].append(time.perf_counter() - started)
            if kind == "save":
                self.saves_in_flight -= 1
        if not ok:
            name = error_name or ("TIMEOUT" if timed_out else "UNKNOWN")
            self.errors.append(f"{kind}:{name}")
        self.inner.transfer_finished(req_id, kind, ok, nbytes, error_name, failed_blocks,
                                     after_hit, timed_out, bytes_by_group)

    def save_skipped(self, req_id: str, blocks: int, reason: str) -> None:
        """Count the skip under its reason, then forward."""
        self.errors.append(f"save:{reason}")
        self.inner.save_skipped(req_id, blocks, reason)

    def error(self, where: str, name: str, message: str, code: int | None = None,
              req_id: str | None = None) -> None:
        """Forward."""
        self.inner.error(where, name, message, code, req_id)

    def layout(self, digest: str, facts: dict[str, str | int]) -> None:
        """Forward."""
        self.inner.layout(digest, facts)


class StatsCollector:
    """Turns a process's running counters and its ``StatsTap`` into interval stats.

    Args:
        counters: returns the process's counters object (a dataclass: ``LookupCounters`` or
            ``WorkerCounters``); its int fields are diffed between calls.
        tap: the process's ``StatsTap``.
        worker: whether this is a worker (reports ``save_queue_depth``).
    """

    def __init__(self, counters: Callable[[], object], tap: StatsTap, *, worker: bool) -> None:
        self._counters = counters
        self._tap = tap
        self._worker = worker
        self._last: dict[str, int] = {}
        self._last_depth = 0

    def _snapshot(self) -> dict[str, int]:
        c = self._counters()
        values = {f.name: getattr(c, f.name) for f in fields(c)}  # type: ignore[arg-type]
        return {k: v for k, v in values.items() if type(v) is int}

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
        self._errors = counter_cls(
            name="vllm:kvpool_transfer_errors",
            documentation="Failed loads and saves and skipped saves, by kind and error name.",
            labelnames=[*labelnames, "kind", "error"])
        self._histograms: dict[str, Any] = {
            key: histogram_cls(
                name=f"vllm:kvpool_{key}", documentation=doc, labelnames=labelnames,
                buckets=list(LATENCY_BUCKETS_S))
            for key, doc in (
                ("lookup_seconds", "Prefix lookup latency."),
                ("load_seconds", "Load duration (one worker rank's part of a request's step)."),
                ("save_seconds", "Save duration (one worker rank's part of a request's step)."),
            )
        }
        self._depth = gauge_cls(
            name="vllm:kvpool_save_queue_depth",
            documentation="Saves in flight on the busiest worker.",
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
