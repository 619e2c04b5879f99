"""Attacks on a keyed hub by holders of valid but lesser keys (another engine's agent key, a
viewer key) and careless key handling, each against a real FleetHub with real CURVE keys and
real sockets, asserting the attack had no effect."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from agent_testlib import FakeAgent, make_source

from kvpool_agent import FleetClient, FleetHub, KeyPaths
from kvpool_agent.auth import Role, authorize_key, generate_keys
from kvpool_agent.protocol import FlushArgs, StartFailure


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _wait(cond: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.02)


def _agent_dir(tmp_path: Path, name: str, hub_keys: KeyPaths) -> KeyPaths:
    """A fresh agent key pair with the hub's ``hub.key``, authorized on the hub."""
    d = generate_keys(tmp_path / name, "agent")
    (d.root / "hub.key").write_bytes(hub_keys.hub_public.read_bytes())
    authorize_key(hub_keys.root, "agent", d.public("agent"), name)
    return d


def test_another_engines_key_cannot_add_an_agent_to_a_live_engine(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Engine B's valid key reports a NEW agent id under engine A's id, with a start failure
    (console: A FAILED, its other alerts hidden) and as a worker (A's engine flush would go to
    it). Nothing of it is kept and no command reaches it; A's own key still reports."""
    key_a = _agent_dir(tmp_path, "engine-a", fleet_keys["hub"])
    key_b = _agent_dir(tmp_path, "engine-b", fleet_keys["hub"])
    a = FakeAgent(ctx, hub_address, keys=key_a.client("agent"))
    b = FakeAgent(ctx, hub_address, keys=key_b.client("agent"))
    a.report(make_source("eng-a"))
    _wait(lambda: "eng-a/dp0.tp0.pp0" in hub.fleet())
    b.report(make_source("eng-b"))
    _wait(lambda: "eng-b/dp0.tp0.pp0" in hub.fleet())
    failure = StartFailure(ts_ms=time.time() * 1e3, name="PortInUse", message="forged")
    for _ in range(20):
        b.report(make_source("eng-a", tp=7), start_failure=failure)
        time.sleep(0.01)
    _wait(lambda: hub.takeover_refused >= 20)
    assert hub.takeover_refused >= 20
    assert sorted(hub.fleet()) == ["eng-a/dp0.tp0.pp0", "eng-b/dp0.tp0.pp0"]
    assert all(st.start_failure is None for st, _ in hub.fleet().values())
    with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
        (r,) = viewer.command("flush", flush=FlushArgs(scope="engine", engine_id="eng-a"),
                              timeout_ms=500)
    assert r.agent_id == "eng-a/dp0.tp0.pp0"
    assert [c.command for c in a.drain(300)] == ["flush"] and b.drain(300) == []
    # A's own key still adds agents to A.
    a.report(make_source("eng-a", tp=1))
    _wait(lambda: "eng-a/dp0.tp1.pp0" in hub.fleet())
    assert "eng-a/dp0.tp1.pp0" in hub.fleet()

