"""Replay progress over real ZMQ: engines' totals are summed; a terminal gets a rich bar with an
ETA, a pipe gets plain lines."""

from __future__ import annotations

import io
from pathlib import Path

from kvpool_replay._progress import ProgressReceiver, ProgressSender, ReplayProgress


def _p(engine: str, done: int, inp: int, hit: int, errors: int = 0) -> ReplayProgress:
    return ReplayProgress(engine_id=engine, done=done, total=10, input_tokens=inp,
                          hit_tokens=hit, load_errors=errors)


class _Tty(io.StringIO):
    """A stream that says it is a terminal, as stderr in an operator's shell does."""

    def isatty(self) -> bool:
        return True


def _until(rx: ProgressReceiver, done: int) -> None:
    for _ in range(100):
        rx.poll(50)
        if rx.done == done:
            return
    raise AssertionError(f"receiver saw {rx.done} requests, expected {done}")


def test_two_engines_are_summed_and_logged_without_terminal(tmp_path: Path) -> None:
    out = io.StringIO()
    with ProgressReceiver(tmp_path, total=20, stream=out) as rx:
        rx.begin()
        a, b = ProgressSender(rx.address), ProgressSender(rx.address)
        a.update(_p("engine-0", 4, 1000, 250), final=True)
        b.update(_p("engine-1", 6, 3000, 750, errors=2), final=True)
        _until(rx, 10)
        # Updates within 0.25 s of the last are dropped unless final: the engine's hot loop
        # never waits on progress.
        a.update(_p("engine-0", 5, 1100, 250))
        a.update(_p("engine-0", 10, 2000, 500), final=True)
        _until(rx, 16)
        a.close()
        b.close()
    text = out.getvalue()
    last = text.strip().splitlines()[-1]
    assert last.startswith("kvpool-replay: 16/20 requests"), text
    assert "hit rate 25.0%" in last and "load errors 2" in last  # 1250 / 5000


def test_terminal_gets_a_bar_with_eta(tmp_path: Path) -> None:
    out = _Tty()
    with ProgressReceiver(tmp_path, total=10, stream=out) as rx:
        rx.begin()
        tx = ProgressSender(rx.address)
        tx.update(_p("engine-0", 3, 400, 100), final=True)
        _until(rx, 3)
        tx.close()
    text = out.getvalue()
    assert "3/10" in text and "ETA" in text and "hit 25.0%" in text
    assert "kvpool-replay: " not in text  # no log lines when the bar is live
