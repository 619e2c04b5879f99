"""The hub's miss-split memory under forged reports (helper 70's attacks B2 and B3), on a real
keyed hub over CURVE with the fleet's agent key: a report past ``REPORT_ACCESS_CHUNKS`` chunk
ids has only its lookups within them split, the rest counted (``unsplit_accesses``); reports
that take every one of the memory's layouts leave later layouts' chunk ids unremembered,
counted (``layouts_full``); both on ``/metrics``'s family and in ``status --json``'s
``hub_counters`` (``HubCounters``)."""

from __future__ import annotations

import time

import zmq
from agent_testlib import FakeAgent, make_source, wait_until

from kvpool_agent import FleetHub
from kvpool_agent._saved_chunks import MAX_LAYOUTS
from kvpool_agent.protocol import (
    MAX_ACCESS_CHUNKS,
    PROTOCOL_VERSION,
    REPORT_ACCESS_CHUNKS,
    Access,
    EngineState,
    Report,
    encode,
)


def _frame(agent: FakeAgent, report: dict[str, object], model: str, role: str,
           digest: str = "") -> bytes:
    agent.seq += 1
    now = time.time() * 1e3
    src = make_source("forger", role=role, model=model, layout_digest=digest)
    return encode(Report(v=PROTOCOL_VERSION, seq=agent.seq, kind="snapshot",
                         state=EngineState(source=src, started_ms=1.0, ts_ms=now),
                         **report))  # type: ignore[arg-type]


def test_forged_reports_are_split_within_bounds_and_counted(
        hub: FleetHub, hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    worker = FakeAgent(ctx, hub_address)
    sched = FakeAgent(ctx, hub_address)
    assert worker._send(_frame(worker, {}, "m", "worker", "a" * 12))
    wait_until(lambda: hub.counters.reports >= 1)
    assert hub.counters.reports == 1
    n = REPORT_ACCESS_CHUNKS // MAX_ACCESS_CHUNKS + 2
    accesses = [Access(tokens=16 * MAX_ACCESS_CHUNKS, chunk_size=16,
                       chunks=list(range(i * MAX_ACCESS_CHUNKS, (i + 1) * MAX_ACCESS_CHUNKS)),
                       ts_ms=time.time() * 1e3, served=0) for i in range(n)]
    assert sched._send(_frame(sched, {"accesses": accesses}, "m", "scheduler"))
    wait_until(lambda: hub.counters.unsplit_accesses == 2)
    assert hub.counters.unsplit_accesses == 2
    assert hub.reuse.not_in_pool()["forger"] == {"first_use": 16 * REPORT_ACCESS_CHUNKS}
    # One layout a report, each under a model of its own: the memory's layouts run out.
    before = hub.counters.reports
    for i in range(MAX_LAYOUTS + 1):
        assert worker._send(_frame(worker, {"saves": [1, 2, 3]}, f"m{i}", "worker",
                                   f"{i:012x}"))
    wait_until(lambda: hub.counters.reports >= before + MAX_LAYOUTS + 1, timeout_s=60)
    assert hub.counters.reports == before + MAX_LAYOUTS + 1
    # The first layout (model m) took one slot: the last two reports' saves are not kept.
    assert hub.counters.layouts_full == 2 * 3
    assert hub.counters.metrics()["layouts_full"] == 6
