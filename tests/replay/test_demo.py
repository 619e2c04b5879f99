"""``kvpool-console --demo``, end to end through the console's command line: the hand-off to
``python -m kvpool_replay.demo`` (the console loads neither kvpool_replay nor torch nor vLLM),
option and trace errors, start-up progress, and a clean stop on SIGTERM or a lost terminal."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvpool_replay import default_trace_path

REPO = Path(__file__).resolve().parents[2]
SYNTHETIC = default_trace_path("synthetic_trace.jsonl")


def _demo_dirs(tmp: Path) -> set[Path]:
    """Demo work directories under ``tmp`` (the tests point TMPDIR there: other demos on the
    machine then cannot be mistaken for ours)."""
    return set(tmp.glob("kvpool-demo-*"))


def _console(*argv: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``kvpool-console ARGV`` in a child process with TMPDIR pointing at ``tmp``."""
    return subprocess.run([sys.executable, "-m", "kvpool_console.cli", *argv],
                          capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
                          env={**os.environ, "TMPDIR": str(tmp), **env})


_HANDOFF = """
import json, os, sys
import kvpool_console.cli as cli

def execv(path, argv):
    loaded = sorted(m for m in sys.modules
                    if m.split(".")[0] in ("kvpool_replay", "torch", "vllm"))
    print(json.dumps({"path": path, "argv": argv, "loaded": loaded}))
    sys.exit(0)

os.execv = execv
cli.main(sys.argv[1:])
"""


def test_demo_is_handed_to_kvpool_replay_with_its_options(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _HANDOFF, "--demo", "--engines", "3", "--speedup", "2.5",
         "--engine", "vllm", "--refresh", "0.25", "--trace", "t.jsonl"],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert out.returncode == 0, out.stderr
    done = json.loads(out.stdout)
    assert done["path"] == sys.executable
    assert done["argv"] == [sys.executable, "-m", "kvpool_replay.demo", "--engines", "3",
                            "--speedup", "2.5", "--engine", "vllm", "--refresh", "0.25",
                            "--trace", "t.jsonl"]
    # The console hands over without importing the demo (or torch and vLLM) itself.
    assert done["loaded"] == []


@pytest.mark.parametrize("argv, needle", [
    (["--demo", "--trace", "/nonexistent/trace.jsonl"],
     "--trace /nonexistent/trace.jsonl not found: pass --trace PATH or set KVPOOL_TRACES_DIR"),
    (["--demo", "--engines", "0"], "argument --engines: must be >= 1, got 0"),
    (["--demo", "--engines", "-3"], "argument --engines: must be >= 1, got -3"),
    # A negative or NaN redraw interval hung the TUI before its first draw (q, Ctrl-C and
    # SIGTERM unheard; a SIGKILL then left the demo's processes behind).
    (["--demo", "--refresh", "-5"],
     "argument --refresh: must be a finite number of seconds >= 0.25, got -5"),
    (["--refresh", "nan"], "argument --refresh: must be a finite number of seconds >= 0.25, "
     "got nan"),
    (["--demo", "--speedup", "nan"], "argument --speedup: must be a finite number >= 0, got nan"),
    (["status", "--wait", "0"], "argument --wait: must be a finite number of seconds >= 0.1, "
     "got 0"),
])
def test_demo_bad_options_exit_2_cleanly(argv: list[str], needle: str, tmp_path: Path) -> None:
    out = _console(*argv, tmp=tmp_path)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert _demo_dirs(tmp_path) == set()


