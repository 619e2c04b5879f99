"""The TUI in a real pseudo-terminal: it starts, draws, and exits when the terminal goes away
(an SSH session dropping closes the pty and the kernel sends SIGHUP)."""

from __future__ import annotations

import os
import pty
import select
import sys
import time
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


def test_quits_when_terminal_goes_away(live_fleet: LiveFleet) -> None:
    live_fleet.add_engine("p0", "prefill", "kv_producer", tp=1)
    live_fleet.wait_agents(2)
    pid, fd = pty.fork()
    if pid == 0:  # child: the console on the pty, as over SSH
        os.chdir(_ROOT)
        os.environ.update(TERM="xterm-256color", COLUMNS="100", LINES="30")
        os.execv(sys.executable, [sys.executable, "-m", "kvpool_console.cli",
                                  "--hub", live_fleet.address, "--refresh", "0.5"])
    try:
        out = _read_until(fd, b"p0", 30)
        assert b"p0" in out, out[-2000:]
        os.close(fd)  # the terminal is gone
        deadline = time.monotonic() + 15
        status = None
        while time.monotonic() < deadline:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            time.sleep(0.1)
        assert status is not None, "console still running 15 s after its terminal closed"
        # It left on its own (SIGHUP handler: sockets closed, exit 129), not killed.
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 129
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
