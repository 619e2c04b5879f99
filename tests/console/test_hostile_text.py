"""Strings from agent reports are data: markup in them (``[/x]``, ``[bold red]``, ``[link=]``)
is shown literally by the TUI and the one-shots and never parsed, terminal controls are made
visible, and ids that are not printable words are refused by the wire schema at decode."""

from __future__ import annotations

import html
import io
import json
import re
import time
from argparse import Namespace

import msgspec
import pytest
from fleetdata import NOW_MS, engine, pool
from livefleet import LiveFleet
from rich.console import Console

from kvpool_agent import start_agent
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    EngineState,
    ErrorRecord,
    ProtocolError,
    Report,
    Source,
    Transfer,
    decode,
    encode,
)
from kvpool_console._text import plain, visible
from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import _status, main
from kvpool_console.screens import EngineDetailScreen
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable

MARKUP = "[/x] [bold red]boom[/] [link=https://evil.example]click[/link]"
"""Each part alone breaks markup parsing or changes what is shown."""
ENGINE = "eng[/x]"


def _hostile_fleet() -> dict[str, EngineState]:
    """One engine whose every free string is markup; built directly (no decode), as a hub of
    an older release could still deliver it."""
    fleet = engine(ENGINE, model=MARKUP, lookup_errors=2, errors={"E[/x]": 2}, loads=1,
                   pool_stats=pool(healthy=False))
    out: dict[str, EngineState] = {}
    for aid, st in fleet.items():
        src = msgspec.structs.replace(st.source, backend="mc[/x]", host="h[b]")
        p = st.pool
        if p is not None:
            p = msgspec.structs.replace(p, health_detail=MARKUP)
        out[aid] = msgspec.structs.replace(
            st, source=src, pool=p,
            in_flight=[Transfer(req_id="chatcmpl-[/x]", kind="load", blocks=1, bytes=1,
                                started_ms=NOW_MS - 10)] if st.in_flight else [],
            recent_errors=[ErrorRecord(ts_ms=NOW_MS - 5,
                                       where="lookup" if st.lookup.lookups else "load[/x]",
                                       name="E[/x]",
                                       message=f"{MARKUP}\x1b[2J", req_id="chatcmpl-[/x]")])
    return out


def _screen_text(app: KVPoolConsole) -> str:
    svg = app.export_screenshot()
    # The text of each styled run, in screen order, without the SVG around it.
    return html.unescape("".join(re.findall(r">([^<]*)</text>", svg))).replace("\xa0", " ")


async def test_tui_shows_markup_literally() -> None:
    app = KVPoolConsole(StaticSource(_hostile_fleet(), address="tcp://hub:7600"),
                        refresh_s=3600, clock=lambda: NOW_MS)
    async with app.run_test(size=(200, 60)) as pilot:
        await pilot.pause()
        table = app.query_one(FleetTable)
        assert table.selected_engine_id == ENGINE
        await pilot.press("space")  # the agent rows
        await pilot.pause()
        assert f"▾ {ENGINE}" in _screen_text(app) and "mc[/x]" in _screen_text(app)
        await pilot.press("2")  # pool tab: health detail
        await pilot.pause()
        assert "DOWN [/x] [bold red]boom[/]" in _screen_text(app)
        await pilot.press("3")  # events: alerts quoting the errors
        await pilot.pause()
        events = _screen_text(app)
        assert f" {ENGINE}: backend errors: E[/x] 4" in events
        assert f" 2 of 100 lookups failed; last: E[/x]: {MARKUP}\\x1b[2J " in events
        await pilot.press("1", "h")  # health modal: agent ids and errors of the replies
        await pilot.pause()
        assert f"{ENGINE}/scheduler" in _screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("enter")  # detail screen: summary, in-flight, errors
        await pilot.pause()
        assert isinstance(app.screen, EngineDetailScreen)
        detail = _screen_text(app)
        assert f"{ENGINE} prefill/kv_producer" in detail
        assert f"model={MARKUP[:30]}" in detail
        assert "chatcmpl-[/x]" in detail and "load[/x]" in detail
        assert "\\x1b[2J" in detail and "\x1b" not in detail


