"""What the triage tests share (their ``hub`` and ``master`` fixtures are in ``conftest``): a
stand-in engine (``standin_engine.py``) reporting a given host name, and ``kvpool-console
triage`` run until the engine's process shows a state. The SSH tests (``test_triage.py``) pass
their ``--ssh-config``; the local ones (``test_triage_local.py``) nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvpool_agent.client import FleetClient
from kvpool_console.cli import main
from kvpool_console.triage import TriageReport
from kvpool_replay import free_port

STANDIN = Path(__file__).with_name("standin_engine.py")


def wait_for(pred: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout_s} s")
        time.sleep(0.05)


def wait_reported(hub: str, engine_id: str) -> None:
    client = FleetClient(hub)

    def seen() -> bool:
        client.updates(200)
        return any(e.state.source.engine_id == engine_id for e in client.fleet().values())

    try:
        wait_for(seen, f"{engine_id} reported to {hub}", timeout_s=20)
    finally:
        client.close()


def spawn(hub: str, engine_id: str, host: str, port: int, master: str,
          log: Path) -> subprocess.Popen[bytes]:
    """A stand-in engine whose agents report ``host``, its output in ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, str(STANDIN), hub, engine_id, host, str(port),
                                 master], stdout=out, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def standin(hub: str, master: str, tmp_path: Path, host: str,
            ) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """Engine ``e1`` (``spawn``) listening on its port and reported to ``hub``: (process,
    port, log); SIGKILLed after."""
    port = free_port()
    log = tmp_path / "e1.log"
    proc = spawn(hub, "e1", host, port, master, log)
    try:
        wait_for(lambda: f"listening on port {port}" in log.read_text(), "listening")
        wait_reported(hub, "e1")
        yield proc, port, log
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def run_triage(capsys: pytest.CaptureFixture[str], hub: str, engine_id: str,
               *extra: str) -> tuple[int, TriageReport | None, str, str]:
    """``kvpool-console triage ENGINE --hub HUB EXTRA...``: (exit status, the report when
    ``--json`` is in ``extra``, stdout, stderr)."""
    rc = main(["triage", engine_id, "--hub", hub, *extra])
    out, err = capsys.readouterr()
    report = msgspec.json.decode(out, type=TriageReport) if "--json" in extra and out else None
    return rc, report, out, err


def run_triage_until(capsys: pytest.CaptureFixture[str], hub: str, engine_id: str,
                     state: str, *extra: str) -> TriageReport:
    """Triage (``--json``) repeatedly until the engine's process shows ``state``; fails after
    30 s."""
    deadline = time.monotonic() + 30
    while True:
        _, report, _, err = run_triage(capsys, hub, engine_id, *extra, "--json")
        assert report is not None, err
        if report.hosts[0].processes[0].state == state or time.monotonic() > deadline:
            break
    assert report.hosts[0].processes[0].state == state, report.diagnosis
    return report


def one_agent_console(engine_id: str, host: str, **kw: Any) -> Any:
    """A ``KVPoolConsole`` over a static fleet of one agent (this process's pid and facts)
    reporting ``host``; ``kw`` go to the console."""
    from kvpool_agent.process_facts import process_facts
    from kvpool_agent.protocol import EngineState, Source
    from kvpool_console.app import KVPoolConsole
    from kvpool_console.source import StaticSource

    now = time.time() * 1e3
    src = Source(agent_id=f"{engine_id}/scheduler", engine_id=engine_id, instance_role="mixed",
                 kv_role="kv_both", process_role="replay", pid=os.getpid(), host=host,
                 **process_facts())
    return KVPoolConsole(StaticSource({src.agent_id: EngineState(
        source=src, started_ms=now, ts_ms=now)}), clock=lambda: now, **kw)


async def tui_triage(app: Any, pilot: Any, timeout_s: float) -> Any:
    """Press ``t`` and wait for the triage panel's report (``TriagePanel``); fails after
    ``timeout_s``."""
    from kvpool_console.triage.panel import TriagePanel

    await pilot.press("t")
    await pilot.pause()
    panel = app.screen.query_one(TriagePanel)
    deadline = time.monotonic() + timeout_s
    while panel.report is None and time.monotonic() < deadline:
        await pilot.pause(0.05)
    assert panel.report is not None, f"no triage report within {timeout_s} s"
    return panel
