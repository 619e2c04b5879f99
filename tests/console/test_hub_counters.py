"""The hub's own counters shown to operators (issue 42): ``FleetUpdate.hub_counters`` in a
snapshot's first frame, read by ``FleetClient.hub_counters``, in ``status --json`` and on the
Pool tab. A real keyed hub, a real agent, a real bad message sent with an agent key."""

from __future__ import annotations

import json

import pytest
import zmq
from livefleet import LiveFleet, until
from textual.widgets import Static

from kvpool_agent import KeyPaths
from kvpool_agent._hub_counters import COUNTER_NAMES
from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import main as console_main
from kvpool_console.source import ClientSource


def _bad_message(fleet: LiveFleet) -> None:
    """One frame that is no report, from a connection holding a real agent key."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        KeyPaths.of(fleet.keys.root.parent / "agent").client("agent").apply(sock)
        sock.setsockopt(zmq.LINGER, 1_000)
        sock.connect(fleet.address)  # the agents' port
        sock.send(b"not a report")
    finally:
        ctx.destroy(linger=1_000)


async def test_status_and_pool_tab_show_the_hubs_counters(
        live_fleet: LiveFleet, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    live_fleet.add_engine("p0", "prefill", "kv_producer", tp=1)
    live_fleet.wait_agents(2)
    app = KVPoolConsole(ClientSource(live_fleet.address, pump=True), refresh_s=0.25)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("2")
        summary = app.query_one("#pool-summary", Static)
        await until(pilot, lambda: "reports; nothing shed or refused" in str(summary.render()),
                    "the hub's quiet counters on the Pool tab")
        _bad_message(live_fleet)
        await until(pilot, lambda: "bad messages 1" in str(summary.render()),
                    "the hub's counters on the Pool tab")
        line = str(summary.render()).splitlines()[-1]
        assert line.startswith("hub since start: ") and line.endswith(
            " reports; shed or refused: bad messages 1")
    assert console_main(["status", "--json", "--hub", live_fleet.address]) == 0
    counters = json.loads(capsys.readouterr().out)["hub_counters"]
    assert counters.keys() == set(COUNTER_NAMES)
    assert counters["bad_messages"] == 1 and counters["memory_sheds"] == 0
    assert counters["connection_sheds"] == 0
    assert 2 <= counters["reports"] <= live_fleet.hub.counters.reports
