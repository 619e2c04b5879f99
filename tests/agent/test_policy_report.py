"""``EngineState.policy`` (issue 40 item 1): the scheduler's ``Reporter.policy`` events fold into
the latest ``PolicySteering`` within the wire's bounds, a report carrying it decodes, one from
an agent before the field decodes with ``None``, and an out-of-range one is refused whole."""

from __future__ import annotations

import msgspec
import pytest
from agent_testlib import make_source

from kvpool_agent._aggregate import Aggregator
from kvpool_agent.protocol import (
    MAX_COUNT,
    MAX_ID_CHARS,
    PROTOCOL_VERSION,
    PolicySteering,
    ProtocolError,
    Report,
    decode,
    encode,
)
from kvpool_agent.reporter import Reporter


def _folded(*calls: tuple) -> Aggregator:
    rep = Reporter()
    for args in calls:
        rep.policy(*args)
    agg = Aggregator(make_source("e", role="scheduler"))
    agg.apply(rep.drain())
    return agg


def test_the_latest_event_is_reported_within_the_wire_bounds() -> None:
    agg = _folded(("service", "tcp://10.0.0.5:5600", 250.0, 3000.0, True, 12, 0, 7),
                  ("master", "tcp://10.0.0.5:5600\x1b[2J" + "x" * 400, float("nan"), 3000.0,
                   False, 2**60, -4, 2**60))
    p = agg.state(1.0).policy
    assert p is not None
    assert (p.in_charge, p.silent_ms, p.stale_ms, p.records_connected, p.records_sent,
            p.records_dropped, p.service_removed_keys) == (
        "master", 0.0, 3000.0, False, MAX_COUNT - 1, 0, MAX_COUNT - 1)
    assert p.service.startswith("tcp://10.0.0.5:5600?[2J") and len(p.service) == MAX_ID_CHARS
    report = Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot", state=agg.state(2.0))
    got = decode(encode(report))
    assert isinstance(got, Report) and got.state.policy == p


def test_an_engine_without_the_service_reports_none_and_old_reports_decode() -> None:
    st = Aggregator(make_source("e", role="scheduler")).state(1.0)
    assert st.policy is None
    raw = msgspec.to_builtins(Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot", state=st))
    del raw["state"]["policy"]  # an agent before the field
    got = decode(msgspec.msgpack.encode(raw))
    assert isinstance(got, Report) and got.state.policy is None


def test_an_out_of_range_steering_is_refused_whole() -> None:
    st = Aggregator(make_source("e", role="scheduler")).state(1.0)
    good = PolicySteering(ts_ms=1.0, in_charge="service")
    raw = msgspec.to_builtins(Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot",
                                     state=msgspec.structs.replace(st, policy=good)))
    for field, bad in (("in_charge", "boss"), ("silent_ms", -1.0), ("records_sent", 2**53),
                       ("service", "a\x1b]0;x"), ("service_removed_keys", -1)):
        forged = {**raw, "state": {**raw["state"], "policy": {**raw["state"]["policy"],
                                                              field: bad}}}
        with pytest.raises(ProtocolError):
            decode(msgspec.msgpack.encode(forged))
