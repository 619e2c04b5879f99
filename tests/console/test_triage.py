"""``kvpool-console triage`` against a real sshd on 127.0.0.1, a real hub and real processes.

The engines are stand-in processes (``standin_engine.py``) with a real agent reporting the
facts a connector reports; triage takes their host, pid, log file, port and master from the
hub, logs in with the operator's ssh config (``sshd.py``) and looks at the real processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
from sshd import Sshd
from triagekit import (
    one_agent_console,
    run_triage,
    run_triage_until,
    spawn,
    standin,
    tui_triage,
    wait_for,
    wait_reported,
)

from kvpool_agent import start_agent
from kvpool_agent.agent import AgentHandle
from kvpool_agent.process_facts import process_facts, start_ticks
from kvpool_agent.protocol import Source
from kvpool_console.source import StaticSource
from kvpool_console.triage import TriageReport
from kvpool_console.triage._commands import PORTS, command
from kvpool_console.triage._model import HostReport, LogTail
from kvpool_console.triage._parse import kernel_evidence, parse_proc_sockets, sections
from kvpool_console.triage._plan import safe_host, safe_path
from kvpool_console.triage._render import render
from kvpool_replay import free_port


@pytest.fixture(autouse=True)
def _no_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the keys in the test's ssh config count, never an agent of whoever runs the tests.
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


def triage(capsys: pytest.CaptureFixture[str], hub: str, engine_id: str, sshd: Sshd,
           *extra: str) -> tuple[int, TriageReport | None, str, str]:
    return run_triage(capsys, hub, engine_id, "--ssh-config", str(sshd.ssh_config), *extra)


def triage_until(capsys: pytest.CaptureFixture[str], hub: str, engine_id: str, sshd: Sshd,
                 state: str) -> TriageReport:
    return run_triage_until(capsys, hub, engine_id, state, "--ssh-config",
                            str(sshd.ssh_config))


@pytest.fixture
def engine(hub: str, master: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes],
                                                                    int, Path]]:
    with standin(hub, master, tmp_path, "engine-host-1") as e:
        yield e


def test_running_engine_everything_checked(capsys: pytest.CaptureFixture[str], hub: str,
                                           sshd: Sshd, engine: Any, master: str) -> None:
    proc, port, log = engine
    rc, report, _, err = triage(capsys, hub, "e1", sshd, "--json")
    assert report is not None, err
    host = report.hosts[0]
    assert host.ssh_error == "" and host.target == f"root@127.0.0.1:{sshd.port}"
    p = host.processes[0]
    assert (p.pid, p.state, p.agents) == (proc.pid, "running", ["e1/scheduler"])
    assert p.start_ticks == p.reported_start_ticks == start_ticks(proc.pid)
    assert p.name == Path(f"/proc/{proc.pid}/comm").read_text().strip()
    assert host.logs[0].path == str(log)
    assert f"listening on port {port}" in host.logs[0].lines
    assert host.ports is not None and host.ports.method == "ss"
    assert [(h.pid, h.name) for h in host.ports.items[0].holders] == [(proc.pid, p.name)]
    assert f"tcp {port}" in host.ports.engine_listens
    total_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text()
                    .splitlines() if line.startswith("MemTotal:"))
    assert host.memory is not None and host.memory.total_bytes == total_kb * 1024
    assert 0 < host.memory.available_bytes <= host.memory.total_bytes
    assert host.accel is not None and not host.accel.present
    assert "neither npu-smi nor hccn_tool" in host.accel.note
    assert host.master is not None and host.master.address == master
    assert host.master.reachable is True
    # Reporting and running: nothing critical, exit 0.
    assert rc == 0 and [f.kind for f in report.diagnosis] == ["ok"]


def test_stopped_engine_is_hung(capsys: pytest.CaptureFixture[str], hub: str, sshd: Sshd,
                                engine: Any) -> None:
    proc, _, _ = engine
    os.kill(proc.pid, signal.SIGSTOP)
    report = triage_until(capsys, hub, "e1", sshd, "stopped")
    assert report.hosts[0].processes[0].letter == "T"
    hung = [f.text for f in report.diagnosis if f.kind == "hung"]
    assert hung and hung[0].startswith(f"hung: pid {proc.pid} (")
    assert f"kill -CONT {proc.pid}" in hung[0]
    rc, _, text, _ = triage(capsys, hub, "e1", sshd)
    assert rc == 1 and "hung: pid" in text
    os.kill(proc.pid, signal.SIGCONT)


def test_killed_engine_is_gone(capsys: pytest.CaptureFixture[str], hub: str, sshd: Sshd,
                               engine: Any) -> None:
    proc, _, _ = engine
    os.kill(proc.pid, signal.SIGKILL)
    # Not reaped yet: the kernel still holds the exit status.
    report = triage_until(capsys, hub, "e1", sshd, "zombie")
    p = report.hosts[0].processes[0]
    assert p.exit == "killed by signal 9 (SIGKILL)" and p.ppid == os.getpid()
    gone = [f.text for f in report.diagnosis if f.kind == "gone"]
    assert gone == [f"gone: pid {proc.pid} ({p.name}) on engine-host-1 killed by signal 9 "
                    f"(SIGKILL); its parent pid {os.getpid()} has not reaped it"]
    assert proc.wait() == -signal.SIGKILL
    # Reaped: only the kernel log could still tell, and it names no OOM kill of this pid.
    report = triage_until(capsys, hub, "e1", sshd, "gone")
    p = report.hosts[0].processes[0]
    assert p.exit == ""
    if p.kernel_log.startswith("unreadable"):
        assert p.oom_killed is None and p.exit_source.startswith("unknown: kernel log")
    else:
        assert p.kernel_log in ("dmesg", "journalctl -k") and p.oom_killed is False
        assert p.exit_source.startswith("unknown: reaped by its parent")
    assert any(f.text.startswith(f"gone: pid {proc.pid} on engine-host-1 no longer exists")
               for f in report.diagnosis)


def test_port_taken_names_its_holder(capsys: pytest.CaptureFixture[str], hub: str,
                                     sshd: Sshd, master: str, tmp_path: Path) -> None:
    port = free_port()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"up\n"
        log = tmp_path / "e2.log"
        engine = spawn(hub, "e2", "engine-host-1", port, master, log)
        assert engine.wait(30) == 1
        assert "Address already in use" in log.read_text()
        report = triage_until(capsys, hub, "e2", sshd, "gone")
        name = Path(f"/proc/{holder.pid}/comm").read_text().strip()
        item = report.hosts[0].ports.items[0]  # type: ignore[union-attr]
        assert (item.kind, item.port) == ("tcp", port)
        assert [(h.pid, h.name) for h in item.holders] == [(holder.pid, name)]
        assert (f"port {port} held by pid {holder.pid} ({name}) on engine-host-1"
                in [f.text for f in report.diagnosis if f.kind == "port"])
        assert any("Address already in use" in line for line in report.hosts[0].logs[0].lines)
    finally:
        holder.kill()
        holder.wait()


HOSTILE = "e'3\"; touch {c}; $(touch {c}) `touch {c}`\ntouch {c}"


def _agent(hub: str, engine_id: str, host: str, **facts: Any) -> AgentHandle:
    return start_agent(Source(agent_id=f"{engine_id}/scheduler", engine_id=engine_id,
                              instance_role="mixed", kv_role="kv_both",
                              process_role="replay", pid=os.getpid(), host=host,
                              start_ticks=start_ticks(), **facts), address=hub)


def test_hostile_values_run_nothing(capsys: pytest.CaptureFixture[str], hub: str, sshd: Sshd,
                                    tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    # An engine id like HOSTILE is refused by the wire schema (tests/console/test_hostile_text).
    name = "hostile-e"
    bad_path = f"/tmp/x'; touch {canary}; echo '"
    # The master without a space (the wire takes visible ASCII only: protocol.Address).
    handle = _agent(hub, name, "engine-host-1", log_path=bad_path,
                    sockets=(f"/tmp/$(touch {canary})",),
                    master=f"`touch${{IFS}}{canary}`:1")
    try:
        wait_reported(hub, name)
        rc, report, _, err = triage(capsys, hub, name, sshd, "--json")
    finally:
        handle.stop()
    assert report is not None, err
    host = report.hosts[0]
    # The process was checked; every hostile value was refused and none sent.
    assert host.processes[0].state == "running" and host.processes[0].pid == os.getpid()
    assert host.logs == [] and host.master is None and host.ports.items == []  # type: ignore
    assert len(host.refused) == 3 and all("refused" in r for r in host.refused)
    assert not canary.exists()
    assert rc == 0


def test_quoting_keeps_arguments_literal(tmp_path: Path) -> None:
    """Even unchecked text passed to ``command`` reaches the script as one literal argument."""
    canary = tmp_path / "canary"
    hostile = HOSTILE.format(c=canary)
    out = subprocess.run(["sh", "-c", command('printf "%s" "$1"', hostile, timeout_s=5)],
                         capture_output=True, text=True, check=True).stdout
    assert out == hostile and not canary.exists()


@pytest.mark.parametrize(("host", "reason"), [
    ("stranger-host", "host key unknown"),
    ("refused-host", "login refused"),
    ("nokey-host", "no key"),
    ("closed-host", "host unreachable: Connection refused"),
    ("nocheck-host", "host key checking is off"),
])
def test_no_ssh_access_is_one_line(capsys: pytest.CaptureFixture[str], hub: str, sshd: Sshd,
                                   host: str, reason: str) -> None:
    handle = _agent(hub, f"e-{host}", host)
    try:
        wait_reported(hub, f"e-{host}")
        rc, _, out, err = triage(capsys, hub, f"e-{host}", sshd)
    finally:
        handle.stop()
    assert rc == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"triage: cannot ssh to {host}")
    assert f": {reason}" in lines[0]
    assert "Traceback" not in err


def test_unknown_engine_exit_2(capsys: pytest.CaptureFixture[str], hub: str,
                               sshd: Sshd) -> None:
    handle = _agent(hub, "known", "engine-host-1")
    try:
        wait_reported(hub, "known")
        rc, _, out, err = triage(capsys, hub, "nope", sshd)
    finally:
        handle.stop()
    assert rc == 2 and out == ""
    assert err.strip() == "triage: unknown engine 'nope'; known: known"


def test_proc_fallback_without_ss(tmp_path: Path) -> None:
    """The ``/proc`` branch of the port check finds a real listener and its process."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "cat", "find", "grep"):
        (bin_dir / tool).symlink_to(shutil.which(tool))  # type: ignore[arg-type]
    marker = "@@m@@"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([str(bin_dir / "sh"), "-c", command(PORTS, marker, timeout_s=5)],
                             env={"PATH": str(bin_dir)}, capture_output=True, text=True).stdout
    parts = dict(sections(out, marker))
    assert "proc" in parts and "ss" not in parts
    found = parse_proc_sockets(parts["proc"], parts["fds"], parts["comm"])
    mine = [h for kind, where, h in found if (kind, where) == ("tcp", str(port))]
    assert [h.pid for h in mine] == [os.getpid()]
    assert mine[0].name == Path("/proc/self/comm").read_text().strip()


