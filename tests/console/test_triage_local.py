"""``kvpool-console triage`` of an engine on the console's own host: the checks run locally, as
this user, with no SSH at all (no sshd, no key, an empty home; an SSH attempt would fail).

The engine is a stand-in process (``standin_engine.py``) with a real agent reporting to a real
hub this machine's host name, its pid, log file, port and master; the hostile reports name this
machine with another process's pid and shell metacharacters in every path.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
from triagekit import (
    one_agent_console,
    run_triage,
    run_triage_until,
    standin,
    tui_triage,
    wait_for,
    wait_reported,
)

from kvpool_agent import start_agent
from kvpool_agent.process_facts import start_ticks
from kvpool_agent.protocol import Source
from kvpool_console._liveness import local_process_alive
from kvpool_console._this_host import is_this_host
from kvpool_console.triage import TriageReport, _local
from kvpool_console.triage import _commands as C

HOSTNAME = socket.gethostname()


@pytest.fixture(autouse=True)
def _no_ssh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A home with no ~/.ssh and no agent: any SSH login fails with "no key".
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


def triage(capsys: pytest.CaptureFixture[str], hub: str, engine_id: str,
           *extra: str) -> tuple[int, TriageReport | None, str, str]:
    return run_triage(capsys, hub, engine_id, *extra)


def triage_until(capsys: pytest.CaptureFixture[str], hub: str, engine_id: str,
                 state: str) -> TriageReport:
    return run_triage_until(capsys, hub, engine_id, state)


@pytest.fixture
def engine(hub: str, master: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes],
                                                                    int, Path]]:
    """A stand-in engine reporting this machine's host name, as a connector does."""
    with standin(hub, master, tmp_path, HOSTNAME) as e:
        yield e


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_local_engine_is_checked_without_ssh(capsys: pytest.CaptureFixture[str], hub: str,
                                             engine: Any, master: str) -> None:
    proc, port, log = engine
    rc, report, _, err = triage(capsys, hub, "e1", "--json")
    assert report is not None, err
    [host] = report.hosts
    assert (host.host, host.target, host.ssh_error, host.refused) == (HOSTNAME, "local", "", [])
    [p] = host.processes
    assert (p.pid, p.state, p.agents) == (proc.pid, "running", ["e1/scheduler"])
    assert p.start_ticks == p.reported_start_ticks == start_ticks(proc.pid)
    assert p.name == _comm(proc.pid) and p.ppid == os.getpid()
    assert host.logs[0].path == str(log) and host.logs[0].error == ""
    assert f"listening on port {port}" in host.logs[0].lines
    assert host.ports is not None and host.ports.method == "ss"
    assert [(h.pid, h.name) for h in host.ports.items[0].holders] == [(proc.pid, p.name)]
    assert f"tcp {port}" in host.ports.engine_listens
    total_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text()
                    .splitlines() if line.startswith("MemTotal:"))
    assert host.memory is not None and host.memory.total_bytes == total_kb * 1024
    assert host.master is not None and (host.master.address, host.master.reachable) == (
        master, True)
    assert rc == 0 and [f.text for f in report.diagnosis] == [
        f"running: pid {proc.pid} ({p.name}) on {HOSTNAME}, state {p.letter}, reporting"]
    rc, _, text, err = triage(capsys, hub, "e1")
    assert (rc, err) == (0, "")
    assert f"host {HOSTNAME} checked locally, no SSH, " in text
    assert f"    | listening on port {port}\n" in text


def test_local_engine_stopped_then_killed(capsys: pytest.CaptureFixture[str], hub: str,
                                          engine: Any) -> None:
    proc, _, _ = engine
    os.kill(proc.pid, signal.SIGSTOP)
    report = triage_until(capsys, hub, "e1", "stopped")
    assert report.hosts[0].target == "local" and report.hosts[0].processes[0].letter == "T"
    hung = [f.text for f in report.diagnosis if f.kind == "hung"]
    assert hung == [f"hung: pid {proc.pid} ({_comm(proc.pid)}) on {HOSTNAME} is stopped "
                    f"(state T: SIGSTOP or a debugger); kill -CONT {proc.pid} resumes it"]
    rc, _, text, _ = triage(capsys, hub, "e1")
    assert rc == 1 and "hung: pid" in text
    os.kill(proc.pid, signal.SIGKILL)
    p = triage_until(capsys, hub, "e1", "zombie").hosts[0].processes[0]
    assert (p.exit, p.ppid) == ("killed by signal 9 (SIGKILL)", os.getpid())
    assert proc.wait() == -signal.SIGKILL


def test_ssh_forced_for_a_local_engine(capsys: pytest.CaptureFixture[str], hub: str,
                                       engine: Any) -> None:
    """``--ssh`` logs in even to this host: with no key in this home, exit 2 and one line."""
    rc, _, out, err = triage(capsys, hub, "e1", "--ssh")
    assert (rc, out) == (2, "")
    [line] = err.splitlines()
    assert line.startswith(f"triage: cannot ssh to {HOSTNAME}: no key") and "Traceback" not in err


