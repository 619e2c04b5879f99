"""The connector's interval stats for vLLM (``kvpool_connector._stats``) without an engine: the
tap forwards every event unchanged, intervals are counter increments, workers merge, and
``KVPoolPromMetrics`` writes them into real ``prometheus_client`` metrics. The engine-level
check is ``tests/vllm/test_vllm_observability.py``."""

from __future__ import annotations

import functools
from dataclasses import fields as dataclass_fields
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent.ledger import fact, facts_on, metric_fact
from kvpool_agent.reporter import (
    EVENT_METHODS,
    LayoutKnown,
    Loaded,
    Lookup,
    NullReporter,
    ReportedError,
    Reporter,
    SaveSkipped,
    TransferFinished,
    TransferProgress,
    TransferStarted,
)
from kvpool_connector._counters import LookupCounters, WorkerCounters
from kvpool_connector._stats import (
    PROM_COUNTERS,
    KVPoolConnectorStats,
    KVPoolPromMetrics,
    StatsCollector,
    StatsTap,
)


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


def test_tap_declares_no_event_method() -> None:
    """The reporter interface is written once, in ``Reporter``: the tap watches events in
    ``put`` and every event method it has is ``Reporter``'s own."""
    assert "lookup" in EVENT_METHODS and "transfer_finished" in EVENT_METHODS
    assert not set(EVENT_METHODS) & set(StatsTap.__dict__)
    assert all(getattr(StatsTap, n) is getattr(Reporter, n) for n in EVENT_METHODS)
    # Forwarded into a NullReporter: nothing kept there, the tap's samples still taken.
    tap = StatsTap(NullReporter())
    tap.lookup("r", 10, 0, 0, 3.0)
    assert tap.drain() == [] and tap.depth == 0 and list(tap.samples["lookup_seconds"]) == [0.003]


def test_every_vllm_metric_is_one_catalogue_fact() -> None:
    """Every ``vllm:kvpool_*`` family is a catalogue fact shown on vLLM, with its help; every
    running total of the connector is one (or, counted by the other role too, is that role's
    own and reaches no metric)."""
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    KVPoolPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                      ["model_name", "engine"], {0: ["tiny", "0"]})
    shown = set()
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        # prometheus_client's own ``<name>_created`` timestamps come as families of their own.
        if not fam.name.startswith("vllm:kvpool_") or fam.name.endswith("_created"):
            continue
        f = metric_fact("vllm", fam.name)
        assert f is not None, fam.name
        assert (fam.documentation, fam.type) == (f.help, f.kind), fam.name
        shown.add(f.name)
    assert shown == {f.name for f in facts_on("vllm")}
    for cls, role in ((LookupCounters, "scheduler"), (WorkerCounters, "worker")):
        for field in dataclass_fields(cls):
            if field.type != "int":
                continue
            f = fact(field.name)
            assert f.counted_by == role or (cls, field.name) == (
                WorkerCounters, "load_failed_tokens"), field.name


def test_collector_reports_increments_once() -> None:
    counters = WorkerCounters()
    tap = StatsTap(Reporter())
    col = StatsCollector(lambda: counters, tap, worker=True)
    assert col.take() is None
    counters.saved_keys, counters.loaded_bytes = 3, 8192
    # The rank's own load_failed_tokens is not vLLM's: the scheduler counts that fact.
    counters.load_failed_tokens = 16
    tap.transfer_started("r", "save", 1, 1)
    tap.transfer_finished("r", "save", False, 0, None, 1)
    first = col.take()
    assert first is not None
    # The save failed without a name.
    assert first.data["counters"] == {"saved_keys": 3, "loaded_bytes": 8192}
    assert first.data["errors"] == {"save:UNKNOWN": 1}
    assert len(first.data["save_seconds"]) == 1
    assert "save_queue_depth" not in first.data  # 0 before and after: unchanged
    assert col.take() is None
    counters.saved_keys = 5
    assert col.take() == KVPoolConnectorStats(data={"counters": {"saved_keys": 2}})
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
