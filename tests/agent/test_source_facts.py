"""The triage facts in ``Source`` (start time, pid namespace, log file, ports, sockets, master)
are optional fields at its end: a peer of the previous release and this one decode each
other's reports."""

from __future__ import annotations

import os

import msgspec

from kvpool_agent.protocol import PROTOCOL_VERSION, EngineState, Report, Source, decode, encode


class _OldSource(msgspec.Struct, frozen=True, kw_only=True):
    """``Source`` as the previous release defined it."""

    agent_id: str
    engine_id: str
    instance_role: str
    kv_role: str
    process_role: str
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    pid: int = 0
    host: str = ""
    backend: str = ""
    model: str = ""


class _OldState(msgspec.Struct, kw_only=True):
    source: _OldSource
    started_ms: float
    ts_ms: float


class _OldReport(msgspec.Struct, tag="report", kw_only=True):
    v: int
    seq: int
    kind: str
    state: _OldState


def test_old_and_new_peers_decode_each_other() -> None:
    new = Source(agent_id="e/scheduler", engine_id="e", instance_role="mixed",
                 kv_role="kv_both", process_role="scheduler", pid=7, host="h",
                 start_ticks=12345, pid_ns=4026531836, log_path="/var/log/e.log",
                 ports=(8000, 8001),
                 sockets=("/tmp/kvpool-lookup-h-1-dp0.sock",), master="10.0.0.1:50051")
    frame = encode(Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot",
                          state=EngineState(source=new, started_ms=1.0, ts_ms=2.0)))
    old = msgspec.msgpack.decode(frame, type=_OldReport).state.source
    assert (old.agent_id, old.pid, old.host) == ("e/scheduler", 7, "h")

    old_frame = msgspec.msgpack.encode(_OldReport(v=PROTOCOL_VERSION, seq=1, kind="snapshot",
                                                  state=_OldState(source=_OldSource(
                                                      **{f: getattr(old, f)
                                                         for f in old.__struct_fields__}),
                                                      started_ms=1.0, ts_ms=2.0)))
    got = decode(old_frame)
    assert isinstance(got, Report)
    src = got.state.source
    assert (src.pid, src.start_ticks, src.pid_ns, src.log_path, src.ports, src.sockets,
            src.master) == (7, 0, 0, "", (), (), "")
    # And the new fields survive a round trip between new peers.
    back = decode(frame)
    assert isinstance(back, Report) and back.state.source == new


def test_pid_namespace_is_this_process_s() -> None:
    """``process_facts`` reports the inode ``readlink /proc/self/ns/pid`` names."""
    from kvpool_agent.process_facts import pid_namespace, process_facts

    link = os.readlink("/proc/self/ns/pid")
    assert link == f"pid:[{pid_namespace()}]" and pid_namespace() > 0
    assert process_facts()["pid_ns"] == pid_namespace()
