"""The real-vLLM replay engine's pool counters (``lookup_errors``, ``save_failed_keys``,
``save_skipped_keys``, ``max_lookup_s``) read back from the connector's own Prometheus series
(``KVPoolPromMetrics`` on real ``prometheus_client`` metrics, the way vLLM builds them)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpool_connector._stats import KVPoolPromMetrics
from kvpool_replay import EngineResult
from kvpool_replay._vllm_engine import pool_counters


def _metrics(engines: int) -> tuple[CollectorRegistry, KVPoolPromMetrics]:
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    labels = {i: ["tiny", str(i)] for i in range(engines)}
    return reg, KVPoolPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                                  ["model_name", "engine"], labels)


def test_counters_and_the_longest_lookup_come_from_the_connector_series() -> None:
    reg, prom = _metrics(2)
    prom.observe({"counters": {"lookup_errors": 3, "save_failed_keys": 7, "lookups": 9,
                               "save_skipped_keys": 5},
                  "lookup_seconds": [0.0004, 4.0, 4.3]}, engine_idx=0)
    prom.observe({"counters": {"lookup_errors": 1}, "lookup_seconds": [0.002]}, engine_idx=1)
    res = EngineResult(engine_id="e")
    pool_counters(res, reg)
    assert (res.lookup_errors, res.save_failed_keys, res.save_skipped_keys) == (4, 7, 5)
    # 4.3 s falls in the (2.5, 5.0] bucket: the histogram bounds the longest lookup by 5 s.
    assert res.max_lookup_s == 5.0


def test_the_sum_bounds_the_longest_lookup_when_tighter_and_nothing_means_zero() -> None:
    reg, prom = _metrics(1)
    res = EngineResult(engine_id="e", max_lookup_s=9.0)
    pool_counters(res, reg)
    assert (res.lookup_errors, res.save_failed_keys, res.max_lookup_s) == (0, 0, 0.0)
    prom.observe({"lookup_seconds": [0.0002, 0.0001]})
    pool_counters(res, reg)
    assert abs(res.max_lookup_s - 0.0003) < 1e-12
    # Beyond the last bucket (10 s) only the sum bounds it.
    prom.observe({"lookup_seconds": [12.0]})
    pool_counters(res, reg)
    assert abs(res.max_lookup_s - 12.0003) < 1e-9
