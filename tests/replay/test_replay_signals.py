"""``kvpool-replay`` on SIGTERM or SIGHUP once its services run (a real ``mooncake_master``,
store and engine): it stops every process it started, removes its work directory and the
pool's logs, and exits 128 + the signal (143, 129), like the demo."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest

from kvpool_replay import default_trace_path

REPO = Path(__file__).resolve().parents[2]
TRACE = default_trace_path("conversation_trace.jsonl")
READY = b"engines ready; replay started"


def _cmdlines(procs: Iterable[psutil.Process]) -> list[str]:
    """The command lines of the live ones of ``procs``: one that exits while it is read (a
    zombie by then: psutil.ZombieProcess, seen under load) is not live."""
    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.cmdline()))
        except psutil.NoSuchProcess:  # ZombieProcess is one
            continue
    return out


def _read_until(proc: subprocess.Popen[bytes], buf: bytearray, needle: bytes,
                timeout_s: float) -> bool:
    """Read ``proc``'s stderr into ``buf`` until ``needle`` shows up (True), it exits or the
    time is up."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    deadline = time.monotonic() + timeout_s
    while needle not in buf and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
    return needle in buf


def _leftovers(tmp: Path) -> list[Path]:
    """Directories a replay (and the master and store it starts) makes under TMPDIR."""
    return sorted(p for p in tmp.iterdir()
                  if p.name.startswith(("kvpool-replay-", "kvpool-master-", "kvpool-store-")))


def _replay(tmp_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``kvpool-replay`` of the conversation trace's first 200 requests at ``--speedup 1``
    (72 s of trace time: still replaying when a test signals it), its work directories under
    ``tmp_path``, its stderr piped."""
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    return subprocess.Popen(
        [sys.executable, "-m", "kvpool_replay.cli", str(TRACE), "--limit", "200",
         "--speedup", "1", "--no-progress", *extra],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _running(proc: subprocess.Popen[bytes], buf: bytearray) -> tuple[list[psutil.Process], str]:
    """Once the replay says its engines are ready: every process under it, and their command
    lines joined."""
    assert _read_until(proc, buf, READY, 240), bytes(buf[-3000:])
    tree = psutil.Process(proc.pid).children(recursive=True)
    return tree, " ".join(_cmdlines(tree))


def _end(proc: subprocess.Popen[bytes], procs: Iterable[psutil.Process]) -> None:
    """Whatever a test left: the replay killed and reaped, then each of ``procs``."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


@pytest.mark.skipif(not TRACE.is_file(), reason="shared traces not available")
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)],
                         ids=["SIGTERM", "SIGHUP"])
def test_replay_stops_everything_it_started_on_a_signal(signum: int, status: int,
                                                       tmp_path: Path) -> None:
    proc = _replay(tmp_path)
    buf = bytearray()
    tree: list[psutil.Process] = []
    try:
        tree, names = _running(proc, buf)
        for started in ("mooncake_master", "mooncake_client"):
            assert started in names, names
        # The engine is forked from the fork server (``kvpool_replay._forkserver``): both
        # carry the server's command line.
        forked = [p for p in tree if any("forkserver" in c for c in _cmdlines([p]))]
        assert len(forked) == 2, names
        # One work directory, the master's and the store's logs inside it.
        assert [p.name[:14] for p in _leftovers(tmp_path)] == ["kvpool-replay-"]
        proc.send_signal(signum)
        _read_until(proc, buf, b"\0never", 60)  # to its end: the pipe must never fill
        assert proc.wait(timeout=60) == status, bytes(buf[-3000:])
        assert b"Traceback" not in buf
        if signum == signal.SIGTERM:  # a hangup points stderr at /dev/null (the terminal is gone)
            assert b"kvpool-replay: stopped by signal 15; every process it started" in buf
        left = _cmdlines(tree)
        assert left == [], (left, bytes(buf[-3000:]))
        assert _leftovers(tmp_path) == []
    finally:
        _end(proc, tree)


@pytest.mark.skipif(not TRACE.is_file(), reason="shared traces not available")
def test_replay_stops_what_it_started_on_sigterm_during_start_up(tmp_path: Path) -> None:
    """SIGTERM while the store (or the engine) is still starting: what
    already runs stops and nothing more starts (every child seen until the exit is gone)."""
    proc = _replay(tmp_path)
    seen: dict[int, psutil.Process] = {}

    def look() -> str:
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
        return " ".join(_cmdlines(seen.values()))

    try:
        deadline = time.monotonic() + 120
        while "mooncake_client" not in look():
            assert proc.poll() is None and time.monotonic() < deadline, look()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            look()  # a child started after the signal would be seen here
            time.sleep(0.01)
        assert proc.poll() == 143
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert b"Traceback" not in err and b"stopped by signal 15" in err, err[-3000:]
        assert READY not in err
        assert _cmdlines(seen.values()) == []
        assert _leftovers(tmp_path) == []
    finally:
        _end(proc, seen.values())


@pytest.mark.skipif(not TRACE.is_file(), reason="shared traces not available")
def test_a_killed_replay_leaves_nothing_running(tmp_path: Path) -> None:
    """``kill -9`` of ``kvpool-replay`` once its master, store, policy service and two forked
    engines run: no handler of its own runs, and its tether (``kvpool_replay._tether``, as the
    demo's) stops every one of them and removes the work directory."""
    # A bounded pool: the replay's default then starts the policy service beside the master.
    proc = _replay(tmp_path, "--engines", "2", "--pool-tokens", "300000")
    buf = bytearray()
    tree: list[psutil.Process] = []
    try:
        tree, names = _running(proc, buf)
        for started in ("mooncake_master", "mooncake_client", "kvpool_policy.cli"):
            assert started in names, names
        forked = [p for p in tree if any("forkserver" in c for c in _cmdlines([p]))]
        assert len(forked) == 3, names  # the fork server and its two engines
        assert [p.name[:14] for p in _leftovers(tmp_path)] == ["kvpool-replay-"]
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        deadline = time.monotonic() + 60
        while _cmdlines(tree) or _leftovers(tmp_path):
            assert time.monotonic() < deadline, (_cmdlines(tree), _leftovers(tmp_path))
            time.sleep(0.05)
    finally:
        _end(proc, tree)
