"""Issue 42: ``kvpool-agent store`` reported no ``Source.master``, so the console and the hub
named its pool by its segments while the engines' workers, whose ``Source.master`` is their
``master_server_address``, named the same pool ``mooncake@<address>``: one pool shown as two,
and the store agent's readings never weighed with the engines'. The store agent now reports
the engines' address (``--master-server-address``, default ``$MOONCAKE_MASTER``:
``kvpool_agent._store_agent``), and a real store agent and a real worker agent of one real
master land in one pool in the hub's view: its ``/metrics`` families and the console's pool
rows built from the hub's fleet."""

from __future__ import annotations

import argparse
import io
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent import FleetHub, start_agent
from kvpool_agent._metrics import FleetCollector
from kvpool_agent._store_agent import MASTER_ENV, add_master_option, master_of, store_source
from kvpool_agent.agent import AgentHandle
from kvpool_agent.pool_readings import pool_name
from kvpool_agent.protocol import EngineState, Source
from kvpool_console.model import build_view
from kvpool_replay import LocalMooncakeMaster


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_master_option(p)
    return p.parse_args(argv)


def test_the_master_option_defaults_to_the_connectors_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MASTER_ENV, "etcd://10.0.0.5:2379")
    assert master_of(_parse([])) == "etcd://10.0.0.5:2379"
    assert master_of(_parse(["--master-server-address", "10.0.0.1:50051"])) == "10.0.0.1:50051"
    monkeypatch.delenv(MASTER_ENV)
    err = io.StringIO()
    assert master_of(_parse([]), err) == ""
    assert err.getvalue().count("\n") == 1 and "--master-server-address" in err.getvalue()


def test_the_store_source_names_the_workers_pool() -> None:
    store = store_source("store@m1", "10.0.0.1:50051")
    assert (store.process_role, store.agent_id, store.master) == (
        "store", "store@m1", "10.0.0.1:50051")
    worker = Source(agent_id="e0/dp0.tp0.pp0", engine_id="e0", instance_role="mixed",
                    kv_role="kv_both", process_role="worker", backend="mooncake",
                    master="10.0.0.1:50051")
    names = {pool_name(EngineState(source=s, started_ms=0.0, ts_ms=0.0)) for s in (store, worker)}
    assert names == {"mooncake@10.0.0.1:50051"}


@pytest.fixture
def handles() -> Iterator[list[AgentHandle]]:
    started: list[AgentHandle] = []
    yield started
    for h in started:
        h.stop()


def _scrape(collector: FleetCollector) -> dict[str, dict[str, float]]:
    """Family -> pool label -> value of the pool families ``collector`` exports."""
    reg = CollectorRegistry()
    reg.register(collector)
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            if s.name.startswith("kvpool_pool_") and "pool" in s.labels:
                out.setdefault(s.name, {})[s.labels["pool"]] = s.value
    return out


def test_a_store_agent_and_a_worker_of_one_master_are_one_pool(
        hub: FleetHub, hub_address: str, agent_master: LocalMooncakeMaster,
        handles: list[AgentHandle], procs: list[subprocess.Popen[bytes]]) -> None:
    """The store agent a ``kvpool-agent store --master-server-address`` process runs, and a
    worker agent as the connector starts it (``Source.master`` = ``master_server_address``),
    both reading the one real master's admin port, both with the fleet's agent key (the
    ``hub`` fixture's ``KVPOOL_AGENT_KEYS``)."""
    address = agent_master.address
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "kvpool_agent.cli", "store", "--hub", hub_address,
         "--admin-url", agent_master.admin_url, "--master-server-address", address,
         "--engine-id", "store-1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    worker = Source(agent_id="e0/dp0.tp0.pp0", engine_id="e0", instance_role="mixed",
                    kv_role="kv_both", process_role="worker", backend="mooncake",
                    master=address)
    handles.append(start_agent(worker, address=hub_address,
                               pool_admin_url=agent_master.admin_url))
    assert all(h.enabled for h in handles)
    # Two agents, each with its first pool reading read (healthy set): generous, loaded CI.
    deadline = time.monotonic() + 60
    while True:
        states = hub.fleet()
        read = {k for k, (st, _) in states.items()
                if st.pool is not None and st.pool.healthy is not None}
        if read >= {"store-1", "e0/dp0.tp0.pp0"}:
            break
        assert time.monotonic() < deadline, f"agents not read in time: {sorted(states)}"
        time.sleep(0.2)
    pool = f"mooncake@{address}"
    assert {pool_name(st) for st, _ in states.values()} == {pool}
    # The hub's own collector (the store agent's key is the fleet's, not bound to one engine:
    # vouched for) and one over the same states without key knowledge (agreement alone).
    for collector in (hub._collector(),
                      FleetCollector(lambda: states, dict, dict, lambda: time.time() * 1e3)):
        scraped = _scrape(collector)
        assert scraped["kvpool_pool_readings_agree"] == {pool: 1}
        assert set(scraped["kvpool_pool_total_bytes"]) == {pool}
        assert scraped["kvpool_pool_healthy"] == {pool: 1}
    view = build_view({k: st for k, (st, _) in states.items()},
                      {k: seen for k, (_, seen) in states.items()}, time.time() * 1e3)
    assert [p.name for p in view.pools] == [pool]
    store = procs[0]
    store.send_signal(signal.SIGTERM)
    assert store.wait(30) == 0
    out = store.stdout.read().decode() if store.stdout is not None else ""
    assert "--master-server-address" not in out  # no warning: the master was given
