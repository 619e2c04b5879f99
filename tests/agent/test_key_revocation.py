"""A key revoked (its file removed) or rotated (another key renamed over its file) loses its
power on a connection opened before, from the moment the hub reads the change
(``kvpool_agent._hub_revocation``): its reports, replies and commands are refused and counted
against ``revoked:<its name>``, its agents are dropped (consoles told), no command is routed to
them, and its subscription stops receiving the fleet. Each attack of the round (a revoked key
read as a fleet-wide one) runs against a real keyed hub and asserts it had no effect; the
honest worker's ``flush --scope all`` removes the keys of a real ``mooncake_master``."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from agent_testlib import (
    Claimant,
    FakeAgent,
    assert_really_flushed,
    make_source,
    pool_keys,
    wait_until,
)

from kvpool_agent import FleetClient, FleetHub, KeyPaths, local_fleet_keys, start_agent
from kvpool_agent.auth import AllowList, Role, authorize_key, generate_keys
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    FleetUpdate,
    FlushArgs,
    decode,
    encode,
)
from kvpool_connector.keys import ParallelLayout, PoolKey
from kvpool_connector.operations import BackendOperations
from kvpool_replay import LocalMooncakeMaster

DIGEST = "0123456789ab"


def _agent_key(tmp_path: Path, hub: KeyPaths, name: str, *, engine: str | None = None
               ) -> KeyPaths:
    """A fresh agent key pair with the hub's ``hub.key``, authorized on ``hub`` (bound to
    ``engine`` when given)."""
    d = generate_keys(tmp_path / name, "agent")
    (d.root / "hub.key").write_bytes(hub.hub_public.read_bytes())
    authorize_key(hub.root, "agent", d.public("agent"), None if engine else name, engine)
    return d


@pytest.fixture
def own_keys(tmp_path: Path) -> dict[Role, KeyPaths]:
    """Every role's keys of this test alone (conftest's), without the fleet-wide agent key:
    every engine here has an engine-bound key."""
    keys = local_fleet_keys(tmp_path / "keys")
    (keys["hub"].authorized("agent") / "agent.key").unlink()
    return keys


def _revoke(hub: KeyPaths, role: Role, name: str, tmp_path: Path, how: str) -> KeyPaths | None:
    """Remove ``authorized_keys/ROLE/NAME.key`` (``revoke``), or rename a new key over it
    (``rotate``, ``kvpool-agent authorize``); returns the new key's pair."""
    f = hub.authorized(role) / f"{name}.key"
    if how == "revoke":
        f.unlink()
        return None
    new = generate_keys(tmp_path / f"{name}-new", role)
    (new.root / "hub.key").write_bytes(hub.hub_public.read_bytes())
    authorize_key(hub.root, role, new.public(role), name=name)
    return new


def _flush_all(address: str, operator: KeyPaths, dry_run: bool = False,
               timeout_ms: int = 15_000) -> list[CommandReply]:
    with FleetClient(address, keys_dir=operator.root) as op:
        return op.command("flush", flush=FlushArgs(scope="all", dry_run=dry_run),
                          timeout_ms=timeout_ms)


@pytest.fixture
def real_keys(mooncake_backend: Any, pool_buffer: ctypes.Array[ctypes.c_char],
              model: str) -> Iterator[list[str]]:
    """Six keys of ``model`` really stored in the agent tests' pool."""
    keys = [str(PoolKey(model, DIGEST, ParallelLayout(), f"{i:032x}")) for i in range(6)]
    codes = mooncake_backend.batch_put_from(
        keys, [[ctypes.addressof(pool_buffer)]] * len(keys), [[4096]] * len(keys))
    assert codes == [0] * len(keys)
    yield keys
    mooncake_backend.remove_by_scope(f"^kvpool@{model}", dry_run=False, force=True)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("how", ["revoke", "rotate"])
