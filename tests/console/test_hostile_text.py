"""Strings from agent reports are data: markup in them (``[/x]``, ``[bold red]``, ``[link=]``)
is shown literally by the TUI and the one-shots and never parsed, terminal controls are made
visible, and ids that are not printable words are refused by the wire schema at decode."""

from __future__ import annotations

import html
import io
import json
import math
import os
import re
import time
from argparse import Namespace
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from fleetdata import NOW_MS, engine, pool
from livefleet import LiveFleet, keyed_live_fleet, until
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from kvpool_agent import AGENT_KEYS_ENV, start_agent
from kvpool_agent.auth import KeyPaths
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    EngineState,
    ErrorRecord,
    LookupStats,
    ProtocolError,
    Report,
    Source,
    Transfer,
    decode,
    encode,
)
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_console._text import json_line, plain, visible
from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import _status, main
from kvpool_console.screens import EngineDetailScreen
from kvpool_console.source import ClientSource, StaticSource
from kvpool_console.widgets import FleetTable
from kvpool_replay import LocalMooncakeMaster, free_port

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


# -- numbers and escapes that killed consoles (issue 27, items 6 and 8) -----------------------

_RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
"""Every C0 control but newline, DEL and every C1 control."""
_BAD_NUMBERS = (math.nan, math.inf, -math.inf, 1e308, -1e308)


