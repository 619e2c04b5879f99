"""Hostile agent reports against triage's local path (the console's own host, its own user).

A report names this machine in many spellings (one engine may have 1,024 agents), a log path
at one of the console user's secrets (or a log swapped for a link to one while it is read),
and a log holding C1 terminal controls; the checks are
the real local ones (``_local.run``), the reports pass the protocol's own validation.
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvpool_agent.process_facts import start_ticks
from kvpool_agent.protocol import EngineState, Source
from kvpool_console._text import json_line
from kvpool_console.triage import _commands as C
from kvpool_console.triage import _local
from kvpool_console.triage import _run as R
from kvpool_console.triage._run import triage_engine


def _states(*sources: dict[str, Any]) -> dict[str, EngineState]:
    out = {}
    for i, extra in enumerate(sources):
        src = msgspec.convert({"agent_id": f"evil/a{i}", "engine_id": "evil",
                               "instance_role": "mixed", "kv_role": "kv_both",
                               "process_role": "replay", "pid": os.getpid(),
                               "host": socket.gethostname(), **extra}, Source)
        out[src.agent_id] = EngineState(source=src, started_ms=0, ts_ms=0)
    return out


def _spellings(n: int) -> list[str]:
    """``n`` different host strings that all name this machine."""
    base = ["localhost", "LOCALHOST", "LocalHost", socket.gethostname().upper()]
    ips = [f"127.0.{i >> 8}.{i & 255}" for i in range(1, n)]
    mapped = [f"0::ffff:127.1.{i >> 8}.{i & 255}" for i in range(1, n)]
    return (base + [h for pair in zip(ips, mapped, strict=True) for h in pair])[:n]


async def test_many_spellings_of_this_host_run_one_set_of_checks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 agents of one engine, each naming this host differently with its own log: one
    local host is checked (its checks once), not 200 sets of local processes."""
    runs = 0
    real = _local.run

    async def counted(argv: list[str], timeout_s: float) -> Any:
        nonlocal runs
        runs += 1
        return await real(argv, timeout_s)

    monkeypatch.setattr(_local, "run", counted)
    logs = []
    for i in range(200):
        log = tmp_path / f"e{i}.log"
        log.write_text(f"line of {i}\n")
        log.chmod(0o644)
        logs.append(str(log))
    states = _states(*({"host": h, "log_path": log}
                       for h, log in zip(_spellings(200), logs, strict=True)))
    report = await triage_engine("evil", states, reporting=False)
    [host] = report.hosts
    assert host.target == "local" and host.host == "localhost"
    [proc] = host.processes
    assert proc.pid == os.getpid() and len(proc.agents) == 200 and proc.state == "running"
    assert len(host.logs) == R.MAX_LOGS and {log.path for log in host.logs} <= set(logs)
    assert all(log.lines and log.lines[0].startswith("line of ") for log in host.logs)
    assert any("more log paths not read" in r for r in host.refused)
    assert any("name this host as well: checked once, as localhost" in r for r in host.refused)
    assert runs == 5 + R.MAX_LOGS


async def test_ssh_keeps_hosts_apart_but_bounded() -> None:
    """With ``--ssh`` each spelling is its own login (none works here: no key), at most
    ``MAX_HOSTS`` of them."""
    states = _states(*({"host": f"h{i}.invalid"} for i in range(R.MAX_HOSTS + 10)))
    plans = R._bounded(R.plan_engine("evil", states), ssh=True)
    assert len(plans) == R.MAX_HOSTS
    assert "10 more hosts not checked" in plans[0].refused[-1]


SECRET = 'curve\n    secret-key = "TOPSECRETz85"\n'
"""A CURVE secret key file's text; no report may hold ``TOPSECRET``."""

LINK = "a symbolic link: triage reads no link (the engine's log is the file itself)"


@pytest.mark.parametrize("mode", [0o600, 0o400])
async def test_forged_log_path_at_a_private_file_shows_nothing(tmp_path: Path,
                                                                 mode: int) -> None:
    """A log path naming a file only its owner may read (the console's CURVE secret key, an
    SSH key), directly or under a linked directory, or a link to one or to
    ``/proc/self/environ``: refused with the reason, its text nowhere in the report."""
    secret = tmp_path / "keys" / "operator.key_secret"
    secret.parent.mkdir()
    secret.write_text(SECRET)
    secret.chmod(mode)
    environ = tmp_path / "environ"
    environ.symlink_to("/proc/self/environ")
    link = tmp_path / "engine.log"
    link.symlink_to(secret)
    linked_dir = tmp_path / "logs"
    linked_dir.symlink_to(secret.parent)
    report = await triage_engine("evil", _states(
        {"log_path": str(secret)}, {"log_path": str(linked_dir / secret.name)},
        {"log_path": str(environ)}, {"log_path": str(link)}), reporting=False)
    [host] = report.hosts
    assert host.target == "local"
    private = (f"private to its owner (mode {stat.filemode(stat.S_IFREG | mode)}): triage "
               "shows no such file (keys, credentials)")
    assert [(log.lines, log.error) for log in host.logs] == [([], private)] * 2 + [([], LINK)] * 2
    text = msgspec.json.encode(report).decode()
    assert "TOPSECRET" not in text and os.environ.get("PATH", "unset") not in text


