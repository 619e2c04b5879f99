"""Pin and unpin from the TUI (``N``, ``u``), driven with Textual's Pilot: the console (operator
key) -> a real hub over ZMQ+CURVE -> the agent of a simulated engine's real ``KVPoolConnector``
worker -> its ``Pins`` over a real mooncake_master and store. A pin made in the dialog is what
``kvpool-console pins`` lists, with its token count; unpin drops it and its values; bad input is
one line in the dialog and nothing reaches the hub; a viewer-key console pins nothing."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from livefleet import until
from textual.pilot import Pilot
from textual.widgets import Button, Input, RichLog, Select, Static

from kvpool_agent import FleetClient, FleetHub, local_fleet_keys
from kvpool_agent.protocol import CommandReply, PinArgs
from kvpool_connector.keys import chunk_hashes
from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import main as console_main
from kvpool_console.screens import PinScreen, UnpinScreen
from kvpool_console.source import ClientSource
from kvpool_console.widgets import FleetTable
from kvpool_replay import (
    EngineSpec,
    LocalMooncakeMaster,
    LocalPoolStore,
    ModelShape,
    TraceRequest,
    free_port,
    free_port_block,
    mooncake_extra_config,
    request_tokens,
)

CHUNK = 64
SHAPE = ModelShape(layers=2, kv_heads=2, head_size=64, block_size=16)
SHARES = SHAPE.kv_heads
"""Values per chunk: one per KV head."""
ENGINE = "pin-tui"


@dataclass
class Fleet:
    hub: FleetHub
    engine: Any
    model: str
    operator: Path
    viewer: Path
    audit: Path
    runs: int = 0

    def save(self, hash_ids: list[int]) -> list[int]:
        """Replay a prompt of ``hash_ids`` (a chunk each) until the pool holds every chunk;
        returns its whole chunks' token ids."""
        ids = tokens(hash_ids)
        deadline = time.monotonic() + 30
        while self.held(ids) < len(hash_ids):
            self.runs += 1
            req = TraceRequest(0, len(hash_ids) * CHUNK + 1, 1, [*hash_ids, 10**9 + self.runs])
            self.engine.run_request(self.runs, req)
            assert time.monotonic() < deadline, f"{hash_ids} never saved whole"
        return ids

    def held(self, ids: list[int]) -> int:
        """Leading chunks of ``ids`` the pool holds (the worker's own lookup)."""
        return int(self.engine.worker.pool_worker.lookup_chunks(chunk_hashes(ids, CHUNK)))

    def pin_audits(self) -> int:
        """The hub's audit lines of ``pin`` and ``unpin``, on either port."""
        n = 0
        for path in (self.audit, Path(f"{self.audit}.readonly")):
            if path.exists():
                n += sum(json.loads(x).get("command") in ("pin", "unpin")
                         for x in path.read_text().splitlines())
        return n


def tokens(hash_ids: list[int]) -> list[int]:
    return request_tokens((hash_ids, len(hash_ids) * CHUNK))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from kvpool_replay._sim_engine import SimEngine

    work = tmp_path_factory.mktemp("tui-pins")
    keys = local_fleet_keys(work / "keys")
    address = f"tcp://127.0.0.1:{free_port_block()}"
    kp = keys["hub"]
    # A short lease: every lookup leases its chunks, and an unpin waits leases out.
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=500) as master, \
            LocalPoolStore(master, 32 << 20), FleetHub(
                address, authorized_keys_dir=kp.authorized_dir, secret_key_file=kp.hub_secret,
                audit_file=work / "audit.jsonl", snapshot_interval_s=1.0,
                delta_interval_s=0.1) as hub:
        model = f"org/tui-pins-{uuid.uuid4().hex[:8]}"
        extra = {**mooncake_extra_config(master.address, master.admin_url, lease_ttl_ms=500),
                 "agent_keys": str(keys["agent"].root)}
        # A leased key is tried again this long after the refusal (kvpool_connector._removals):
        # short, so an unpin outlasts the 500 ms lease within its wait.
        extra["mooncake"]["transfer_timeout_ms"] = 2_000
        spec = EngineSpec(engine_id=ENGINE, master_address=master.address, model=model,
                          shape=SHAPE, chunk_size=CHUNK, trace_path="unused", wait_saves=True,
                          agent_address=address, lookup_rpc_port=free_port(),
                          extra_config=extra)
        engine = SimEngine(spec, num_blocks=128)
        try:
            yield Fleet(hub, engine, model, keys["operator"].root, keys["viewer"].root,
                        work / "audit.jsonl")
        finally:
            engine.close()


