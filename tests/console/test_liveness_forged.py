"""The stale alert's hung / gone verdict on this host, with an agent key that adds forged agents
to a real engine (helper 76): a forged agent naming a live pid must not turn a dead engine
"hung", nor one naming a dead pid turn a stopped one "gone"; without the reporter's start
ticks a running pid proves nothing. Real processes: a stopped ``sleep`` (hung) and a reaped
one (gone)."""

from __future__ import annotations

import socket
import subprocess
from typing import Any

import msgspec
import pytest

from kvpool_agent.process_facts import start_ticks
from kvpool_agent.protocol import EngineState, Source
from kvpool_console._liveness import local_process_alive
from kvpool_console.alerts import AlertSettings, evaluate

NOW_MS = 1_800_000_000_000.0
AGE_MS = 2_000_000.0  # silent past DOWN: the verdict is critical whatever it is


def _states(*sources: dict[str, Any]) -> dict[str, EngineState]:
    out = {}
    for i, extra in enumerate(sources):
        src = msgspec.convert({"agent_id": f"e/a{i}", "engine_id": "e",
                               "instance_role": "mixed", "kv_role": "kv_both",
                               "process_role": "replay", "host": socket.gethostname(),
                               **extra}, Source)
        out[src.agent_id] = EngineState(source=src, started_ms=0, ts_ms=NOW_MS - AGE_MS)
    return out


def _stale_text(states: dict[str, EngineState]) -> str:
    seen = {a: NOW_MS - AGE_MS for a in states}
    (alert,) = [a for a in evaluate(states, seen, NOW_MS,
                                    AlertSettings(alive=local_process_alive))
                if a.rule == "stale"]
    return alert.message


@pytest.fixture
def dead() -> int:
    """The pid of a process that exited and was reaped (a gone engine)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_one_engine_alone_is_hung_or_gone(stopped: subprocess.Popen[bytes], dead: int) -> None:
    hung = _states({"pid": stopped.pid, "start_ticks": start_ticks(stopped.pid)})
    assert _stale_text(hung).startswith(f"hung: pid {stopped.pid} on ")
    assert _stale_text(_states({"pid": dead, "start_ticks": 12345})).startswith(
        f"gone: pid {dead} on ")


def test_a_forged_live_pid_does_not_make_a_dead_engine_hung(dead: int) -> None:
    """The real agent's pid is gone; a forged agent names pid 1 (running) with no start ticks,
    or with pid 1's own: never "hung"."""
    real = {"pid": dead, "start_ticks": 12345}
    for order in ((real, {"pid": 1}), ({"pid": 1}, real)):  # the forged agent listed first too
        assert _stale_text(_states(*order)).startswith(f"gone: pid {dead} on ")
    forged = {"pid": 1, "start_ticks": start_ticks(1)}
    text = _stale_text(_states(real, forged))
    assert text.startswith("down: no report for"), text  # they disagree: neither verdict


def test_a_forged_dead_pid_does_not_make_a_hung_engine_gone(
        stopped: subprocess.Popen[bytes], dead: int) -> None:
    real = {"pid": stopped.pid, "start_ticks": start_ticks(stopped.pid)}
    text = _stale_text(_states(real, {"pid": dead, "start_ticks": 1}))
    assert text.startswith("down: no report for"), text


def test_a_running_pid_without_start_ticks_proves_nothing(
        stopped: subprocess.Popen[bytes]) -> None:
    src = msgspec.convert({"agent_id": "e/a0", "engine_id": "e", "instance_role": "mixed",
                           "kv_role": "kv_both", "process_role": "replay",
                           "host": socket.gethostname(), "pid": stopped.pid}, Source)
    assert local_process_alive(src) is None
    assert local_process_alive(msgspec.structs.replace(
        src, start_ticks=start_ticks(stopped.pid))) is True
    assert local_process_alive(msgspec.structs.replace(
        src, start_ticks=start_ticks(stopped.pid) + 1)) is False  # another process's pid