def test_demo_missing_default_trace_and_broken_or_empty_trace(tmp_path: Path) -> None:
    out = _console("--demo", tmp=tmp_path, KVPOOL_TRACES_DIR=str(tmp_path / "none"))
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        f"kvpool-console --demo: the default trace {tmp_path / 'none' / 'conversation_trace.jsonl'}"
        " not found: pass --trace PATH or set KVPOOL_TRACES_DIR to the directory holding "
        "conversation_trace.jsonl (unset, the copy shipped in kvpool_replay/traces is used)\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"timestamp": 0, "input_length": 10}\n')
    out = _console("--demo", "--engines", "1", "--trace", str(broken), tmp=tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"--trace {broken} is not a valid Mooncake trace: {broken}:1:" in out.stderr
    assert "missing required field `output_length`" in out.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    out = _console("--demo", "--engines", "1", "--trace", str(empty), tmp=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.endswith(
        f"--trace {empty} is not a valid Mooncake trace: {empty}: no requests (the file is "
        "empty or holds only blank lines); pass --trace PATH to a valid one\n"), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert _demo_dirs(tmp_path) == set()


_NO_PORTS = """
import sys
import kvpool_replay._cluster as cluster
from kvpool_replay import demo

def no_ports(count=5, host="127.0.0.1"):
    # The machine's ports exhausted (connections in TIME-WAIT): no fake of Mooncake or vLLM.
    raise RuntimeError(f"no {count} consecutive free TCP ports on {host}")

cluster.free_port_block = no_ports
sys.exit(demo.main(sys.argv[1:]))
"""


def test_demo_that_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_PORTS, "--engines", "1", "--speedup", "8", "--engine", "sim",
         "--refresh", "0.5", "--trace", str(SYNTHETIC)],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1] == (
        "kvpool-console --demo: the demo could not start: no 5 consecutive free TCP ports on "
        "127.0.0.1"), out.stderr
    assert _demo_dirs(tmp_path) == set()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Pty:
    """The master side of the demo's pty, closed at most once.

    A second ``os.close`` of the same number would close whatever the process opened under it
    meanwhile: this pytest process still runs Mooncake client threads of earlier tests (a
    client abandoned by ``MooncakeBackend.close``), and one of their sockets closed from here
    left its RPC thread using, and then closing, the next test's pty ("Socket operation on
    non-socket" from master_client.cpp, and a demo that lost its terminal).
    """

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd = pid, fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _drain(term: _Pty, buf: bytearray, needle: bytes, timeout_s: float) -> bool:
    """Read the pty into ``buf`` until ``needle`` shows up (True) or the time is up (or the
    pty is closed)."""
    fd = term.fd
    if fd < 0:
        return needle in buf
    deadline = time.monotonic() + timeout_s
    while needle not in buf and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                buf += os.read(fd, 65536)
            except OSError:
                return False
    return needle in buf


def _runtime_dir(tmp_path: Path) -> Path:
    """The demo's engines' runtime directory (their lookup sockets), under ``tmp_path``."""
    return tmp_path / "rt"


def _demo_on_pty(tmp_path: Path) -> _Pty:
    """``kvpool-console --demo`` (one sim engine) in a child on a new pty, as over SSH, with
    TMPDIR at ``tmp_path`` and the runtime directory at ``_runtime_dir``."""
    _runtime_dir(tmp_path).mkdir(mode=0o700)
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(REPO)
        # A shell on a terminal runs its foreground job with SIGINT's default action. A test
        # run started in the background by a non-interactive shell (`make test &`, CI) has
        # SIGINT ignored, an exec keeps it so, and Python then installs no KeyboardInterrupt:
        # the Ctrl-C case hung in every such run.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.update(TERM="xterm-256color", COLUMNS="120", LINES="30",
                          TMPDIR=str(tmp_path), KVPOOL_RUNTIME_DIR=str(_runtime_dir(tmp_path)))
        os.execv(sys.executable, [
            sys.executable, "-m", "kvpool_console.cli", "--demo", "--engines", "1",
            "--speedup", "1", "--refresh", "0.5",
            "--trace", str(SYNTHETIC)])
    return _Pty(pid, fd)


def _stop_and_wait(term: _Pty, how: str, buf: bytearray) -> int | None:
    """Send SIGTERM to the demo, type Ctrl-C on its terminal or close it (``how``); its wait
    status once it left within 60 s (stopping the engines, store and master takes a few
    seconds), else None. Keeps reading the pty after a SIGTERM or Ctrl-C so that the last
    writes never block."""
    if how == "SIGTERM":
        os.kill(term.pid, signal.SIGTERM)
    elif how == "ctrl-c":
        os.write(term.fd, b"\x03")  # the terminal sends its foreground group SIGINT
    else:
        term.close()  # the terminal is gone
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if how != "hangup":
            _drain(term, buf, b"\0never", 0.1)
        done, st = os.waitpid(term.pid, os.WNOHANG)
        if done:
            return st
        time.sleep(0.05)
    return None


