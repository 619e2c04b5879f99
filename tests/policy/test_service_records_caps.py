"""Records connections of the policy service were not capped per key (docs/security.md): one
borrowed agent key could open as many connections to ``P`` as the file limit allows, each
queueing up to 36 MiB of batches, so the key chose the service's memory. Now an agent key holds
``--max-agent-connections-per-key`` of them (engine-bound; the same cap as its snapshot
subscribers: a scheduler holds one of each). Replayed over real CURVE sockets against a real
``PolicyService`` (its store client on a real ``mooncake_master``): an engine-bound key's
connections past its cap are refused, at the handshake or, admitted in a burst, shut down at
their first batch; their batches are never applied, each refusal is counted once for that key
(``/metrics`` too), and an honest engine's records on another key are applied."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from policy_harness import RunningService
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from test_service_live import chunk, wait_for
from zmq.utils.monitor import recv_monitor_message

from kvpool_agent import key_caps
from kvpool_agent.auth import (
    ClientKeys,
    authorize_key,
    generate_keys,
    local_fleet_keys,
)
from kvpool_connector.keys import ParallelLayout, shard_prefix
from kvpool_connector.policy_client import PolicyClient
from kvpool_connector.policy_wire import (
    WIRE_VERSION,
    PolicyLayout,
    PolicyRecord,
    RecordBatch,
)
from kvpool_policy._metrics import ServiceCollector
from kvpool_replay import LocalMooncakeMaster

CAP = 2
"""The test's ``max_agent_connections_per_key`` (an engine-bound agent key)."""
PAST_CAP = 3
"""Records connections the attacker opens past ``CAP``."""
ATTACKER = "agent/attacker-eng.engine"
"""The attacker's key as the service names it (``AllowList.name``)."""
CHUNK_BYTES = 64 << 10
ATTACKER_LAYOUT = PolicyLayout("aaaaaaaaaaaa", [shard_prefix("attacker", "aaaaaaaaaaaa",
                                                             ParallelLayout())])
VICTIM_LAYOUT = PolicyLayout("cccccccccccc", [shard_prefix("victim", "cccccccccccc",
                                                           ParallelLayout())])


class Running(RunningService):
    """The service with an engine-bound cap of ``CAP`` and the attacker's engine-bound agent
    key (authorized before the service reads its keys)."""

    def __init__(self, master: LocalMooncakeMaster, tmp: Path) -> None:
        keys = local_fleet_keys(tmp / "keys")
        attacker = generate_keys(tmp / "attacker", "agent", force=True)
        shutil.copyfile(keys["hub"].hub_public, attacker.hub_public)
        authorize_key(keys["hub"].root, "agent", attacker.public("agent"),
                      engine="attacker-eng")
        self.attacker = attacker.client("agent")
        super().__init__(master, keys, max_agent_connections_per_key=CAP)

    def refused(self) -> dict[str, float]:
        """Key -> its records connections refused (``/metrics``' family, rendered)."""
        registry = CollectorRegistry()
        registry.register(ServiceCollector(self.service.core))
        text = generate_latest(registry).decode()
        return {s.labels["key"]: s.value for fam in text_string_to_metric_families(text)
                if fam.name == "kvpool_policy_records_connections_refused" for s in fam.samples
                if s.name.endswith("_total")}


@pytest.fixture
def running(mooncake_master: LocalMooncakeMaster, tmp_path: Path) -> Iterator[Running]:
    r = Running(mooncake_master, tmp_path)
    try:
        yield r
    finally:
        r.close()


