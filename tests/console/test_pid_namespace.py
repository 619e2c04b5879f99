"""An engine in another pid namespace (a container on the host's network) reports this host and
a pid of its container: triage (local and over SSH) and the stale alert's hung/gone verdict
must not judge that pid here, where it names an unrelated process; triage says so in one line.

The engine is a real process in a new pid namespace (``unshare --user --map-root-user --pid
--fork``: no root needed where user namespaces are allowed) reporting the facts an agent
reports (``process_facts``): there it is pid 1, here pid 1 is this machine's init. Reports
naming another namespace with a live or a dead pid of this one are forged beside it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from sshd import Sshd

from kvpool_agent.process_facts import pid_namespace, start_ticks
from kvpool_agent.protocol import EngineState, Source
from kvpool_console._liveness import OTHER_PID_NAMESPACE, local_process_alive
from kvpool_console.alerts import AlertSettings, evaluate
from kvpool_console.triage import TriageReport, exit_status, render
from kvpool_console.triage._run import triage_engine

HOST = socket.gethostname()
NOW_MS = 1_800_000_000_000.0
AGE_MS = 2_000_000.0  # silent past DOWN: any verdict would be critical

_FACTS = ("import json, os, sys; from kvpool_agent.process_facts import process_facts; "
          "print(json.dumps({'pid': os.getpid(), **process_facts()}), flush=True); "
          "sys.stdin.read()")


@pytest.fixture
def contained() -> Iterator[dict[str, Any]]:
    """A process in a pid namespace of its own: the facts it reports (``pid``, ``pid_ns``,
    ``start_ticks``...). Skipped where ``unshare`` cannot make one (user namespaces off)."""
    proc = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--",
         sys.executable, "-c", _FACTS],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.skip(f"unshare cannot make a pid namespace here: "
                        f"{proc.communicate(timeout=30)[1].decode().strip()}")
        yield json.loads(line)
    finally:
        proc.stdin.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _states(*sources: dict[str, Any]) -> dict[str, EngineState]:
    out = {}
    for i, extra in enumerate(sources):
        src = msgspec.convert({"agent_id": f"c/a{i}", "engine_id": "c", "instance_role": "mixed",
                               "kv_role": "kv_both", "process_role": "replay", "host": HOST,
                               **extra}, Source)
        out[src.agent_id] = EngineState(source=src, started_ms=0, ts_ms=NOW_MS - AGE_MS)
    return out


def _reported(facts: dict[str, Any]) -> dict[str, Any]:
    """What the contained process's agent reports of itself."""
    return {k: facts[k] for k in ("pid", "pid_ns", "start_ticks")}


def _stale(states: dict[str, EngineState]) -> str:
    (alert,) = [a for a in evaluate(states, {a: NOW_MS - AGE_MS for a in states}, NOW_MS,
                                    AlertSettings(alive=local_process_alive))
                if a.rule == "stale"]
    return alert.message


def test_the_contained_process_reports_its_own_namespace(contained: dict[str, Any]) -> None:
    assert contained["pid"] == 1 and contained["start_ticks"] > 0
    assert contained["pid_ns"] not in (0, pid_namespace())


def test_liveness_does_not_judge_another_namespace(contained: dict[str, Any],
                                                   stopped: subprocess.Popen[bytes]) -> None:
    src = msgspec.convert(_states(_reported(contained))["c/a0"].source, Source)
    assert local_process_alive(src) is None
    # Without the field (an agent before it) pid 1 here, this machine's init, was judged:
    # another start time, so "gone" for an engine that runs.
    assert local_process_alive(msgspec.structs.replace(src, pid_ns=0)) is False
    # The stale alert: "down", neither hung nor gone.
    assert _stale(_states(_reported(contained))).startswith("down: no report for")
    # Forged: a live (stopped) pid and a dead one of this namespace, reported from another.
    other = contained["pid_ns"]
    hung = {"pid": stopped.pid, "start_ticks": start_ticks(stopped.pid)}
    assert _stale(_states({**hung, "pid_ns": other})).startswith("down: no report for")
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert _stale(_states({"pid": dead.pid, "start_ticks": 1, "pid_ns": other})).startswith(
        "down: no report for")
    # The same reports naming this namespace are judged, as before the field.
    assert _stale(_states({**hung, "pid_ns": pid_namespace()})).startswith(
        f"hung: pid {stopped.pid} on ")
    assert _stale(_states({"pid": dead.pid, "start_ticks": 1, "pid_ns": pid_namespace()})
                  ).startswith(f"gone: pid {dead.pid} on ")


def _assert_not_judged(report: TriageReport, pid: int, pid_ns: int) -> None:
    """``pid`` (of namespace ``pid_ns``) is neither hung, gone nor running: one line says
    where to run triage."""
    [host] = report.hosts
    assert host.pid_ns == pid_namespace()
    [proc] = [p for p in host.processes if p.pid == pid]
    assert (proc.state, proc.pid_ns, proc.letter, proc.name) == ("other_namespace", pid_ns,
                                                                  "", "")
    lines = [f.text for f in report.diagnosis if "namespace" in f.text]
    assert lines == [f"pid {pid} on {host.host} (pid namespace pid:[{pid_ns}]): "
                     f"{OTHER_PID_NAMESPACE}"]
    assert not any(f.kind in ("hung", "gone", "oom", "ok") for f in report.diagnosis), \
        report.diagnosis
    assert exit_status(report) == 0
    assert f"other_namespace (its pid namespace pid:[{pid_ns}], this check's pid:" \
           f"[{pid_namespace()}])" in render(report).plain


async def test_local_triage_says_where_to_run_it(contained: dict[str, Any],
                                                 stopped: subprocess.Popen[bytes]) -> None:
    report = await triage_engine("c", _states(_reported(contained)), reporting=False)
    assert report.hosts[0].target == "local"
    _assert_not_judged(report, 1, contained["pid_ns"])
    # A forged report: this namespace's stopped pid, said to be of another: not "hung".
    forged = {"pid": stopped.pid, "start_ticks": start_ticks(stopped.pid),
              "pid_ns": contained["pid_ns"]}
    report = await triage_engine("c", _states(forged), reporting=False)
    _assert_not_judged(report, stopped.pid, contained["pid_ns"])


async def test_ssh_triage_says_where_to_run_it(contained: dict[str, Any], sshd: Sshd,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Over SSH the checking shell's namespace is the remote login's (here: this machine's)."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    states = _states({**_reported(contained), "host": "engine-host-1"})
    report = await triage_engine("c", states, reporting=False, ssh_config=str(sshd.ssh_config))
    assert report.hosts[0].ssh_error == "" and report.hosts[0].target.startswith("root@")
    _assert_not_judged(report, 1, contained["pid_ns"])
    # The same process reported without the field (an older agent): pid 1 here is judged.
    old = _states({**_reported(contained), "pid_ns": 0, "host": "engine-host-1"})
    report = await triage_engine("c", old, reporting=False, ssh_config=str(sshd.ssh_config))
    assert report.hosts[0].processes[0].state == "reused"

