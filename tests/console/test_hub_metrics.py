"""The hub's Prometheus ``/metrics``: a real hub with real agents (and a real Mooncake pool
polled by the worker agents), scraped over HTTP, parsed with ``prometheus_client``'s parser and
compared value by value with ``kvpool-console status --json`` of the same fleet."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from livefleet import LEASE_TTL_MS, LiveFleet, hub_address, keyed_live_fleet
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent.cli import main as agent_main
from kvpool_agent.hub import FleetHub
from kvpool_agent.vocabulary import HINTS
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_console.cli import main as console_main
from kvpool_replay import LocalMooncakeMaster, free_port, free_port_block

CONFIG = Path(__file__).resolve().parents[2] / "config"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def metrics_fleet(tmp_path: Path, mooncake_master: LocalMooncakeMaster,
                  pool_backend: MooncakeBackend, monkeypatch: pytest.MonkeyPatch
                  ) -> Iterator[LiveFleet]:
    """A keyed hub with /metrics (bound on 127.0.0.1, as a keyed hub does by default)."""
    with keyed_live_fleet(tmp_path / "keys", mooncake_master, pool_backend, monkeypatch,
                          "metrics", metrics_port=free_port()) as fleet:
        yield fleet


def _scrape(hub: FleetHub) -> Samples:
    assert hub.metrics is not None
    resp = httpx.get(hub.metrics.url, timeout=5.0)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def _feed(fleet: LiveFleet) -> float:
    """p0 (prefill, TP2): two lookups (one with a local hit), a load accepted, a layer-wise
    load in flight with a lease, a finished load; d0 (decode, TP1) a load failed after a hit
    and a timed-out one. Returns the lease expiry of p0's load in flight."""
    p0 = fleet.add_engine("p0", "prefill", "kv_both")
    d0 = fleet.add_engine("d0", "decode", "kv_consumer", tp=1)
    p0[0].reporter.lookup("r1", 3000, 256, 2048, 1.0)
    p0[0].reporter.lookup("r2", 1000, 0, 512, 1.0)
    p0[0].reporter.loaded("r1", 1792)
    expiry = time.time() * 1e3 + LEASE_TTL_MS
    for w in p0[1:]:
        w.reporter.transfer_started("r1", "load", 4, 4 * 4096, layers_total=8,
                                    lease_expires_ms=expiry)
        w.reporter.transfer_started("r0", "load", 2, 8192)
        w.reporter.transfer_finished("r0", "load", True, 8192)
    d0[0].reporter.lookup("r3", 100, 0, 64, 1.0)
    d0[1].reporter.transfer_started("r3", "load", 1, 4096)
    d0[1].reporter.transfer_finished("r3", "load", False, 0, "OBJECT_NOT_FOUND", 1,
                                     after_hit=True)
    d0[1].reporter.transfer_started("r4", "load", 1, 4096)
    d0[1].reporter.transfer_finished("r4", "load", False, 0, None, 1, timed_out=True)
    fleet.wait_agents(5)
    return expiry


def _status(fleet: LiveFleet, capsys: pytest.CaptureFixture[str]) -> dict:
    # Agents report every 0.25 s and poll the pool every 2 s: wait until both are in.
    deadline = time.monotonic() + 15
    while True:
        assert console_main(["status", "--json", "--hub", fleet.address]) == 0
        doc = json.loads(capsys.readouterr().out)
        by = {e["engine_id"]: e for e in doc["engines"]}
        if (len(by) == 2 and by["p0"]["prompt_tokens"] == 4000
                and by["d0"]["loads_failed"] == 2 and by["p0"]["segment_total_bytes"] > 0
                and by["d0"]["segment_total_bytes"] > 0):
            return doc
        assert time.monotonic() < deadline, f"fleet not reported in time: {doc}"
        time.sleep(0.3)