def _pusher(ctx: zmq.Context[zmq.Socket[bytes]], at: str,
            keys: ClientKeys) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A records connection to ``at`` with ``keys`` (what a scheduler's ``PolicyClient`` opens)
    and a monitor of its handshakes (succeeded or failed) and disconnections."""
    s: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
    s.linger = 0
    keys.apply(s)
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                               | zmq.EVENT_DISCONNECTED)
    s.connect(at)
    return s, mon


def _handshake(mon: zmq.Socket[bytes]) -> bool:
    """Whether the next handshake of the connection ``mon`` watches passed (waits for it)."""
    while True:
        assert mon.poll(30_000), "no handshake outcome in 30 s"
        event = recv_monitor_message(mon)["event"]
        if event != zmq.EVENT_DISCONNECTED:
            return bool(event == zmq.EVENT_HANDSHAKE_SUCCEEDED)


def _disconnected(mon: zmq.Socket[bytes]) -> bool:
    """Whether the connection ``mon`` watches was disconnected by now (no wait)."""
    while mon.poll(0):
        if recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


def _batch(connection: int, records: int) -> bytes:
    """The attacker's batch of ``records`` records of fresh chunks from its ``connection``."""
    return msgspec.msgpack.encode(RecordBatch(
        WIRE_VERSION, "attacker-eng", connection, 0, [ATTACKER_LAYOUT],
        [PolicyRecord(ATTACKER_LAYOUT.digest, [chunk(f"a{connection}.{i}")], CHUNK_BYTES, 1)
         for i in range(records)]))


def _honest(running: Running, records: int) -> PolicyClient:
    """An honest engine on the fleet-wide agent key: its ``records`` records sent, the service
    having applied them (its snapshot says so) before it returns."""
    engine = PolicyClient(running.address, running.keys["agent"].client("agent"), "victim-eng",
                          VICTIM_LAYOUT, CHUNK_BYTES)
    c = running.service.core.counters
    base = c.records
    wait_for(lambda: engine.records_connected, 30, "the honest engine connected")
    for i in range(records):
        engine.admit([chunk(f"v{i}")])
    wait_for(lambda: c.records >= base + records, 30, "the honest engine's records applied")
    return engine


def test_records_connections_past_an_engine_keys_cap_are_refused_at_the_handshake(
    running: Running,
) -> None:
    """An engine-bound key holds ``CAP`` records connections (their batches applied) and opens
    ``PAST_CAP`` more, each sending a batch: their handshakes fail, each counted once for the
    key; the service applies only the held connections' records and the honest engine's."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    c = running.service.core.counters
    try:
        held = [_pusher(ctx, running.records_at, running.attacker) for _ in range(CAP)]
        assert all(_handshake(mon) for _, mon in held)
        for i, (s, _) in enumerate(held):
            s.send(_batch(i, 4))
        wait_for(lambda: c.records == 4 * CAP, 30, "the held connections' batches applied")
        extra = [_pusher(ctx, running.records_at, running.attacker) for _ in range(PAST_CAP)]
        assert not any(_handshake(mon) for _, mon in extra), "a connection past the cap passed"
        for i, (s, _) in enumerate(extra, CAP):
            # Queued in the socket, or refused outright while it has no pipe (between two
            # refused handshakes: zmq.Again, seen under load): it never reaches the service.
            with contextlib.suppress(zmq.Again):
                s.send(_batch(i, 64), zmq.NOBLOCK)
        wait_for(lambda: c.records_connections_over_cap == PAST_CAP, 30,
                 "the refusals counted")
        engine = _honest(running, 3)
        try:
            assert c.records == 4 * CAP + 3
            assert c.records_connections_over_cap == PAST_CAP
            assert c.records_over_cap_by_key == {ATTACKER: PAST_CAP}
            assert running.refused() == {ATTACKER: PAST_CAP}
            assert c.subscribers_over_cap == 0
            assert running.service.caps.held("records", running.attacker.public.decode()) == CAP
            assert c.errors == 0
        finally:
            engine.close()
    finally:
        ctx.destroy(linger=0)


def test_records_connections_admitted_in_a_burst_past_the_cap_are_shut_down_unapplied(
    running: Running, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst: ``CAP + PAST_CAP`` connections of the engine-bound key all pass their handshake
    before any sends (no admitted handshake counts against the cap: ``ADMIT_WINDOW_S`` 0), then
    each sends two batches. The first ``CAP`` connections to send are held and their batches
    applied; every other one is shut down at its first batch: neither of its batches is
    applied, its refusal counted once (not once a batch). Each reconnects, as libzmq does, and
    is refused at the handshake: counted too, so ``2 x PAST_CAP`` refusals. The honest
    engine's records are applied."""
    monkeypatch.setattr(key_caps, "ADMIT_WINDOW_S", 0.0)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    c = running.service.core.counters
    try:
        burst = [_pusher(ctx, running.records_at, running.attacker) for _ in range(CAP + PAST_CAP)]
        assert all(_handshake(mon) for _, mon in burst), "a handshake of the burst failed"
        for i, (s, _) in enumerate(burst):
            s.send(_batch(2 * i, 4))
            s.send(_batch(2 * i + 1, 4))
        shut: list[zmq.Socket[bytes]] = []

        def shut_down() -> bool:
            shut.extend(mon for _, mon in burst if mon not in shut and _disconnected(mon))
            return len(shut) == PAST_CAP and c.records == 8 * CAP
        wait_for(shut_down, 30, f"{PAST_CAP} connections shut down, {CAP} connections' "
                 "batches applied")
        assert not any(_handshake(mon) for mon in shut), "a reconnection past the cap passed"
        wait_for(lambda: c.records_connections_over_cap == 2 * PAST_CAP, 30,
                 "the shut-down connections and their reconnections counted")
        engine = _honest(running, 3)
        try:
            assert c.records == 8 * CAP + 3
            assert c.records_connections_over_cap == 2 * PAST_CAP
            assert c.records_over_cap_by_key == {ATTACKER: 2 * PAST_CAP}
            assert not any(_disconnected(mon) for _, mon in burst if mon not in shut)
            assert running.service.caps.held("records", running.attacker.public.decode()) == CAP
            assert c.errors == 0
        finally:
            engine.close()
    finally:
        ctx.destroy(linger=0)
