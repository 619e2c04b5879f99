"""The hub's fleet state never holds a report from the future (an attack found in review: an
agent key stamping ``ts_ms = 2**52`` took the console's pool row of the whole pool)."""

from __future__ import annotations

import time

from agent_testlib import make_source

from kvpool_agent._fleet import Fleet
from kvpool_agent.protocol import PROTOCOL_VERSION, EngineState, Report


def test_a_report_stamped_in_the_future_is_held_at_the_receive_time() -> None:
    fleet = Fleet()
    src = make_source("e0", "worker")
    before = time.time() * 1e3
    st = EngineState(source=src, started_ms=before, ts_ms=2.0**52)
    assert fleet.accept(b"r0", Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot",
                                      state=st)) is None
    held, seen_ms = fleet.states()[src.agent_id]
    assert before <= held.ts_ms <= seen_ms <= time.time() * 1e3
    # An honest stamp (the agent's own clock, behind the hub's) is kept as sent.
    honest = EngineState(source=src, started_ms=before, ts_ms=before - 5.0)
    assert fleet.accept(b"r0", Report(v=PROTOCOL_VERSION, seq=2, kind="snapshot",
                                      state=honest)) is None
    assert fleet.states()[src.agent_id][0].ts_ms == before - 5.0