async def test_log_swapped_for_a_link_to_a_secret_shows_no_byte_of_it(tmp_path: Path) -> None:
    """A local user who can write the log's directory swaps the log for a symbolic link to a
    file only its owner may read, and back, while triage reads it (each swap one atomic
    ``rename``): every read shows the log or refuses the link, never a byte of the secret.
    Checking the path and then reading it by name (``tail``) showed the secret when a swap
    fell in between; the check reads one open file."""
    secret = tmp_path / "operator.key_secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    logs = tmp_path / "logs"
    logs.mkdir()
    log, real = logs / "e.log", logs / "real.log"
    real.write_text("an ordinary line\n")
    real.chmod(0o644)
    os.link(real, log)
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.symlink(secret, logs / "new")
            os.replace(logs / "new", log)
            os.link(real, logs / "new")
            os.replace(logs / "new", log)

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    seen: set[str] = set()
    runs = 0
    deadline = time.monotonic() + 120
    try:
        # Until both states were read (a swap fell around many reads), bounded in time.
        while seen != {"read", "refused"} or runs < 50:
            assert time.monotonic() < deadline, (runs, seen)
            out = await _local.run(C.argv(*C.log_tail(str(log), sys.executable),
                                          timeout_s=5), 5)
            assert not isinstance(out, str), out
            status, stdout, stderr = out
            assert "TOPSECRET" not in stdout + stderr and "curve" not in stdout
            assert (status, stdout, stderr) in ((0, "an ordinary line\n", ""),
                                                (3, "", LINK + "\n")), out
            seen.add("read" if status == 0 else "refused")
            runs += 1
    finally:
        stop.set()
        swapper.join()


async def test_group_only_file_is_not_shown_to_root(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.write_text("root:$6$hash:19000:0:99999:7:::\n")
    shadow.chmod(0o640)
    report = await triage_engine("evil", _states({"log_path": str(shadow)}), reporting=False)
    [log] = report.hosts[0].logs
    if os.geteuid() == 0:
        assert log.lines == [] and log.error.startswith("readable by its owner and group only")
    else:
        assert log.lines == ["root:$6$hash:19000:0:99999:7:::"] and log.error == ""


def test_triage_json_escapes_c1_controls(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A log line holding C1 controls (U+009B is CSI) is printed by ``triage --json`` escaped,
    as every other ``--json`` of the console: JSON leaves them raw."""
    import argparse

    from rich.console import Console

    from kvpool_console.source import StaticSource
    from kvpool_console.triage import cli

    log = tmp_path / "c1.log"
    log.write_bytes(b"ok\n\xc2\x9b2J\xc2\x9d0;retitled\x07\x7f\n")
    log.chmod(0o644)
    args = argparse.Namespace(engine="evil", json=True, ssh_config=None, ssh=False)
    cli.run(args, StaticSource(_states({"log_path": str(log)})), Console(), Console())
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x9b\x9d\x7f\x07"), out
    report = msgspec.json.decode(out)
    assert report["hosts"][0]["logs"][0]["lines"][1] == "\x9b2J\x9d0;retitled\x07\x7f"
    assert json_line(report) == out.strip()


def test_this_host_reads_interfaces_at_most_once_a_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Forged silent engines naming IP literals: the stale alert asks ``is_this_host`` once
    per engine per refresh; the interface addresses are read once, not once per engine."""
    import psutil

    from kvpool_console import _this_host

    calls = 0
    real = psutil.net_if_addrs

    def counted() -> Any:
        nonlocal calls
        calls += 1
        return real()

    monkeypatch.setattr(psutil, "net_if_addrs", counted)
    monkeypatch.setattr(_this_host, "_cache", (-1e18, set()), raising=False)
    assert not any(_this_host.is_this_host(f"10.99.{i >> 8}.{i & 255}") for i in range(2000))
    assert calls == 1


@pytest.mark.parametrize("hosts", [("localhost", "localhost"), ("localhost", "127.0.0.1")],
                         ids=["one-spelling", "two-spellings"])
@pytest.mark.parametrize("forged_first", [True, False], ids=["forged-first", "forged-last"])
async def test_a_forged_later_start_does_not_make_a_live_engine_gone(
        hosts: tuple[str, str], forged_first: bool) -> None:
    """A forged agent copying a live engine's host and pid with a later start (which would read
    as "pid reused by another process: gone") and the engine's own agent with its true start:
    the disputed start is not used, the process is judged running, and the report says why."""
    true_start = start_ticks()
    real = {"host": hosts[0], "start_ticks": true_start}
    forged = {"host": hosts[1], "start_ticks": true_start + 1000}
    states = _states(*((forged, real) if forged_first else (real, forged)))
    report = await triage_engine("evil", states, reporting=True)
    [host] = report.hosts
    [proc] = host.processes
    assert (proc.pid, proc.state, proc.start_ticks) == (os.getpid(), "running", true_start)
    assert proc.reported_start_ticks == 0  # disputed: neither claim is used
    assert not [f for f in report.diagnosis if f.kind == "gone"], report.diagnosis
    assert any(f"pid {os.getpid()}: its agents" in r and "different start times" in r
               for r in host.refused), host.refused
    # The same agents agreeing on the true start: it is used.
    report = await triage_engine("evil", _states(real, dict(forged, start_ticks=true_start)),
                                 reporting=True)
    [proc] = report.hosts[0].processes
    assert (proc.state, proc.reported_start_ticks) == ("running", true_start)
