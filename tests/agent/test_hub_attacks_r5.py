"""Round 5 of the insider attacks on a keyed hub (issue 42's fixes): each test asserts the attack
has no effect; those that break today are ``xfail(strict=True)`` with the break in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq
from agent_testlib import FakeAgent, hub_process_of, make_source, wait_until

from kvpool_agent import FleetClient, FleetHub, KeyPaths
from kvpool_agent._fleet import MAX_AGENTS_PER_ENGINE
from kvpool_agent.auth import Role, authorize_key, generate_keys
from kvpool_agent.hub import hub_ports
from kvpool_agent.protocol import (
    FULL_RATE_TOPICS,
    MAX_TEXT_CHARS,
    PROTOCOL_VERSION,
    CommandReply,
    EngineState,
    FleetUpdate,
    FlushArgs,
    PinArgs,
    PinInfo,
    PinOutcome,
    PoolStats,
    Report,
    Source,
    encode,
)

_LIMIT_MB = 256

_SPLIT_MULTIPART = """
import sys, zmq
from kvpool_agent import KeyPaths
ctx = zmq.Context()
socks = []
for _ in range(int(sys.argv[3])):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.IMMEDIATE, 1)
    KeyPaths.of(sys.argv[1]).client("viewer").apply(s)
    s.connect(sys.argv[2])
    socks.append(s)
part = b"\\x00" * (2 * 2**20 - 1024)  # within the port's 2 MiB part limit, with CURVE
for s in socks:
    assert s.poll(30_000, zmq.POLLOUT)
for s in socks:  # 15 parts: ~30 MiB a connection, under 1/8 of the limit (32 MiB)
    for _ in range(14):
        s.send(part, zmq.SNDMORE, copy=False)
    s.send(part, copy=False)
print("sent", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def limited_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths],
                tmp_path: Path) -> Iterator[psutil.Process]:
    """The hub with ``--memory-limit-mb 256``."""
    yield from hub_process_of(hub_address, fleet_keys, tmp_path, "--memory-limit-mb",
                              str(_LIMIT_MB))


def test_a_multipart_flood_split_over_connections_leaves_the_hub_serving_the_operator(
    limited_hub: psutil.Process, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    tmp_path: Path,
) -> None:
    """One viewer key, 12 connections to the read-only port, each sending one message of 15
    parts of ~2 MiB (~30 MiB, under the 32 MiB a single connection must have sent to be dropped
    alone): the hub passes its 256 MiB limit with no connection heavy enough and rebuilds every
    port but the operator's. Whatever the hub sheds, the operator must still be answered
    afterwards and a console must get updates again. Measured before d279252: the rebuild's
    bind of the consoles' port failed ("Address already in use", libzmq's I/O thread stuck in
    a monitor event's send) and no one was answered again; after it, every port was still
    rebuilt for one viewer's messages. Now the hub drops the heaviest connections in order
    until they cover the growth (``ConnectionTable.shed``): the viewer's, no port rebuilt.
    A run beside two CPU burners still rebuilt every port (issue 42). Measured there: the
    guard judged the shed 0.25 s after it while libzmq was still reading what was on its way
    on the dropped connections (closed 0.06 to 0.59 s after the shed), and in one of 8 runs
    the RSS was then 38 MiB past the shed's, over 1/8 of the limit: the next shed was an
    escalation. Now it judges a shed once they are closed (``_memory_guard.RELEASE_S``)."""
    log = tmp_path / "hub.log"
    attacker = subprocess.Popen(
        [sys.executable, "-c", _SPLIT_MULTIPART, str(fleet_keys["viewer"].root),
         hub_ports(hub_address).commands, "12"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "sent"
        wait_until(lambda: "over the memory limit" in log.read_text(), 30)
        assert "over the memory limit" in log.read_text()
        time.sleep(2)  # the shed and the attacker's reconnections settle (not an outcome)
    finally:
        attacker.kill()
        attacker.wait()
    with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
        (r,) = op.command("forget", targets=["no-such-engine"], timeout_ms=2_000)
        assert r.agent_id == "hub" and "no agent or engine named" in (r.error or ""), r
        deadline = time.monotonic() + 30
        updates: list[FleetUpdate] = []
        while not (updates and op.hub_counters) and time.monotonic() < deadline:
            updates += op.updates(200)
        assert updates, "no fleet update reached a console after the shed"
        counters = dict(op.hub_counters)  # from the snapshot a new subscriber gets
    sheds = [ln for ln in log.read_text().splitlines() if "memory limit" in ln]
    assert counters.get("memory_sheds") == 0, (counters, sheds)  # no port rebuilt
    assert counters.get("connection_sheds", 0) >= 1, (counters, sheds)
    assert not [ln for ln in sheds if "is rebuilt" in ln], sheds


_MASTER = "127.0.0.1:50051"
_DIGEST = "0123456789ab"


def _bound_agent(tmp_path: Path, hub_keys: KeyPaths, engine: str) -> KeyPaths:
    """A fresh agent key bound to ``engine`` (``kvpool-agent authorize --engine``)."""
    d = generate_keys(tmp_path / engine, "agent")
    (d.root / "hub.key").write_bytes(hub_keys.hub_public.read_bytes())
    authorize_key(hub_keys.root, "agent", d.public("agent"), None, engine)
    return d


@pytest.fixture
def keyed_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths],
              tmp_path: Path) -> Iterator[FleetHub]:
    kp = fleet_keys["hub"]
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  snapshot_interval_s=1.0) as h:
        yield h


