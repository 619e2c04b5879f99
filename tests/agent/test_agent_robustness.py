"""Late joiners, several consoles, stale agents, sequence gaps, a hub that is not there, and
10,000 fuzzed frames: none of it crashes the agent or the hub, and all of it is counted."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from agent_testlib import env_keys, free_port_block, make_source

from kvpool_agent import AGENT_KEYS_ENV, FleetClient, FleetHub, NullReporter, start_agent
from kvpool_agent.auth import KeyPaths, Role
from kvpool_agent.hub import ENGINES_PER_UPDATE
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandRequest,
    EngineState,
    FleetUpdate,
    Report,
    SeqTracker,
    encode,
)

ROOT = Path(__file__).resolve().parents[2]


def _report(agent_id: str, seq: int, kind: str = "delta", v: int = PROTOCOL_VERSION) -> bytes:
    src = msgspec.structs.replace(make_source(), agent_id=agent_id, engine_id=agent_id)
    st = EngineState(source=src, started_ms=1.0, ts_ms=time.time() * 1e3)
    return encode(Report(v=v, seq=seq, kind=kind, state=st))  # type: ignore[arg-type]


@pytest.fixture
def dealer(hub: FleetHub) -> Iterator[zmq.Socket[bytes]]:
    """A raw agent-side socket connected to the hub, for hand-made frames."""
    ctx = zmq.Context()
    s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    keys = env_keys("agent")
    if keys is not None:
        keys.apply(s)
    s.connect(hub.ports.agents)
    yield s
    s.close(linger=0)
    ctx.term()


def _snapshots_until(c: FleetClient, n_agents: int, timeout_s: float = 30.0) -> list[FleetUpdate]:
    """The frames of the first snapshot ``c`` receives naming ``n_agents`` agents in all
    (polled: CI's load sets no pace). Agents' deltas may name them first."""
    got: list[FleetUpdate] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(u.engines) for u in got) < n_agents:
        assert time.monotonic() < deadline, f"snapshots heard: {got}"
        got += [u for u in c.updates(100) if u.kind == "snapshot"]
    return got


def test_late_and_concurrent_consoles_get_the_full_state_on_joining(
    hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A console that joins gets a snapshot of every agent at once, not at the hub's next
    periodic one: here the periodic snapshot is an hour away, so every snapshot the consoles
    hear is a join's."""
    kp = fleet_keys["hub"]
    monkeypatch.setenv(AGENT_KEYS_ENV, str(fleet_keys["agent"].root))
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(fleet_keys["viewer"].root))
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  snapshot_interval_s=3600.0) as hub:
        handles = [start_agent(make_source("eng-late", tp=i), address=hub_address)
                   for i in range(3)]
        try:
            for i, h in enumerate(handles):
                h.reporter.lookup(f"r{i}", 1000, 0, 100 * (i + 1), 1.0)
                h.reporter.loaded(f"r{i}", 100 * (i + 1))
            # The agents have reported before any console exists.
            ids = {h.source.agent_id for h in handles}
            deadline = time.monotonic() + 30
            while sorted(st.lookup.loaded_tokens for aid, (st, _) in hub.fleet().items()
                         if aid in ids) != [100, 200, 300]:
                assert time.monotonic() < deadline, "the agents' reports did not reach the hub"
                time.sleep(0.02)
            for _ in range(2):  # a console that starts, quits and starts again
                with FleetClient(hub_address) as a, FleetClient(hub_address) as b:
                    for c in (a, b):
                        (snap, *_) = _snapshots_until(c, 3)
                        hits = sorted(e.lookup.loaded_tokens for e in snap.engines)
                        assert hits == [100, 200, 300]
                    assert a.gaps.total_gaps == 0 and b.bad_messages == 0
        finally:
            for h in handles:
                h.stop()


