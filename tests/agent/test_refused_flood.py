"""Issue 42, leftover 1: refused CURVE handshakes in a tight loop. A flood of refused
handshakes from a key the hub does not list, on the agent and the operator port, leaves the
hub serving: counted per port, nothing registered, the operator's ``health`` and a
viewer's snapshot answered. A real keyed hub, real ZMQ with CURVE. (What the flood costs the
hub is measured, not asserted: ``bench/bench_refused_handshakes.py``, docs/security.md.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import zmq
import zmq.auth
from agent_testlib import make_source, wait_until
from zmq.utils.monitor import recv_monitor_message

from kvpool_agent import FleetClient, FleetHub, KeyPaths, start_agent
from kvpool_agent.auth import Role


@contextmanager
def _refused_flood(server_public: bytes, endpoints: list[str],
                   sockets: int = 16) -> Iterator[None]:
    """``sockets`` DEALERs with a key the hub does not list, spread over ``endpoints``, each
    connecting again as soon as its refusal is seen (libzmq does not reconnect after a ZAP
    refusal by itself), on a thread of their own while in the block."""
    stop = threading.Event()
    public, secret = zmq.curve_keypair()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    def run() -> None:
        poller = zmq.Poller()
        socks = {}
        for i in range(sockets):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = (
                server_public, public, secret)
            mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            s.connect(endpoints[i % len(endpoints)])
            socks[mon] = (s, endpoints[i % len(endpoints)])
            poller.register(mon, zmq.POLLIN)
        while not stop.is_set():
            for mon, _ in poller.poll(100):
                recv_monitor_message(mon)
                s, ep = socks[mon]
                s.disconnect(ep)
                s.connect(ep)
        for mon, (s, _) in socks.items():
            s.disable_monitor()
            mon.close(linger=0)
            s.close(linger=0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        ctx.destroy(linger=0)


def test_a_refused_handshake_flood_leaves_the_hub_serving(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths],
) -> None:
    """16 sockets of an unlisted key refused and reconnecting at once on the agent port and
    the operator port: every refusal is counted on its port, the key registers nothing and is
    refused nothing by name, and meanwhile the operator's ``health`` of a real agent and a new
    viewer's snapshot are answered."""
    server_public = zmq.auth.load_certificate(str(own_keys["hub"].hub_public))[0]
    agent = start_agent(make_source("real-0", role="scheduler"), address=hub_address,
                        keys_dir=own_keys["agent"].root)
    try:
        with FleetClient(hub_address, keys_dir=own_keys["operator"].root) as op:
            op.wait_for(1, 30)
            with _refused_flood(server_public, [own_hub.ports.agents, own_hub.ports.curve]):
                refused = own_hub.refused_connections
                wait_until(lambda: refused["agents"] >= 100 and refused["curve"] >= 100, 60)
                assert refused["agents"] >= 100 and refused["curve"] >= 100, refused
                for _ in range(5):
                    (r,) = op.command("health", targets=[agent.source.agent_id],
                                      timeout_ms=10_000)
                    assert r.ok and r.health is not None, r
                with FleetClient(hub_address, keys_dir=own_keys["viewer"].root) as viewer:
                    wait_until(lambda: viewer.updates(100) != [] and viewer.last_update_ms > 0)
                    assert list(viewer.wait_for(1, 30)) == [agent.source.agent_id]
                during = refused["agents"] + refused["curve"]
                wait_until(lambda: refused["agents"] + refused["curve"] >= during + 100, 60)
                assert refused["agents"] + refused["curve"] >= during + 100
    finally:
        agent.stop()
    assert list(own_hub.fleet()) == [agent.source.agent_id]
    assert own_hub.refused_by_key == {} and own_hub.bad_messages == 0
    assert (own_hub.refused_connections["pub"], own_hub.refused_connections["commands"]) == (
        0, 0)
