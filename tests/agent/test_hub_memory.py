"""Issue 42's memory attacks on a keyed hub run as its own process (its RSS alone is measured):
stalled subscribers and a suspended console while an agent key reports at its engine budget,
and a multipart flood. Each asserts the hub stays under the bound ``kvpool_agent._hub_memory``
documents and still serves a console."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq
from agent_testlib import FakeAgent, make_source, wait_until

from kvpool_agent import FleetClient, KeyPaths
from kvpool_agent._fleet import MAX_ENGINE_STATE_BYTES
from kvpool_agent._hub_memory import PUB_SNDHWM, hub_memory_bound
from kvpool_agent.auth import Role
from kvpool_agent.protocol import (
    FULL_RATE_TOPICS,
    MAX_TEXT_CHARS,
    PROTOCOL_VERSION,
    EngineState,
    Report,
    encode,
)

_ENC = msgspec.msgpack.Encoder()
_AGENTS = 64
_STATE_BYTES = 240 * 1024
"""64 agents of ~240 KiB: 15 MiB a round, inside the engine's 16 MiB (issue 42's attack)."""

_SUSPENDED_CONSOLE = """
import sys
from kvpool_agent import FleetClient
with FleetClient(sys.argv[1], keys_dir=sys.argv[2]) as c:
    while not c.updates(100):
        pass
    print("ready", flush=True)
    while True:
        c.updates(100)
"""


@pytest.fixture
def hub_process(hub_address: str, fleet_keys: dict[Role, KeyPaths],
                tmp_path: Path) -> Iterator[psutil.Process]:
    """``kvpool-agent hub --keys`` as its own process, ready when a viewer gets a snapshot."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool_agent.cli", "hub", "--address", hub_address, "--keys",
         str(fleet_keys["hub"].root), "--metrics-port", "0", "--state-file",
         str(tmp_path / "state.json")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as c:
            wait_until(lambda: c.updates(100) != [], 30)
            assert c.last_update_ms > 0
        yield psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(10)


def _padded(aid: str, engine: str, size: int, round_no: int) -> EngineState:
    """A worker's state of about ``size`` encoded bytes (text in its layout), ``ts_ms`` the
    round it belongs to."""
    layout = {f"k{i:02d}": "A" * min(MAX_TEXT_CHARS, size - i * MAX_TEXT_CHARS)
              for i in range(64) if size > i * MAX_TEXT_CHARS}
    src = msgspec.structs.replace(make_source(engine), agent_id=aid, layout=layout)
    return EngineState(source=src, started_ms=1.0, ts_ms=float(round_no))


def _stalled_subscriber(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
                        keys: KeyPaths) -> zmq.Socket[bytes]:
    """A viewer that subscribes like a console and never reads: one frame on its side, a 4 KiB
    kernel buffer, so what it does not read stays in the hub."""
    s: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    keys.client("viewer").apply(s)
    for topic in FULL_RATE_TOPICS:
        s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(endpoint)
    return s


def test_stalled_subscribers_and_a_suspended_console_do_not_swell_the_hub(
    hub_process: psutil.Process, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Issue 42, attack 1: libzmq queued 1,000 update frames per subscriber (~2 MiB each under
    an agent key reporting at its budget): each stalled viewer held up to 1.86 GiB, a console
    suspended with Ctrl-Z 738 MiB in 50 s. Three viewers that never read, opened rounds apart
    (so they hold different frames), and a console stopped with SIGSTOP watch 32 rounds of
    64 agents x 240 KiB (~480 MiB of frames published). The hub's RSS after every round
    stays under its base plus ``hub_memory_bound`` for these connections, and a console that
    reads still gets every round."""
    base = hub_process.memory_info().rss
    viewer = fleet_keys["viewer"]
    console = subprocess.Popen(
        [sys.executable, "-c", _SUSPENDED_CONSOLE, hub_address, str(viewer.root)],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    attacker = FakeAgent(ctx, hub_address, keys=fleet_keys["agent"].client("agent"))
    attacker.sock.setsockopt(zmq.SNDHWM, 2 * _AGENTS)
    stalled: list[zmq.Socket[bytes]] = []
    rounds, peak = 32, base
    try:
        assert console.stdout is not None and console.stdout.readline() == "ready\n"
        with FleetClient(hub_address, keys_dir=viewer.root) as observer:
            for r in range(1, rounds + 1):
                if r in (1, 9, 17):
                    stalled.append(_stalled_subscriber(ctx, observer.ports.pub, viewer))
                if r == 5:
                    console.send_signal(signal.SIGSTOP)
                for i in range(_AGENTS):
                    st = _padded(f"atk/a{i:02d}", "atk", _STATE_BYTES, r)
                    attacker.seq += 1
                    assert attacker.sock.poll(30_000, zmq.POLLOUT)
                    attacker.sock.send(encode(Report(
                        v=PROTOCOL_VERSION, seq=attacker.seq, kind="snapshot", state=st)))

                def round_seen(r: int = r) -> bool:
                    f = observer.fleet()
                    return sum(1 for a, e in f.items()
                               if a.startswith("atk/") and e.state.ts_ms == r) == _AGENTS

                wait_until(round_seen, 60)
                assert round_seen(), f"round {r} did not reach a reading console"
                peak = max(peak, hub_process.memory_info().rss)
            fleet_bytes = sum(len(_ENC.encode(e.state)) for a, e in observer.fleet().items()
                              if a.startswith("atk/"))
    finally:
        console.send_signal(signal.SIGCONT)
        console.kill()
        console.wait()
    assert fleet_bytes <= MAX_ENGINE_STATE_BYTES
    # Subscribers: 3 stalled, the suspended console, the observer; agents: the attacker.
    bound = hub_memory_bound(subscribers=5, agent_connections=1, command_connections=0,
                             fleet_state_bytes=fleet_bytes)
    published = rounds * _AGENTS * _STATE_BYTES
    assert published > bound, "the attack must publish more than the bound to test it"
    grown = peak - base
    assert grown < bound, (f"hub RSS grew by {grown >> 20} MiB, bound {bound >> 20} MiB "
                           f"(PUB_SNDHWM={PUB_SNDHWM})")
