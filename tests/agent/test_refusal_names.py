"""Issue 42: the names of the keys the hub refused are an operator's to know. Consoles' updates
(P+1) are one broadcast to every subscriber, a viewer too, so they carry the total only
(``FleetUpdate.refused_total``); an operator key asks for the names on P+3 (``refusals``).
A real keyed hub, real ZMQ with CURVE keys of the test's own."""

from __future__ import annotations

import json
import time

import pytest
import zmq
from agent_testlib import wait_until

from kvpool_agent import FleetClient, FleetHub, KeyPaths
from kvpool_agent.auth import Role
from kvpool_agent.protocol import FleetUpdate, decode
from kvpool_console.cli import main as console_main


def _refuse_viewer(viewer: FleetClient, n: int) -> None:
    """``n`` operator-only commands from the viewer key: each refused by the hub and counted
    against ``viewer/viewer``."""
    for _ in range(n):
        (r,) = viewer.command("forget", targets=["nobody"])
        assert not r.ok and "operator key" in (r.error or ""), r


def _raw_frames(keys: KeyPaths, pub: str, until_total: int) -> list[bytes]:
    """Every frame a viewer-keyed SUB subscribed to everything (``b""``: every stream, as
    consoles before tiers subscribe) receives until a snapshot carries ``until_total``
    refusals (30 s at most)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    frames: list[bytes] = []
    try:
        sub = ctx.socket(zmq.SUB)
        keys.client("viewer").apply(sub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not sub.poll(200):
                continue
            frames.append(sub.recv())
            msg = decode(frames[-1]) if frames[-1][:1] != b"\xc1" else None
            if isinstance(msg, FleetUpdate) and msg.refused_total >= until_total:
                break
    finally:
        ctx.destroy(linger=0)
    return frames


def test_a_viewer_sees_the_refusals_total_and_an_operator_their_keys(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two refusals of the viewer key: every frame a viewer receives (subscribed to every
    stream) carries the total and no key's name; the viewer's ``refusals`` is refused and
    its ``status --json`` shows the total, no names; the operator's ``refusals`` and
    ``status --json`` name the key and its count."""
    with FleetClient(hub_address, keys_dir=own_keys["viewer"].root) as viewer:
        _refuse_viewer(viewer, 2)
        assert own_hub.refused_by_key == {"viewer/viewer": 2}
        frames = _raw_frames(own_keys["viewer"], own_hub.ports.pub, 2)
        assert frames and not any(b"viewer/viewer" in f for f in frames)
        last = decode(frames[-1])
        assert isinstance(last, FleetUpdate)
        assert (last.refused_total, last.refused_by_key) == (2, {})
        # The viewer's own refusals command is the third refusal, by its port and key.
        (r,) = viewer.command("refusals")
        assert not r.ok and r.refused_by_key == {} and "operator key" in (r.error or ""), r
        wait_until(lambda: viewer.updates(100) != [] and viewer.refused_total >= 3, 30)
        assert viewer.refused_total == 3 and viewer.refused_by_key == {}
        assert viewer.refused_names() == {}
    with FleetClient(hub_address, keys_dir=own_keys["operator"].root) as op:
        wait_until(lambda: op.updates(100) != [] and op.refused_total >= 3, 30)
        assert op.refused_by_key == {}  # the broadcast: the total only, for an operator too
        assert op.refused_names() == {"viewer/viewer": 3}
    shown: tuple[tuple[Role, dict[str, int]], ...] = (
        ("viewer", {}), ("operator", {"viewer/viewer": 3}))
    for role, names in shown:
        assert console_main(["status", "--json", "--hub", hub_address, "--keys",
                             str(own_keys[role].root)]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["refused_total"], doc["refused_by_key"]) == (3, names), role
    assert console_main(["status", "--hub", hub_address, "--keys",
                         str(own_keys["viewer"].root)]) == 0
    text = capsys.readouterr().out
    assert "hub refused keys 3 times" in text and "viewer/viewer" not in text