def test_a_revoked_agent_keys_open_connection_gets_no_power(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths], tmp_path: Path,
    mooncake_backend: Any, agent_master: LocalMooncakeMaster, model: str,
    real_keys: list[str], how: str,
) -> None:
    """The round's A1: an engine-bound key ``imp-0`` claims the real worker's pool at 4,242
    keys and answers every flush "removed 4242". The operator revokes it (or rotates it under
    its name). Its open connection's reports are then refused and counted against
    ``revoked:agent/imp-0.engine``, its agent is dropped, and as a key that binds nothing it
    registers no other engine (``someone-else``, nor any of 20 agent ids: it filled the fleet).
    ``flush --scope all`` goes to the real worker alone and really removes the pool's keys;
    the revoked connection receives nothing (read as fleet-wide, it ranked first). A second
    engine-bound key (``vouch``, reporting the master's true count) vouches for the pool, so it
    is not left out as one engine-bound key's alone, and lists it truly for the hub's check of
    the flush's answer. Rotated: the new key is admitted."""
    pool = agent_master.address
    hub_keys = own_keys["hub"]
    member = _agent_key(tmp_path, hub_keys, "real-0", engine="real-0")
    evil = _agent_key(tmp_path, hub_keys, "imp-0", engine="imp-0")
    vouch = _agent_key(tmp_path, hub_keys, "vouch-0", engine="vouch-0")
    src = make_source("real-0", model=model, master=pool, layout_digest=DIGEST)
    vsrc = make_source("vouch-0", model=model, master=pool, layout_digest=DIGEST)
    worker = start_agent(src, address=hub_address, pool_admin_url=agent_master.admin_url,
                         keys_dir=member.root, operations=BackendOperations(
                             mooncake_backend, src,
                             key_scope=(model, DIGEST, (ParallelLayout(),))))
    try:
        aid = worker.source.agent_id
        isrc = make_source("imp-0", model=model, master=pool, layout_digest=DIGEST)
        wait_until(lambda: aid in own_hub.fleet(), 60)
        with Claimant(hub_address, evil, isrc) as imp, Claimant(
                hub_address, vouch, vsrc, lambda: len(pool_keys(agent_master)),
                lambda: len(set(real_keys) & pool_keys(agent_master))) as voucher:
            wait_until(lambda: {aid, isrc.agent_id, vsrc.agent_id} <= set(own_hub.fleet()), 60)
            assert {aid, isrc.agent_id, vsrc.agent_id} <= set(own_hub.fleet())
            new = _revoke(hub_keys, "agent", "imp-0.engine", tmp_path, how)
            counted = "revoked:agent/imp-0.engine"
            wait_until(lambda: isrc.agent_id not in own_hub.fleet()
                       and own_hub.refused_by_key.get(counted, 0) >= 3, 60)
            assert isrc.agent_id not in own_hub.fleet(), own_hub.refused_by_key
            assert own_hub.refused_by_key.get(counted, 0) >= 3, own_hub.refused_by_key
            # Read as a key binding nothing it took any engine id and filled the fleet: now
            # every report is refused, whatever it names.
            others = [make_source("someone-else", model=model, master=pool)] + [
                make_source(f"flood-{i}", master=pool) for i in range(20)]
            for other in others:
                imp.src = other
                n = own_hub.refused_by_key.get(counted, 0)
                wait_until(lambda n=n: own_hub.refused_by_key.get(counted, 0) >= n + 2, 30)
            assert not {o.agent_id for o in others} & set(own_hub.fleet())
            imp.received.clear()
            voucher.received.clear()
            if new is not None:
                nsrc = make_source("imp-0", master="10.9.9.9:50051")
                with Claimant(hub_address, new, nsrc):
                    wait_until(lambda: nsrc.agent_id in own_hub.fleet(), 60)
                    assert nsrc.agent_id in own_hub.fleet()
                with FleetClient(hub_address, keys_dir=own_keys["operator"].root) as op:
                    op.command("forget", targets=[nsrc.agent_id], timeout_ms=10_000)
                assert nsrc.agent_id not in own_hub.fleet()  # its pool is not the one flushed
            wait_until(lambda: (st := own_hub.fleet().get(aid)) is not None
                       and st[0].pool is not None and st[0].pool.keys >= len(real_keys), 30)
            got = _flush_all(hub_address, own_keys["operator"])
            # The voucher lists the pool for the hub's check of the answer, no more.
            assert imp.received == [], imp.received
            assert all(c.flush is not None and c.flush.dry_run for c in voucher.received)
    finally:
        worker.stop()
    assert_really_flushed(got, aid, real_keys, agent_master)


