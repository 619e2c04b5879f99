"""The connector's interval stats for vLLM (``kvpool_connector._stats``) without an engine: the
tap forwards every event unchanged, intervals are counter increments, workers merge, and
``KVPoolPromMetrics`` writes them into real ``prometheus_client`` metrics. The engine-level
check is ``tests/vllm/test_vllm_observability.py``."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent.reporter import (
    LayoutKnown,
    Loaded,
    Lookup,
    ReportedError,
    Reporter,
    SaveSkipped,
    TransferFinished,
    TransferProgress,
    TransferStarted,
)
from kvpool_connector._stats import (
    PROM_COUNTERS,
    KVPoolConnectorStats,
    KVPoolPromMetrics,
    StatsCollector,
    StatsTap,
)


@dataclass
class _Counters:
    lookups: int = 0
    loaded_bytes: int = 0
    reasons: dict[str, int] | None = None


def test_tap_forwards_every_event_and_keeps_samples() -> None:
    inner = Reporter()
    tap = StatsTap(inner)
    tap.lookup("r1", 100, 32, 64, 2.0)
    tap.loaded("r1", 64)
    tap.transfer_started("r1", "load", 2, 4096)
    tap.transfer_progress("r1", "load", 1)
    tap.transfer_finished("r1", "load", False, 0, "OBJECT_NOT_FOUND", 2, after_hit=True)
    tap.transfer_started("r1", "save", 1, 2048)
    tap.save_skipped("r2", 4, "NO_AVAILABLE_HANDLE")
    tap.error("save", "BAD_METADATA", "x")
    tap.layout("abc", {"dtype": "float32"})
    assert tap.depth == 9
    kinds = [type(e) for e in tap.drain()]
    assert kinds == [Lookup, Loaded, TransferStarted, TransferProgress, TransferFinished,
                     TransferStarted, SaveSkipped, ReportedError, LayoutKnown]
    assert list(tap.samples["lookup_seconds"]) == [0.002]
    assert len(tap.samples["load_seconds"]) == 1 and not tap.samples["save_seconds"]
    assert list(tap.errors) == ["load:OBJECT_NOT_FOUND", "save:NO_AVAILABLE_HANDLE"]
    assert tap.saves_in_flight == 1


def test_tap_forwards_every_reporter_method() -> None:
    """Every public ``Reporter`` method of the tap reaches the inner reporter: overridden here,
    or (a method added to ``Reporter`` later) bound to the inner reporter's own."""
    inner = Reporter()
    tap = StatsTap(inner)
    names = [n for n, _ in inspect.getmembers(Reporter, inspect.isfunction)
             if not n.startswith("_")]
    assert "lookup" in names and "drain" in names
    for name in names:
        method = getattr(tap, name)
        assert name in StatsTap.__dict__ or method.__self__ is inner, name


def test_collector_reports_increments_once() -> None:
    counters = _Counters(reasons={"X": 1})
    tap = StatsTap(Reporter())
    col = StatsCollector(lambda: counters, tap, worker=True)
    assert col.take() is None
    counters.lookups, counters.loaded_bytes = 3, 8192
    tap.transfer_started("r", "save", 1, 1)
    tap.transfer_finished("r", "save", False, 0, None, 1)
    first = col.take()
    assert first is not None
    # Only int fields are counters; the save failed without a name.
    assert first.data["counters"] == {"lookups": 3, "loaded_bytes": 8192}
    assert first.data["errors"] == {"save:UNKNOWN": 1}
    assert len(first.data["save_seconds"]) == 1
    assert "save_queue_depth" not in first.data  # 0 before and after: unchanged
    assert col.take() is None
    counters.lookups = 5
    assert col.take() == KVPoolConnectorStats(data={"counters": {"lookups": 2}})
    # The queue depth is reported when it changes, also back to 0.
    tap.transfer_started("s", "save", 1, 1)
    assert col.take() == KVPoolConnectorStats(data={"save_queue_depth": 1})
    assert col.take() is None
    tap.transfer_finished("s", "save", True, 1)
    depth_back = col.take()
    assert depth_back is not None and depth_back.data["save_queue_depth"] == 0


def test_aggregate_and_reduce() -> None:
    a = KVPoolConnectorStats(data={"counters": {"loaded_bytes": 10, "lookups": 1},
                                   "errors": {"load:TIMEOUT": 1}, "load_seconds": [0.1],
                                   "save_queue_depth": 2})
    b = KVPoolConnectorStats(data={"counters": {"loaded_bytes": 5},
                                   "errors": {"load:TIMEOUT": 2}, "load_seconds": [0.3],
                                   "save_queue_depth": 1})
    m = a.aggregate(b)
    assert m.data == {"counters": {"loaded_bytes": 15, "lookups": 1},
                      "errors": {"load:TIMEOUT": 3}, "load_seconds": [0.1, 0.3],
                      "save_queue_depth": 2}
    assert m.reduce() == {"loaded_bytes": 15, "lookups": 1, "errors[load:TIMEOUT]": 3,
                          "loads": 2, "load_mean_ms": 200.0, "save_queue_depth": 2}
    assert KVPoolConnectorStats().is_empty() and not m.is_empty()


def test_prom_metrics_observe() -> None:
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVPoolPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                             ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe({"counters": {"loaded_bytes": 4096, "lookups": 2, "not_listed": 7},
                  "errors": {"load:LEASE_EXPIRED": 1}, "lookup_seconds": [0.001, 0.002],
                  "save_queue_depth": 3})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(reg).decode())
               for s in f.samples}
    eng = (("engine", "0"), ("model_name", "tiny"))
    assert samples[("vllm:kvpool_loaded_bytes_total", eng)] == 4096
    assert samples[("vllm:kvpool_lookups_total", eng)] == 2
    # Every listed counter exists from the start, at 0.
    assert samples[("vllm:kvpool_saved_bytes_total", eng)] == 0
    assert {n for n, _ in samples if n.endswith("_total") and "transfer_errors" not in n} == {
        f"{name}_total" for name, _ in PROM_COUNTERS.values()}
    assert samples[("vllm:kvpool_transfer_errors_total",
                    tuple(sorted((*eng, ("kind", "load"), ("error", "LEASE_EXPIRED")))))] == 1
    assert samples[("vllm:kvpool_lookup_seconds_count", eng)] == 2
    assert samples[("vllm:kvpool_save_queue_depth", eng)] == 3
