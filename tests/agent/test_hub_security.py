"""Issue 10's attacks on the hub, each against a real FleetHub, real ZMQ sockets and real
agents, asserting the attack had no effect: no id taken over, no command delivered to the
attacker, no forged reply accepted, no console starved, no operator starved, nothing kept
forever; and the CURVE roles: nothing without a key or with a key not allowed on a port."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from agent_testlib import FakeAgent, Spammer, make_source, wait_until

from kvpool_agent import AGENT_KEYS_ENV, FleetClient, FleetHub, KeyPaths, _fleet, start_agent
from kvpool_agent._hub_memory import COMMAND_SNDHWM
from kvpool_agent.auth import Role
from kvpool_agent.hub import MAX_PENDING_PER_CONNECTION, OPERATOR_ONLY
from kvpool_agent.protocol import (
    MAX_IN_FLIGHT,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    EngineState,
    FleetUpdate,
    Transfer,
    decode,
    encode,
)


def test_a_live_agent_id_cannot_be_taken_over(
    hub: FleetHub, hub_address: str, keys_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Observation 2: a faster reporter under a live engine's agent id gets nothing."""
    real = start_agent(make_source("eng-t", role="scheduler"), address=hub_address)
    aid = real.source.agent_id
    fake = FakeAgent(ctx, hub_address)
    forged = msgspec.structs.replace(real.source, pid=999_999, host="attacker")
    try:
        with FleetClient(hub_address, keys_dir=keys_dir) as op:
            op.wait_for(1, 30)
            with Spammer(fake, forged):
                wait_until(lambda: hub.takeover_refused >= 20)
                replies = [op.command("health", targets=[aid]) for _ in range(10)]
    finally:
        real.stop()
    assert hub.takeover_refused >= 20
    assert fake.drain(200) == []
    # Told its reports are dropped, and nothing about who holds the id.
    assert fake.notices and all(n.startswith("takeover: this agent id or engine id is held by "
                                             "another live connection") for n in fake.notices)
    for (r,) in replies:
        assert r.ok and r.agent_id == aid and r.health is not None
        assert [c.name for c in r.health.checks] == ["agent"]
    state, _ = hub.fleet()[aid]
    assert (state.source.pid, state.source.host) == (real.source.pid, real.source.host)


def test_replies_count_only_from_the_connection_asked_and_once(
    hub: FleetHub, hub_address: str, keys_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]],
    tmp_path: Path,
) -> None:
    """Observation 3: even knowing the request id, another connection cannot answer; the
    connection asked answers once; ids are unguessable."""
    mute = FakeAgent(ctx, hub_address)  # registers, never answers by itself
    mute_src = make_source("eng-m", role="scheduler")
    mute.report(mute_src)
    attacker = FakeAgent(ctx, hub_address)  # never reports
    result: list[list[CommandReply]] = []
    with FleetClient(hub_address, keys_dir=keys_dir) as op:
        op.wait_for(1, 30)
        t = threading.Thread(target=lambda: result.append(
            op.command("health", targets=[mute_src.agent_id], timeout_ms=1500)))
        t.start()
        (req,) = mute.drain(5000)
        for guess in [req.request_id, "hub-1", "hub-2"]:
            attacker.reply(guess, mute_src.agent_id)
        t.join()
        ((timed_out,),) = result
        assert not timed_out.ok and (timed_out.error or "").startswith("timeout")
        # The connection asked answers: accepted once, a repeat is refused.
        rejected = hub.rejected_replies
        t = threading.Thread(target=lambda: result.append(
            op.command("health", targets=[mute_src.agent_id], timeout_ms=3000)))
        t.start()
        (req2,) = mute.drain(5000)[1:]
        mute.reply(req2.request_id, mute_src.agent_id)
        mute.reply(req2.request_id, mute_src.agent_id)
        t.join()
    assert result[1][0].ok and result[1][0].agent_id == mute_src.agent_id
    assert rejected == 3
    wait_until(lambda: hub.rejected_replies == 4)
    assert hub.rejected_replies == 4
    assert len(req.request_id) == 32 and int(req.request_id, 16) >= 0
    assert req.request_id != req2.request_id


def _big_state(n_transfers: int, id_chars: int = 9) -> dict[str, object]:
    return {"in_flight": [
        Transfer(req_id=f"r{i:08d}".ljust(id_chars, "x"), kind="save", blocks=i,
                 bytes=i * 4096, started_ms=1.7e12 + i, lease_expires_ms=1.7e12 + i)
        for i in range(n_transfers)
    ]}


