"""Connections per key on a keyed hub's ports (issue 42: a viewer's stalled subscribers and
connection floods were uncapped; an agent key's connections on ``P`` were too): a key past its
cap gains nothing, another key's console or agent still works. ``KeyCaps`` itself is tested on
its counts."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import zmq
from agent_testlib import FakeAgent, free_port_block, make_source, wait_until

from kvpool_agent import FleetClient, FleetHub, KeyPaths
from kvpool_agent.auth import Role, authorize_key, generate_keys, local_fleet_keys
from kvpool_agent.key_caps import (
    ADMIT_WINDOW_S,
    MAX_CONNECTIONS_PER_KEY,
    MAX_SUBSCRIBERS_PER_KEY,
    KeyCaps,
    key_kind,
)
from kvpool_agent.protocol import (
    FULL_RATE_TOPICS,
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    decode,
    encode,
)


def _subscriber(ctx: zmq.Context[zmq.Socket[bytes]], hub: FleetHub,
                keys: KeyPaths, role: Role) -> zmq.Socket[bytes]:
    """A console's subscription on ``P+1`` with ``role``'s key, read by the test (or never)."""
    s: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    keys.client(role).apply(s)
    for topic in FULL_RATE_TOPICS:
        s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(hub.ports.pub)
    return s


def _frames(sock: zmq.Socket[bytes]) -> int:
    """Frames ``sock`` holds now (read and dropped)."""
    n = 0
    while sock.poll(0):
        sock.recv()
        n += 1
    return n


def _answered(console: FleetClient) -> None:
    """``console``'s command is answered by the hub (no agent: the hub's own answer)."""
    assert [(r.agent_id, r.error) for r in console.command("snapshot", timeout_ms=10_000)] == [
        ("hub", "no live agent connected to the hub")]


def test_a_keys_subscribers_past_its_cap_get_no_frame_and_are_counted(
    hub: FleetHub, fleet_keys: dict[Role, KeyPaths], ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A viewer key holds its ``MAX_SUBSCRIBERS_PER_KEY`` subscribers (each got a frame, then
    stalls) and opens 4 more: they are refused at the handshake, get no frame while an
    operator's console gets three snapshots, and each refusal is counted for the viewer key;
    when one of the held closes, exactly one of the 4 takes its place."""
    viewer = fleet_keys["viewer"]
    held = [_subscriber(ctx, hub, viewer, "viewer") for _ in range(MAX_SUBSCRIBERS_PER_KEY)]
    for s in held:
        assert s.poll(30_000), "a subscriber within the cap got no frame"
    extra = [_subscriber(ctx, hub, viewer, "viewer") for _ in range(4)]
    got = [0] * len(extra)
    with FleetClient(hub.address, keys_dir=fleet_keys["operator"].root) as console:

        def watch(updates: int, also: Callable[[], bool]) -> int:
            """Updates the console got while waiting for ``updates`` of them and ``also``;
            the extra subscribers' frames are added to ``got`` meanwhile."""
            seen = 0

            def done() -> bool:
                nonlocal seen
                seen += len(console.updates(50))
                for i, s in enumerate(extra):
                    got[i] += _frames(s)
                return seen >= updates and also()

            wait_until(done, 30)
            return seen

        assert watch(3, lambda: hub.counters.connections_over_cap >= len(extra)) >= 3
        assert got == [0] * len(extra), f"subscribers past the cap got frames: {got}"
        # Refused once each: libzmq does not retry a handshake the ZAP handler refused.
        assert hub.counters.connections_over_cap == len(extra)
        assert hub.refused_connections["pub"] == len(extra)
        assert hub.refused_by_key == {"viewer/viewer": len(extra)}
        _answered(console)

        # A place freed is taken by the next subscriber, and only one.
        held.pop().close(linger=0)
        # The place is free once the hub saw the close (its socket monitor), not before: a
        # subscriber connecting sooner is refused, and libzmq does not retry it.
        caps, z85 = hub._sockets.caps, viewer.client("viewer").public.decode()
        assert caps is not None
        wait_until(lambda: caps.held("pub", z85) == MAX_SUBSCRIBERS_PER_KEY - 1, 30)
        late = [_subscriber(ctx, hub, viewer, "viewer")]
        wait_until(lambda: hub.counters.connections_over_cap > len(extra) or late[0].poll(0))
        assert late[0].poll(30_000), "a subscriber in a freed place got no frame"
        late.append(_subscriber(ctx, hub, viewer, "viewer"))
        extra.append(late[1])
        got.append(0)
        assert watch(3, lambda: hub.counters.connections_over_cap > len(extra) - 1) >= 3
    assert got == [0] * len(extra), f"subscribers past the cap got frames: {got}"
    assert hub.counters.connections_over_cap == len(extra)