def test_kernel_log_evidence_for_the_pid() -> None:
    lines = [
        "[  100.000001] Out of memory: Killed process 4242 (python3) total-vm:1000kB, "
        "anon-rss:900kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:40kB oom_score_adj:0",
        "[  100.000002] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,"
        "mems_allowed=0,global_oom,task_memcg=/,task=python3,pid=4242,uid=0",
        "[   50.000000] Out of memory: Killed process 777 (other) total-vm:1kB",
        "[  120.500000] python3[5151]: segfault at 0 ip 0000 sp 0000 error 4",
    ]
    assert kernel_evidence(lines, 4242)[:2] == (True, "")
    assert len(kernel_evidence(lines, 4242)[2]) == 2
    # An OOM kill stamped before the process started was an older process with that pid.
    assert kernel_evidence(lines, 4242, after_s=150.0) == (False, "", [])
    assert kernel_evidence(lines, 5151)[:2] == (False, "killed by signal 11 (SIGSEGV)")
    assert kernel_evidence(lines, 42)[:2] == (False, "")


def test_process_facts_of_a_redirected_process(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    code = ("import msgspec, sys; from kvpool_agent.process_facts import process_facts; "
            "sys.stderr.write(msgspec.json.encode(process_facts(sockets=['/s'], "
            "master='m:1')).decode())")
    with log.open("wb") as f:
        subprocess.run([sys.executable, "-c", code], stderr=f, check=True)
    facts = msgspec.json.decode(log.read_bytes())
    assert facts["log_path"] == str(log)
    assert facts["sockets"] == ["/s"] and facts["master"] == "m:1"
    assert facts["start_ticks"] > 0


async def test_tui_triage_in_detail_screen(sshd: Sshd, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """``t`` on the fleet screen opens the engine's detail screen with the triage result;
    the operator's ~/.ssh (here the test's home) is used."""
    from textual.widgets import Static

    from kvpool_agent.protocol import EngineState
    from kvpool_console.app import KVPoolConsole
    from kvpool_console.screens import EngineDetailScreen
    from kvpool_console.triage.panel import TriagePanel

    monkeypatch.setenv("HOME", str(sshd.home))
    now = time.time() * 1e3
    src = Source(agent_id="tui/scheduler", engine_id="tui", instance_role="mixed",
                 kv_role="kv_both", process_role="replay", pid=os.getpid(),
                 host="engine-host-1", **process_facts())
    app = KVPoolConsole(StaticSource({"tui/scheduler": EngineState(
        source=src, started_ms=now, ts_ms=now)}), clock=lambda: now)
    async with app.run_test(size=(120, 50)) as pilot:
        await pilot.press("t")
        await pilot.pause()
        assert isinstance(app.screen, EngineDetailScreen) and app.screen.engine_id == "tui"
        panel = app.screen.query_one(TriagePanel)
        deadline = time.monotonic() + 30
        while panel.report is None and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert panel.report is not None
        assert panel.report.hosts[0].processes[0].state == "running"
        body = str(panel.query_one("#triage-body", Static).render())
        assert f"running: pid {os.getpid()}" in body
        # ``t`` again on the detail screen replaces the panel with a fresh run.
        await pilot.press("t")
        await pilot.pause()
        assert len(app.screen.query(TriagePanel)) == 1


def test_hidden_proc_is_not_called_gone() -> None:
    """When ``/proc`` hides other users' processes a missing pid is not evidence of death."""
    from kvpool_console.triage._plan import ProcPlan
    from kvpool_console.triage._run import _processes

    m = "@@m@@"
    out = f"{m} clk 100\n{m} hidepid\n{m} pid 4242\n{m} gone 4242\n"
    klog = f"{m} dmesg\n"
    [check], _ = _processes([ProcPlan(4242, 1000, ("e/scheduler",))], (0, out, ""),
                            (0, klog, ""), m)
    assert check.state == "unknown" and "hidepid" in check.error
    [check], _ = _processes([ProcPlan(4242, 1000, ("e/scheduler",))],
                            (0, out.replace(f"{m} hidepid\n", ""), ""), (0, klog, ""), m)
    assert check.state == "gone" and check.oom_killed is False


def test_fifo_log_is_not_read_and_nothing_stays(capsys: pytest.CaptureFixture[str], hub: str,
                                                sshd: Sshd, tmp_path: Path) -> None:
    """A FIFO as the log path: refused on the host as not a regular file, and no ``tail``
    of it is left blocked there after the check."""
    fifo = tmp_path / "engine.log"
    os.mkfifo(fifo)
    handle = _agent(hub, "fifo-e", "engine-host-1", log_path=str(fifo))
    try:
        wait_reported(hub, "fifo-e")
        rc, report, _, err = triage(capsys, hub, "fifo-e", sshd, "--json")
    finally:
        handle.stop()
    assert report is not None, err
    assert [(log.path, log.error, log.lines) for log in report.hosts[0].logs] == [
        (str(fifo), "not a regular file", [])]
    assert rc == 0
    assert _readers_of(str(fifo)) == []


def test_log_linked_to_a_secret_shows_no_byte_of_it(capsys: pytest.CaptureFixture[str],
                                                     hub: str, sshd: Sshd,
                                                     tmp_path: Path) -> None:
    """Over SSH, the log tail runs the same one-open-file script as locally: a log swapped for
    a symbolic link to a file only its owner may read, or one under a linked directory, shows
    no byte of it."""
    secret = tmp_path / "keys" / "operator.key_secret"
    secret.parent.mkdir()
    secret.write_text('curve\n    secret-key = "TOPSECRETz85"\n')
    secret.chmod(0o600)
    link = tmp_path / "engine.log"
    link.symlink_to(secret)
    linked_dir = tmp_path / "logs"
    linked_dir.symlink_to(secret.parent)
    handles = [_agent(hub, "link-e", "engine-host-1", log_path=str(link)),
               _agent(hub, "dir-e", "engine-host-1",
                      log_path=str(linked_dir / "operator.key_secret"))]
    try:
        wait_reported(hub, "link-e")
        wait_reported(hub, "dir-e")
        _, link_report, link_out, _ = triage(capsys, hub, "link-e", sshd, "--json")
        _, dir_report, dir_out, _ = triage(capsys, hub, "dir-e", sshd, "--json")
    finally:
        for h in handles:
            h.stop()
    assert link_report is not None and dir_report is not None
    assert [(log.lines, log.error) for log in link_report.hosts[0].logs] == [
        ([], "a symbolic link: triage reads no link (the engine's log is the file itself)")]
    assert [(log.lines, log.error) for log in dir_report.hosts[0].logs] == [
        ([], "private to its owner (mode -rw-------): triage shows no such file (keys, "
             "credentials)")]
    assert "TOPSECRET" not in link_out + dir_out


def _readers_of(path: str) -> list[int]:
    """Pids of processes whose command line names ``path``."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if path in (p.info["cmdline"] or []):
            found.append(p.info["pid"])
    return found


def test_device_paths_refused_before_sending(capsys: pytest.CaptureFixture[str], hub: str,
                                             sshd: Sshd) -> None:
    handle = _agent(hub, "dev-e", "engine-host-1", log_path="/dev/zero")
    try:
        wait_reported(hub, "dev-e")
        rc, report, _, err = triage(capsys, hub, "dev-e", sshd, "--json")
    finally:
        handle.stop()
    assert report is not None, err
    host = report.hosts[0]
    assert host.logs == []  # no LOG_TAIL was sent for it
    assert host.refused == ["dev-e/scheduler: log path '/dev/zero' refused (not an absolute "
                            "path of plain characters outside /dev, /proc and /sys)"]
    assert rc == 0


@pytest.mark.parametrize("path", ["/dev/zero", "/proc/kmsg", "/sys/kernel/x", "/dev",
                                  "//dev/zero", "/./proc/kmsg", "/var/../dev/zero",
                                  "/var/log/.."])
def test_safe_path_refuses_device_trees(path: str) -> None:
    assert not safe_path(path)


@pytest.mark.parametrize("path", ["/var/log/vllm/engine.log", "/tmp/e1.log", "/devices.log",
                                  "/home/u/proc/x.log", "/var/log/"])
def test_safe_path_keeps_log_files(path: str) -> None:
    assert safe_path(path)


@pytest.mark.parametrize("host", ["fe80::1%a b;c", "::1%\nX", "::1%-oProxyCommand=x",
                                  "fe80::1%eth0", "-oProxyCommand=x", "[::1%x]", ""])
def test_safe_host_refuses_scope_ids_and_options(host: str) -> None:
    assert not safe_host(host)


@pytest.mark.parametrize("host", ["engine-host-1", "10.0.0.7", "::1", "[fe80::1]", "fe80::1"])
def test_safe_host_keeps_names_and_literals(host: str) -> None:
    assert safe_host(host)


def test_remote_script_is_killed_after_its_bound(tmp_path: Path) -> None:
    """``command`` puts the script under ``timeout``: a check that would block forever (a
    reader of a FIFO nobody writes) ends, and so does everything it started."""
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    done = subprocess.run(["sh", "-c", command('cat "$1" | cat', str(fifo), timeout_s=0.5)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 124  # timeout(1): the command timed out
    wait_for(lambda: _readers_of(str(fifo)) == [], "no reader of the FIFO left")


def test_render_makes_controls_visible() -> None:
    report = TriageReport(engine_id="e", ts_ms=0.0, reporting=True, hosts=[HostReport(
        host="h", target="h:22", logs=[LogTail(path="/l", lines=[
            "\x1b]0;owned\x07title", "\x1b[2Jclear\tand\x9bcsi"])])])
    text = render(report).plain
    assert "    | \\x1b]0;owned\\x07title\n" in text
    assert "    | \\x1b[2Jclear\tand\\x9bcsi\n" in text
    assert not any(c in text for c in "\x1b\x07\x9b")


async def test_tui_triage_uses_the_consoles_ssh_config(sshd: Sshd, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvpool-console --ssh-config FILE`` reaches the TUI's triage: with a home that knows
    no host, the run logs in only through FILE."""
    from kvpool_console.cli import _parse

    assert _parse(["--ssh-config", str(sshd.ssh_config)]).ssh_config == str(sshd.ssh_config)
    monkeypatch.setenv("HOME", str(tmp_path))
    app = one_agent_console("cfg", "engine-host-1", ssh_config=str(sshd.ssh_config))
    async with app.run_test(size=(120, 50)) as pilot:
        panel = await tui_triage(app, pilot, 10.0)
        assert panel.report.hosts[0].ssh_error == ""
        assert panel.report.hosts[0].processes[0].state == "running"


def test_the_ssh_module_imports_without_warnings() -> None:
    """Importing the console's SSH login (asyncssh) printed 5 of cryptography's DSA
    deprecation warnings, with their source lines, before a one-line triage answer."""
    proc = subprocess.run([sys.executable, "-W", "default", "-c",
                           "import kvpool_console.triage._ssh"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode, proc.stderr) == (0, "")