def test_status_table_shows_markup_literally(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet's clock: its errors are recent, so their counter alerts are active.
    monkeypatch.setattr("kvpool_console.cli.now_ms", lambda: NOW_MS)
    buf = io.StringIO()
    out = Console(file=buf, width=400, color_system=None)
    rc = _status(Namespace(json=False, fail_on="critical"), StaticSource(_hostile_fleet()), out)
    text = buf.getvalue()
    assert rc == 1  # the alerts are active, the rendering did not fail
    assert ENGINE in text and "mc[/x]" in text
    assert f"WARNING {ENGINE}: backend errors: E[/x] 4" in text
    assert f"WARNING {ENGINE}: 2 of 100 lookups failed; last: E[/x]: {MARKUP}\\x1b[2J" in text
    assert "[/x] [bold red]boom[/]" in text and "\\x1b[2J" in text and "\x1b" not in text


def test_live_status_and_json(live_fleet: LiveFleet, capsys: pytest.CaptureFixture[str]) -> None:
    """Through real agents and the hub: markup in request ids, error places and messages is
    shown as sent; terminal controls arrive as ``?``; an agent whose engine id is markup is
    refused at decode and counted as a bad message."""
    p0 = live_fleet.add_engine("p0", "prefill", "kv_producer", tp=1)
    p0[0].reporter.lookup("chatcmpl-[/x]", 100, 0, 0, 1.0, error=f"{MARKUP}\x1b]0;pwned\x07")
    p0[1].reporter.transfer_started("chatcmpl-[/x]", "load", 4, 4096)
    p0[1].reporter.error("load[/x]", "E[/x]", MARKUP, req_id="chatcmpl-[/x]")
    rogue = start_agent(Source(agent_id=f"{ENGINE}/scheduler", engine_id=ENGINE,
                               instance_role="mixed", kv_role="kv_both",
                               process_role="replay"), address=live_fleet.address)
    try:
        deadline = time.monotonic() + 10
        while True:
            rc = main(["status", "--json", "--hub", live_fleet.address])
            doc = json.loads(capsys.readouterr().out)
            by = {e["engine_id"]: e for e in doc["engines"]}
            done = ("p0" in by and by["p0"]["loads_in_flight"] == 1 and doc["alerts"]
                    and live_fleet.hub.bad_messages > 0)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        rogue.stop()
    assert rc == 0 and list(by) == ["p0"]
    assert live_fleet.hub.bad_messages > 0
    lookup = next(a for a in doc["alerts"] if a["rule"] == "lookup_errors")
    assert lookup["message"].endswith(f"LOOKUP: {MARKUP}?]0;pwned?")
    rc = main(["status", "--hub", live_fleet.address, "--fail-on", "critical"])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in err
    flat = " ".join(out.split())
    assert f"LOOKUP: {MARKUP}?]0;pwned?" in flat
    assert "\x1b" not in out


@pytest.mark.parametrize("field", [
    {"engine_id": "e[/x]"}, {"engine_id": "a" * 257}, {"engine_id": "-oProxyCommand=x"},
    {"agent_id": "e/scheduler\n"}, {"host": "fe80::1%a b;c"}, {"host": "h[b]"},
    {"backend": "mc\x1b[2J"}, {"model": "m\x1b]0;x\x07"}, {"model": "m" * 257},
    {"log_path": "/l\x00"}, {"sockets": ("/s\r",)},
])
def test_decode_refuses_bad_ids_and_controls(field: dict[str, object]) -> None:
    kw: dict[str, object] = dict(agent_id="engine-2/dp0.tp0.pp0", engine_id="engine-2",
                                 instance_role="prefill", kv_role="kv_producer",
                                 process_role="worker")
    frame = encode(Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot", state=EngineState(
        source=Source(**kw | field), started_ms=0, ts_ms=0)))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="malformed frame"):
        decode(frame)


@pytest.mark.parametrize("ids", [
    ("prefill-0", "prefill-0/scheduler", "node-1.example.com", "Qwen/Qwen2.5-7B"),
    ("engine-2", "engine-2/dp0.tp0.pp0", "10.0.0.7", "/models/Llama 3 [8B]"),
    ("0f3c1a2e-uuid_x", "0f3c1a2e-uuid_x/replay", "fe80::1", ""),
])
def test_decode_keeps_real_ids(ids: tuple[str, str, str, str]) -> None:
    eid, aid, host, model = ids
    src = Source(agent_id=aid, engine_id=eid, instance_role="prefill", kv_role="kv_producer",
                 process_role="worker", host=host, backend="mooncake", model=model,
                 log_path="/var/log/vllm/engine 1.log", master="[fe80::1]:50051")
    msg = decode(encode(Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot",
                               state=EngineState(source=src, started_ms=0, ts_ms=0))))
    assert isinstance(msg, Report) and msg.state.source == src


def test_visible_and_plain() -> None:
    assert visible("a\x1b]0;t\x07b\x1b[2J\tc\nd\x9b\x7f") == \
        "a\\x1b]0;t\\x07b\\x1b[2J\tc\nd\\x9b\\x7f"
    assert plain("[/x]").plain == "[/x]" and plain("[bold]x[/]").spans == []