def _answer_pinned(agent: FakeAgent, agent_id: str) -> None:
    """``agent`` answers the commands it received (waiting for the first): "pinned 4 keys" of
    ``sys-prompt`` (true or not: the hub cannot tell until another key's worker reports)."""
    for req in agent.drain(10_000):  # returns at the first command (a loaded CI is slow)
        agent.seq += 1
        agent.sock.send(encode(CommandReply(
            v=PROTOCOL_VERSION, seq=agent.seq, request_id=req.request_id, agent_id=agent_id,
            ok=True, pins=PinOutcome(
                pin=PinInfo(pin_id="sys-prompt", model="m", layout_digest=_DIGEST, mode="soft",
                            ttl_ms=1_800_000, tokens=1024, keys=4, bytes=4096),
                pinned_now=4))))


def _layout_workers(hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths],
                    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]],
                    *engines: str) -> list[tuple[FakeAgent, Source]]:
    """A worker of each of ``engines`` (in this order, so the first holds the oldest tenure),
    each with a key bound to it, of one pool and layout, each reporting 500 keys and no pin."""
    out = []
    for engine in engines:
        agent = FakeAgent(ctx, hub_address, keys=_bound_agent(
            tmp_path, fleet_keys["hub"], engine).client("agent"))
        src = make_source(engine, master=_MASTER, model="m", layout_digest=_DIGEST)
        agent.report(src, pool=PoolStats(backend="mooncake", keys=500))
        wait_until(lambda src=src: src.agent_id in hub.fleet())
        out.append((agent, src))
    return out


def _pin_in_background(op: FleetClient, got: list[CommandReply]) -> threading.Thread:
    """The operator's ``pin`` of ``sys-prompt`` on its own thread; its replies go to ``got``."""
    t = threading.Thread(target=lambda: got.extend(op.command(
        "pin", pin=PinArgs(model="m", pin_id="sys-prompt", token_ids=list(range(1024))),
        timeout_ms=3_000)))
    t.start()
    return t