def test_oversized_state_is_refused_and_snapshots_stay_decodable(
    hub: FleetHub, hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]],
    fleet_keys: dict[Role, KeyPaths],
) -> None:
    """Observation 4: a 3.6 MB state is refused (past the schema's ``MAX_IN_FLIGHT``: a bad
    message), so is one within the schema but over ``_fleet.MAX_STATE_BYTES`` (oversized); 40
    agents with large-but-allowed states still reach a console, every frame under the consoles'
    limit."""
    viewer = fleet_keys["viewer"].client("viewer")
    fake = FakeAgent(ctx, hub_address)
    bad = hub.bad_messages
    fake.report(make_source("huge"), **_big_state(30_000))
    assert len(encode(EngineState(source=make_source("huge"), started_ms=0, ts_ms=0,
                                  **_big_state(30_000)))) > 3_000_000  # type: ignore[arg-type]
    wait_until(lambda: hub.bad_messages > bad)
    assert hub.bad_messages == bad + 1
    fake.report(make_source("huge"), **_big_state(MAX_IN_FLIGHT, id_chars=100))
    assert len(encode(EngineState(source=make_source("huge"), started_ms=0, ts_ms=0,
                                  **_big_state(MAX_IN_FLIGHT, id_chars=100)))
               ) > _fleet.MAX_STATE_BYTES  # type: ignore[arg-type]
    big = [FakeAgent(ctx, hub_address) for _ in range(40)]
    for i, f in enumerate(big):
        f.report(make_source(f"big-{i:02d}"), **_big_state(1_900))
    wait_until(lambda: len(hub.fleet()) == 40 and hub.oversized_states == 1)
    assert hub.oversized_states == 1 and "huge/dp0.tp0.pp0" not in hub.fleet()
    with FleetClient(hub_address) as c:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        viewer.apply(sub)
        sub.connect(hub.ports.pub)
        fleet = c.wait_for(40, 10)
        # Every frame of the next full snapshot, as a console receives them.
        sizes: list[int] = []
        in_snapshot: set[str] = set()
        while len(in_snapshot) < 40 and sub.poll(5000):
            frame = sub.recv()
            upd = decode(frame)
            assert isinstance(upd, FleetUpdate)
            if upd.kind == "snapshot":
                sizes.append(len(frame))
                in_snapshot |= {e.source.agent_id for e in upd.engines}
        sub.close(linger=0)
        assert c.bad_messages == 0
    assert sorted(fleet) == [f"big-{i:02d}/dp0.tp0.pp0" for i in range(40)]
    assert all(len(e.state.in_flight) == 1_900 for e in fleet.values())
    assert len(in_snapshot) == 40 and len(sizes) >= 3
    assert sum(sizes) > 8_000_000 and max(sizes) < MAX_MESSAGE_BYTES


def test_many_large_agents_cannot_grow_the_hub_past_its_fleet_budget(
    hub: FleetHub, hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One agent key registering agent after agent with large states: the hub keeps at most
    ``MAX_FLEET_STATE_BYTES`` of state, refuses (and counts) the rest, and the agents it kept
    go on reporting."""
    one = len(encode(EngineState(source=make_source("big-00"), started_ms=0, ts_ms=0,
                                 **_big_state(1_900))))  # type: ignore[arg-type]
    monkeypatch.setattr(_fleet, "MAX_FLEET_STATE_BYTES", 5 * one + one // 2)
    agents = [FakeAgent(ctx, hub_address) for _ in range(12)]
    for i, f in enumerate(agents):
        f.report(make_source(f"big-{i:02d}"), **_big_state(1_900))
    wait_until(lambda: hub.fleet_full == 7)
    assert len(hub.fleet()) == 5 and hub.fleet_full == 7
    kept = sorted(hub.fleet())
    # A kept agent's next (smaller) report is accepted: the budget bounds, it does not freeze.
    n = hub.reports
    agents[int(kept[0][4:6])].report(make_source(kept[0].split("/")[0]), **_big_state(10))
    wait_until(lambda: hub.reports > n)
    assert len(hub.fleet()[kept[0]][0].in_flight) == 10


def test_a_read_only_flood_does_not_starve_the_operator(
    hub: FleetHub, hub_address: str, keys_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]],
    tmp_path: Path, fleet_keys: dict[Role, KeyPaths],
) -> None:
    """Observation 5: 1,024 commands on P+2 at an agent that never answers fill only that
    connection's quota; the operator (and another read-only console) are still served. Every
    refusal is answered or, past the connection's reply queue, counted as lost."""
    mute = FakeAgent(ctx, hub_address)
    mute_src = make_source("eng-q", role="scheduler")
    mute.report(mute_src)
    real = start_agent(make_source("eng-r", role="scheduler"), address=hub_address)
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    fleet_keys["viewer"].client("viewer").apply(flood)
    flood.connect(hub.ports.commands)
    try:
        with FleetClient(hub_address, keys_dir=keys_dir) as op, FleetClient(hub_address) as ro:
            op.wait_for(2, 30)
            for i in range(1024):
                flood.send(encode(CommandRequest(
                    v=PROTOCOL_VERSION, seq=i + 1, request_id=f"f{i}", command="health",
                    targets=[mute_src.agent_id], timeout_ms=60_000,
                )))
            wait_until(lambda: hub.busy == 1024 - MAX_PENDING_PER_CONNECTION)
            (r,) = op.command("health", targets=[real.source.agent_id])
            (r2,) = ro.command("health", targets=[real.source.agent_id])
    finally:
        real.stop()
    assert r.ok and r.agent_id == real.source.agent_id
    assert r2.ok and r2.agent_id == real.source.agent_id
    assert hub.busy == 1024 - MAX_PENDING_PER_CONNECTION
    busy = 0
    while flood.poll(500):
        (frame,) = flood.recv_multipart()
        msg = decode(frame)
        assert isinstance(msg, CommandReply) and (msg.error or "").startswith("hub busy")
        busy += 1
    flood.close(linger=0)
    # Replies queue 64 deep per connection (kvpool_agent._hub_memory): a console that sends
    # without reading loses the rest, counted, instead of growing the hub.
    assert busy + hub.lost_replies == 1024 - MAX_PENDING_PER_CONNECTION
    assert busy >= COMMAND_SNDHWM
    # Refusals are counted, not audited: the audit files hold the two served commands (the
    # operator's, and the read-only console's in the read-only file).
    assert len((tmp_path / "audit.jsonl").read_text().splitlines()) == 1
    assert len((tmp_path / "audit.jsonl.readonly").read_text().splitlines()) == 1


@pytest.fixture
def forgetful_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths],
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetHub]:
    kp = fleet_keys["hub"]
    monkeypatch.setenv(AGENT_KEYS_ENV, str(fleet_keys["agent"].root))
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(fleet_keys["viewer"].root))
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, snapshot_interval_s=0.5,
                  forget_after_s=1.5) as h:
        yield h


