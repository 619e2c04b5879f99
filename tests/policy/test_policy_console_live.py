"""The console shows who steers an ``admission: service`` engine (issue 40 item 1), live: a real
``kvpool-policy serve`` on a real master, the engine's scheduler ``PolicyClient`` made by the
connector's own wiring (``_policy_link.scheduler_client`` from a worker's handshake) and
reporting through its real agent over CURVE to a real hub, read by ``kvpool-console status
--json``. With the service running: ``policy`` ``service``, its records counted; killed: the
master in charge within the stale time (``policy`` ``service_silent``), and the
``policy_master`` warning with its fix."""

from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import test_service_live as live
import torch
from test_service_live import MODEL, Pool, chunk, wait_for

from kvpool_agent import FleetHub, start_agent
from kvpool_agent.protocol import Source
from kvpool_connector._policy_link import scheduler_client, worker_handshake
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import ParallelLayout
from kvpool_connector.worker import KVPoolWorker
from kvpool_console.cli import main as console_main
from kvpool_replay import free_port_block

pool = live.pool
"""The live service tests' fixture: a master, a store of its own, the fleet's keys, the
service (started by the test)."""

STALE_MS = 1_500
ENGINE = "steered-0"


@pytest.fixture
def hub(pool: Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A hub with the pool's fleet keys on every port; consoles read it with a viewer key."""
    address = f"tcp://127.0.0.1:{free_port_block(5)}"
    kp = pool.keys["hub"]
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(pool.keys["viewer"].root))
    with FleetHub(address, authorized_keys_dir=kp.authorized_dir, secret_key_file=kp.hub_secret,
                  audit_file=tmp_path / "audit.jsonl", snapshot_interval_s=0.5):
        yield address


def test_console_shows_the_service_then_the_master_in_charge(
        pool: Pool, hub: str, capsys: pytest.CaptureFixture[str]) -> None:
    agent = start_agent(Source(agent_id=f"{ENGINE}/scheduler", engine_id=ENGINE,
                               instance_role="mixed", kv_role="kv_both",
                               process_role="scheduler", pid=os.getpid(), host="localhost",
                               backend="mooncake", model=MODEL, master=pool.master.address),
                        address=hub, keys_dir=pool.keys["agent"].root)
    pool.start_service()  # first: a start may move to other ports, and engines need its own
    extra = {"chunk_size": 32, "admission": "service", "policy_service": pool.address,
             "agent_keys": str(pool.keys["agent"].root), "policy_stale_ms": STALE_MS}
    cfg = KVPoolConfig.from_dicts(extra, kv_role="kv_both", block_size=16, model=MODEL,
                                  engine_id=ENGINE)
    worker = KVPoolWorker(cfg, ParallelLayout(), cfg.model, pool.store)
    worker.register_kv_caches({f"layers.{i}": torch.zeros(4, 8, 16, 256) for i in range(2)})
    shake = worker_handshake(cfg, worker, tp_rank=0, pp_rank=0)
    assert shake is not None
    client = scheduler_client(cfg, {0: pickle.loads(pickle.dumps(shake))}, agent.reporter)
    assert client is not None
    pool.clients.append(client)

    def status() -> dict[str, Any]:
        assert console_main(["status", "--json", "--hub", hub]) in (0, 1), capsys.readouterr()
        return json.loads(capsys.readouterr().out)

    def row(doc: dict[str, Any]) -> dict[str, Any]:
        return next((e for e in doc["engines"] if e["engine_id"] == ENGINE), {})

    def status_when(cond: Callable[[dict[str, Any]], bool], what: str,
                    timeout_s: float = 60.0) -> dict[str, Any]:
        """The first ``status --json`` document for which ``cond`` holds."""
        last: list[dict[str, Any]] = []

        def ready() -> bool:
            last[:] = [status()]
            return cond(last[0])

        wait_for(ready, timeout_s, what=what, log=lambda: f"{last}\n{pool.log()}")
        return last[0]

    try:
        # (a) The service running: it steers, and the records the engine sent are counted.
        wait_for(lambda: client.in_charge == "service", what="the service in charge",
                 log=pool.log)
        assert client.admit([chunk("c0"), chunk("c1")]) == 2
        assert client.admit([chunk("c2")]) == 1
        doc = status_when(lambda d: row(d).get("policy_records_sent") == 2,
                          "2 records counted in status --json")
        e = row(doc)
        assert (e["policy"], e["policy_in_charge"], e["policy_service"]) == (
            "service", "service", pool.address)
        assert e["policy_records_dropped"] == 0
        assert 0.0 <= e["policy_silent_ms"] < STALE_MS
        assert [a for a in doc["alerts"] if a["rule"] == "policy_master"] == []

        # (b) The service killed: the master in charge, shown within the stale time (plus one
        # agent delta and the hub's forwarding), then the warning with its fix.
        pool.kill_service()
        killed = time.monotonic()
        doc = status_when(lambda d: row(d).get("policy_in_charge") == "master",
                          "the master in charge in status --json", timeout_s=30)
        assert time.monotonic() - killed < STALE_MS / 1e3 + 2.0
        doc = status_when(lambda d: any(a["rule"] == "policy_master" for a in d["alerts"]),
                          "the policy_master warning", timeout_s=10)
        e = row(doc)
        assert e["policy"] == "service_silent"
        assert e["policy_silent_ms"] >= STALE_MS
        (alert,) = [a for a in doc["alerts"] if a["rule"] == "policy_master"]
        assert alert["severity"] == "warning"
        assert alert["subject"] == f"mooncake@{pool.master.address}"
        assert f"configured for the policy service ({ENGINE}): {pool.address} silent" in \
            alert["message"]
        assert "`kvpool-policy serve`" in alert["hint"] and "docs/policy.md" in alert["hint"]
        # Records sent with the service away are dropped and counted, never waited for.
        assert client.admit([chunk("c3")]) == 1
        wait_for(lambda: row(status()).get("policy_records_dropped", 0) >= 1,
                 what="a dropped record counted")
    finally:
        agent.stop()
