"""The engine detail screen leaves out a field without a value: a worker built outside vLLM (or
a model without a revision, quantization or checksum) reports those layout facts empty, and
the screen printed ``revision= quantization= attn_backend= checksum=``; likewise an empty
version, model or adapter identity."""

from __future__ import annotations

import re

import msgspec
from fleetdata import NOW_MS, engine
from livefleet import LiveFleet, until
from textual.widgets import Static

from kvpool_connector._layout_digest import LAYOUT_SCHEME, LayoutFacts
from kvpool_console.app import KVPoolConsole
from kvpool_console.screens import EngineDetailScreen
from kvpool_console.source import ClientSource, FleetSource, StaticSource
from kvpool_console.widgets import FleetTable

BARE = re.compile(r"[\w.-]+=(?=\s|$)|:[ \t]*$", re.MULTILINE)
"""A field followed by nothing: ``revision=``, or a line ending in a label (``adapters:``)."""

FACTS = LayoutFacts(scheme=LAYOUT_SCHEME, model="tiny", revision="", quantization="",
                    dtype="float16", kv_cache_dtype="auto", attn_backend="", kv_heads=2,
                    head_size=64, layers=4, cache="4x float16(B,2,16,64)/(*,2048,64,1)",
                    block_size=16, chunk_size=256, tp=1, pcp=1, dcp=1, pp=1)
"""What a worker reports when the model names no revision, quantization or attention backend
and values carry no checksum (``LayoutFacts`` keeps those fields, empty)."""


async def _summary(source: FleetSource, engine_id: str) -> str:
    """The detail screen's summary of ``engine_id`` once its layout is in, as drawn."""
    app = KVPoolConsole(source, refresh_s=0.25, clock=lambda: NOW_MS) \
        if isinstance(source, StaticSource) else KVPoolConsole(source, refresh_s=0.25)
    async with app.run_test(size=(160, 40)) as pilot:
        await until(pilot, lambda: any(r.engine_id == engine_id and r.layout_digest
                                       for r in (app.view.engines if app.view else [])),
                    f"{engine_id}'s layout reported")
        table = app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index(f"e:{engine_id}"))
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, EngineDetailScreen)
        return str(app.screen.query_one("#detail-summary", Static).visual)


async def test_empty_layout_facts_are_left_out(live_fleet: LiveFleet) -> None:
    # A real worker agent reports the facts as the connector hands them over, through a real hub.
    p0 = live_fleet.add_engine("p0", "prefill", "kv_producer", tp=1)
    p0[1].reporter.layout(FACTS.digest, FACTS.as_dict())
    live_fleet.wait_agents(2)
    text = await _summary(ClientSource(live_fleet.address, pump=True), "p0")
    (layout,) = [line for line in text.splitlines() if line.startswith("layout ")]
    assert layout.startswith(f"layout {FACTS.digest}: scheme={LAYOUT_SCHEME} model=tiny "
                             "dtype=float16 kv_cache_dtype=auto kv_heads=2"), layout
    for empty in ("revision", "quantization", "attn_backend", "checksum"):
        assert f"{empty}=" not in text, text
    assert BARE.findall(text) == [], text


async def test_empty_model_version_and_adapter_identity_are_left_out() -> None:
    states = engine("e0", role="mixed", model="", versions={"kvpool": "0.1.0", "vllm": ""})
    sched = "e0/scheduler"
    states[sched] = msgspec.structs.replace(states[sched], lookup=msgspec.structs.replace(
        states[sched].lookup, adapters={"sql": "lora:ab12", "old": ""}))
    for agent, st in states.items():
        if agent != sched:
            st.source = msgspec.structs.replace(st.source, layout_digest=FACTS.digest,
                                                layout=FACTS.as_dict())
    text = await _summary(StaticSource(states), "e0")
    first = text.splitlines()[0]
    assert first.startswith("e0 mixed/kv_both dp0 tp0-1 pp0 mooncake ") and "model" not in first
    assert "versions: kvpool 0.1.0\n" in text + "\n" and "vllm" not in text
    assert "adapters: old, sql=lora:ab12" in text
    assert BARE.findall(text) == [], text