def test_a_keys_command_connections_past_its_cap_are_refused(
    hub: FleetHub, fleet_keys: dict[Role, KeyPaths], ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A viewer key holding ``MAX_CONNECTIONS_PER_KEY`` command connections on ``P+2`` (each
    answered once) opens one more: its command is never answered and the refusal is counted,
    while the operator's console is answered."""
    viewer = fleet_keys["viewer"].client("viewer")

    def dealer() -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        viewer.apply(s)
        s.connect(hub.ports.commands)
        return s

    def snapshot(s: zmq.Socket[bytes], n: int) -> None:
        s.send(encode(CommandRequest(v=PROTOCOL_VERSION, seq=n, request_id=f"cap-{n}",
                                     command="snapshot", targets=[], sender="cap test")))

    held = [dealer() for _ in range(MAX_CONNECTIONS_PER_KEY)]
    for n, s in enumerate(held):
        snapshot(s, n)
        assert s.poll(10_000), f"connection {n} within the cap got no answer"
        assert isinstance(decode(s.recv()), CommandReply)
    extra = dealer()
    snapshot(extra, 99)
    wait_until(lambda: hub.counters.connections_over_cap >= 1, 30)
    assert hub.counters.connections_over_cap == 1
    assert hub.refused_connections["commands"] == 1
    with FleetClient(hub.address, keys_dir=fleet_keys["operator"].root) as console:
        _answered(console)
    assert not extra.poll(0), "a connection past the cap was answered"


def test_key_caps_count_admitted_and_seen_connections_per_key_and_port() -> None:
    """``KeyCaps``: handshakes admitted count until their first message, a key's connections
    past the cap are refused at the handshake or, admitted in a burst, at their first
    message; a closed descriptor frees its place; another key and another port are apart."""
    caps = KeyCaps({"pub": {"console": 2}, "commands": {"console": 1}})
    assert [caps.admit("pub", "k", now=0.0) for _ in range(3)] == [True, True, False]
    assert caps.admit("pub", "other", now=0.0) and caps.admit("commands", "k", now=0.0)
    assert caps.seen("pub", 10, "k") and caps.seen("pub", 11, "k")
    assert caps.seen("pub", 10, "k"), "a connection's next message is no new connection"
    assert not caps.seen("pub", 12, "k"), "a third connection of a burst passed the cap"
    assert caps.held("pub", "k") == 2
    assert not caps.admit("pub", "k", now=1.0)
    caps.closed(11)
    assert caps.held("pub", "k") == 1
    assert caps.admit("pub", "k", now=1.0)
    # An admitted handshake that never sends stops counting after ADMIT_WINDOW_S.
    assert not caps.admit("pub", "k", now=2.0)
    assert caps.admit("pub", "k", now=1.0 + ADMIT_WINDOW_S)
    refusals = caps.drain_refusals()
    assert [(r.port, r.identity, r.cap, r.handshake) for r in refusals] == [
        ("pub", "k", 2, True), ("pub", "k", 2, False), ("pub", "k", 2, True),
        ("pub", "k", 2, True)]
    assert caps.drain_refusals() == []
    caps.closed_port("pub")
    assert caps.held("pub", "k") == 0
    assert KeyCaps({"pub": {"console": 0}}).admit("pub", "k"), "0 is no cap"


def test_an_agent_keys_cap_follows_its_kind() -> None:
    """An engine-bound agent key and a fleet-wide one are capped apart on ``P`` (a fleet-wide
    key holds every engine's connections); a console key's kind has no cap there."""
    assert (key_kind("agent/eng-0.engine"), key_kind("agent/fleet"),
            key_kind("viewer/alice")) == ("engine", "fleet", "console")
    caps = KeyCaps({"agents": {"engine": 1, "fleet": 2}})
    assert [caps.admit("agents", "b", "engine", now=0.0) for _ in range(2)] == [True, False]
    assert [caps.admit("agents", "f", "fleet", now=0.0) for _ in range(3)] == [True, True, False]
    assert caps.admit("agents", "c", "console", now=0.0)
    assert caps.seen("agents", 10, "b") and not caps.seen("agents", 11, "b")
    assert [(r.identity, r.cap) for r in caps.drain_refusals()] == [
        ("b", 1), ("f", 2), ("b", 1)]


def test_an_agent_keys_connections_past_its_cap_change_nothing_on_the_hub(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A borrowed engine-bound agent key (engine ``atk``, cap 4 for the test) holds its 4
    connections, each reporting one agent id, and opens 6 more over real CURVE sockets: they
    are refused at the handshake and report nothing; the hub keeps the same agents, the key
    holds 4 connections, each refusal is counted for that key; a fleet-wide key's 6
    connections (past the engine-bound cap: it is every engine's) still report."""
    keys = local_fleet_keys(tmp_path / "keys")
    attacker = generate_keys(tmp_path / "attacker", "agent", force=True)
    shutil.copyfile(keys["hub"].hub_public, attacker.hub_public)
    authorize_key(keys["hub"].root, "agent", attacker.public("agent"), engine="atk")
    atk, fleet = attacker.client("agent"), keys["agent"].client("agent")
    with FleetHub(f"tcp://127.0.0.1:{free_port_block()}",
                  authorized_keys_dir=keys["hub"].authorized_dir,
                  secret_key_file=keys["hub"].hub_secret, snapshot_interval_s=1.0,
                  max_agent_connections_per_key=4) as hub:
        victims = [FakeAgent(ctx, hub.address, fleet) for _ in range(6)]
        held = [FakeAgent(ctx, hub.address, atk) for _ in range(4)]
        for i, a in enumerate(victims):
            assert a.report(make_source("victim", tp=i))
        for i, a in enumerate(held):
            assert a.report(make_source("atk", tp=i))
        wait_until(lambda: len(hub.fleet()) == 10, 30)
        agents = set(hub.fleet())
        reports = hub.reports

        extra = [FakeAgent(ctx, hub.address, atk) for _ in range(6)]
        wait_until(lambda: hub.counters.connections_over_cap >= len(extra), 30)
        for i, a in enumerate(extra):  # queued by the DEALER at most, never reaches the hub
            a.report(make_source("atk", tp=4 + i), send_timeout_ms=0)
        # The victims still report, and are heard after the flood.
        for i, a in enumerate(victims):
            assert a.report(make_source("victim", tp=i))
        wait_until(lambda: hub.reports >= reports + len(victims), 30)

        assert set(hub.fleet()) == agents, "the hub's agents changed"
        assert hub.reports == reports + len(victims)
        assert hub._sockets.caps is not None
        z85 = atk.public.decode()
        assert hub._sockets.caps.held("agents", z85) == 4
        assert hub.counters.connections_over_cap == len(extra)
        assert hub.refused_connections["agents"] == len(extra)
        assert hub.refused_by_key == {"agent/atk.engine": len(extra)}
        assert (hub.fleet_full, hub.bad_messages, hub.takeover_refused) == (0, 0, 0)