def test_hub_metrics_equal_status_json(metrics_fleet: LiveFleet,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    expiry = _feed(metrics_fleet)
    doc = _status(metrics_fleet, capsys)
    m = _scrape(metrics_fleet.hub)
    model = metrics_fleet.model
    by = {e["engine_id"]: e for e in doc["engines"]}
    assert not [k for k in m if k[0] == "kvpool_pool_hit_tokens_total"]  # one fact, one series
    for eid, role in (("p0", "prefill"), ("d0", "decode")):
        e = by[eid]
        lab = {"engine": eid, "model": model, "role": role}
        assert _get(m, "kvpool_prompt_tokens_total", **lab) == e["prompt_tokens"]
        assert _get(m, "kvpool_loaded_tokens_total", **lab) == e["loaded_tokens"]
        assert _get(m, "kvpool_local_tokens_total", **lab) == e["local_tokens"]
        assert _get(m, "kvpool_recomputed_tokens_total", **lab) == e["recomputed_tokens"]
        assert _get(m, "kvpool_local_hit_ratio", **lab) == pytest.approx(e["local_hit_rate"])
        assert _get(m, "kvpool_lookups_total", **lab) == e["lookups"]
        assert _get(m, "kvpool_pool_hit_ratio", **lab) == pytest.approx(e["hit_rate"])
        assert _get(m, "kvpool_loads_in_flight", **lab) == e["loads_in_flight"]
        assert _get(m, "kvpool_saves_in_flight", **lab) == e["saves_in_flight"]
        assert _get(m, "kvpool_loads_failed_total", **lab) == e["loads_failed"]
        assert _get(m, "kvpool_loads_finished_total", **lab) == e["loads_finished"]
        assert _get(m, "kvpool_failed_after_hit_total", **lab) == e["failed_after_hit"]
        # The engine's newest pool report: the scheduler's pool client and the workers' master
        # poll may say different TTLs, and the newest can change between status and scrape.
        ttls = {st.pool.lease_ttl_ms / 1e3 for st, _ in metrics_fleet.hub.fleet().values()
                if st.source.engine_id == eid and st.pool is not None}
        assert _get(m, "kvpool_lease_ttl_seconds", **lab) in ttls
        assert e["lease_ttl_ms"] / 1e3 in ttls
        assert _get(m, "kvpool_report_age_seconds", **lab) < 5.0
        assert _get(m, "kvpool_engine_info", **lab, kv_role=e["kv_role"],
                    backend="mooncake", layout_digest="") == 1
        for a in e["agents"]:
            assert _get(m, "kvpool_agent_state", **lab, agent=a["agent_id"], state="up") == 1
            assert _get(m, "kvpool_agent_state", **lab, agent=a["agent_id"],
                        state="down") == 0
    p0 = {"engine": "p0", "model": model, "role": "prefill"}
    d0 = {"engine": "d0", "model": model, "role": "decode"}
    # The values themselves, not only their agreement with the console.
    assert _get(m, "kvpool_local_tokens_total", **p0) == 256
    assert _get(m, "kvpool_recomputed_tokens_total", **p0) == 4000 - 256 - 1792
    assert _get(m, "kvpool_local_hit_ratio", **p0) == pytest.approx(256 / 4000)
    assert _get(m, "kvpool_lease_expiry_timestamp_seconds", **p0) == pytest.approx(
        expiry / 1e3, abs=1e-3)
    assert ("kvpool_lease_expiry_timestamp_seconds", frozenset(d0.items())) not in m
    assert _get(m, "kvpool_transfer_errors_total", **d0, error="OBJECT_NOT_FOUND") == 1
    assert _get(m, "kvpool_transfer_errors_total", **d0, error="TIMEOUT") == 1
    assert _get(m, "kvpool_loaded_bytes_total", **p0) == 2 * 8192
    # Pools: the one real pool every worker agent reports, deduplicated.
    assert len(doc["pools"]) == 1
    pool = doc["pools"][0]
    pl = {"pool": pool["name"], "backend": "mooncake"}
    assert _get(m, "kvpool_pool_total_bytes", **pl) == pool["total_bytes"]
    assert _get(m, "kvpool_pool_high_watermark_ratio", **pl) == pool["high_watermark"]
    assert _get(m, "kvpool_pool_evicted_keys_total", **pl) == pool["evicted_keys"]
    # No store dropped here: nothing lost, as the console says.
    assert _get(m, "kvpool_pool_lost_keys_total", **pl) == pool["lost_keys"] == 0
    assert _get(m, "kvpool_pool_lost_bytes_total", **pl) == pool["lost_bytes"] == 0
    assert 0 <= _get(m, "kvpool_pool_used_bytes", **pl) <= pool["total_bytes"]
    assert [dict(k[1])["pool"] for k in m if k[0] == "kvpool_pool_keys"] == [pool["name"]]
    tot = doc["totals"]
    assert _get(m, "kvpool_fleet_pool_hit_ratio") == pytest.approx(tot["hit_rate"])
    assert _get(m, "kvpool_fleet_local_hit_ratio") == pytest.approx(tot["local_hit_rate"])
    assert (tot["local_tokens"], tot["loaded_tokens"], tot["recomputed_tokens"]) == (
        256, 1792, 4100 - 256 - 1792)
    assert _get(m, "kvpool_fleet_engines") == tot["engines"] == 2
    assert _get(m, "kvpool_fleet_agents", state="up") == tot["agents"] == 5
    assert _get(m, "kvpool_fleet_agents", state="down") == tot["down"] == 0
    assert 5 <= _get(m, "kvpool_hub_reports_total") <= metrics_fleet.hub.reports


def test_forgotten_engine_leaves_the_scrape(metrics_fleet: LiveFleet) -> None:
    """An engine the hub forgets disappears from /metrics at the next scrape (no stale series
    left behind, as a per-report registry would keep)."""
    handles = metrics_fleet.add_engine("gone", "mixed", "kv_both", tp=1)
    handles[0].reporter.lookup("r1", 640, 0, 128, 1.0)
    metrics_fleet.wait_agents(2)
    lab = {"engine": "gone", "model": metrics_fleet.model, "role": "mixed"}
    deadline = time.monotonic() + 10
    while ("kvpool_prompt_tokens_total", frozenset(lab.items())) not in (m := _scrape(
            metrics_fleet.hub)) or _get(m, "kvpool_prompt_tokens_total", **lab) != 640:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for h in handles:
        h.stop()
    metrics_fleet.engines.clear()
    # A stopped agent's last frames may still be queued at the hub: forget once it is quiet,
    # or a late report would bring the engine back.
    seen = {k: t for k, (_, t) in metrics_fleet.hub.fleet().items()}
    while True:
        time.sleep(0.6)
        now = {k: t for k, (_, t) in metrics_fleet.hub.fleet().items()}
        if now == seen:
            break
        seen = now
    metrics_fleet.hub._fleet.forget(["gone"])
    m = _scrape(metrics_fleet.hub)
    assert not any(dict(k[1]).get("engine") == "gone" for k in m)
    assert _get(m, "kvpool_fleet_engines") == 0


def test_metrics_port_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--metrics-port`` out of range and a port already taken are one-line errors, exit 2;
    the hub's ZMQ ports are released again after the failed start."""
    address = hub_address()
    assert agent_main(["hub", "--address", address, "--metrics-port", "70000"]) == 2
    assert "--metrics-port: 70000 is not a port" in capsys.readouterr().err
    with FleetHub(address, metrics_port=free_port()) as hub:
        assert hub.metrics is not None
        taken = int(hub.metrics.url.rsplit(":", 1)[1].split("/")[0])
        other = hub_address()
        rc = agent_main(["hub", "--address", other, "--metrics-port", str(taken)])
        err = capsys.readouterr().err
        assert rc == 2 and f"cannot bind metrics http://127.0.0.1:{taken}" in err
        assert "Traceback" not in err
    # The failed hub released its ZMQ ports: a hub binds them again.
    with FleetHub(other) as again:
        assert again.metrics is None


CONSOLE_RULES = {"pool_watermark", "failed_after_hit", "lease_ttl", "lookup_errors",
                 "backend_errors", "backend_mismatch", "kv_role_mismatch", "pool_unhealthy",
                 "pool_no_segments",
                 "disk_over_limit", "stale"}
"""The console's alert rule ids (``kvpool_console.alerts.Alert.rule``)."""


def test_rules_and_dashboard_use_only_exported_hub_series(
        metrics_fleet: LiveFleet, capsys: pytest.CaptureFixture[str],
        observability_series: dict[str, set[str]]) -> None:
    """Every ``kvpool_*`` series the Prometheus rules and the Grafana dashboard name is in a
    real scrape of the hub (a fleet with lookups, a lease in flight, failed loads and a real
    pool); the ``vllm:kvpool_*`` ones are checked against a real vLLM scrape in
    ``tests/vllm/test_vllm_observability.py``. Every console alert rule has a Prometheus rule."""
    _feed(metrics_fleet)
    _status(metrics_fleet, capsys)
    # Pool health comes with the agents' pool poll: wait for it in the scrape.
    deadline = time.monotonic() + 10
    while "kvpool_pool_healthy" not in (scraped := {n for n, _ in _scrape(metrics_fleet.hub)}):
        assert time.monotonic() < deadline, "no kvpool_pool_healthy in the scrape"
        time.sleep(0.3)
    for which in ("rules", "dashboard"):
        hub_names = {n for n in observability_series[which] if n.startswith("kvpool_")}
        assert hub_names, which
        assert hub_names <= scraped, f"{which} name series the hub does not export: " \
            f"{sorted(hub_names - scraped)}"
    rules = yaml.safe_load((CONFIG / "prometheus" / "kvpool-rules.yml").read_text())
    rows = [r for g in rules["groups"] for r in g["rules"]]
    assert {r["labels"]["rule"] for r in rows} == CONSOLE_RULES
    for r in rows:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["hint"], r["alert"]
    # The hints are the console's for the same causes (kvpool_agent.vocabulary.HINTS).
    hints = {r["alert"]: r["annotations"]["hint"] for r in rows}
    assert hints["KvpoolLoadsSlowerThanLease"] == HINTS["LEASE_EXPIRED"]
    assert hints["KvpoolLookupErrors"] == HINTS["LOOKUP"]
    assert hints["KvpoolPoolUnhealthy"] == HINTS["RPC_FAIL"]


def test_hub_command_serves_metrics_on_p_plus_4(tmp_path: Path) -> None:
    """``kvpool-agent hub`` without ``--metrics-port`` serves /metrics on P+4 of its address;
    SIGTERM stops it cleanly."""
    base = free_port_block(5)
    proc = subprocess.Popen([sys.executable, "-m", "kvpool_agent.cli", "hub", "--address",
                             f"tcp://127.0.0.1:{base}"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                resp = httpx.get(f"http://127.0.0.1:{base + 4}/metrics", timeout=1.0)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "no /metrics on P+4"
                time.sleep(0.2)
        fams = {f.name: f for f in text_string_to_metric_families(resp.text)}
        assert [s.value for s in fams["kvpool_fleet_engines"].samples] == [0.0]
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