def test_silent_agents_stay_listed_with_their_last_state(hub: FleetHub, hub_address: str) -> None:
    h = start_agent(make_source("eng-quiet"), address=hub_address)
    h.reporter.lookup("r", 512, 0, 256, 1.0)
    h.reporter.loaded("r", 256)
    aid = h.source.agent_id
    with FleetClient(hub_address) as c:
        c.wait_for(1, 30)
        h.stop()  # its last report carries the lookup recorded just before
        time.sleep(1.5)  # hub snapshots keep coming; this agent's last_seen does not move
        c.updates(1000)
        entry = c.fleet()[aid]
        assert entry.state.lookup.loaded_tokens == 256
        assert entry.age_s() >= 1.0
        assert aid in hub.fleet()


def test_sequence_gaps_are_detected_by_hub_and_console(
    hub: FleetHub, hub_address: str, dealer: zmq.Socket[bytes]
) -> None:
    for seq in (1, 2, 5, 6, 9):
        dealer.send(_report("gappy", seq, "snapshot" if seq == 1 else "delta"))
    with FleetClient(hub_address) as c:
        deadline = time.monotonic() + 30
        while c.fleet().get("gappy") is None or c.fleet()["gappy"].report_gaps < 4:
            assert time.monotonic() < deadline, c.fleet().get("gappy")
            c.updates(100)
    assert hub.gaps == 4 and hub.seq_tracker.gaps == {"gappy": 4}
    # A sender whose seq starts again from 1 restarted: not a gap.
    dealer.send(_report("gappy", 1, "snapshot"))
    deadline = time.monotonic() + 30
    while hub.seq_tracker.restarts < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert hub.gaps == 4


def test_console_detects_gaps_in_fleet_updates(hub_address: str) -> None:
    # A stand-in hub publisher that skips seq 3 and 4.
    c = FleetClient(hub_address)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind(c.ports.pub)
    try:
        assert pub.poll(3000), "the console never subscribed"
        pub.recv()
        for seq in (1, 2, 5):
            upd = FleetUpdate(v=PROTOCOL_VERSION, seq=seq, kind="delta", ts_ms=1.0, engines=[])
            pub.send(encode(upd))
        got = 0
        deadline = time.monotonic() + 30
        while got < 3 and time.monotonic() < deadline:
            got += len(c.updates(100))
        assert got == 3 and c.gaps.total_gaps == 2
    finally:
        c.close()
        pub.close(linger=0)
        ctx.term()


def test_seq_tracker_counts() -> None:
    t = SeqTracker()
    assert [t.observe("a", s) for s in (3, 4, 7, 8)] == [0, 0, 2, 0]
    assert t.observe("a", 1) == 0 and t.restarts == 1
    assert t.observe("b", 10) == 0 and t.total_gaps == 2


def test_no_hub_never_blocks_and_memory_stays_bounded(hub_address: str) -> None:
    # Nobody listens at hub_address: the agent drops and counts, the engine never waits.
    h = start_agent(make_source("eng-alone"), address=hub_address)
    try:
        rep = h.reporter
        n = 200_000
        t0 = time.perf_counter()
        for i in range(n):
            rep.transfer_progress("r", "load", i)
        per_event_us = (time.perf_counter() - t0) / n * 1e6
        assert per_event_us < 20, per_event_us
        assert rep.depth <= 65_536
        deadline = time.monotonic() + 30
        while h.counters["reports_dropped"] < 2:
            assert time.monotonic() < deadline, h.counters
            time.sleep(0.05)
        assert h.counters["sent"] == 0
        st = h.state()
        assert st.process.reports_dropped >= 2 and st.process.queue_depth == 0
        # A hub that appears later gets a snapshot at once (connect -> snapshot).
        with FleetHub(hub_address) as hub_late, FleetClient(hub_address) as c:
            fleet = c.wait_for(1, 30)
            assert h.source.agent_id in fleet
            assert fleet[h.source.agent_id].state.process.reports_dropped >= 2
            assert hub_late.reports >= 1
    finally:
        h.stop()


def test_without_an_address_the_agent_is_off_and_bad_addresses_never_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVPOOL_AGENT_ADDRESS", raising=False)
    off = start_agent(make_source("eng-off"))
    assert not off.enabled
    assert isinstance(off.reporter, NullReporter)
    off.reporter.lookup("r", 10, 0, 5, 1.0)
    assert (off.reporter.depth, off.reporter.dropped, off.reporter.drain()) == (0, 0, [])
    off.stop()
    bad = start_agent(make_source("eng-bad"), address="not an address")
    assert not bad.enabled
    bad.stop()
    monkeypatch.setenv("KVPOOL_AGENT_ADDRESS", "tcp://127.0.0.1:1")
    env = start_agent(make_source("eng-env"))
    assert env.enabled
    env.stop()