def pins(f: Fleet, capsys: pytest.CaptureFixture[str]) -> list[tuple[str, str, int, int]]:
    """``kvpool-console pins --model M --json`` (viewer key): (id, mode, tokens, keys) of
    every pin."""
    capsys.readouterr()
    rc = console_main(["pins", "--model", f.model, "--hub", f.hub.address, "--keys",
                       str(f.viewer), "--wait", "10", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [(p["pin_id"], p["mode"], p["tokens"], p["keys"]) for p in json.loads(out)["pins"]]


async def held_pins(f: Fleet) -> list[tuple[str, str, int, int]]:
    """What ``pins`` (viewer key) answers while the app runs (it holds stdout, so not the
    CLI): (id, mode, tokens, keys) of every pin."""
    def ask() -> list[CommandReply]:
        with FleetClient(f.hub.address, keys_dir=f.viewer) as c:
            return c.command("pins", pin=PinArgs(model=f.model))

    replies = await asyncio.to_thread(ask)
    assert replies and all(r.ok for r in replies), replies
    return [(p.pin_id, p.mode, p.tokens, p.keys)
            for r in replies if r.pins is not None for p in r.pins.pins]


def _status(screen: PinScreen | UnpinScreen) -> str:
    return str(screen.query_one(".pin-status", Static).content)


def _events(app: KVPoolConsole) -> str:
    log = app.query_one("#events-log", RichLog)
    return "\n".join(line.text for line in log.lines)


async def _click(pilot: Pilot[None], screen: PinScreen | UnpinScreen, button: str) -> None:
    """Click ``button`` once it takes clicks: a button ignores clicks for 0.2 s after one
    (while it shows itself pressed)."""
    b = screen.query_one(button, Button)
    await until(pilot, lambda: not b.has_class("-active"), f"{button} released")
    await pilot.click(button)


async def _refused(pilot: Pilot[None], screen: PinScreen | UnpinScreen, button: str,
                   line: str) -> None:
    """Press ``button``: the dialog shows ``line`` and sends nothing."""
    screen.query_one(".pin-status", Static).update("")
    await _click(pilot, screen, button)
    await until(pilot, lambda: _status(screen) != "", f"{button} answered")
    assert _status(screen) == line
    assert screen.sent is None


async def _open(pilot: Pilot[None], app: KVPoolConsole, key: str) -> None:
    """Select the engine's row once its worker reported its layout (the pin dialog takes the
    model's chunk size from it; the row shows with the scheduler's first report), press
    ``key``."""
    table = app.query_one(FleetTable)
    await until(pilot, lambda: f"e:{ENGINE}" in table.rows, "the engine's row", 20)

    def layout_known() -> bool:
        return any(s.source.engine_id == ENGINE and s.source.process_role == "worker"
                   and s.source.layout.get("chunk_size")
                   for s in app.source.fleet()[0].values())

    await until(pilot, layout_known, "the engine's worker layout", 20)
    table.focus()
    table.move_cursor(row=table.get_row_index(f"e:{ENGINE}"))
    await pilot.press(key)


async def test_pin_and_unpin_from_the_tui(fleet: Fleet, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    ids = fleet.save([1, 2])  # 2 chunks in the pool before the pin
    app = KVPoolConsole(ClientSource(fleet.hub.address, keys_dir=str(fleet.operator), pump=True),
                        refresh_s=0.25)
    async with app.run_test(size=(140, 40)) as pilot:
        await _open(pilot, app, "N")
        await until(pilot, lambda: isinstance(app.screen, PinScreen), "the pin dialog")
        screen = app.screen
        assert isinstance(screen, PinScreen) and screen.model == fleet.model
        audits = fleet.pin_audits()
        # Bad input: one line naming the field, nothing sent.
        await _refused(pilot, screen, "#pin-go", "token ids: no token ids; give them "
                       "comma-separated, e.g. 1,15043,29892")
        screen.query_one("#pin-prefix", Input).value = "1,x"
        await _refused(pilot, screen, "#pin-go", "token ids: '1,x' is not comma-separated "
                       "integers; e.g. 1,15043,29892")
        screen.query_one("#pin-prefix", Input).value = "1,2"
        screen.query_one("#pin-ttl", Input).value = "0"
        await _refused(pilot, screen, "#pin-go", "TTL (s): 0 s; give 0 < S <= 86400 "
                       "(Mooncake's max_kv_soft_pin_ttl)")
        screen.query_one("#pin-ttl", Input).value = "ten"
        await _refused(pilot, screen, "#pin-go", "TTL (s): 'ten' is not a number of seconds; "
                       "e.g. 1800")
        screen.query_one("#pin-ttl", Input).value = "600"
        # Fewer token ids than a chunk: refused here (it was the agents' ValueError).
        await _refused(pilot, screen, "#pin-go", f"token ids: 2 tokens hold no whole chunk of "
                       f"{CHUNK} (the model's chunk_size): give at least {CHUNK} token ids")
        assert screen.sent is None
        # A prefix of 2 whole chunks and 5 tokens more: the whole chunks are pinned.
        screen.query_one("#pin-prefix", Input).value = ",".join(map(str, [*ids, 7, 7, 7, 7, 7]))
        screen.query_one("#pin-ttl", Input).value = "600"
        screen.query_one("#pin-id", Input).value = "system"
        await _click(pilot, screen, "#pin-go")
        await until(pilot, lambda: screen.replies is not None, "the pin's answer", 30)
        status = _status(screen)
        assert (f"pinned 'system' of {fleet.model} layout " in status
                and f"soft, TTL 600 s: {2 * CHUNK} tokens, {2 * SHARES} keys" in status
                and f"{2 * SHARES} in the pool now, 0 pinned when saved" in status), status
        assert fleet.pin_audits() == audits + 1  # the bad inputs never reached the hub
        assert any("pinned 'system'" in str(n.message) for n in app._notifications)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, PinScreen), "dialog closed")
        assert await held_pins(fleet) == [("system", "soft", 2 * CHUNK, 2 * SHARES)]

        # A hard pin of text is refused by this engine (no tokenizer): its line, in place.
        await _open(pilot, app, "N")
        await until(pilot, lambda: isinstance(app.screen, PinScreen), "the pin dialog 2")
        screen = app.screen
        assert isinstance(screen, PinScreen)
        screen.query_one("#pin-what", Select).value = "text"
        screen.query_one("#pin-mode", Select).value = "hard"
        await pilot.pause()
        assert screen.query_one("#pin-ttl", Input).disabled
        screen.query_one("#pin-prefix", Input).value = "You are a helpful assistant."
        await _click(pilot, screen, "#pin-go")
        await until(pilot, lambda: screen.replies is not None, "the text pin's answer", 30)
        assert screen.sent is not None and screen.sent.mode == "hard"
        assert _status(screen).startswith(f"pin failed on {ENGINE}/dp0.tp0.pp0: CommandError: "
                                          f"agent {ENGINE}/dp0.tp0.pp0 has no tokenizer")
        await pilot.press("escape")
        assert await held_pins(fleet) == [("system", "soft", 2 * CHUNK, 2 * SHARES)]

        # Unpin: an empty id is refused in place, then the pin and its values go.
        await until(pilot, lambda: not isinstance(app.screen, PinScreen), "dialog closed 2")
        await _open(pilot, app, "u")
        await until(pilot, lambda: isinstance(app.screen, UnpinScreen), "the unpin dialog")
        unpin = app.screen
        assert isinstance(unpin, UnpinScreen)
        await _refused(pilot, unpin, "#unpin-go", "pin id: empty; give the pin's name (see pins)")
        assert unpin.sent is None
        unpin.query_one("#unpin-id", Input).value = "system"
        await _click(pilot, unpin, "#unpin-go")
        await until(pilot, lambda: unpin.replies is not None, "the unpin's answer", 40)
        status = _status(unpin)
        assert (f"unpinned 'system' of {fleet.model}" in status
                and f"{2 * SHARES} of {2 * SHARES} keys removed" in status), status
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, UnpinScreen), "dialog closed 3")
        await pilot.press("3")  # the Events tab: its log renders once it has a size
        logged = [f"pin 'system' of {fleet.model} requested", f"pinned 'system' of {fleet.model}",
                  f"unpin 'system' of {fleet.model} requested",
                  f"unpinned 'system' of {fleet.model}"]
        await until(pilot, lambda: all(x in _events(app) for x in logged),
                    "the pin and unpin in the events log")
    assert pins(fleet, capsys) == []
    assert fleet.held(ids) == 0