def test_a_revoked_key_cannot_take_the_honest_engines_id(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The round's A1c: after its revocation the impostor's open connection claims engine
    ``real-0`` while the real engine restarts. Its reports are refused; the real engine's
    valid key registers ``real-0`` (no takeover refused of it), and a command reaches it."""
    hub_keys = own_keys["hub"]
    member = _agent_key(tmp_path, hub_keys, "real-0", engine="real-0")
    evil = _agent_key(tmp_path, hub_keys, "imp-0", engine="imp-0")
    isrc = make_source("imp-0", master="10.0.0.7:50051")
    with Claimant(hub_address, evil, isrc) as imp:
        wait_until(lambda: isrc.agent_id in own_hub.fleet(), 60)
        assert isrc.agent_id in own_hub.fleet()
        _revoke(hub_keys, "agent", "imp-0.engine", tmp_path, "revoke")
        wait_until(lambda: isrc.agent_id not in own_hub.fleet(), 60)
        assert isrc.agent_id not in own_hub.fleet()
        real = make_source("real-0", master="10.0.0.7:50051")
        imp.src = real
        counted = "revoked:agent/imp-0.engine"
        n = own_hub.refused_by_key.get(counted, 0)
        wait_until(lambda: own_hub.refused_by_key.get(counted, 0) >= n + 3, 30)
        assert real.agent_id not in own_hub.fleet()
        honest = FakeAgent(ctx, hub_address, keys=member.client("agent"))
        wait_until(lambda: honest.report(real, send_timeout_ms=200)
                   and real.agent_id in own_hub.fleet(), 60)
        assert real.agent_id in own_hub.fleet()
        assert "agent/real-0.engine" not in own_hub.refused_by_key, own_hub.refused_by_key
        with FleetClient(hub_address, keys_dir=own_keys["operator"].root) as op:
            asked: dict[str, list[CommandReply]] = {}
            t = threading.Thread(target=lambda: asked.setdefault(
                "r", op.command("health", targets=[real.agent_id], timeout_ms=30_000)))
            t.start()
            wait_until(lambda: honest.drain(100) != [], 30)
            for c in honest.received:
                honest.reply(c.request_id, real.agent_id)
            t.join()
        assert [(r.agent_id, r.ok) for r in asked["r"]] == [(real.agent_id, True)], asked
        assert imp.received == []


def test_a_revoked_viewer_keeps_no_stream_and_no_commands(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The round's A5: viewer ``eve`` holds a subscription and a command connection open; the
    operator revokes her key. Once the hub has seen it (her reconnection refused on P+1), her
    subscription receives no update about an agent that comes after (the honest viewer's
    does), and her dry run on the open command connection is refused, counted against
    ``revoked:viewer/eve``, and reaches no agent. Her dry run in flight at the revocation runs
    to its end and is audited, but she is answered refused."""
    hub_keys = own_keys["hub"]
    eve = generate_keys(tmp_path / "eve", "viewer")
    (eve.root / "hub.key").write_bytes(hub_keys.hub_public.read_bytes())
    authorize_key(hub_keys.root, "viewer", eve.public("viewer"), name="eve")
    subs = {}
    for who, keys in (("eve", eve), ("honest", own_keys["viewer"])):
        s = subs[who] = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        keys.client("viewer").apply(s)
        s.connect(own_hub.ports.pub)
    dealer = ctx.socket(zmq.DEALER)
    eve.client("viewer").apply(dealer)
    dealer.connect(own_hub.ports.commands)

    def ask(rid: str) -> None:
        dealer.send(encode(CommandRequest(
            v=PROTOCOL_VERSION, seq=1, request_id=rid, command="flush",
            flush=FlushArgs(scope="all", dry_run=True), timeout_ms=60_000)))

    ask("before")
    assert dealer.poll(30_000), "eve's command connection got no answer before revocation"
    dealer.recv_multipart()
    for s in subs.values():
        assert s.poll(30_000), "no snapshot before revocation"
    early = make_source("early-0", master="10.0.0.8:50051")
    authorize_key(hub_keys.root, "agent", own_keys["agent"].public("agent"), name="fw")
    agent = FakeAgent(ctx, hub_address, keys=own_keys["agent"].client("agent"))
    wait_until(lambda: agent.report(early, send_timeout_ms=200)
               and early.agent_id in own_hub.fleet(), 60)
    assert early.agent_id in own_hub.fleet()
    ask("inflight")  # reaches the agent, which answers only after the revocation
    wait_until(lambda: agent.drain(100) != [], 30)
    assert agent.received
    refused = own_hub.refused_connections.get("pub", 0)
    _revoke(hub_keys, "viewer", "eve", tmp_path, "revoke")
    wait_until(lambda: own_hub.refused_connections.get("pub", 0) > refused, 60)
    assert own_hub.refused_connections.get("pub", 0) > refused
    for c in agent.received:
        agent.reply(c.request_id, early.agent_id)
    assert dealer.poll(60_000), "eve's command in flight got no answer"
    withheld = [r for f in dealer.recv_multipart() if isinstance(r := decode(f), CommandReply)]
    assert [(r.request_id, r.agent_id, r.ok) for r in withheld] == [("inflight", "hub", False)]
    assert "no longer authorized" in (withheld[0].error or ""), withheld
    # It ran: audited in full, with the agent's answer.
    wait_until(lambda: "inflight" in _read(tmp_path / "audit.jsonl.readonly"), 30)
    assert early.agent_id in _read(tmp_path / "audit.jsonl.readonly")
    late = make_source("late-0", master="10.0.0.8:50051")
    wait_until(lambda: agent.report(late, send_timeout_ms=200)
               and late.agent_id in own_hub.fleet(), 60)

    def mentions(s: zmq.Socket[bytes], aid: str, timeout_ms: int) -> bool:
        while s.poll(timeout_ms):
            u = decode(s.recv_multipart()[-1])
            timeout_ms = 0
            if isinstance(u, FleetUpdate) and any(e.source.agent_id == aid for e in u.engines):
                return True
        return False

    seen: list[bool] = []
    wait_until(lambda: seen.append(mentions(subs["honest"], late.agent_id, 200)) or seen[-1],
               60)
    assert seen[-1], "the honest viewer never saw the late agent"
    assert not mentions(subs["eve"], late.agent_id, 0)
    sent = len(agent.drain(0))
    ask("after")
    assert dealer.poll(30_000), "eve's command got no answer"
    (frame,) = dealer.recv_multipart()
    (reply,) = [decode(frame)]
    assert isinstance(reply, CommandReply) and not reply.ok, reply
    assert reply.agent_id == "hub" and "no longer authorized" in (reply.error or ""), reply
    assert own_hub.refused_by_key.get("revoked:viewer/eve", 0) >= 1, own_hub.refused_by_key
    assert len(agent.drain(0)) == sent  # refused on its way in: no agent was asked


def test_the_allow_list_names_each_key_revoked_or_rotated_once(tmp_path: Path) -> None:
    """``AllowList.revoked`` (no sockets): a key rotated under its name at once after it was
    read (two changes of the directory, maybe within one tick of its clock) and a key removed
    are each returned once with the name they had; the new key is listed; a revoked key's
    ``former_name`` is its old name, and it is named nowhere."""
    hub = generate_keys(tmp_path / "hub", "hub")
    allow = AllowList(hub.authorized_dir, {"d": ("agent",), "v": ("viewer",)})
    a, b, c = (generate_keys(tmp_path / n, r) for n, r in (("a", "agent"), ("b", "agent"),
                                                           ("c", "viewer")))
    authorize_key(hub.root, "agent", a.public("agent"), engine="e0")
    authorize_key(hub.root, "viewer", c.public("viewer"), name="eve")
    pa, pc = (zmq.auth.load_certificate(str(k))[0] for k in (a.public("agent"),
                                                              c.public("viewer")))
    assert allow.name("d", pa) == "agent/e0.engine" and allow.name("v", pc) == "viewer/eve"
    assert allow.revoked() == []
    authorize_key(hub.root, "agent", b.public("agent"), engine="e0")  # rotated at once
    (hub.authorized("viewer") / "eve.key").unlink()
    assert sorted(allow.revoked()) == sorted([(pa, "agent/e0.engine"), (pc, "viewer/eve")])
    pb = zmq.auth.load_certificate(str(b.public("agent")))[0]
    assert allow.name("d", pb) == "agent/e0.engine" and allow.name("d", pa) is None
    assert allow.former_name(pa) == "agent/e0.engine" and allow.name("v", pc) is None
    assert allow.revoked() == []
