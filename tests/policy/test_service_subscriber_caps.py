"""V1 (round 6): snapshot subscribers of the policy service were not capped per key, so one
viewer key's stalled subscribers grew the service (30 took +45 MiB). Replayed over real CURVE
sockets against a real ``PolicyService`` (its store client on a real ``mooncake_master``): a
key's subscribers past its cap get no snapshot and change nothing for other keys' subscribers;
each refusal is counted for that key."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from test_service_live import wait_for

from kvpool_agent.auth import ClientKeys, KeyPaths, Role, local_fleet_keys
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.policy_wire import AdmissionSnapshot, policy_ports
from kvpool_policy.service import PolicyService
from kvpool_replay import LocalMooncakeMaster, free_port_block

CAP = 2
"""The test's ``max_subscribers_per_key`` (a viewer or operator key)."""


class Running:
    """A ``PolicyService`` serving on its own thread, with the fleet's keys."""

    def __init__(self, master: LocalMooncakeMaster, tmp: Path) -> None:
        self.keys: dict[Role, KeyPaths] = local_fleet_keys(tmp / "keys")
        self.backend = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": master.address, "master_admin_url": master.admin_url,
            "global_segment_size": 0, "local_buffer_size": "16MB"}}))
        address = f"tcp://127.0.0.1:{free_port_block()}"
        self.at = policy_ports(address)[1]
        self.service = PolicyService(address, self.keys["hub"], self.backend, 64 << 20,
                                     max_subscribers_per_key=CAP)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.service.serve, args=(self.stop,),
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.service.close()
        self.backend.close()


@pytest.fixture
def running(mooncake_master: LocalMooncakeMaster, tmp_path: Path) -> Iterator[Running]:
    r = Running(mooncake_master, tmp_path)
    try:
        yield r
    finally:
        r.close()


def _subscriber(ctx: zmq.Context[zmq.Socket[bytes]], at: str,
                keys: ClientKeys) -> zmq.Socket[bytes]:
    """A subscriber to every snapshot on ``at`` with ``keys``, read by the test (or never)."""
    s: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    s.linger = 0
    keys.apply(s)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(at)
    return s


def _snapshots(sock: zmq.Socket[bytes]) -> int:
    """Snapshots ``sock`` holds now (read, checked and dropped)."""
    n = 0
    while sock.poll(0):
        msgspec.msgpack.decode(sock.recv(), type=AdmissionSnapshot)
        n += 1
    return n


def test_a_keys_subscribers_past_its_cap_get_no_snapshot_and_are_counted(
    running: Running,
) -> None:
    """A viewer key holds its ``CAP`` subscribers (each got a snapshot) and opens 6 more: they
    are refused, get no snapshot while an operator's subscriber and an engine's (the
    fleet-wide agent key) get three each; the viewer key still holds ``CAP`` places; each
    refusal is counted once, for the viewer key."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        viewer = running.keys["viewer"].client("viewer")
        held = [_subscriber(ctx, running.at, viewer) for _ in range(CAP)]
        for s in held:
            assert s.poll(30_000), "a subscriber within the cap got no snapshot"
        extra = [_subscriber(ctx, running.at, viewer) for _ in range(6)]
        others = [_subscriber(ctx, running.at, running.keys[role].client(role))
                  for role in ("operator", "agent")]
        counters = running.service.core.counters
        got, seen = [0] * len(extra), [0] * len(others)

        def three_each_and_counted() -> bool:
            for i, s in enumerate(extra):
                got[i] += _snapshots(s)
            for i, s in enumerate(others):
                seen[i] += _snapshots(s)
            return min(seen) >= 3 and counters.subscribers_over_cap >= len(extra)

        wait_for(three_each_and_counted, 60, "3 snapshots each and the refusals counted")
        assert got == [0] * len(extra), f"subscribers past the cap got snapshots: {got}"
        assert counters.subscribers_over_cap == len(extra)
        assert counters.over_cap_by_key == {"viewer/viewer": len(extra)}
        assert running.service.caps.held("snapshots", viewer.public.decode()) == CAP
        assert counters.errors == 0
    finally:
        ctx.destroy(linger=0)
