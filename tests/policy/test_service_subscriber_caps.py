"""V1 (round 6): snapshot subscribers of the policy service were not capped per key, so one
viewer key's stalled subscribers grew the service (30 took +45 MiB). Replayed over real CURVE
sockets against a real ``PolicyService`` (its store client on a real ``mooncake_master``): a
key's subscribers past its cap get no snapshot and change nothing for other keys' subscribers;
each refusal is counted for that key.

V1b: an agent key's cap was the hub's (1,024 for an engine-bound key: every worker's agent
connection), so a borrowed engine-bound key's stalled subscribers could hold 8 GiB of
snapshots. The service's own cap (``--max-agent-connections-per-key``) is replayed with the
service in its own process, its Bloom filter at its largest: its RSS stays within the bound
docs/security.md states for the key's cap."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
import zmq
from policy_harness import RunningService
from prometheus_client.parser import text_string_to_metric_families
from test_service_live import chunk, wait_for

from kvpool_agent.auth import (
    ClientKeys,
    authorize_key,
    generate_keys,
    local_fleet_keys,
)
from kvpool_connector.keys import ParallelLayout, shard_prefix
from kvpool_connector.policy_client import PolicyClient
from kvpool_connector.policy_wire import AdmissionSnapshot, PolicyLayout, policy_ports
from kvpool_policy.policy import DOORKEEPER_MAX_MIB
from kvpool_policy.service import SNAPSHOT_HWM
from kvpool_replay import LocalMooncakeMaster, LocalPolicyService, free_port_block

CAP = 2
"""The test's ``max_subscribers_per_key`` (a viewer or operator key)."""


@pytest.fixture
def running(mooncake_master: LocalMooncakeMaster, tmp_path: Path) -> Iterator[RunningService]:
    r = RunningService(mooncake_master, local_fleet_keys(tmp_path / "keys"),
                       max_subscribers_per_key=CAP)
    try:
        yield r
    finally:
        r.close()


def _subscriber(ctx: zmq.Context[zmq.Socket[bytes]], at: str, keys: ClientKeys,
                stalled: bool = False) -> zmq.Socket[bytes]:
    """A subscriber to every snapshot on ``at`` with ``keys``, read by the test (or never);
    ``stalled``: one never read, queueing one snapshot and 64 KiB of socket buffer (so the
    service's queue for it fills soon and the test process holds little)."""
    s: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    s.linger = 0
    if stalled:
        s.rcvhwm, s.rcvbuf = 1, 64 << 10
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
    running: RunningService,
) -> None:
    """A viewer key holds its ``CAP`` subscribers (each got a snapshot) and opens 6 more: they
    are refused, get no snapshot while an operator's subscriber and an engine's (the
    fleet-wide agent key) get three each; the viewer key still holds ``CAP`` places; each
    refusal is counted once, for the viewer key."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        viewer = running.keys["viewer"].client("viewer")
        held = [_subscriber(ctx, running.snapshots_at, viewer) for _ in range(CAP)]
        for s in held:
            assert s.poll(30_000), "a subscriber within the cap got no snapshot"
        extra = [_subscriber(ctx, running.snapshots_at, viewer) for _ in range(6)]
        others = [_subscriber(ctx, running.snapshots_at, running.keys[role].client(role))
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


ENGINE_CAP = 2
"""The V1b test's ``--max-agent-connections-per-key`` (an engine-bound agent key)."""
PAST_CAP = 4
"""Stalled subscribers the attacker opens past ``ENGINE_CAP``."""
ATTACKER = "agent/attacker-eng.engine"
"""The attacker's key as the service names it (``AllowList.name``)."""
VICTIM = PolicyLayout("cccccccccccc", [shard_prefix("victim", "cccccccccccc",
                                                    ParallelLayout())])
ALLOCATOR_SNAPSHOTS = 4
"""Snapshots' worth of freed buffers glibc's allocator may keep mapped beside the ones libzmq
holds (docs/security.md: +27.6 MiB for 2 stalled subscribers of 4 MiB snapshots, 12.1 MiB of it
held; none with ``MALLOC_MMAP_THRESHOLD_``). Uncapped, all 6 subscribers held took +44 MiB,
over the bound's 32: the assertion tells them apart."""


