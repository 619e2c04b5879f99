"""Operators see versions (issue 39 item 5): the engine detail screen's identity line and
``status --json``'s ``layout.fingerprint``, on a fleet of one model over two weight versions
and an engine without a content identity."""

from __future__ import annotations

import html
import re

import msgspec
from fleetdata import NOW_MS, engine

from kvpool_agent.protocol import EngineState
from kvpool_console.alerts import evaluate
from kvpool_console.app import KVPoolConsole
from kvpool_console.cli import status_document
from kvpool_console.model import build_view
from kvpool_console.screens import EngineDetailScreen
from kvpool_console.source import StaticSource
from kvpool_console.widgets import FleetTable
from kvpool_console.widgets._identity import identity_line

V1, V2 = "safetensors:" + "1" * 32, "safetensors:" + "2" * 32
LONE = "unshared:" + "3" * 32


def _described(eid: str, fingerprint: str, model: str = "m") -> dict[str, EngineState]:
    """Engine ``eid`` whose workers report ``fingerprint`` (its scheduler reports no layout)."""
    out = {}
    for k, s in engine(eid, model=model).items():
        facts = ({"model": model, "block_size": 16, "fingerprint": fingerprint}
                 if s.source.process_role == "worker" else {})
        out[k] = msgspec.structs.replace(s, source=msgspec.structs.replace(
            s.source, model=model, layout_digest="d" + fingerprint[-1] if facts else "",
            layout=facts))
    return out


def _fleet() -> dict[str, EngineState]:
    return (_described("a", V1) | _described("b", V2) | _described("c", V2)
            | _described("x", LONE) | _described("other", V1, model="n"))


def test_the_identity_line_names_the_weights_and_who_shares_them() -> None:
    fleet = _fleet()
    rows = {r.engine_id: r for r in build_view(fleet, {}, NOW_MS).engines}
    assert identity_line(rows["b"], fleet) == (
        f"weights {V2}, as c; other weights of m: {V1} on a; {LONE} on x (never shared with "
        "these)")
    # Engine "other" runs V1 too, but another model: not listed under m.
    assert identity_line(rows["a"], fleet) == (
        f"weights {V1}; other weights of m: {V2} on b, c; {LONE} on x (never shared with "
        "these)")
    assert identity_line(rows["x"], fleet).startswith(
        f"weights {LONE} (shares with no engine: set model_fingerprint")
    assert identity_line(rows["other"], fleet) == f"weights {V1}"
    # Before the workers registered their KV caches: no line.
    bare = engine("y")
    assert identity_line(build_view(bare, {}, NOW_MS).engines[0], bare) == ""


def test_status_json_carries_each_engines_fingerprint() -> None:
    fleet = _fleet()
    doc = status_document(build_view(fleet, {}, NOW_MS, alerts=evaluate(fleet, {}, NOW_MS)))
    got = {e["engine_id"]: e["layout"].get("fingerprint") for e in doc["engines"]}
    assert got == {"a": V1, "b": V2, "c": V2, "x": LONE, "other": V1}
    assert {a["rule"] for a in doc["alerts"]} >= {"model_versions", "unshared_identity"}


async def test_the_detail_screen_shows_it() -> None:
    app = KVPoolConsole(StaticSource(_fleet(), address="tcp://hub:7600"), refresh_s=3600,
                        clock=lambda: NOW_MS)
    async with app.run_test(size=(220, 60)) as pilot:
        await pilot.pause()
        table = app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index("e:b"))
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, EngineDetailScreen)
        svg = app.export_screenshot()
        text = html.unescape("".join(re.findall(r">([^<]*)</text>", svg))).replace("\xa0", " ")
        assert f"identity: weights {V2}, as c; other weights of m: {V1} on a;" in text