def _raw_agent(address: str) -> zmq.Socket[bytes]:
    """A DEALER on the hub's agent port holding the fleet's agent key (as any engine host
    does): it sends whatever frames the test writes, no agent code in between."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    KeyPaths.of(os.environ[AGENT_KEYS_ENV]).client("agent").apply(sock)
    sock.connect(address)
    return sock


def _report(source: Source, seq: int, **state: object) -> bytes:
    now = time.time() * 1e3
    return encode(Report(v=PROTOCOL_VERSION, seq=seq, kind="snapshot", state=EngineState(
        source=source, started_ms=now, ts_ms=now, **state)))  # type: ignore[arg-type]


def _hostile_reports(source: Source) -> list[bytes]:
    """NaN / inf / 1e308 rates, a 2**64-1 token count, escape-laden layout strings."""
    frames = [_report(source, 100 + i, lookup=LookupStats(prompt_tokens=10, hit_rate_1m=v,
                                                          hit_rate=v))
              for i, v in enumerate(_BAD_NUMBERS)]
    frames.append(_report(source, 110, lookup=LookupStats(prompt_tokens=2**64 - 1)))
    frames.append(_report(msgspec.structs.replace(
        source, layout_digest="\x1b]0;PWNED\x07\x1b[2J",
        layout={"cache": "\x9b2J", "model\x1b[2J": 1}), 111))
    return frames


async def test_tui_keeps_running_after_nan_inf_and_huge_reports(live_fleet: LiveFleet) -> None:
    """A running TUI on a live keyed hub: an agent-key holder sends NaN, ±inf, 1e308 and
    2**64-1 reports, for a real engine's agent and for one of its own. The hub counts each as a
    bad message; the TUI keeps running and keeps following the real engine."""
    p0 = live_fleet.add_engine("p0", "prefill", "kv_producer", tp=1)
    p0[0].reporter.lookup("r1", 1000, 0, 400, 1.0)
    p0[0].reporter.loaded("r1", 400)
    live_fleet.wait_agents(2)
    app = KVPoolConsole(ClientSource(live_fleet.address, pump=True), refresh_s=0.2)
    sock = _raw_agent(live_fleet.address)
    try:
        async with app.run_test(size=(160, 40)) as pilot:
            table = app.query_one(FleetTable)
            await until(pilot, lambda: "e:p0" in table.rows
                        and str(table.get_cell("e:p0", "hit")) == "40%", "p0 drawn")
            before = live_fleet.hub.bad_messages
            frames = [*_hostile_reports(p0[0].source),
                      *_hostile_reports(msgspec.structs.replace(
                          p0[0].source, agent_id="evil/scheduler", engine_id="evil"))]
            for f in frames:
                sock.send(f)
            await until(pilot, lambda: live_fleet.hub.bad_messages - before >= len(frames),
                        "the hub refused every hostile report")
            # The console crashed 0.8 s after such a frame: give it several refreshes.
            p0[0].reporter.lookup("r2", 1000, 0, 1000, 1.0)
            p0[0].reporter.loaded("r2", 1000)
            await until(pilot, lambda: str(table.get_cell("e:p0", "hit")) == "70%",
                        "p0's next report drawn")
            assert app.is_running and app.return_code is None
            assert live_fleet.hub.bad_messages - before == len(frames)
            assert "e:evil" not in table.rows
            assert str(table.get_cell("__totals__", "tokens")) == "1.4k/2.0k"
            assert set(str(table.get_cell("e:p0", "trend"))) <= set("▁▂▃▄▅▆▇█")
    finally:
        sock.close()


async def test_tui_survives_non_finite_rates_it_is_handed() -> None:
    """A state that never went through the schema (a recorded fleet) with NaN, ±inf and
    ±1e308 rates: every refresh draws, the Trend cell included, and the app keeps running."""
    fleet: dict[str, EngineState] = {}
    for i, v in enumerate(_BAD_NUMBERS):
        for aid, st in engine(f"e{i}", hit_1m=v).items():
            fleet[aid] = msgspec.structs.replace(st, lookup=msgspec.structs.replace(
                st.lookup, hit_rate=v), transfers=msgspec.structs.replace(
                st.transfers, load_bytes_per_s=v, max_load_ms=v))
    app = KVPoolConsole(StaticSource(fleet), refresh_s=0.1, clock=lambda: NOW_MS)
    async with app.run_test(size=(200, 40)) as pilot:
        table = app.query_one(FleetTable)
        await until(pilot, lambda: all(len(app.model.hit_history.get(f"e{i}", ())) >= 3
                                       for i in range(len(_BAD_NUMBERS))), "three refreshes")
        trends = [str(table.get_cell(f"e:e{i}", "trend")) for i in range(len(_BAD_NUMBERS))]
        assert trends[0].startswith("▁") and trends[1].startswith("█")  # NaN low, inf high
        assert trends[2].startswith("▁") and trends[3].startswith("█")
        assert app.is_running and app.return_code is None


def test_metrics_and_status_json_carry_no_control_characters(
        tmp_path: Path, mooncake_master: LocalMooncakeMaster, pool_backend: MooncakeBackend,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Names a report may carry (tabs, newlines, quotes, backslashes in a model or error name)
    reach ``/metrics`` and ``status --json`` escaped; the escape-laden layout of the attack is
    refused at the hub; a 2**64-1 prompt count cannot zero the fleet's hit rate."""
    model = 'm\tx\n"q"\\ [b] é'
    with keyed_live_fleet(tmp_path / "keys", mooncake_master, pool_backend, monkeypatch,
                          "ctl", metrics_port=free_port()) as fleet:
        p0 = fleet.add_engine("p0", "prefill", "kv_producer", tp=1, model=model)
        p0[0].reporter.lookup("r1", 1000, 0, 250, 1.0)
        p0[0].reporter.loaded("r1", 250)
        p0[1].reporter.transfer_started("r2", "load", 1, 4096)
        p0[1].reporter.transfer_finished("r2", "load", False, 0, "E\tX\nY", 1)
        sock = _raw_agent(fleet.address)
        try:
            for f in _hostile_reports(msgspec.structs.replace(
                    p0[0].source, agent_id="evil/scheduler", engine_id="evil")):
                sock.send(f)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                assert fleet.hub.metrics is not None
                body = httpx.get(fleet.hub.metrics.url, timeout=5.0).content
                # The lookup and the failed load arrive in separate reports: wait for both.
                if (b"E\\\\x09X\\\\x0aY" in body and fleet.hub.bad_messages >= 7
                        and b"kvpool_fleet_pool_hit_ratio 0.25" in body):
                    break
                time.sleep(0.1)
        finally:
            sock.close()
        text = body.decode()
        assert _RAW_CONTROL.search(text) is None, _RAW_CONTROL.findall(text)
        # Label values as a scraper reads them: the controls as visible escapes.
        labels = {s.labels.get("model") for fam in text_string_to_metric_families(text)
                  for s in fam.samples} - {None}
        assert labels == {'m\\x09x\\x0a"q"\\ [b] é'}
        assert "PWNED" not in text and 'engine="evil"' not in text
        assert "kvpool_fleet_pool_hit_ratio 0.25" in text
        assert main(["status", "--json", "--hub", fleet.address]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and _RAW_CONTROL.search(out[:-1]) is None
    doc = json.loads(out)
    assert [e["model"] for e in doc["engines"]] == [model]
    assert doc["totals"]["hit_rate"] == 0.25


def test_status_json_escapes_c1_controls(capsys: pytest.CaptureFixture[str]) -> None:
    """A state built without the schema (a recorded fleet, an older hub's) with C1 controls
    and escapes in its layout: ``status --json`` prints them as ``\\u`` escapes, and a JSON
    reader gets the same strings back."""
    hostile = "\x9b2J\x1b]0;PWNED\x07\x7f\x85"
    fleet = {aid: msgspec.structs.replace(st, source=msgspec.structs.replace(
        st.source, model=f"m{hostile}", layout_digest=f"d{hostile}",
        layout={"cache": hostile}))
        for aid, st in engine("e0").items()}
    rc = _status(Namespace(json=True, fail_on=None), StaticSource(fleet), Console())
    out = capsys.readouterr().out
    assert rc == 0 and _RAW_CONTROL.search(out[:-1]) is None
    assert "\\u009b2J\\u001b]0;PWNED\\u0007\\u007f\\u0085" in out
    (row,) = json.loads(out)["engines"]
    assert row["model"] == f"m{hostile}" and row["layout"] == {"cache": hostile}
    assert json_line({"s": "\x00\x1f\x80\x9f é"}) == '{"s":"\\u0000\\u001f\\u0080\\u009f é"}'


def test_status_never_shows_hits_as_none() -> None:
    """An engine claiming 2**53-1 prompt tokens (the most a report may carry) outweighs the
    others' hits: the fleet's rate is tiny but above 0, and ``status`` says so."""
    fleet = {**engine("big", prompt=2**53 - 1, hits=0), **engine("p0", prompt=1000, hits=500)}
    buf = io.StringIO()
    _status(Namespace(json=False, fail_on=None), StaticSource(fleet),
            Console(file=buf, width=400, color_system=None))
    text = buf.getvalue()
    assert "hit rate <0.1% (local 0.0%)" in text
    assert " 50.0% " in text and " 0.0% " in text  # p0's row and big's
