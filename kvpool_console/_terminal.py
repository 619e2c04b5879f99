"""The console's terminal driver: Textual's ``LinuxDriver``, made to survive its terminal going
away (an SSH session dropping).

When a pty's other end closes, the kernel first makes every read of the terminal return EOF and
every write fail with ``EIO``, and only then sends SIGHUP (then SIGCONT) to the session leader.
Textual's output thread writes frames from its own queue: a frame it writes in that window, or
a write it was blocked in because nobody read the terminal, raises ``EIO`` and ends the thread.
The queue then fills up (Textual caps it at 30 writes) and the app blocks for ever on its next
write, at the latest when it restores the terminal on exit: the SIGHUP's orderly exit never
happens. ``HangupSafeDriver`` drops output for a terminal that is gone instead.
"""

from __future__ import annotations

from typing import IO, Any

from textual.app import App
from textual.drivers.linux_driver import LinuxDriver

__all__ = ["HangupSafeDriver"]


class _TerminalOutput:
    """The terminal's text stream as Textual's output thread uses it (``write``, ``flush``,
    ``fileno``), where an ``OSError`` means the terminal is gone: from then on the text is
    dropped, as a terminal nobody reads would drop it. ``gone`` tells whether that happened."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        """Write ``text``; its length in characters, written or dropped."""
        if not self.gone:
            try:
                self._stream.write(text)
            except OSError:  # EIO: the terminal hung up (EINTR is retried by Python itself)
                self.gone = True
        return len(text)

    def flush(self) -> None:
        """Flush the stream, unless the terminal is gone."""
        if not self.gone:
            try:
                self._stream.flush()
            except OSError:
                self.gone = True

    def fileno(self) -> int:
        """The stream's file descriptor."""
        return self._stream.fileno()


class HangupSafeDriver(LinuxDriver):
    """``LinuxDriver`` whose output thread outlives its terminal (see the module docstring).

    Only the stream the output thread writes to differs. Pair it with a SIGHUP handler that
    asks the app to exit and stops Textual from re-entering application mode on the SIGCONT
    that follows every hangup (``kvpool_console.signals``).
    """

    def __init__(self, app: App[Any], *, debug: bool = False, mouse: bool = True,
                 size: tuple[int, int] | None = None) -> None:
        super().__init__(app, debug=debug, mouse=mouse, size=size)
        # LinuxDriver writes to its private ``_file`` (Textual 8.x, pinned in pyproject.toml);
        # tests/console/test_terminal.py hangs, and fails, if an upgrade stops reading it.
        if self._file is not None:
            self._file = _TerminalOutput(self._file)  # type: ignore[assignment]