def test_a_bound_key_first_in_a_pool_cannot_pass_off_a_forged_pin_as_done(
    keyed_hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Every worker of the pool has a key bound to its engine and ``evil-0``'s is the oldest
    (tenure first come, docs/security.md): the operator's ``pin`` goes to it alone. The hub
    re-checks a real flush's answer against another key's count (a forged "removed N of N" is
    suspect) and took a pin's answer as it came, although every worker of the layout reports
    the pins it holds (``PoolStats.pins``): the forged "pinned 4 keys" was ok and not suspect
    while the real worker never received the pin and kept reporting 0 pins. Now the pin's
    answer waits for another key's worker of the layout to report it (``_answers``)."""
    (attacker, asrc), (honest, hsrc) = _layout_workers(
        keyed_hub, hub_address, fleet_keys, tmp_path, ctx, "evil-0", "real-0")
    got: list[CommandReply] = []
    with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
        t = _pin_in_background(op, got)
        _answer_pinned(attacker, asrc.agent_id)
        for _ in range(10):  # the honest worker keeps reporting: it holds no pin
            honest.report(hsrc, pool=PoolStats(backend="mooncake", keys=500, pins=0))
            time.sleep(0.1)
        t.join()
    assert [q.command for q in attacker.received] == ["pin"]  # tenure: the pin went to it
    (r,) = got
    honest_got = [q.command for q in honest.drain(0)]
    assert "pin" in honest_got or not r.ok or r.suspect is not None, (r, honest_got)


@pytest.mark.parametrize("late_s", [0, 7], ids=["at-once", "after-its-records-refresh"])
def test_a_pin_another_keys_worker_of_the_layout_reports_is_done(
    late_s: float, keyed_hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The honest side of the pin check above: the pin's agent answers "pinned" and the pool's
    other worker of the layout (another key) then reports the pin (``PoolStats.pins`` 0 -> 1):
    the answer is ok and not suspect. A real worker learns a pin when it next reads the pin
    records (every 10 s, ``Pins.refresh_s``) and measures the pool (every 2 s): here also 7 s
    after the answer. The hub held a pin's answer ``VERIFY_S`` (5 s) and then called it
    suspect, a genuine pin about every second time; now it waits ``PIN_VERIFY_S``."""
    (pinner, psrc), (other, osrc) = _layout_workers(
        keyed_hub, hub_address, fleet_keys, tmp_path, ctx, f"w-{late_s}a", f"w-{late_s}b")
    got: list[CommandReply] = []
    with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
        t = _pin_in_background(op, got)
        _answer_pinned(pinner, psrc.agent_id)
        answered = time.monotonic()
        # The other worker's reports before its records refresh: no pin yet (the agent's
        # 0.25 s report period, for ``late_s`` of its clock).
        while time.monotonic() < answered + late_s:
            other.report(osrc, pool=PoolStats(backend="mooncake", keys=500, pins=0))
            t.join(0.25)
        assert got == [], "the pin's answer was given before the other worker could report it"
        other.report(osrc, pool=PoolStats(backend="mooncake", keys=500, pins=1,
                                          pinned_bytes=4096))
        t.join()
    (r,) = got
    assert r.ok and r.suspect is None, r


def test_a_bound_keys_agent_ids_do_not_spend_the_operators_work_budget(
    keyed_hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A key bound to ``evil-0`` registers ``MAX_AGENTS_PER_ENGINE`` (1,024) agent ids of its
    engine from one connection (within its bounds); the fleet has one real worker. Each of
    the operator's ``health`` of every agent reached 1,025 ids and cost 64 of the operator's
    240 work units a minute (1/16 per agent id), though the 1,024 ids are one connection the
    hub queues 64 commands to. Measured: the 5th ``health --all`` and then the operator's
    ``flush --scope engine`` of the real engine and its ``forget`` were answered "hub busy:
    this key's engine work budget ... is spent" (the deficit refills at 4 units/s; a
    fleet-wide key's 16,384 ids would have cost 1,024 units per health, ~200 s of refusals).
    Now a command costs per connection reached (``_work_budget``): 2/16 unit each."""
    evil = _bound_agent(tmp_path, fleet_keys["hub"], "evil-0")
    attacker = FakeAgent(ctx, hub_address, keys=evil.client("agent"))
    honest = FakeAgent(ctx, hub_address, keys=fleet_keys["agent"].client("agent"))
    hsrc = make_source("real-0")
    honest.report(hsrc)
    base = make_source("evil-0")
    for i in range(MAX_AGENTS_PER_ENGINE):
        attacker.report(msgspec.structs.replace(base, agent_id=f"evil-0/a{i}"))
    wait_until(lambda: len(keyed_hub.fleet()) == MAX_AGENTS_PER_ENGINE + 1, 20)
    assert len(keyed_hub.fleet()) == MAX_AGENTS_PER_ENGINE + 1
    with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
        for _ in range(5):
            honest.report(hsrc)
            op.command("health", timeout_ms=300)
        honest.report(hsrc)
        flush = op.command("flush", flush=FlushArgs(scope="engine", engine_id="real-0"),
                           timeout_ms=300)
        forget = op.command("forget", targets=["no-such-engine"], timeout_ms=300)
    busy = [r.error for r in [*flush, *forget] if r.error and "hub busy" in r.error]
    assert busy == [], busy


_PADDED_AGENTS = 64
_PADDED_BYTES = 240 * 1024


def _padded(aid: str, size: int, round_no: int) -> EngineState:
    """A worker's state of about ``size`` encoded bytes (text in its layout)."""
    layout = {f"k{i:02d}": "A" * min(MAX_TEXT_CHARS, size - i * MAX_TEXT_CHARS)
              for i in range(64) if size > i * MAX_TEXT_CHARS}
    src = msgspec.structs.replace(make_source("big"), agent_id=aid, layout=layout)
    return EngineState(source=src, started_ms=1.0, ts_ms=float(round_no))


@pytest.fixture
def small_limit_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths],
                    tmp_path: Path) -> Iterator[psutil.Process]:
    """The hub with ``--memory-limit-mb 128``."""
    yield from hub_process_of(hub_address, fleet_keys, tmp_path, "--memory-limit-mb", "128")


