"""The TUI in a real pseudo-terminal: it starts, draws, and exits when the terminal goes away
(an SSH session dropping closes the pty and the kernel sends SIGHUP, then SIGCONT), also when the
terminal had stopped reading its output first."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

from livefleet import LiveFleet

_ROOT = Path(__file__).resolve().parents[2]


def _read_until(fd: int, needle: bytes, timeout_s: float) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout_s
    while needle not in buf and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                buf += os.read(fd, 65536)
            except OSError:
                break
    return buf


def _drain(fd: int, timeout_s: float) -> bytes:
    """What the console writes to the pty within ``timeout_s`` (read as a terminal reads)."""
    buf = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        try:
            buf += os.read(fd, 65536)
        except OSError:  # the console closed the terminal (EIO)
            break
    return buf


def _console_on_pty(live_fleet: LiveFleet) -> tuple[int, int]:
    """``kvpool-console --hub ...`` in a child on a new pty, as over SSH: (pid, master fd)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(_ROOT)
        os.environ.update(TERM="xterm-256color", COLUMNS="100", LINES="30")
        os.execv(sys.executable, [sys.executable, "-m", "kvpool_console.cli",
                                  "--hub", live_fleet.address, "--refresh", "0.5"])
    return pid, fd


def _unread(fd: int) -> int:
    """Bytes the console wrote to the pty that nobody read yet (FIONREAD on the master)."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


@contextlib.contextmanager
def _console_up(live_fleet: LiveFleet) -> Iterator[tuple[int, int]]:
    """A console on a pty (``_console_on_pty``) once it drew engine ``p0``: (pid, master fd);
    killed on the way out if it is still there."""
    live_fleet.add_engine("p0", "prefill", "kv_producer", tp=1)
    live_fleet.wait_agents(2)
    pid, fd = _console_on_pty(live_fleet)
    try:
        out = _read_until(fd, b"p0", 30)
        assert b"p0" in out, out[-2000:]
        yield pid, fd
    finally:
        _kill(pid)


def _assert_left_with_129(pid: int, after: str, read_fd: int | None = None) -> bytes:
    """The console left on its own within 15 s (SIGHUP handler: sockets closed, exit 129),
    not killed. ``read_fd``: a live terminal, read meanwhile as a real one is (unread, the
    console's repaints fill the pty and its last writes block: seen at a load average of 14);
    returns what was read."""
    out = b""
    deadline = time.monotonic() + 15
    status = None
    while status is None and time.monotonic() < deadline:
        if read_fd is not None:
            out += _drain(read_fd, 0.1)
        else:
            time.sleep(0.1)
        done, st = os.waitpid(pid, os.WNOHANG)
        status = st if done else None
    assert status is not None, f"console still running 15 s after {after}"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 129
    return out


def test_quits_when_terminal_goes_away(live_fleet: LiveFleet) -> None:
    with _console_up(live_fleet) as (pid, fd):
        os.close(fd)  # the terminal is gone
        _assert_left_with_129(pid, "its terminal closed")


def test_quits_when_terminal_goes_away_with_its_output_backed_up(live_fleet: LiveFleet) -> None:
    """A stalled SSH session: the terminal stops reading, the console's writes back up until its
    output thread blocks on the full pty; then the terminal goes away. The blocked write fails
    (EIO) before the SIGHUP is handled. Textual's output thread would end there and the app
    block for ever on its full queue (``kvpool_console._terminal``): it must leave on its own."""
    with _console_up(live_fleet) as (pid, fd):
        # Each resize repaints the whole screen; nobody reads: the pty fills up and stays full.
        sizes = [(30, 100), (31, 120)]
        before, stalled_since, deadline = -1, time.monotonic(), time.monotonic() + 30
        i = 0
        while time.monotonic() - stalled_since < 2 and time.monotonic() < deadline:
            rows, cols = sizes[i % 2]
            i += 1
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            time.sleep(0.05)
            now = _unread(fd)
            if now != before:
                before, stalled_since = now, time.monotonic()
        # The master's read buffer (4 KiB) stayed full for 2 s of repaints: backed up.
        assert before >= 4000 and i >= 10, (before, i)
        os.close(fd)  # the terminal is gone
        _assert_left_with_129(pid, "its terminal closed")


def test_sighup_on_a_live_terminal_restores_it(live_fleet: LiveFleet) -> None:
    """``kill -HUP`` with the terminal still there (an operator, a supervisor): the console
    leaves as on a hangup, and the terminal it leaves is usable again: out of the alternate
    screen, echo and line editing back on (not raw mode on a screen nobody can read)."""
    with _console_up(live_fleet) as (pid, fd):
        lflag = termios.tcgetattr(fd)[3]  # the slave's modes, as the console set them
        assert not lflag & (termios.ECHO | termios.ICANON), lflag
        os.kill(pid, signal.SIGHUP)
        rest = _assert_left_with_129(pid, "SIGHUP", read_fd=fd)
        rest += _read_until(fd, b"\x1b[?1049l", 5)
        assert b"\x1b[?1049l" in rest, rest[-300:]  # left the alternate screen
        lflag = termios.tcgetattr(fd)[3]
        assert lflag & termios.ECHO and lflag & termios.ICANON, lflag


_HANGUP = """
import os, signal, sys
from kvpool_console.signals import Stopped, stop_signals

signal.signal(signal.SIGCONT, lambda *_: None)  # what Textual's driver installs
with stop_signals() as sig:
    try:
        os.kill(os.getpid(), signal.SIGHUP)
    except Stopped:
        pass
with open(sys.argv[1], "w") as out:
    out.write(f"{sig.signum} {signal.getsignal(signal.SIGCONT) is signal.SIG_DFL}")
"""


def test_hangup_stops_textual_from_resuming_on_the_sigcont_that_follows(tmp_path: Path) -> None:
    """SIGHUP hands SIGCONT back to the default action: Textual would otherwise restart its
    terminal threads on the dead terminal when the kernel's SIGCONT follows the hangup."""
    result = tmp_path / "result"
    done = subprocess.run([sys.executable, "-c", _HANGUP, str(result)], cwd=_ROOT,
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert result.read_text() == f"{int(signal.SIGHUP)} True"
