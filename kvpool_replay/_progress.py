"""Replay progress: engine processes PUSH what they have done, ``kvpool-replay`` shows one bar.

Each engine sends a ``ReplayProgress`` (msgspec JSON over a ZMQ PUSH socket, at most every
``_SEND_EVERY_S`` and once at the end); the orchestrator PULLs them and drives a ``rich``
progress bar on stderr with the fleet's requests done, hit rate and ETA. Without a terminal
(CI logs, pipes) rich draws nothing live, so a plain line goes out every ``_LOG_EVERY_S``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TextIO

import msgspec
import zmq
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["ProgressReceiver", "ProgressSender", "ReplayProgress"]

_SEND_EVERY_S = 0.25
_LOG_EVERY_S = 10.0


class ReplayProgress(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's running totals (tokens in tokens, counts in requests/blocks)."""

    engine_id: str
    done: int
    total: int
    input_tokens: int
    hit_tokens: int
    load_errors: int


class ProgressSender:
    """Engine side: ``update()`` after each request; sends at most every 0.25 s (and on
    ``final=True``) so a fast replay spends no time on progress. Never blocks: a full or absent
    receiver drops the update (progress is advisory)."""

    def __init__(self, address: str) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        self._sock.connect(address)
        self._last = 0.0

    def update(self, p: ReplayProgress, *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < _SEND_EVERY_S:
            return
        self._last = now
        with contextlib.suppress(zmq.Again):
            self._sock.send(msgspec.json.encode(p), zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close()


class ProgressReceiver:
    """Orchestrator side: binds an IPC PULL socket in ``workdir`` (``address`` goes into each
    ``EngineSpec.progress_to``) and shows the sum over engines.

    Args:
        workdir: private directory of this replay (the socket file lives there).
        total: requests the whole replay will run.
        show: ``False`` collects totals without printing anything (``--no-progress``).
        stream: where the bar or log lines go (default stderr).
    """

    def __init__(self, workdir: Path, total: int, *, show: bool = True,
                 stream: TextIO | None = None) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = f"ipc://{workdir / 'progress.sock'}"
        self._sock.bind(self.address)
        self._decoder = msgspec.json.Decoder(ReplayProgress)
        self._latest: dict[str, ReplayProgress] = {}
        self._total = total
        self._show = show
        self._console = Console(file=stream or sys.stderr)
        self._live = show and self._console.is_terminal
        self._started = time.monotonic()
        self._last_log = self._started
        self._progress = Progress(
            TextColumn("replay"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:.1f} req/s  hit {task.fields[hit]:.1%}  "
                       "load errors {task.fields[errors]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self._console, disable=not self._live, transient=False,
        )
        self._task: TaskID = self._progress.add_task(
            "replay", total=total, rate=0.0, hit=0.0, errors=0)

    def __enter__(self) -> ProgressReceiver:
        return self

    def begin(self) -> None:
        """Start the clock and the bar (call when the engines start replaying, so start-up
        time does not skew the rate and ETA)."""
        self._started = self._last_log = time.monotonic()
        self._progress.reset(self._task, start=True)
        self._progress.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._drain(0)
        self._render(force_log=True)
        self._progress.stop()
        self._sock.close()

    @property
    def done(self) -> int:
        """Requests finished by all engines so far."""
        return sum(p.done for p in self._latest.values())

    @property
    def total(self) -> int:
        """Requests the replay runs, all engines together."""
        return self._total

    def poll(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for updates, apply them and redraw."""
        self._drain(timeout_ms)
        self._render()

    def _drain(self, timeout_ms: int) -> None:
        if not self._sock.poll(timeout_ms):
            return
        while True:
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                p = self._decoder.decode(raw)
            except msgspec.DecodeError:
                continue  # only our own engines can reach this private socket
            self._latest[p.engine_id] = p

    def _render(self, *, force_log: bool = False) -> None:
        if not self._show:
            return
        done = self.done
        inp = sum(p.input_tokens for p in self._latest.values())
        hit = sum(p.hit_tokens for p in self._latest.values())
        errors = sum(p.load_errors for p in self._latest.values())
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = done / elapsed
        hr = hit / inp if inp else 0.0
        self._progress.update(self._task, completed=done, rate=rate, hit=hr, errors=errors)
        now = time.monotonic()
        if not self._live and (force_log or now - self._last_log >= _LOG_EVERY_S):
            self._last_log = now
            eta = f"{(self._total - done) / rate:.0f} s" if rate > 0 else "?"
            self._console.print(
                f"kvpool-replay: {done:,}/{self._total:,} requests, {rate:.1f} req/s, "
                f"hit rate {hr:.1%}, load errors {errors}, ETA {eta}",
                highlight=False, soft_wrap=True,
            )