def test_a_viewers_stalled_subscribers_never_get_an_agents_connection_dropped(
    small_limit_hub: psutil.Process, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The fleet's own agents (the fleet-wide key) report 64 states of ~240 KiB each round,
    within every bound; a viewer opens one more subscriber each round that never reads (each
    holds its 32 frames, ~12 MiB of this hub; connections per key are not capped). The hub
    passes its 128 MiB limit with the memory in the viewer's queues, yet the connection it
    dropped was the agents' (most bytes received since the RSS was last under 3/4 of the
    limit: the baselines froze while the viewer grew it), which freed nothing. Measured with
    a 256 MiB limit: the agents' connection dropped at 264 MiB ("171 MiB received since the
    RSS was calm"), then every port rebuilt at 293 MiB. Now bytes the hub read are no
    connection's weight: no connection holds the growth and the console port is rebuilt."""
    viewer = fleet_keys["viewer"]
    agents = FakeAgent(ctx, hub_address, keys=fleet_keys["agent"].client("agent"))
    agents.sock.setsockopt(zmq.SNDHWM, 2 * _PADDED_AGENTS)
    log = tmp_path / "hub.log"
    stalled: list[zmq.Socket[bytes]] = []
    for r in range(1, 25):
        s: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        viewer.client("viewer").apply(s)
        for topic in FULL_RATE_TOPICS:
            s.setsockopt(zmq.SUBSCRIBE, topic)
        s.connect(hub_ports(hub_address).pub)
        stalled.append(s)
        for i in range(_PADDED_AGENTS):
            agents.seq += 1
            if not agents.sock.poll(10_000, zmq.POLLOUT):
                break
            agents.sock.send(encode(Report(v=PROTOCOL_VERSION, seq=agents.seq, kind="snapshot",
                                           state=_padded(f"big/a{i:02d}", _PADDED_BYTES, r))))
        time.sleep(0.3)  # a delta goes out (0.25 s): the stalled queues fill, not an outcome
        if "over the memory limit" in log.read_text():
            break
    text = log.read_text()
    assert "over the memory limit" in text, "the viewer's subscribers never reached the limit"
    assert "on port agents" not in text, [ln for ln in text.splitlines() if "limit" in ln]


@pytest.fixture
def hub_process(hub_address: str, fleet_keys: dict[Role, KeyPaths],
                tmp_path: Path) -> Iterator[psutil.Process]:
    """The hub with its default memory limit."""
    yield from hub_process_of(hub_address, fleet_keys, tmp_path)