def test_silent_agents_are_forgotten_and_consoles_drop_them(
    forgetful_hub: FleetHub, hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Observation 6: one fake report is not kept forever; a live agent is kept."""
    real = start_agent(make_source("eng-live", role="scheduler"), address=hub_address)
    fake = FakeAgent(ctx, hub_address)
    fake.report(make_source("ghost", role="scheduler"))
    try:
        with FleetClient(hub_address) as c:
            assert "ghost/scheduler" in c.wait_for(2, 30)
            deadline = time.monotonic() + 10
            while "ghost/scheduler" in c.fleet() and time.monotonic() < deadline:
                c.updates(100)
            fleet = c.fleet()
    finally:
        real.stop()
    assert sorted(fleet) == ["eng-live/scheduler"]
    assert "ghost/scheduler" not in forgetful_hub.fleet()
    assert forgetful_hub.forgotten == 1


def test_operator_forgets_an_engine_now(
    hub: FleetHub, hub_address: str, keys_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """``forget ENGINE`` drops every agent of the engine at once; without the key it is
    refused and nothing is dropped."""
    fake = FakeAgent(ctx, hub_address)
    fake.report(make_source("gone", role="scheduler"))
    fake.report(make_source("gone", tp=0))
    fake.report(make_source("kept", role="scheduler"))
    with FleetClient(hub_address) as viewer:
        viewer.wait_for(3, 30)
        (refused,) = viewer.command("forget", targets=["gone"])
        assert not refused.ok and refused.error == OPERATOR_ONLY.format(what="forget")
        assert len(hub.fleet()) == 3
        with FleetClient(hub_address, keys_dir=keys_dir) as op:
            (r,) = op.command("forget", targets=["gone"])
        assert r.ok and r.forgotten == ["gone/dp0.tp0.pp0", "gone/scheduler"]
        deadline = time.monotonic() + 10
        while len(viewer.fleet()) > 1 and time.monotonic() < deadline:
            viewer.updates(100)
        assert sorted(viewer.fleet()) == ["kept/scheduler"]
    assert sorted(hub.fleet()) == ["kept/scheduler"]


def test_the_audit_file_rotates_by_size(hub_address: str, tmp_path: Path) -> None:
    """A flood of audited commands cannot fill the disk: the file rotates at its size and
    only ``audit_backups`` older files are kept. Without keys every command comes on the
    read-only port: its file (``FILE.readonly``) rotates, the operator's file is not made."""
    audit = tmp_path / "audit.jsonl"
    with FleetHub(hub_address, audit_file=audit, audit_max_bytes=2_000, audit_backups=2) as hub:
        real = start_agent(make_source("eng-a", role="scheduler"), address=hub_address)
        try:
            with FleetClient(hub_address) as c:
                c.wait_for(1, 30)
                for _ in range(40):
                    (r,) = c.command("health")
                    assert r.ok
        finally:
            real.stop()
    assert hub.commands == 40
    files = sorted(p.name for p in tmp_path.glob("audit.jsonl*"))
    assert files == ["audit.jsonl.readonly", "audit.jsonl.readonly.1", "audit.jsonl.readonly.2"]
    for name in files:
        text = (tmp_path / name).read_text()
        assert 0 < len(text) <= 2_000
        assert all(json.loads(line)["command"] == "health" for line in text.splitlines())