def test_a_failed_start_leaves_no_zmq_context_for_the_garbage_collector() -> None:
    # A context collected as garbage can be finalised before its sockets and then waits for
    # them forever: the failed start must close its own (a fresh interpreter, so a hang is a
    # timeout here rather than a stuck test session).
    code = (
        "import gc, logging\n"
        "logging.disable(logging.CRITICAL)\n"
        "from kvpool_agent import start_agent\n"
        "from agent_testlib import make_source\n"
        "h = start_agent(make_source('eng-bad'), address='not an address')\n"
        "assert not h.enabled\n"
        "gc.collect()\n"
        "print('collected')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests/agent")])}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "collected", out.stderr


def test_large_fleet_snapshot_spans_several_updates(
    hub: FleetHub, hub_address: str, dealer: zmq.Socket[bytes]
) -> None:
    n = 2 * ENGINES_PER_UPDATE + 44
    for i in range(n):
        dealer.send(_report(f"bulk-{i:04d}", 1, "snapshot"))
    deadline = time.monotonic() + 30
    while len(hub.fleet()) < n:
        assert time.monotonic() < deadline, f"the hub holds {len(hub.fleet())} of {n}"
        time.sleep(0.02)
    with FleetClient(hub_address) as c:
        frames = _snapshots_until(c, n)
        assert len(c.fleet()) == n
    # The agents reported once: only snapshots name them, ENGINES_PER_UPDATE at most a frame.
    sizes = [len(u.engines) for u in frames]
    assert max(sizes) == ENGINES_PER_UPDATE and sum(sizes) >= n, sizes