def _hub_cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def test_a_command_to_every_agent_costs_the_hub_linear_work(
    hub_process: psutil.Process, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A fleet-wide agent key registers 8,192 agent ids (8 engines of 1,024, within
    ``MAX_AGENTS``) from one connection that never reads; a viewer's ``snapshot`` of every
    agent (1/64 unit each: 128 of its 240) is answered with 64 timeouts and 8,128 "agent
    unreachable". ``CommandRouter._finish`` checks every reply as a flush answer and computes
    ``Fleet.pool_keys`` (a scan of every agent) for each target, whatever the command: the hub
    thread spent ~2 s of CPU on that one command (measured in-process: 0.15 s at 2,304
    agents, 0.55 s at 4,096, 14.8 s at 16,384, during which not even the operator's
    ``forget`` was answered: 67 s in that run). Now only a flush's answers are counted, in
    one scan. The hub's CPU for the command, less an idle window as long, must stay under
    1 s (2.1 s before the fix)."""
    agents = FakeAgent(ctx, hub_address, keys=fleet_keys["agent"].client("agent"))
    n = 8 * MAX_AGENTS_PER_ENGINE
    for i in range(n):
        engine = f"many-{i // MAX_AGENTS_PER_ENGINE}"
        agents.report(msgspec.structs.replace(make_source(engine), agent_id=f"{engine}/a{i}"))
    with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
        wait_until(lambda: len(viewer.fleet()) >= n, 60)
        assert len(viewer.fleet()) >= n
        idle0 = _hub_cpu_s(hub_process)
        time.sleep(8)  # an idle window to compare with (the hub publishes 8,192 states)
        idle = _hub_cpu_s(hub_process) - idle0
        cmd0, t0 = _hub_cpu_s(hub_process), time.monotonic()
        viewer.command("snapshot", timeout_ms=300)
        time.sleep(max(0.0, 8 - (time.monotonic() - t0)))  # the same window, with the command
        spent = _hub_cpu_s(hub_process) - cmd0 - idle
    assert spent < 1.0, f"one snapshot of {n} agents cost the hub {spent:.1f} s of CPU"


def test_a_viewers_unknown_subscription_leaves_the_hub_serving_the_operator(
    hub_process: psutil.Process, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """``kvpool-agent hub --keys`` with its defaults (``--memory-limit-mb 2048``: the hub
    monitors every port's connections, a626c25). A viewer subscribes to a topic the hub does
    not publish: the hub bans the key and rebuilds the console port (``_hub_updates``), closing
    the port's monitor before the socket; the socket's connections then close and libzmq's one
    I/O thread blocks for ever sending their events to the closed monitor. Measured: the
    operator's ``forget`` (answered by the hub itself) unanswered, no update reaches any
    console; with ``--memory-limit-mb 0`` (no connection events) the same subscription leaves
    the hub serving. One message of one viewer; no flood."""
    with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
        wait_until(lambda: op.updates(100) != [], 10)
        s: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        fleet_keys["viewer"].client("viewer").apply(s)
        s.setsockopt(zmq.SUBSCRIBE, b"no-such-topic")
        s.connect(hub_ports(hub_address).pub)
        # The subscription arrives and is counted: a snapshot after it says so (the port is
        # rebuilt in the same turn); a hub stuck in the rebuild sends none.
        wait_until(lambda: op.updates(100) is not None
                   and op.hub_counters.get("bad_messages", 0) >= 1, 10)
        (r,) = op.command("forget", targets=["no-such-engine"], timeout_ms=2_000)
        assert r.agent_id == "hub" and "no agent or engine named" in (r.error or ""), r
        deadline = time.monotonic() + 30
        updates: list[FleetUpdate] = []
        while not updates and time.monotonic() < deadline:
            updates = op.updates(200)
        assert updates, "no fleet update reached the operator's console after the rebuild"
        assert op.hub_counters.get("bad_messages", 0) >= 1, op.hub_counters
