"""SIGHUP and SIGTERM as an orderly exit, for the console and the demo that runs it.

Killed on the spot, the console would leave the terminal in Textual's application mode, and the
demo its ``mooncake_master``, store, engines and work directory. Inside ``stop_signals()`` the
first SIGHUP or SIGTERM instead asks the running TUI to exit (``StopSignals.app``) or, with no
TUI running, raises ``Stopped`` where the main thread is, so every ``finally`` on the way out
runs; the caller then exits with 128 + ``StopSignals.signum``, as a shell reports a signal.

A SIGHUP means the terminal is gone (an SSH session dropped): stdin, stdout and stderr are
pointed at ``/dev/null`` so that what is still written goes nowhere instead of failing (all but
a terminal still there, as after a ``kill -HUP`` by hand, which Textual then restores), and
SIGCONT is given back its default action. The kernel sends a SIGCONT after every hangup's
SIGHUP, on which Textual's driver would re-enter application mode: a second output and input
thread on the dead terminal, and its first input thread (not a daemon) left to notice the exit
within 0.1 s or keep the process alive for ever. (Output the TUI wrote before the SIGHUP was
handled: ``kvpool_console._terminal``.)
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["StopSignals", "Stopped", "stop_signals"]


class Stopped(BaseException):
    """SIGHUP or SIGTERM arrived while no TUI was running (e.g. during the demo's start-up).
    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the way
    out swallows it."""


class StopSignals:
    """The state of ``stop_signals()``: which signal came, and whom to tell.

    Attributes:
        signum: the first SIGHUP or SIGTERM that arrived; None: none.
        app: the running Textual app, asked to exit on the first signal; None: no TUI runs,
            the first signal raises ``Stopped``.
        cleaning_up: set by the caller once its clean-up started: a signal then only records
            itself, it must not abort the clean-up.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.app: Any = None
        self.cleaning_up = False

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        """The handler of SIGHUP and SIGTERM.

        Raises:
            Stopped: the first signal, while no TUI runs and no clean-up started.
        """
        if signum == signal.SIGHUP:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                # A terminal that is still there (``kill -HUP`` by hand) stays: Textual
                # restores it on the way out. A hung-up one fails isatty()'s ioctl (EIO).
                if not os.isatty(fd):
                    os.dup2(null, fd)
            os.close(null)
            signal.signal(signal.SIGCONT, signal.SIG_DFL)
        if self.signum is not None or self.cleaning_up:
            self.signum = self.signum or signum
            return  # already stopping: a second signal must not abort the clean-up
        self.signum = signum
        loop = getattr(self.app, "_loop", None) if self.app is not None else None
        if loop is None:
            raise Stopped(f"signal {signum}")
        # The handler runs between two steps of Textual's event loop: ask the loop to exit
        # the app rather than touching its message queue from here.
        loop.call_soon_threadsafe(self.app.exit)


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """Route SIGHUP and SIGTERM to a new ``StopSignals`` for the duration of the block; the
    handlers before it come back afterwards (a nested block hands them back to the outer
    one). Main thread only, as ``signal.signal``."""
    sig = StopSignals()
    before = {s: signal.signal(s, sig.handle) for s in (signal.SIGHUP, signal.SIGTERM)}
    try:
        yield sig
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
