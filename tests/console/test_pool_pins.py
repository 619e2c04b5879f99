"""Pinned bytes per pool (``kvpool_console.model._pools``): the agents of one layout report the
same pins, so each layout counts once (its largest report) and layouts add up."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine, pool

from kvpool_agent.protocol import EngineState
from kvpool_console.model import build_view

MB = 1 << 20


def _pinned(states: dict[str, EngineState], digest: str, pinned: int, pins: int
            ) -> dict[str, EngineState]:
    out = {}
    for aid, st in states.items():
        if st.source.process_role == "worker":
            st = msgspec.structs.replace(
                st, source=msgspec.structs.replace(st.source, layout_digest=digest),
                pool=msgspec.structs.replace(pool(), pinned_bytes=pinned, pins=pins))
        out[aid] = st
    return out


def test_pinned_bytes_count_each_layout_once() -> None:
    states = {
        # Two engines of layout a (two TP workers each) hold the same 2 pins; an engine of
        # layout b holds 1; the schedulers report none.
        **_pinned(engine("a1", tp=2), "aaaaaaaaaaaa", 96 * MB, 2),
        **_pinned(engine("a2", tp=2), "aaaaaaaaaaaa", 96 * MB, 2),
        **_pinned(engine("b1", tp=1), "bbbbbbbbbbbb", 8 * MB, 1),
    }
    view = build_view(states, {a: NOW_MS for a in states}, NOW_MS)
    (row,) = view.pools
    assert (row.pinned_bytes, row.pins) == (104 * MB, 3)
    assert msgspec.to_builtins(row)["pinned_bytes"] == 104 * MB  # as status --json has it


def test_a_pool_without_pins_shows_none() -> None:
    states = engine("a1", tp=2)
    (row,) = build_view(states, {a: NOW_MS for a in states}, NOW_MS).pools
    assert (row.pinned_bytes, row.pins) == (0, 0)