class CappedService(LocalPolicyService):
    """``kvpool-policy serve`` in its own process (its RSS is its own), 40 GiB of capacity (its
    Bloom filter at ``DOORKEEPER_MAX_MIB`` once a record of 64 KiB chunks sizes it), the
    engine-bound cap ``ENGINE_CAP`` and ``/metrics`` on P+2."""

    def __init__(self, master: LocalMooncakeMaster, hub_keys: Path, log_dir: Path) -> None:
        port = free_port_block(3)
        super().__init__(master, hub_keys, capacity_bytes=40 << 30, port=port, log_dir=log_dir)
        self.url = f"http://127.0.0.1:{port + 2}/metrics"

    def command(self) -> list[str]:
        return [*super().command(), "--max-agent-connections-per-key", str(ENGINE_CAP),
                "--metrics-port", str(self.port + 2)]

    def refused(self) -> dict[str, float]:
        """Key -> its subscribers refused past its cap (``/metrics``)."""
        text = httpx.get(self.url, timeout=5.0).text
        return {s.labels["key"]: s.value for fam in text_string_to_metric_families(text)
                if fam.name == "kvpool_policy_subscribers_refused" for s in fam.samples
                if s.name.endswith("_total")}

    def rss(self) -> int:
        assert self.proc is not None and self.proc.poll() is None, self.log_path.read_text()
        return int(psutil.Process(self.proc.pid).memory_info().rss)


def test_an_engine_keys_stalled_subscribers_past_its_cap_hold_nothing(
    mooncake_master: LocalMooncakeMaster, tmp_path: Path,
) -> None:
    """A borrowed engine-bound agent key opens ``ENGINE_CAP + PAST_CAP`` subscribers and never
    reads them, snapshots at their largest (4 MiB of filter): ``ENGINE_CAP`` get a snapshot,
    the rest none, each refusal counted once for that key; the service's RSS grows by at most
    the documented ``ENGINE_CAP x (SNAPSHOT_HWM + 1) x`` one snapshot; a real engine's client
    (the fleet-wide key) gets a snapshot every turn and keeps the service in charge."""
    keys = local_fleet_keys(tmp_path / "keys")
    attacker = generate_keys(tmp_path / "attacker", "agent", force=True)
    shutil.copyfile(keys["hub"].hub_public, attacker.hub_public)
    authorize_key(keys["hub"].root, "agent", attacker.public("agent"), engine="attacker-eng")
    service = CappedService(mooncake_master, keys["hub"].root, tmp_path)
    service.start()
    log = service.log_path.read_text
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engine = PolicyClient(service.address, keys["agent"].client("agent"), "victim-eng", VICTIM,
                          64 << 10)
    try:
        # A record sent before the CURVE handshake is dropped (the client's socket queues only
        # to a connected service): CI's first admit, under load, sized nothing.
        wait_for(lambda: engine.records_connected, 30, "the engine connected", log=log)
        engine.admit([chunk("v0")])

        def largest() -> AdmissionSnapshot | None:
            s = engine.snapshot
            full = s is not None and len(s.bloom) > (DOORKEEPER_MAX_MIB << 20) - 1024
            return s if full else None

        first = wait_for(largest, 60, "a snapshot with the largest filter", log=log)
        size = len(msgspec.msgpack.encode(first))

        def published(version: int) -> bool:
            s = engine.snapshot
            return s is not None and s.version >= version

        # Its publishing to one subscriber in the RSS before the attack.
        wait_for(lambda: published(first.version + 4), 30, "4 snapshots more", log=log)
        rss0 = service.rss()
        at = policy_ports(service.address)[1]
        stalled = [_subscriber(ctx, at, attacker.client("agent"), stalled=True)
                   for _ in range(ENGINE_CAP + PAST_CAP)]

        def holding() -> int:
            """Stalled subscribers with a snapshot waiting (polled, never read)."""
            return sum(bool(s.poll(0)) for s in stalled)

        wait_for(lambda: holding() == ENGINE_CAP and service.refused().get(ATTACKER) == PAST_CAP,
                 60, f"{ENGINE_CAP} subscribers holding a snapshot, {PAST_CAP} refused",
                 log=log)
        # Eight more snapshots (4 s): the held subscribers' queues fill (a few snapshots of
        # loopback buffers first), the RSS sampled all along.
        since = engine.snapshot
        assert since is not None
        peak, master = rss0, []

        def eight_more() -> bool:
            nonlocal peak
            peak = max(peak, service.rss())
            master.append(engine.in_charge == "master")
            return published(since.version + 8)

        wait_for(eight_more, 60, "8 snapshots more", log=log)
        bound = (ENGINE_CAP * (SNAPSHOT_HWM + 1) + ALLOCATOR_SNAPSHOTS) * size
        assert peak - rss0 <= bound, (
            f"RSS +{(peak - rss0) / 2**20:.1f} MiB, snapshot {size / 2**20:.2f} MiB")
        assert holding() == ENGINE_CAP
        assert service.refused() == {ATTACKER: PAST_CAP}
        assert not any(master), "the engine took the service for down during the attack"
    finally:
        engine.close()
        ctx.destroy(linger=0)
        service.stop()