def test_hostile_report_naming_this_host_has_no_effect(capsys: pytest.CaptureFixture[str],
                                                        hub: str, tmp_path: Path) -> None:
    """A report naming this machine, another process's pid and shell metacharacters in every
    path and the master: that process is only read (its /proc/<pid>/stat), every hostile value
    is refused before anything runs, and nothing they name is executed."""
    canary = tmp_path / "canary"
    victim = subprocess.Popen(["sleep", "600"])
    try:
        # Asleep, not merely exec'd: a process caught still running once read "running"
        # here and "sleeping" after (a CI run with two CPU burners).
        wait_for(lambda: _comm(victim.pid) == "sleep"
                 and psutil.Process(victim.pid).status() == psutil.STATUS_SLEEPING,
                 "sleep asleep")
        before = (start_ticks(victim.pid), psutil.Process(victim.pid).status())
        handle = start_agent(Source(
            agent_id="hostile/scheduler", engine_id="hostile", instance_role="mixed",
            kv_role="kv_both", process_role="replay", pid=victim.pid, host=HOSTNAME,
            start_ticks=start_ticks(), log_path=f"/tmp/x'; touch {canary}; echo '",
            sockets=(f"/tmp/$(touch {canary})",), master=f"`touch${{IFS}}{canary}`:1"),
            address=hub)
        try:
            wait_reported(hub, "hostile")
            rc, report, _, err = triage(capsys, hub, "hostile", "--json")
        finally:
            handle.stop()
        assert report is not None, err
        [host] = report.hosts
        assert host.target == "local"
        # The pid was read as data: it names a process started after the reported start.
        [p] = host.processes
        assert (p.pid, p.state, p.name) == (victim.pid, "reused", "sleep")
        assert p.start_ticks == before[0] != p.reported_start_ticks
        assert host.logs == [] and host.master is None
        assert host.ports is not None and host.ports.items == []
        assert len(host.refused) == 3 and all("refused" in r for r in host.refused)
        assert rc == 1 and [f.kind for f in report.diagnosis if f.severity == "critical"] == [
            "gone"]
        assert not canary.exists()
        assert victim.poll() is None
        assert (start_ticks(victim.pid), psutil.Process(victim.pid).status()) == before
    finally:
        victim.kill()
        victim.wait()


async def test_local_run_passes_values_literally(tmp_path: Path) -> None:
    """Even an unchecked value reaches the local script as one literal argument: no shell
    parses the argument vector."""
    canary = tmp_path / "canary"
    hostile = f"e'3\"; touch {canary}; $(touch {canary}) `touch {canary}`\ntouch {canary}"
    out = await _local.run(C.argv('printf "%s" "$1"', hostile, timeout_s=5), 5)
    assert out == (0, hostile, "") and not canary.exists()


async def test_local_run_is_killed_after_its_bound(tmp_path: Path) -> None:
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    out = await _local.run(C.argv('cat "$1"', str(fifo), timeout_s=0.5), 0.5)
    # timeout(1) ends the script at its bound (124), or the runner's own bound kills it.
    assert out in ((124, "", ""), "timed out after 0.5 s")
    wait_for(lambda: not any(str(fifo) in (q.info["cmdline"] or [])
                             for q in psutil.process_iter(["cmdline"])), "no reader left")


def _own_addresses() -> list[str]:
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6) and "%" not in a.address]


def test_this_host_rule() -> None:
    for host in ("localhost", "LOCALHOST", "127.0.0.1", "127.0.1.1", "::1", "[::1]",
                 "::ffff:127.0.0.1", HOSTNAME, HOSTNAME.upper(), *_own_addresses()):
        assert is_this_host(host), host
    for host in ("engine-host-1", "", "fe80::1%lo", f"{HOSTNAME}.invalid", "0.0.0.0"):
        assert not is_this_host(host), host
    others = [str(ipaddress.ip_address("198.51.100.7")), "2001:db8::7"]
    assert [a for a in others if is_this_host(a)] == [a for a in others
                                                     if a in _own_addresses()]


def test_liveness_asks_the_same_rule() -> None:
    """The stale alert's hung/gone look-up counts an interface address as this host too."""
    for host in (HOSTNAME, *_own_addresses()):
        src = Source(agent_id="l/scheduler", engine_id="l", instance_role="mixed",
                     kv_role="kv_both", process_role="replay", pid=os.getpid(), host=host,
                     start_ticks=start_ticks())
        assert local_process_alive(src) is True, host
    src = msgspec.structs.replace(src, host="engine-host-1")
    assert local_process_alive(src) is None


@pytest.mark.parametrize("ssh", [False, True])
async def test_tui_triage_of_a_local_engine(ssh: bool) -> None:
    """``t`` on an engine of this host: the panel shows the local run, with no SSH setup; a
    console made with ``triage_ssh`` (the screenshots') logs in, and here finds no key."""
    from textual.widgets import RichLog, Static

    app = one_agent_console("tui", HOSTNAME, triage_ssh=ssh)
    async with app.run_test(size=(120, 50)) as pilot:
        panel = await tui_triage(app, pilot, 30.0)
        deadline = time.monotonic() + 30
        [host] = panel.report.hosts
        body = str(panel.query_one("#triage-body", Static).render())
        if ssh:
            assert host.target == "" and host.ssh_error.startswith(
                f"cannot ssh to {HOSTNAME}: no key")
            assert host.processes == [] and f"cannot ssh to {HOSTNAME}: no key" in body
            return
        assert (host.target, host.ssh_error) == ("local", "")
        assert (host.processes[0].pid, host.processes[0].state) == (os.getpid(), "running")
        assert f"running: pid {os.getpid()}" in body
        assert f"host {HOSTNAME} checked locally, no SSH" in body
        # The events log has the verdict, its most severe finding, not only "requested" (a
        # new user found no result there).
        worst = min(panel.report.diagnosis,
                    key=lambda f: ("critical", "warning", "info").index(f.severity))
        await pilot.press("escape", "3")  # the Events tab: its log renders once it has a size
        log = app.query_one("#events-log", RichLog)
        verdict = f"triage: engine tui: {worst.severity} {worst.text}"[:60]
        while time.monotonic() < deadline and not any(verdict in x.text for x in log.lines):
            await pilot.pause(0.05)
        lines = [line.text for line in log.lines]
        assert any("triage: engine tui requested" in x for x in lines), lines
        assert any(verdict in x for x in lines), (verdict, lines)