def _leave_nothing(term: _Pty, tree: list[psutil.Process], workdirs: set[Path],
                   tmp_path: Path) -> None:
    """On failure, leave nothing behind either: the console, what it started, its files."""
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = tree or psutil.Process(term.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(term.pid, signal.SIGKILL)
        os.waitpid(term.pid, 0)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    for d in workdirs or _demo_dirs(tmp_path):
        shutil.rmtree(d, ignore_errors=True)
    term.close()


def _tree(pid: int) -> tuple[list[psutil.Process], str]:
    """The demo's descendants and their command lines (one that exits meanwhile is skipped,
    not an error)."""
    tree = psutil.Process(pid).children(recursive=True)
    names = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            names.append(" ".join(p.cmdline()))
    return tree, " ".join(names)


def _demo_running(term: _Pty, buf: bytearray, shown: bytes,
                  tmp_path: Path) -> tuple[list[psutil.Process], set[Path]]:
    """Read the demo's pty into ``buf`` until it shows ``shown``; then, once the master, the
    policy service (``kvpool-policy serve``, the demo's default) and an engine are among its
    processes, those processes and its one work directory. On a loaded machine they can come
    late: the line is awaited up to 180 s, the processes up to 60 s more (the pty is read
    meanwhile, so the demo never blocks on its terminal)."""
    assert _drain(term, buf, shown, 180), bytes(buf[-2000:])
    deadline = time.monotonic() + 60
    tree, names = _tree(term.pid)
    while not ("mooncake_master" in names and "engine_proc" in names
               and "kvpool_policy.cli serve" in names):
        assert time.monotonic() < deadline, names
        _drain(term, buf, b"\0never", 0.2)
        tree, names = _tree(term.pid)
    workdirs = _demo_dirs(tmp_path)
    assert len(workdirs) == 1
    return tree, workdirs


def _engine_row_drawn(term: _Pty, buf: bytearray) -> int:
    """Read the pty until the TUI draws the engine's row on its alternate screen (the start-up
    lines before it name the engine too: "engine engine-0 ready"), up to 120 s; the screen's
    offset in ``buf``."""
    tui = buf.index(b"\x1b[?1049h")
    deadline = time.monotonic() + 120
    while b"engine-0" not in buf[tui:]:
        assert time.monotonic() < deadline, bytes(buf[-2000:])
        _drain(term, buf, b"\0never", 0.2)
    return tui


STOP_LINE = (b"kvpool-console --demo: stopped: its engines, master, store, policy service and "
             b"hub are gone and its work directory removed")
"""What the demo says once it stopped everything (on a quit, Ctrl-C or SIGTERM)."""


def _assert_stopped(status: int, how: str, tree: list[psutil.Process],
                    workdirs: set[Path], tmp_path: Path) -> None:
    """The demo left with 128 + the signal's number and left no process, directory or
    engine lookup socket (a new user found 252 in the runtime directory)."""
    assert os.WIFEXITED(status)
    assert os.WEXITSTATUS(status) == {"SIGTERM": 143, "ctrl-c": 130, "hangup": 129}[how]
    assert [_name(p) for p in tree if _alive(p)] == []
    assert not any(d.exists() for d in workdirs)
    assert sorted(p.name for p in _runtime_dir(tmp_path).iterdir()) == []


def _name(p: psutil.Process) -> str:
    """``p``'s pid and command line (its pid alone once it is gone)."""
    try:
        return f"{p.pid} {' '.join(p.cmdline())}"
    except psutil.Error:
        return str(p.pid)


def _with_current(tree: list[psutil.Process], pid: int) -> list[psutil.Process]:
    """``tree`` and the demo's descendants now (right before a signal: whatever it started
    since ``_demo_running`` must be gone afterwards too)."""
    now, _ = _tree(pid)
    return tree + [p for p in now if p not in tree]


@pytest.mark.parametrize("how", ["SIGTERM", "ctrl-c", "hangup"])
def test_demo_stops_everything_on_a_signal_during_start_up(how: str, tmp_path: Path) -> None:
    """A SIGTERM, a Ctrl-C or the terminal going away while the demo waits for its engines
    (before the TUI): the demo's own handler stops the master, store, policy service and
    engines it already started, removes the work directory and (but on a lost terminal) says
    so in its stop line, with no traceback."""
    term = _demo_on_pty(tmp_path)
    buf = bytearray()
    tree: list[psutil.Process] = []
    workdirs: set[Path] = set()
    try:
        tree, workdirs = _demo_running(term, buf, b"waiting for engines to be ready",
                                       tmp_path)
        tree = _with_current(tree, term.pid)
        status = _stop_and_wait(term, how, buf)
        assert status is not None, f"demo still starting 60 s after {how}"
        _assert_stopped(status, how, tree, workdirs, tmp_path)
        assert b"\x1b[?1049h" not in buf  # it stopped before the TUI drew
        if how != "hangup":
            assert STOP_LINE in buf and b"Traceback" not in buf, bytes(buf[-2000:])
    finally:
        _leave_nothing(term, tree, workdirs, tmp_path)


@pytest.mark.parametrize("how", ["SIGTERM", "hangup"])
def test_demo_stops_everything_on_sigterm_and_hangup(how: str, tmp_path: Path) -> None:
    """``kvpool-console --demo`` on a real pty: a SIGTERM, or the terminal going away (the
    kernel sends SIGHUP), stops the master, store, policy service and engines, removes the work
    directory and (SIGTERM) restores the terminal."""
    term = _demo_on_pty(tmp_path)
    buf = bytearray()
    tree: list[psutil.Process] = []
    workdirs: set[Path] = set()
    try:
        tree, workdirs = _demo_running(term, buf, b"\x1b[?1049h", tmp_path)
        tui = _engine_row_drawn(term, buf)
        start = bytes(buf[:tui])
        drawn = len(buf)
        tree = _with_current(tree, term.pid)
        status = _stop_and_wait(term, how, buf)
        assert status is not None, f"console still running 60 s after {how}"
        _assert_stopped(status, how, tree, workdirs, tmp_path)
        if how == "SIGTERM":
            # Textual left the alternate screen: the terminal is usable again, and the demo
            # says what it stopped there, as after a quit (the TUI had taken the SIGTERM).
            after = bytes(buf[drawn:])
            assert b"\x1b[?1049l" in after
            assert STOP_LINE in after[after.index(b"\x1b[?1049l"):], after[-2000:]
        # Start-up progress came before the TUI, on the terminal.
        for line in (b"starting fleet hub on tcp://127.0.0.1:", b"(CURVE keys on every port; "
                     b"Prometheus metrics at http://127.0.0.1:",
                     b"operator/ (kvpool-console --keys ", b"starting mooncake_master",
                     b"starting kvpool-policy serve on tcp://127.0.0.1:",
                     b"starting 1 sim engine(s)", b"waiting for engines to be ready",
                     b"engine engine-0 ready (1 of 1, ",
                     b"policy service serving on tcp://127.0.0.1:"):
            assert line in start, start[-2000:]
    finally:
        _leave_nothing(term, tree, workdirs, tmp_path)


def test_demo_killed_with_sigkill_leaves_nothing(tmp_path: Path) -> None:
    """``kill -9`` of the console while its TUI runs: no handler of its own runs, and its
    tether (``kvpool_replay._tether``, a watcher it started first) stops the master, store,
    policy service and engine, releases the engine's lookup socket and removes the work
    directory (its CURVE secret keys), then ends itself."""
    term = _demo_on_pty(tmp_path)
    buf = bytearray()
    tree: list[psutil.Process] = []
    workdirs: set[Path] = set()
    try:
        tree, workdirs = _demo_running(term, buf, b"\x1b[?1049h", tmp_path)
        tree = _with_current(tree, term.pid)
        names = " ".join(_name(p) for p in tree if _alive(p))
        for part in ("mooncake_master", "mooncake_client", "kvpool_policy.cli serve",
                     "engine_proc", "_tether.py"):
            assert part in names, names  # all running, the policy service too
        assert [(d / "keys" / "operator" / "operator.key_secret").is_file()
                for d in workdirs] == [True]
        os.kill(term.pid, signal.SIGKILL)
        os.waitpid(term.pid, 0)

        def left() -> tuple[list[str], list[Path], list[str]]:
            return ([_name(p) for p in tree if _alive(p)], [d for d in workdirs if d.exists()],
                    sorted(p.name for p in _runtime_dir(tmp_path).iterdir()))

        deadline = time.monotonic() + 60
        while left() != ([], [], []):
            assert time.monotonic() < deadline, left()
            _drain(term, buf, b"\0never", 0.1)
    finally:
        _leave_nothing(term, tree, workdirs, tmp_path)


def test_an_engine_killed_while_the_tui_runs_is_reaped_and_shown_gone(tmp_path: Path) -> None:
    """``kill -9`` of a demo engine while the TUI runs: the demo reaps it (it stayed
    ``<defunct>``, a zombie of the demo, until the demo stopped) and the TUI still names it
    GONE; the demo then stops as ever."""
    term = _demo_on_pty(tmp_path)
    buf = bytearray()
    tree: list[psutil.Process] = []
    workdirs: set[Path] = set()
    try:
        tree, workdirs = _demo_running(term, buf, b"\x1b[?1049h", tmp_path)
        tui = _engine_row_drawn(term, buf)
        (engine,) = [p for p in psutil.Process(term.pid).children()
                     if "engine_proc" in _name(p)]
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.is_running():  # a zombie still runs to psutil; a reaped process does not
            assert time.monotonic() < deadline, f"engine {engine.pid} left a zombie"
            _drain(term, buf, b"\0never", 0.2)
        deadline = time.monotonic() + 60
        while b"GONE" not in buf[tui:]:
            assert time.monotonic() < deadline, bytes(buf[-2000:])
            _drain(term, buf, b"\0never", 0.2)
        tree = _with_current(tree, term.pid)
        status = _stop_and_wait(term, "SIGTERM", buf)
        assert status is not None, "console still running 60 s after SIGTERM"
        _assert_stopped(status, "SIGTERM", tree, workdirs, tmp_path)
    finally:
        _leave_nothing(term, tree, workdirs, tmp_path)
