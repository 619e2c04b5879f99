"""One-shot modes against a live fleet: ``status --json`` field by field, ``--fail-on``,
``health``, and ``flush`` with the same authorisation rules as the TUI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from livefleet import LEASE_TTL_MS, LiveFleet

from kvpool_console.cli import main


def _feed(fleet: LiveFleet) -> float:
    """p0 healthy prefill (TP2) with one layer-wise load in flight, d0 a decode engine started
    with kv_role kv_producer (a config mistake). Returns the lease expiry given to the load."""
    p0 = fleet.add_engine("p0", "prefill", "kv_producer")
    d0 = fleet.add_engine("d0", "decode", "kv_producer", tp=1)
    p0[0].reporter.lookup("r1", 3000, 0, 2048, 1.0)
    p0[0].reporter.lookup("r2", 1000, 0, 512, 1.0)
    expiry = time.time() * 1e3 + LEASE_TTL_MS
    for w in p0[1:]:
        w.reporter.transfer_started("r1", "load", 4, 4 * 4096, layers_total=8,
                                    lease_expires_ms=expiry)
        w.reporter.transfer_started("r0", "load", 2, 8192)
        w.reporter.transfer_finished("r0", "load", True, 8192)
    d0[0].reporter.lookup("r3", 100, 0, 0, 1.0)
    d0[1].reporter.transfer_started("r3", "load", 1, 4096)
    d0[1].reporter.transfer_finished("r3", "load", False, 0, "OBJECT_NOT_FOUND", 1,
                                     after_hit=True)
    fleet.wait_agents(5)
    return expiry


def _status(fleet: LiveFleet, capsys: pytest.CaptureFixture[str], *extra: str
            ) -> tuple[int, dict]:
    # Agents report every 0.25 s and poll the pool every 2 s: wait for both to be in.
    deadline = time.monotonic() + 10
    while True:
        rc = main(["status", "--json", "--hub", fleet.address, *extra])
        doc = json.loads(capsys.readouterr().out)
        by = {e["engine_id"]: e for e in doc["engines"]}
        ready = (len(by) == 2 and by["p0"]["lookup_tokens"] == 4000
                 and by["d0"]["load_errors"] == 1 and by["p0"]["segment_total_bytes"] > 0)
        if ready or time.monotonic() > deadline:
            return rc, doc
        time.sleep(0.3)


def test_status_json_field_by_field(live_fleet: LiveFleet,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    expiry = _feed(live_fleet)
    rc, doc = _status(live_fleet, capsys)
    assert rc == 0  # no --fail-on: alerts are reported, not turned into an exit status
    by = {e["engine_id"]: e for e in doc["engines"]}
    p0, d0 = by["p0"], by["d0"]
    assert (p0["role"], p0["kv_role"], p0["backend"]) == ("prefill", "kv_producer", "mooncake")
    assert (p0["lookup_tokens"], p0["hit_tokens"]) == (4000, 2560)
    assert p0["hit_rate"] == pytest.approx(0.64)
    assert p0["loads_in_flight"] == 1 and p0["load_errors"] == 0
    assert p0["next_lease_expiry_ms"] == pytest.approx(expiry, abs=1.0)
    assert p0["stale"] is False and p0["workers"] == 2 and p0["ranks"] == "dp1 tp2 pp1"
    assert [a["agent_id"] for a in p0["agents"]] == [
        "p0/scheduler", "p0/dp0.tp0.pp0", "p0/dp0.tp1.pp0"]
    # Segment usage comes from the real master's /metrics, polled by the worker agents.
    assert p0["segment_total_bytes"] >= 64 << 20
    assert 0 <= p0["segment_used_bytes"] <= p0["segment_total_bytes"]
    assert (d0["role"], d0["kv_role"], d0["hit_rate"]) == ("decode", "kv_producer", 0.0)
    assert d0["loads_in_flight"] == 0 and d0["load_errors"] == 1
    assert d0["failed_after_hit"] == 1 and d0["next_lease_expiry_ms"] is None
    alerts = {(a["rule"], a["subject"]): a for a in doc["alerts"]}
    assert alerts[("kv_role_mismatch", "d0")]["severity"] == "critical"
    assert alerts[("kv_role_mismatch", "d0")]["hint"] == "set kv_role to kv_consumer for " \
        "decode instances"
    assert alerts[("failed_after_hit", "d0")]["hint"].startswith("block evicted or removed")
    assert not any(subject == "p0" for _, subject in alerts)
    assert doc["totals"]["engines"] == 2 and doc["totals"]["lookup_tokens"] == 4100
    assert main(["status", "--json", "--hub", live_fleet.address, "--fail-on", "critical"]) == 1
    capsys.readouterr()


def test_status_table_and_hub_down(live_fleet: LiveFleet,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    _feed(live_fleet)
    _status(live_fleet, capsys)
    assert main(["status", "--hub", live_fleet.address, "--fail-on", "warning"]) == 1
    out = capsys.readouterr().out
    assert "p0" in out and "d0" in out and "CRITICAL d0: decode instance runs kv_role" in out
    live_fleet.hub.stop()
    assert main(["status", "--hub", live_fleet.address, "--wait", "0.5"]) == 2
    assert "no snapshot from the hub" in capsys.readouterr().err.replace("\n", " ")


def test_health_and_flush_rules(live_fleet: LiveFleet,
                                capsys: pytest.CaptureFixture[str]) -> None:
    _feed(live_fleet)
    keys = live_fleet.put_keys(live_fleet.model, 2)
    hub = live_fleet.address
    assert main(["health", "p0", "--json", "--hub", hub]) == 0
    replies = json.loads(capsys.readouterr().out)
    assert sorted(r["agent_id"] for r in replies) == [
        "p0/dp0.tp0.pp0", "p0/dp0.tp1.pp0", "p0/scheduler"]
    worker = next(r for r in replies if r["agent_id"] == "p0/dp0.tp0.pp0")
    names = {c["name"] for c in worker["health"]["checks"]}
    assert {"probe_put", "probe_get", "probe_remove"} <= names
    assert main(["health", "nope", "--hub", hub]) == 2
    assert "unknown engine(s) nope" in capsys.readouterr().err
    # Read-only: a real flush is refused before anything is sent; a dry run is allowed.
    assert main(["flush", "--scope", "model", "--model", live_fleet.model, "--hub", hub]) == 3
    assert "read-only" in capsys.readouterr().err
    assert main(["flush", "--scope", "model", "--model", live_fleet.model, "--dry-run",
                 "--hub", hub]) == 0
    assert "would remove 4 keys" in capsys.readouterr().out
    assert live_fleet.present(keys) == [1] * 4
    # With the key but without --yes and no terminal: not confirmed, nothing removed.
    keys_dir = str(live_fleet.keys.root)
    assert main(["flush", "--scope", "model", "--model", live_fleet.model, "--force",
                 "--keys", keys_dir, "--hub", hub]) == 3
    assert "not confirmed" in capsys.readouterr().err
    assert live_fleet.present(keys) == [1] * 4
    assert main(["flush", "--scope", "model", "--model", live_fleet.model, "--force", "--yes",
                 "--keys", keys_dir, "--hub", hub, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dry_run"][0]["flush"]["keys"] == 4
    assert sum(r["flush"]["removed_keys"] for r in doc["flush"]) == 4
    assert live_fleet.present(keys) == [0] * 4
    assert main(["flush", "--scope", "engine", "--hub", hub]) == 2


def test_console_script_runs(live_fleet: LiveFleet) -> None:
    _feed(live_fleet)
    time.sleep(0.5)
    out = subprocess.run([sys.executable, "-m", "kvpool_console.cli", "status", "--json",
                          "--hub", live_fleet.address], capture_output=True, text=True,
                         timeout=60, check=False, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert {e["engine_id"] for e in json.loads(out.stdout)["engines"]} == {"p0", "d0"}