async def test_a_viewer_console_pins_nothing(fleet: Fleet, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    ids = fleet.save([31, 32])
    src = ClientSource(fleet.hub.address, keys_dir=str(fleet.viewer), pump=True)
    assert not src.can_flush
    app = KVPoolConsole(src, refresh_s=0.25)
    audits = fleet.pin_audits()
    async with app.run_test(size=(140, 40)) as pilot:
        await _open(pilot, app, "N")
        await pilot.pause(0.3)
        assert not isinstance(app.screen, PinScreen)  # the key is disabled
        assert app.check_action("pin", ()) is None and app.check_action("unpin", ()) is None
        app.action_pin()  # what the command palette entry runs: says why, opens nothing
        app.action_unpin()
        await pilot.pause(0.1)
        assert not isinstance(app.screen, (PinScreen, UnpinScreen))
        said = [str(n.message) for n in app._notifications]
        assert "read-only console: pin needs the operator key (restart with --keys DIR)" in said
        assert "read-only console: unpin needs the operator key (restart with --keys DIR)" in said
        # A dialog opened anyway (by a script) is refused before anything is sent.
        screen = PinScreen(fleet.model)
        await app.push_screen(screen)
        screen.query_one("#pin-prefix", Input).value = ",".join(map(str, ids))
        await _click(pilot, screen, "#pin-go")
        await until(pilot, lambda: "ReadOnlyError" in _status(screen), "the refusal")
        assert _status(screen) == ("ReadOnlyError: read-only console: pin needs the operator "
                                   "key (restart with --keys DIR)")
    assert fleet.pin_audits() == audits  # never reached the hub
    assert pins(fleet, capsys) == []
