"""Running a check on this host, for an engine that runs here: no SSH, the console's own user.

The check is the argument vector ``_commands.argv`` builds, the one an SSH check sends quoted:
it is executed directly (``execve``), so no shell parses the values that came from an agent's
report; they reach the constant script as its positional parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess

__all__ = ["TARGET", "run"]

TARGET = "local"
"""``HostReport.target`` of a host checked locally (an SSH check names ``user@address:port``)."""


async def run(argv: list[str], timeout_s: float) -> tuple[int | None, str, str] | str:
    """Execute ``argv`` with no stdin: (exit status, stdout, stderr) decoded as UTF-8 with
    replacement (log files may hold any bytes), or the error text when it did not finish within
    ``timeout_s`` seconds (its process group is killed) or could not be started."""
    try:
        # Its own session: on a timeout the whole group goes, as an SSH channel's close ends
        # the remote one, and the console's terminal signals never reach it.
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return f"timed out after {timeout_s:g} s"
    finally:
        if proc.returncode is None:
            # Cancelled (the TUI's worker stopped): nothing of it stays behind.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
