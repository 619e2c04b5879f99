"""SVG screenshots of kvpool-console's screens, drawn by the real app, for the docs and README.

Each screen is a fresh ``KVPoolConsole`` over a recorded fleet (``docs/data/demo-fleet.json``,
made by ``scripts/record_demo_fleet.py`` from a running ``kvpool-console --demo``) with its clock
frozen at the recording's time, driven by Textual's Pilot (``App.run_test``) and saved with
Textual's own ``App.save_screenshot``. Nothing is drawn by hand: a screen that cannot be drawn
fails the script (and ``tests/docs/test_docs_screenshots.py``, which runs it into a temp dir).

    .venv/bin/python scripts/screenshots.py [--out docs/img] [--only fleet,help] [--size 120x32]

Screens: fleet, pool, events, detail, flush, triage, help. The triage screen logs in to no host:
its ssh config points every host at a closed port on 127.0.0.1, so it shows what the console
says when it cannot reach an engine's host.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from textual.pilot import Pilot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fleet_recording import FleetRecording, load_recording

from kvpool_console.app import KVPoolConsole
from kvpool_console.source import StaticSource

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "docs" / "data" / "demo-fleet.json"
DEFAULT_OUT = ROOT / "docs" / "img"

Drive = Callable[[Pilot], Awaitable[None]]


def _select(engine_id: str) -> Drive:
    async def run(pilot: Pilot) -> None:
        from kvpool_console.widgets import FleetTable

        table = pilot.app.query_one(FleetTable)
        table.move_cursor(row=table.get_row_index(f"e:{engine_id}"))
        await pilot.pause()

    return run


def _keys(*keys: str, before: Drive | None = None) -> Drive:
    async def run(pilot: Pilot) -> None:
        if before is not None:
            await before(pilot)
        await pilot.press(*keys)
        await pilot.pause()

    return run


async def _events(pilot: Pilot) -> None:
    from textual.widgets import RichLog

    await pilot.press("3")
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    pilot.app.query_one("#events-log", RichLog).scroll_end(animate=False, immediate=True)
    await pilot.pause()


def _triage(engine_id: str) -> Drive:
    async def run(pilot: Pilot) -> None:
        await _select(engine_id)(pilot)
        await pilot.press("t")
        deadline = time.monotonic() + 20.0
        # The checks run in the panel's worker; wait until it finished (a report or an error).
        while time.monotonic() < deadline:
            await pilot.pause(0.1)
            running = [w for w in pilot.app.screen.workers if w.group == "triage"
                       and not w.is_finished]
            panels = pilot.app.screen.query("#triage-panel")
            if panels and not running:
                break
        else:
            raise RuntimeError("triage did not finish within 20 s")
        await pilot.pause()

    return run


def _engine(rec: FleetRecording, role: str) -> str:
    """The recorded engine of ``role`` (the demo names them prefill-0, decode-1, engine-2...)."""
    ids = sorted({s.source.engine_id for s in rec.states.values()
                  if s.source.instance_role == role})
    if not ids:
        raise SystemExit(f"the recording has no {role} engine")
    return ids[0]


TALL = {"help": 66}
"""Screens drawn taller than ``--size`` (rows), so the whole screen fits in one picture."""


def screens(rec: FleetRecording) -> dict[str, Drive]:
    decode = _engine(rec, "decode")
    prefill = _engine(rec, "prefill")
    return {
        "fleet": _keys("space", before=_select(decode)),
        "pool": _keys("2"),
        "events": _events,
        "detail": _keys("enter", before=_select(decode)),
        "flush": _keys("f", before=_select(prefill)),
        "triage": _triage(decode),
        "help": _keys("question_mark"),
    }


async def shoot(rec: FleetRecording, name: str, drive: Drive, out: Path,
                size: tuple[int, int], ssh_config: Path) -> Path:
    app = KVPoolConsole(
        StaticSource(rec.states, rec.seen_ms, address=rec.hub_address, can_flush=True),
        # One sample per screen (the next is 10 s away) at the recording's time: fixed ages.
        refresh_s=10.0, clock=lambda: rec.recorded_ms, ssh_config=str(ssh_config))
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        await drive(pilot)
        path = app.save_screenshot(filename=f"{name}.svg", path=str(out))
    return Path(path)


async def run(data: Path, out: Path, only: list[str] | None, size: tuple[int, int]
              ) -> list[Path]:
    rec = load_recording(data)
    todo = screens(rec)
    unknown = set(only or []) - set(todo)
    if unknown:
        raise SystemExit(f"unknown screen(s) {sorted(unknown)}; known: {', '.join(todo)}")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="kvpool-shots-") as tmp:
        # Every host at a closed port: triage fails fast, never reaches a real machine.
        ssh_config = Path(tmp) / "ssh_config"
        ssh_config.write_text("Host *\n    HostName 127.0.0.1\n    Port 9\n"
                              "    ConnectTimeout 2\n")
        for name, drive in todo.items():
            if only and name not in only:
                continue
            shape = (size[0], max(size[1], TALL.get(name, 0)))
            written.append(await shoot(rec, name, drive, out, shape, ssh_config))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="recorded fleet (JSON)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the SVGs")
    p.add_argument("--only", default="", help="comma-separated screens (default: all)")
    p.add_argument("--size", default="120x32", help="terminal size COLSxROWS")
    args = p.parse_args(argv)
    cols, _, rows = args.size.partition("x")
    only = [s for s in args.only.split(",") if s] or None
    for path in asyncio.run(run(args.data, args.out, only, (int(cols), int(rows)))):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