def _fuzz_frames(n: int, rng: random.Random) -> list[list[bytes]]:
    valid = _report("fuzz-target", 1, "snapshot")
    cmd = encode(CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="x", command="snapshot"))
    frames: list[list[bytes]] = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            frames.append([rng.randbytes(rng.randint(0, 300))])
        elif kind == 1:
            src = valid if i % 2 else cmd
            frames.append([src[: rng.randint(0, len(src) - 1)]])
        elif kind == 2:
            bad_version = rng.choice([0, PROTOCOL_VERSION + 1, 99, -1])
            frames.append([_report("fuzz-target", 1, v=bad_version)])
        elif kind == 3:
            # Valid msgpack of the wrong shape, or two frames where one is expected.
            frames.append([msgspec.msgpack.encode({"type": "report", "v": 1, "seq": "x"})])
            if i % 10 == 3:
                frames[-1] = [valid, valid]
        else:
            frames.append([msgspec.msgpack.encode(rng.random())])
    for i in range(0, n, n // 5):
        # Large garbage, within every port's bound: read and counted (a frame over the bound
        # is refused by libzmq, which drops the connection: test_hub_budgets).
        frames[i] = [b"\x00" * (1024 * 1024)]
    return frames


def _send_all(sock: zmq.Socket[bytes], frames: list[list[bytes]], prefix: list[bytes]) -> None:
    for f in frames:
        while True:
            try:
                sock.send_multipart([*prefix, *f], zmq.NOBLOCK)
                break
            except zmq.Again:
                time.sleep(0.001)


def test_ten_thousand_fuzzed_frames_are_counted_and_harmless(
    hub: FleetHub, hub_address: str, dealer: zmq.Socket[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(1234)
    n = 10_000
    # Hub, agent port and plain command port: 10,000 frames each.
    _send_all(dealer, _fuzz_frames(n, rng), [])
    ctx = zmq.Context()
    console = ctx.socket(zmq.DEALER)
    viewer = env_keys("viewer")
    assert viewer is not None
    viewer.apply(console)
    console.connect(hub.ports.commands)
    _send_all(console, _fuzz_frames(n, rng), [])
    deadline = time.monotonic() + 30
    while hub.bad_messages < 2 * n:
        assert time.monotonic() < deadline, hub.bad_messages
        time.sleep(0.05)
    assert hub.bad_messages == 2 * n and hub.reports == 0

    # The agent: a stand-in hub ROUTER sends it 10,000 fuzzed frames.
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    agent_keys = os.environ[AGENT_KEYS_ENV]
    monkeypatch.delenv(AGENT_KEYS_ENV)  # the stand-in hub is plain
    h = start_agent(make_source("eng-fuzz"), address=f"tcp://127.0.0.1:{port}")
    try:
        assert router.poll(5000)
        rid, _ = router.recv_multipart()
        _send_all(router, _fuzz_frames(n, rng), [rid])
        deadline = time.monotonic() + 30
        while h.counters["bad_messages"] < n:
            assert time.monotonic() < deadline, h.counters
            time.sleep(0.05)
        assert h.counters["bad_messages"] == n
        # Still alive: it answers a real command and keeps reporting its real state.
        h.reporter.lookup("after-fuzz", 100, 0, 50, 1.0)
        h.reporter.loaded("after-fuzz", 50)
        req = CommandRequest(v=PROTOCOL_VERSION, seq=2, request_id="ok?", command="snapshot")
        router.send_multipart([rid, encode(req)])
        deadline = time.monotonic() + 30
        while True:
            assert router.poll(int(max(0.0, deadline - time.monotonic()) * 1000))
            _, frame = router.recv_multipart()
            msg = msgspec.msgpack.decode(frame)
            if msg.get("type") == "reply":
                assert msg["ok"] and msg["snapshot"]["process"]["bad_messages"] == n
                assert msg["snapshot"]["lookup"]["loaded_tokens"] == 50
                break
    finally:
        h.stop()
        router.close(linger=0)
        console.close(linger=0)
        ctx.term()
    # The hub still serves real agents and consoles after its own 20,000.
    monkeypatch.setenv(AGENT_KEYS_ENV, agent_keys)
    real = start_agent(make_source("eng-after"), address=hub_address)
    try:
        with FleetClient(hub_address) as c:
            assert real.source.agent_id in c.wait_for(1, 30)
            (r,) = c.command("snapshot", targets=[real.source.agent_id])
            assert r.ok
    finally:
        real.stop()


def test_hub_restart_agents_and_console_reconnect(hub_address: str) -> None:
    h = start_agent(make_source("eng-restart"), address=hub_address)
    try:
        h.reporter.lookup("r", 1000, 0, 400, 1.0)
        h.reporter.loaded("r", 400)
        with FleetHub(hub_address, snapshot_interval_s=30.0) as first:
            with FleetClient(hub_address) as c:
                assert h.source.agent_id in c.wait_for(1, 30)
            assert first.reports >= 1
        # The hub is gone: the agent drops and counts, then a new hub on the same address
        # gets a snapshot at reconnect (the hub's periodic snapshots are an hour away).
        time.sleep(0.5)
        h.reporter.lookup("r2", 1000, 0, 600, 1.0)
        h.reporter.loaded("r2", 600)
        with FleetHub(hub_address, snapshot_interval_s=3600.0) as second, FleetClient(
            hub_address
        ) as c:
            fleet = c.wait_for(1, 30)
            st = fleet[h.source.agent_id].state
            assert st.lookup.loaded_tokens == 1000 and st.lookup.lookups == 2
            assert second.fleet()[h.source.agent_id][0].lookup.lookups == 2
    finally:
        h.stop()


@pytest.mark.parametrize("taken", [0, 1, 2])
def test_hub_port_in_use_is_a_clear_error_not_a_hang(taken: int) -> None:
    """Every one of the hub's ports, the XPUB one included, fails start() with the address."""
    base = free_port_block(4)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + taken))
        blocker.listen()
        t0 = time.monotonic()
        with pytest.raises(zmq.ZMQError, match=f"cannot bind tcp://127.0.0.1:{base + taken}"):
            FleetHub(f"tcp://127.0.0.1:{base}").start()
        assert time.monotonic() - t0 < 5
