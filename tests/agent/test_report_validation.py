"""Reports are data, validated at decode: a NaN, an infinity, 1e308, a count of 2**64-1 or a
string carrying terminal escapes is refused by the wire schema, so a keyed hub counts the frame
as a bad message and keeps the state it had; the values a real agent sends still fit (it
clamps what it does not control), and the bounds themselves decode."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
from agent_testlib import FakeAgent, make_source, wait_until

from kvpool_agent._aggregate import Aggregator
from kvpool_agent.hub import FleetHub
from kvpool_agent.protocol import (
    MAX_BIG_COUNT,
    MAX_COUNT,
    MAX_IN_FLIGHT,
    MAX_NAMES,
    MAX_SEGMENTS,
    OTHER_NAME,
    PROTOCOL_VERSION,
    EngineState,
    ErrorRecord,
    FleetUpdate,
    LookupStats,
    PoolStats,
    ProcessStats,
    ProtocolError,
    Report,
    SegmentUsage,
    Source,
    Transfer,
    TransferStats,
    decode,
    encode,
)
from kvpool_agent.reporter import LayoutKnown, Loaded, Lookup, SaveSkipped

NAN, INF = math.nan, math.inf
Edit = Callable[[EngineState], EngineState]


def _state(**kw: Any) -> EngineState:
    now = time.time() * 1e3
    return EngineState(source=make_source("good", "scheduler"), started_ms=now, ts_ms=now, **kw)


def _lookup(**kw: Any) -> Edit:
    return lambda st: msgspec.structs.replace(st, lookup=LookupStats(**kw))


def _transfers(**kw: Any) -> Edit:
    return lambda st: msgspec.structs.replace(st, transfers=TransferStats(**kw))


def _process(**kw: Any) -> Edit:
    return lambda st: msgspec.structs.replace(st, process=ProcessStats(**kw))


def _pool(**kw: Any) -> Edit:
    return lambda st: msgspec.structs.replace(st, pool=PoolStats(backend="mooncake", **kw))


def _source(**kw: Any) -> Edit:
    return lambda st: msgspec.structs.replace(st, source=msgspec.structs.replace(st.source,
                                                                                 **kw))


def _times(**kw: Any) -> Edit:
    return lambda st: msgspec.structs.replace(st, **kw)


def _in_flight(**kw: Any) -> Edit:
    base: dict[str, Any] = dict(req_id="r1", kind="load", blocks=1, bytes=1, started_ms=1.0)
    return lambda st: msgspec.structs.replace(st, in_flight=[Transfer(**(base | kw))])


HOSTILE: dict[str, Edit] = {
    "hit_rate_1m NaN": _lookup(hit_rate_1m=NAN),
    "hit_rate_1m inf": _lookup(hit_rate_1m=INF),
    "hit_rate 1e308": _lookup(hit_rate=1e308),
    "hit_rate 1.5": _lookup(hit_rate=1.5),
    "hit_rate -0.1": _lookup(hit_rate=-0.1),
    "latency p99 NaN": _lookup(latency_ms_p99=NAN),
    "latency p50 -inf": _lookup(latency_ms_p50=-INF),
    "prompt_tokens 2**64-1": _lookup(prompt_tokens=2**64 - 1),
    "prompt_tokens 2**53": _lookup(prompt_tokens=MAX_COUNT),
    "loaded_tokens -1": _lookup(loaded_tokens=-1),
    "skipped count 2**64-1": _lookup(skipped_by_reason={"MULTIMODAL": 2**64 - 1}),
    "load_bytes_per_s inf": _transfers(load_bytes_per_s=INF),
    "max_load_ms 1e308": _transfers(max_load_ms=1e308),
    "loaded_bytes 2**63": _transfers(loaded_bytes=MAX_BIG_COUNT),
    "errors_by_name count -1": _transfers(errors_by_name={"TIMEOUT": -1}),
    "cpu_percent NaN": _process(cpu_percent=NAN),
    "rss_bytes 2**64-1": _process(rss_bytes=2**64 - 1),
    "high_watermark NaN": _pool(high_watermark=NAN),
    "high_watermark 2": _pool(high_watermark=2.0),
    "pool keys 2**64-1": _pool(keys=2**64 - 1),
    "segment bytes -1": _pool(segments=[SegmentUsage(name="h:1", used_bytes=-1,
                                                     total_bytes=1)]),
    "ts_ms NaN": _times(ts_ms=NAN),
    "started_ms inf": _times(started_ms=INF),
    "ts_ms -1": _times(ts_ms=-1.0),
    "lease_expires_ms NaN": _in_flight(lease_expires_ms=NAN),
    "transfer bytes 2**64-1": _in_flight(bytes=2**64 - 1),
    "pid 2**64-1": _source(pid=2**64 - 1),
    "port 70000": _source(ports=(70_000,)),
    "layout_digest OSC title + clear": _source(layout_digest="\x1b]0;PWNED\x07\x1b[2J"),
    "layout_digest C1 CSI": _source(layout_digest="ab\x9b2J"),
    "layout_digest not hex": _source(layout_digest="0123456789AB"),
    "layout_digest too long": _source(layout_digest="a" * 65),
    "layout value escape": _source(layout={"cache": "x\x1b[2J"}),
    "layout value newline": _source(layout={"cache": "x\ny"}),
    "layout key C1": _source(layout={"k\x9b": 1}),
    "layout int 2**64-1": _source(layout={"layers": 2**64 - 1}),
    "layout int -1": _source(layout={"layers": -1}),
    "layout value float": _source(layout={"layers": 1.5}),
    "layout 65 entries": _source(layout={f"k{i}": i for i in range(65)}),
    # A look-alike of a real master made a second pool whose /metrics label read the same.
    "master zero-width space": _source(master="127.0.0.1:50051\u200b"),
    "master with a space": _source(master="127.0.0.1: 50051"),
    "master not ASCII": _source(master="127.0.0.\u0661:50051"),
    # Many tiny map entries grow a hub ~15x their encoded size once decoded (issue 42).
    "skipped_by_reason 65 names": _lookup(skipped_by_reason={f"R{i}": 1 for i in range(65)}),
    "errors_by_name 65 names": _transfers(errors_by_name={f"E{i}": 1 for i in range(65)}),
    "paused_after_hit 65 names": _transfers(paused_after_hit={f"E{i}": 1 for i in range(65)}),
    "in_flight 4,097": lambda st: msgspec.structs.replace(st, in_flight=[Transfer(
        req_id=f"r{i}", kind="load", blocks=1, bytes=1, started_ms=1.0)
        for i in range(MAX_IN_FLIGHT + 1)]),
    "segments 4,097": _pool(segments=[SegmentUsage(name=f"h:{i}", used_bytes=0, total_bytes=1)
                                      for i in range(MAX_SEGMENTS + 1)]),
}


def _frame(st: EngineState, seq: int = 1) -> bytes:
    return encode(Report(v=PROTOCOL_VERSION, seq=seq, kind="snapshot", state=st))


@pytest.mark.parametrize("edit", HOSTILE.values(), ids=HOSTILE.keys())
def test_decode_refuses_out_of_range_and_escapes(edit: Edit) -> None:
    with pytest.raises(ProtocolError, match="malformed frame"):
        decode(_frame(edit(_state())))


def test_decode_refuses_a_hub_update_relaying_nan() -> None:
    """A console decodes the hub's updates with the same schema: an older hub relaying a NaN
    gets its frame refused (counted by the console), never drawn."""
    bad = _lookup(hit_rate_1m=NAN)(_state())
    frame = encode(FleetUpdate(v=PROTOCOL_VERSION, seq=1, kind="snapshot", ts_ms=1.0,
                               engines=[bad]))
    with pytest.raises(ProtocolError, match="malformed frame"):
        decode(frame)
    with pytest.raises(ProtocolError, match="malformed frame"):
        decode(encode(FleetUpdate(v=PROTOCOL_VERSION, seq=1, kind="delta", ts_ms=1.0,
                                  engines=[], last_seen_ms={"good/scheduler": NAN})))


def test_the_bounds_and_real_values_decode() -> None:
    st = _lookup(prompt_tokens=MAX_COUNT - 1, loaded_tokens=MAX_COUNT - 1, hit_rate=1.0,
                 hit_rate_1m=0.0, latency_ms_p99=2.0**53)(_state())
    st = _transfers(loaded_bytes=MAX_BIG_COUNT - 1, load_bytes_per_s=1e12)(st)
    st = _pool(high_watermark=1.0, used_bytes=MAX_BIG_COUNT - 1,
               health_detail="HTTP 200 ok\n\tdetail")(st)
    st = _source(
        layout_digest="0123456789ab", ports=(0, 65_535), start_ticks=MAX_BIG_COUNT - 1,
        layout={"scheme": 2, "model": "Qwen/Qwen2.5-7B [int4] é", "layers": 28,
                "cache": " | ".join(["28x float16(B,8,32,256)/(*,8192,256,1) + "
                                     "bfloat16(B,1,64)/(*,64,1)"] * 200),
                "hash_algo": "sha256"})(st)
    msg = decode(_frame(st))
    assert isinstance(msg, Report) and msg.state == st
    for master in ("10.0.0.1:50051", "[::1]:50051", "etcd://10.0.0.1:2379,10.0.0.2:2379"):
        with_master = _source(master=master)(st)
        assert decode(_frame(with_master)) == Report(v=PROTOCOL_VERSION, seq=1,
                                                     kind="snapshot", state=with_master)
    # An error code is signed (Mooncake -707).
    st = msgspec.structs.replace(st, recent_errors=[ErrorRecord(
        ts_ms=1.0, where="load", name="LEASE_EXPIRED", message="m", code=-707)])
    assert decode(_frame(st)) == Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot", state=st)


def test_a_real_agent_clamps_what_it_does_not_control() -> None:
    """The aggregator's state always decodes: hits beyond the prompt tokens counted (a Lookup
    event the full buffer dropped), a NaN from psutil, a master's odd numbers and text, a
    negative latency from a connector, a layout fact longer than the schema takes."""
    agg = Aggregator(make_source("e1", "scheduler"), 1_000, 1e12)
    now = time.time() * 1e3
    agg.apply([Lookup(now, "r1", 10, 0, 10, -5.0, None),
               LayoutKnown(now, "0123456789ab", {"rev": "a\tb\n", "cache": "c" * 40_000,
                                                  "layers": 2})])
    agg.apply([Loaded(now, "r1", 5000)])  # 5,000 hits against 10 prompt tokens
    agg.process.cpu_percent = NAN
    agg.set_pool(PoolStats(backend="mooncake", keys=-1, used_bytes=2**70, high_watermark=1.5,
                           health_detail="\x1b]0;x\x07", segments=[
                               SegmentUsage(name="h\x9b:1", used_bytes=-5, total_bytes=2**70)]))
    st = agg.state(now)
    msg = decode(_frame(st))
    assert isinstance(msg, Report)
    got = msg.state
    assert got.lookup.hit_rate == 1.0 and got.lookup.hit_rate_1m == 1.0
    assert got.lookup.latency_ms_p50 == 0.0 and got.process.cpu_percent == 0.0
    assert got.pool is not None and got.pool.high_watermark == 1.0 and got.pool.keys == 0
    assert got.pool.used_bytes == MAX_BIG_COUNT - 1
    assert got.pool.health_detail == "?]0;x?" and got.pool.segments[0].name == "h?:1"
    assert len(str(got.source.layout["cache"])) == 16_384
    assert got.source.layout["rev"] == "a?b?" and got.source.layout["layers"] == 2


def test_an_agent_folds_names_past_the_bound_into_other() -> None:
    """However many distinct skip reasons and error names a connector reports, the agent's
    state stays within the schema: names past ``MAX_NAMES - 1`` count under ``OTHER``."""
    agg = Aggregator(make_source("e1", "worker"), 1_000, 1e12)
    now = time.time() * 1e3
    agg.apply([Lookup(now, f"r{i}", 10, 0, 0, 1.0, None, f"REASON_{i}") for i in range(100)])
    agg.apply([SaveSkipped(now, f"s{i}", 1, f"SKIP_{i}") for i in range(100)])
    msg = decode(_frame(agg.state(now)))
    assert isinstance(msg, Report)
    skipped = msg.state.lookup.skipped_by_reason
    assert len(skipped) == MAX_NAMES and skipped[OTHER_NAME] == 100 - (MAX_NAMES - 1)
    assert sum(skipped.values()) == msg.state.lookup.lookup_skipped == 100
    errors = msg.state.transfers.errors_by_name
    assert len(errors) == MAX_NAMES and sum(errors.values()) == 100


def test_hub_counts_hostile_reports_as_bad_and_keeps_the_real_state(
        hub: FleetHub, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Through a keyed hub and a raw agent socket: each hostile report of an agent the hub
    already holds, and of a new one, is one bad message; the hub keeps the agent's last good
    state, never shows the new one, and a good report after them is taken as before."""
    fake = FakeAgent(ctx, hub.address)
    good = make_source("good", "scheduler")
    fake.report(good, lookup=LookupStats(prompt_tokens=1000, loaded_tokens=250,
                                         hit_rate=0.25))
    wait_until(lambda: "good/scheduler" in hub.fleet())
    assert "good/scheduler" in hub.fleet()
    before = hub.bad_messages
    cases = [edit(_state()) for edit in HOSTILE.values()]
    evil = make_source("evil", "scheduler")
    cases += [msgspec.structs.replace(st, source=evil) for st in cases[:8]]
    for st in cases:
        fake.seq += 1
        fake.sock.send(_frame(st, fake.seq))
    wait_until(lambda: hub.bad_messages - before >= len(cases))
    assert hub.bad_messages - before == len(cases)
    fleet = hub.fleet()
    assert "evil/scheduler" not in fleet
    kept = fleet["good/scheduler"][0]
    assert (kept.lookup.prompt_tokens, kept.lookup.hit_rate) == (1000, 0.25)
    assert kept.source.layout_digest == "" and kept.source.layout == {}
    fake.report(good, lookup=LookupStats(prompt_tokens=2000, loaded_tokens=1000,
                                         hit_rate=0.5))
    wait_until(lambda: hub.fleet()["good/scheduler"][0].lookup.prompt_tokens == 2000)
    assert hub.fleet()["good/scheduler"][0].lookup.hit_rate == 0.5
    assert hub.bad_messages - before == len(cases)


def test_source_layout_of_a_real_worker_fits() -> None:
    """What ``describe_layout`` produces for a real cache decodes (the layout digest, its
    facts with a cache signature of spaces, parentheses and ``|``)."""
    torch = pytest.importorskip("torch")
    from kvpool_connector._layout_digest import ModelFacts, describe_layout

    caches = {f"layer.{i}": torch.zeros(2, 16, 4, 8, 16) for i in range(3)}
    facts = describe_layout(caches, 16, model="org/m", facts=ModelFacts(dtype="float16"),
                            block_size=16, chunk_size=256)
    src: Source = make_source("e1", layout_digest=facts.digest, layout=facts.as_dict())
    st = EngineState(source=src, started_ms=1.0, ts_ms=2.0)
    msg = decode(_frame(st))
    assert isinstance(msg, Report) and msg.state.source.layout == facts.as_dict()
