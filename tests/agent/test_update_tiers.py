"""The hub's slower update tiers (``protocol.tier_topic``): a tier subscriber gets every
agent's latest state with nothing lost between its ticks, a subscriber of
``FULL_RATE_TOPICS`` gets the full-rate stream and never a tier's frames, and what one
subscriber sends (forged unsubscriptions, messages that are no subscription) changes no other
one's stream. Real hub with CURVE keys on every port, real sockets."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from agent_testlib import env_keys, make_source, wait_until

from kvpool_agent import FleetClient, FleetHub, KeyPaths
from kvpool_agent._fleet import ENGINES_PER_UPDATE, FULL_RATE, Fleet
from kvpool_agent.auth import Role
from kvpool_agent.hub import hub_ports
from kvpool_agent.protocol import (
    FULL_RATE_TOPICS,
    PROTOCOL_VERSION,
    EngineState,
    FleetUpdate,
    ProtocolError,
    Report,
    decode,
    encode,
    split_frame,
    tier_of,
    tier_topic,
)


def _report(agent_id: str, seq: int) -> Report:
    src = msgspec.structs.replace(make_source(), agent_id=agent_id, engine_id=agent_id)
    return Report(v=PROTOCOL_VERSION, seq=seq, kind="snapshot" if seq == 1 else "delta",
                  state=EngineState(source=src, started_ms=1.0, ts_ms=float(seq)))


@pytest.fixture
def quiet_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetHub]:
    """A keyed hub whose periodic snapshot never comes during a test: what a subscriber gets
    after its join snapshot comes from deltas only."""
    kp = fleet_keys["hub"]
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(fleet_keys["viewer"].root))
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  snapshot_interval_s=3600.0) as h:
        yield h


@pytest.fixture
def agent(quiet_hub: FleetHub, ctx: zmq.Context[zmq.Socket[bytes]],
          fleet_keys: dict[Role, KeyPaths]) -> zmq.Socket[bytes]:
    s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    fleet_keys["agent"].client("agent").apply(s)
    s.connect(quiet_hub.ports.agents)
    return s


def _sub(ctx: zmq.Context[zmq.Socket[bytes]], hub: FleetHub,
         *topics: bytes) -> zmq.Socket[bytes]:
    """A raw SUB with the viewer key, subscribed to ``topics``."""
    s: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    keys = env_keys("viewer")
    assert keys is not None
    keys.apply(s)
    for topic in topics:
        s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(hub.ports.pub)
    return s


def _drain(s: zmq.Socket[bytes], out: list[list[bytes]]) -> list[list[bytes]]:
    while s.poll(0):
        out.append(s.recv_multipart())
    return out


def test_fleet_keeps_a_dirty_set_per_stream() -> None:
    # The full-rate stream taking its delta must not take the tier's: the tier's next delta
    # still holds every agent that reported since the tier's previous update.
    fleet = Fleet()
    fleet.add_stream(1000)
    for i in range(3):
        assert fleet.accept(b"r%d" % i, _report(f"a{i}", 1)) is None
    full = fleet.updates("delta", 1, {})
    assert [s.source.agent_id for u in full for s in u.engines] == ["a0", "a1", "a2"]
    assert not fleet.changed_for(FULL_RATE) and fleet.changed_for(1000)
    assert fleet.accept(b"r0", _report("a0", 2)) is None
    assert fleet.forget(["a2"]) == ["a2"]
    tier = fleet.updates("delta", 1, {}, stream=1000)
    assert [(s.source.agent_id, s.ts_ms) for u in tier for s in u.engines] == [
        ("a0", 2.0), ("a1", 1.0)]
    assert tier[0].forgotten == ["a2"]
    assert fleet.changed_for(FULL_RATE) and not fleet.changed_for(1000)
    # A snapshot is an update of every stream.
    fleet.updates("snapshot", 2, {})
    assert not fleet.changed_for(FULL_RATE) and not fleet.changed_for(1000)


def test_a_multi_frame_update_marks_all_but_its_last_frame_more() -> None:
    # A console redraws once the last frame of an update is merged, never half a batch.
    fleet = Fleet()
    for i in range(2 * ENGINES_PER_UPDATE + 1):
        assert fleet.accept(b"r%d" % i, _report(f"m{i:04d}", 1)) is None
    frames = fleet.updates("snapshot", 7, {})
    assert [(u.seq, len(u.engines), u.more) for u in frames] == [
        (7, ENGINES_PER_UPDATE, True), (8, ENGINES_PER_UPDATE, True), (9, 1, False)]
    assert [u.more for u in fleet.updates("delta", 10, {})] == [False]  # nothing changed


def test_tier_subscriber_gets_every_latest_state_from_deltas_and_full_rate_no_tier_frame(
    quiet_hub: FleetHub, agent: zmq.Socket[bytes], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    old = _sub(ctx, quiet_hub, *FULL_RATE_TOPICS)
    raw_tier = _sub(ctx, quiet_hub, tier_topic(1000))
    tier = FleetClient(quiet_hub.address, every_ms=1000)
    old_frames: list[list[bytes]] = []
    tier_frames: list[list[bytes]] = []
    try:
        # Join snapshots first (the hub sends one to every stream on each subscription).
        wait_until(lambda: len(_drain(old, old_frames)) >= 1
                   and len(_drain(raw_tier, tier_frames)) >= 1)
        assert old_frames and tier_frames
        # Joins within a delta interval share one snapshot, a later join's comes up to an
        # interval later: take them all before the deltas under test.
        while any(u.kind == "snapshot" for u in tier.updates(750)):
            pass
        # Agents report in two rounds: the full-rate stream publishes each round in its own
        # delta (and so clears its dirty set) before the next round is sent.
        last: dict[str, int] = {}
        for rnd, ids in enumerate([[f"t{i}" for i in range(5)], [f"t{i}" for i in range(3, 8)]]):
            for aid in ids:
                last[aid] = last.get(aid, 0) + 1
                agent.send(encode(_report(aid, last[aid])))
            want = dict(last)

            def old_has(want: dict[str, int] = want) -> bool:
                _drain(old, old_frames)
                got = {s.source.agent_id: int(s.ts_ms) for f in old_frames
                       for s in decode(f[0]).engines}  # type: ignore[union-attr]
                return all(got.get(a) == n for a, n in want.items())

            wait_until(old_has)
            assert old_has(), f"round {rnd}: the full-rate subscriber missed reports"
        fleet: dict[str, float] = {}

        def tier_has_all() -> bool:
            for u in tier.updates(100):
                assert u.kind == "delta", "only deltas after the join snapshot"
            fleet.update({k: e.state.ts_ms for k, e in tier.fleet().items()})
            return all(fleet.get(a) == float(n) for a, n in last.items())

        wait_until(tier_has_all)
        assert {a: fleet.get(a) for a in last} == {a: float(n) for a, n in last.items()}
        assert tier.gaps.total_gaps == 0 and tier.bad_messages == 0
        # Frame shapes: the full-rate subscriber only FleetUpdates, the tier one frame each of
        # its topic then a FleetUpdate, numbered without gaps.
        _drain(old, old_frames)
        _drain(raw_tier, tier_frames)
        assert all(len(f) == 1 and isinstance(decode(f[0]), FleetUpdate) for f in old_frames)
        tiers = [split_frame(f[0]) for f in tier_frames]
        assert all(len(f) == 1 for f in tier_frames)
        assert all(topic is not None and tier_of(topic) == 1000 for topic, _ in tiers)
        seqs = [decode(payload).seq for _, payload in tiers]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    finally:
        tier.close()


def test_full_rate_stream_starts_with_its_first_subscriber(
    quiet_hub: FleetHub, agent: zmq.Socket[bytes], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    # Watched by tier consoles only, the hub encodes no full-rate update: the first b""
    # subscriber's stream starts at its join snapshot, numbered 1.
    with FleetClient(quiet_hub.address, every_ms=1000) as tier:
        for seq in (1, 2):
            agent.send(encode(_report("fr", seq)))
            wait_until(lambda seq=seq: tier.fleet().get("fr") is not None
                       and tier.fleet()["fr"].state.ts_ms == seq)
            assert tier.fleet()["fr"].state.ts_ms == seq
        old = _sub(ctx, quiet_hub, b"")
        assert old.poll(10_000), "no join snapshot for the b\"\" subscriber"
        first = decode(old.recv())
        assert isinstance(first, FleetUpdate) and first.kind == "snapshot" and first.seq == 1
        assert [s.source.agent_id for s in first.engines] == ["fr"]


def test_a_console_from_before_tiers_skips_tier_frames_and_counts_no_false_gap(
    quiet_hub: FleetHub, agent: zmq.Socket[bytes], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    # A b"" subscriber that reads one frame at a time and decodes each (the client before
    # tiers) gets a tier's frames too: none of them decodes, so none is merged or counted in
    # the full-rate stream's sequence.
    with FleetClient(quiet_hub.address, every_ms=500) as tier:
        old = _sub(ctx, quiet_hub, b"")
        # The b"" subscription is live once its own join snapshot arrives (a tier frame sent
        # earlier may come first); only the tier deltas sent after that are sure to reach it.
        frames: list[bytes] = []
        while True:
            assert old.poll(10_000), "no join snapshot for the b\"\" subscriber"
            frames.append(old.recv())
            if split_frame(frames[-1])[0] is None:
                break
        for seq in range(1, 4):
            agent.send(encode(_report("ob", seq)))
            wait_until(lambda seq=seq: tier.fleet().get("ob") is not None
                       and tier.fleet()["ob"].state.ts_ms == seq)
        while old.poll(1_000):
            frames.append(old.recv())
        plain, refused = [], 0
        for f in frames:
            try:
                msg = decode(f)
            except ProtocolError:
                refused += 1
                assert split_frame(f)[0] == tier_topic(500)
                continue
            assert isinstance(msg, FleetUpdate)
            plain.append(msg.seq)
        assert refused >= 3  # at least one tier delta per report
        assert plain == list(range(1, len(plain) + 1)) and plain


def test_forged_unsubscriptions_stop_no_stream(
    quiet_hub: FleetHub, agent: zmq.Socket[bytes], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    # Any subscriber may send unsubscribe messages for topics it never held: the hub applies
    # them to that connection only, so the others keep their streams.
    old = FleetClient(quiet_hub.address)
    tier = FleetClient(quiet_hub.address, every_ms=500)
    forger: zmq.Socket[bytes] = ctx.socket(zmq.XSUB)
    forger.setsockopt(zmq.LINGER, 0)
    keys = env_keys("viewer")
    assert keys is not None
    keys.apply(forger)
    forger.connect(quiet_hub.ports.pub)
    try:
        wait_until(lambda: old.updates(50) is not None and tier.updates(50) is not None
                   and old.last_update_ms > 0 and tier.last_update_ms > 0)
        # Connected once its own subscription is answered (a join snapshot on tier 2000).
        forger.send(b"\x01" + tier_topic(2000))
        assert forger.poll(10_000), "the hub never answered the forger's subscription"
        while forger.poll(0):
            forger.recv_multipart()
        for topic in (b"", tier_topic(500), tier_topic(1000), b"\x8a"):
            forger.send(b"\x00" + topic)
        # The hub reads one connection's messages in order: once this subscription is
        # answered too, the forged ones were applied.
        forger.send(b"\x00" + tier_topic(2000))
        forger.send(b"\x01" + tier_topic(2000))
        assert forger.poll(10_000), "the hub never answered the forger's subscription"
        agent.send(encode(_report("after-forgery", 1)))
        wait_until(lambda: "after-forgery" in old.fleet() and "after-forgery" in tier.fleet())
        assert "after-forgery" in old.fleet() and "after-forgery" in tier.fleet()
    finally:
        old.close()
        tier.close()


def test_switching_tier_gets_a_snapshot_on_the_new_stream(
    quiet_hub: FleetHub, agent: zmq.Socket[bytes]
) -> None:
    agent.send(encode(_report("sw", 1)))
    wait_until(lambda: "sw" in quiet_hub.fleet())
    with FleetClient(quiet_hub.address, every_ms=2000) as c:
        wait_until(lambda: "sw" in c.fleet())
        c.set_every_ms(500)
        wait_until(lambda: any(u.kind == "snapshot" for u in c.updates(50)))
        assert c.every_ms == 500 and "sw" in c.fleet()
        assert f"hub:{tier_topic(500).hex()}" in c.gaps.last
        with pytest.raises(ValueError, match="update tier 750 ms"):
            c.set_every_ms(750)


def test_a_subscriber_sending_non_subscriptions_cannot_take_another_consoles_subscription(
    quiet_hub: FleetHub, agent: zmq.Socket[bytes], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    # An XSUB may send messages that are no subscription. Under XPUB_MANUAL, libzmq paired the
    # hub's SUBSCRIBE with the connection of the next queued subscription after each one: a
    # viewer flooding them around consoles' joins took their subscriptions for itself and
    # left them blind for good. Each console must get its stream whatever another sends.
    attacker: zmq.Socket[bytes] = ctx.socket(zmq.XSUB)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.setsockopt(zmq.SNDHWM, 0)
    keys = env_keys("viewer")
    assert keys is not None
    keys.apply(attacker)
    attacker.connect(quiet_hub.ports.pub)
    attacker.send(b"\x01" + tier_topic(2000))
    assert attacker.poll(10_000), "the hub never answered the attacker's subscription"
    burst = 50_000

    def flood() -> None:
        for _ in range(burst):
            attacker.send(b"\x02")
            attacker.send(b"\x01" + tier_topic(2000))

    flood()
    victims = [FleetClient(quiet_hub.address) for _ in range(3)]
    victims += [FleetClient(quiet_hub.address, every_ms=ms) for ms in (500, 1000)]
    try:
        flood()
        wait_until(lambda: quiet_hub.bad_messages >= 2 * burst, timeout_s=60.0)
        assert quiet_hub.bad_messages == 2 * burst, "the hub never read the whole flood"
        agent.send(encode(_report("after-flood", 1)))
        wait_until(lambda: all("after-flood" in v.fleet() for v in victims))
        assert ["after-flood" in v.fleet() for v in victims] == [True] * len(victims)
        for v in victims:
            v.updates(100)
            assert v.bad_messages == 0 and v.gaps.total_gaps == 0
            # The full-rate consoles got no tier frame, the tier ones only their own tier's.
            want = {"hub"} if v.every_ms is None else {f"hub:{tier_topic(v.every_ms).hex()}"}
            assert set(v.gaps.last) == want
    finally:
        for v in victims:
            v.close()


def test_a_subscription_flood_gets_no_more_than_one_snapshot_per_delta_interval(
    quiet_hub: FleetHub, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    # Each subscription asks for a join snapshot, which goes to every subscriber. Before, a
    # viewer repeating its subscription made the hub encode and send the whole fleet to every
    # console once per loop turn (~one per subscription); now joins share one snapshot per
    # delta interval, and a console joining during the flood still gets its snapshot.
    observer = FleetClient(quiet_hub.address)
    flooder = _sub(ctx, quiet_hub, tier_topic(2000))
    try:
        wait_until(lambda: any(u.kind == "snapshot" for u in observer.updates(50)))
        start = time.monotonic()
        for _ in range(400):
            flooder.setsockopt(zmq.SUBSCRIBE, tier_topic(2000))
            time.sleep(0.002)
        late = FleetClient(quiet_hub.address)
        try:
            wait_until(lambda: late.updates(50) != [])
            assert late.last_update_ms > 0, "a console joining during the flood got nothing"
        finally:
            late.close()
        snapshots = sum(u.kind == "snapshot" for u in observer.updates(100))
        allowed = (time.monotonic() - start) / quiet_hub.delta_interval_s + 2
        assert snapshots <= allowed, f"{snapshots} snapshots, {allowed:.0f} allowed"
    finally:
        observer.close()


def test_switching_back_to_a_stream_counts_no_gap_for_its_frames_while_away(
    quiet_hub: FleetHub, agent: zmq.Socket[bytes]
) -> None:
    # Each stream numbers its frames on its own, also while a console is subscribed to
    # another one. Before, switching back compared the stream's next seq with the last one
    # seen before leaving and counted every frame sent meanwhile as lost.
    with FleetClient(quiet_hub.address, every_ms=500) as c:
        for every_ms, aid in ((1000, "away-1"), (500, "back-1"), (None, "away-2"),
                              (500, "back-2"), (None, "back-3")):
            c.set_every_ms(every_ms)
            wait_until(lambda: any(u.kind == "snapshot" for u in c.updates(50)))
            # An update of every stream, the one left included.
            agent.send(encode(_report(aid, 1)))
            wait_until(lambda aid=aid: aid in c.fleet())
            assert aid in c.fleet()
        assert c.gaps.total_gaps == 0, c.gaps.gaps


def _earlier_release_hub_frame(agent_id: str, seq: int) -> bytes:
    """A ``FleetUpdate`` snapshot as a hub of an earlier release publishes it: one frame, no
    topic (the full-rate stream is all such a hub has)."""
    src = msgspec.structs.replace(make_source(), agent_id=agent_id, engine_id=agent_id)
    return encode(FleetUpdate(v=PROTOCOL_VERSION, seq=seq, kind="snapshot", ts_ms=float(seq),
                              engines=[EngineState(source=src, started_ms=1.0, ts_ms=1.0)]))


def test_a_tier_subscriber_falls_back_to_full_rate_on_a_hub_without_tiers(
    hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hub from before tiers (git 2be666c) publishes plain frames only: a console asking for
    # a tier saw no agent at all, then every engine DOWN with a critical "hung" alert each.
    monkeypatch.delenv("KVPOOL_KEYS_DIR", raising=False)
    pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(hub_ports(hub_address).pub)
    seq = itertools.count(1)
    with FleetClient(hub_address, every_ms=1000, tier_fallback_s=3600.0) as c:
        for _ in range(20):
            pub.send(_earlier_release_hub_frame("old-1", next(seq)))
            c.updates(20)
        assert c.fleet() == {} and not c.tiers_missing  # still within the fallback window
        c.tier_fallback_s = 0.0

        def fed() -> bool:
            pub.send(_earlier_release_hub_frame("old-1", next(seq)))
            return "old-1" in c.fleet()

        wait_until(fed)
        assert c.tiers_missing and c.every_ms == 1000 and "old-1" in c.fleet()
        # A tier switch keeps the full-rate stream while the hub still has no tiers.
        c.set_every_ms(2000)
        assert c.tiers_missing and set(FULL_RATE_TOPICS) < c._subscribed()
        c.set_every_ms(None)
        assert not c.tiers_missing and c._subscribed() == set(FULL_RATE_TOPICS)


def test_a_tier_fallback_ends_once_the_hub_sends_the_tier(
    hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A console started before its hub (or while it restarts) falls back at once here
    # (tier_fallback_s=0); the tier snapshot of this release's hub, once it is up, ends it.
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(fleet_keys["viewer"].root))
    with FleetClient(hub_address, every_ms=1000, tier_fallback_s=0.0) as c:
        c.updates(0)
        assert c.tiers_missing and set(FULL_RATE_TOPICS) < c._subscribed()
        kp = fleet_keys["hub"]
        with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                      secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                      snapshot_interval_s=3600.0) as hub:
            s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            fleet_keys["agent"].client("agent").apply(s)
            s.connect(hub.ports.agents)
            s.send(encode(_report("fb", 1)))
            wait_until(lambda: "fb" in c.fleet() and not c.tiers_missing)
            assert not c.tiers_missing and "fb" in c.fleet()
            assert c._subscribed() == {tier_topic(1000)}
            assert c.gaps.total_gaps == 0, c.gaps.gaps
