"""SVG screenshots of kvpool-console's screens, drawn by the real app, for the docs and README.

Each screen is a fresh ``KVPoolConsole`` over a recorded fleet (``docs/data/demo-fleet.json``,
made by ``scripts/record_demo_fleet.py`` from a running ``kvpool-console --demo``) with its clock
frozen at the recording's time, driven by Textual's Pilot (``App.run_test``) and saved with
Textual's own ``App.save_screenshot``. Nothing is drawn by hand: a screen that cannot be drawn
fails the script (and ``tests/docs/test_docs_screenshots.py``, which runs it into a temp dir).

    .venv/bin/python scripts/screenshots.py [--out docs/img] [--only fleet,help] [--size 120x32]
        [--whatif-data docs/data/demo-fleet-whatif.json]

Screens: fleet, pool, events, detail, flush, triage, help, and with ``--only whatif`` the
what-if curve. The triage screen logs in to no host: its ssh config points every host at a
closed port on 127.0.0.1, so it shows what the console says when it cannot reach an engine's
host.

The ``whatif`` screen is the Pool tab with the hub's reuse figures (live ceiling, what-if
LRU/MIN curve) over a recording of today's demo (``docs/data/demo-fleet-whatif.json``, same
script, 60 s: its engines report miss reasons, its prefill engine looks up too). A recording
holds no reuse figures: they are computed here by the hub's own ``ReuseService`` over the
lookups the recorded fleet made, rebuilt from the trace the demo replays as ``DemoCluster``
shares it: request k goes to the k mod S-th of the S engines that are not decode engines
(prefill first), the decode engine looks up the prefill engine's requests again, each engine
as many as its scheduler's recorded ``lookups``. Chunk ids are the connector's
(``chunk_hashes`` of the replay's tokens, ``chunk_id``), the pool's capacity the hub's
estimate from the recorded pool stats. Hashing the trace's tokens takes a while, so the screen
is drawn only when named. The other screens carry the reuse figures their recording holds
(the hub's, as the console had them: each engine's top miss split by the hub), none for a
recording made before they were kept.
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

from kvpool_agent._reuse_service import ReuseService, pool_capacity_tokens
from kvpool_agent.protocol import MAX_ACCESS_CHUNKS, Access, ReuseView, chunk_id
from kvpool_console.app import KVPoolConsole
from kvpool_console.source import StaticSource

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "docs" / "data" / "demo-fleet.json"
WHATIF_DATA = ROOT / "docs" / "data" / "demo-fleet-whatif.json"
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


def reuse_of(rec: FleetRecording, trace: Path | None = None) -> ReuseView:
    """The hub's reuse figures for the recorded fleet (module docstring), by a real
    ``ReuseService`` (its worker thread, once)."""
    from kvpool_connector.keys import chunk_hashes
    from kvpool_replay import default_trace_path, load_trace, request_tokens

    workers = [s for s in rec.states.values() if s.source.process_role == "worker"]
    if not workers:
        raise SystemExit("the recording has no worker agent")
    model = workers[0].source.model
    size = int(workers[0].source.layout.get("chunk_size", 0))
    scheds = sorted((s for s in rec.states.values() if s.source.process_role == "scheduler"),
                    key=lambda s: (s.source.kv_role != "kv_producer", s.source.engine_id))
    sharing = [s.lookup.lookups for s in scheds if s.source.kv_role != "kv_consumer"]
    again = sum(s.lookup.lookups for s in scheds if s.source.kv_role == "kv_consumer")
    if not size or not sum(sharing):
        raise SystemExit("the recording has no chunk size or no lookups")
    left = list(sharing)
    accesses = []
    for k, r in enumerate(load_trace(trace or default_trace_path(), limit=sum(sharing) * 2)):
        share = k % len(sharing)
        if not left[share]:
            if not any(left):
                break
            continue
        left[share] -= 1
        tokens = request_tokens(r)
        # The whole chunks a lookup may claim: never the last token (the connector's rule).
        hashes = chunk_hashes(tokens, size)[:(len(tokens) - 1) // size][:MAX_ACCESS_CHUNKS]
        access = Access(tokens=len(tokens), chunk_size=size,
                        chunks=[chunk_id(h) for h in hashes])
        accesses.append(access)
        if share == 0 and again and scheds[0].source.kv_role == "kv_producer":
            accesses.append(access)  # the decode engine's lookup of the prefill's request
            again -= 1
    svc = ReuseService(refresh_s=0.01, whatif_refresh_s=0.0, capacity=lambda m, n:
                       pool_capacity_tokens(rec.states.values(), m, n))
    svc.add(model, accesses)
    svc.start()
    try:
        deadline = time.monotonic() + 120.0
        while (view := svc.view()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        svc.stop()
    if view is None or not view.models or not view.models[0].whatif:
        raise SystemExit("the reuse service computed no what-if curve for the recording")
    return view


TALL = {"help": 66, "whatif": 40}
"""Screens drawn taller than ``--size`` (rows), so the whole screen fits in one picture."""

ON_REQUEST = {"whatif"}
"""Screens drawn only when ``--only`` names them (module docstring)."""


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
        "whatif": _keys("2"),
    }


async def shoot(rec: FleetRecording, name: str, drive: Drive, out: Path,
                size: tuple[int, int], ssh_config: Path, reuse: ReuseView | None) -> Path:
    app = KVPoolConsole(
        StaticSource(rec.states, rec.seen_ms, address=rec.hub_address, can_flush=True,
                     reuse=reuse),
        # One sample per screen (the next is 10 s away) at the recording's time: fixed ages.
        refresh_s=10.0, clock=lambda: rec.recorded_ms, ssh_config=str(ssh_config),
        # Over SSH even where the recording's host name is this machine's: triage looks at no
        # real process (the recorded pids are long gone or someone else's).
        triage_ssh=True)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        await drive(pilot)
        path = app.save_screenshot(filename=f"{name}.svg", path=str(out))
    return Path(path)


async def run(data: Path, out: Path, only: list[str] | None, size: tuple[int, int],
              whatif_data: Path = WHATIF_DATA) -> list[Path]:
    rec = load_recording(data)
    todo = screens(rec)
    unknown = set(only or []) - set(todo)
    if unknown:
        raise SystemExit(f"unknown screen(s) {sorted(unknown)}; known: {', '.join(todo)}")
    out.mkdir(parents=True, exist_ok=True)
    only = only or [n for n in todo if n not in ON_REQUEST]
    whatif = load_recording(whatif_data) if "whatif" in only else None
    written = []
    with tempfile.TemporaryDirectory(prefix="kvpool-shots-") as tmp:
        # Every host at a closed port: triage fails fast, never reaches a real machine.
        ssh_config = Path(tmp) / "ssh_config"
        ssh_config.write_text("Host *\n    HostName 127.0.0.1\n    Port 9\n"
                              "    ConnectTimeout 2\n")
        for name, drive in todo.items():
            if name not in only:
                continue
            shape = (size[0], max(size[1], TALL.get(name, 0)))
            if name == "whatif" and whatif is not None:
                written.append(await shoot(whatif, name, drive, out, shape, ssh_config,
                                           reuse_of(whatif)))
            else:
                written.append(await shoot(rec, name, drive, out, shape, ssh_config,
                                           rec.reuse))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="recorded fleet (JSON)")
    p.add_argument("--whatif-data", type=Path, default=WHATIF_DATA,
                   help="recorded fleet of the whatif screen (JSON)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the SVGs")
    p.add_argument("--only", default="", help="comma-separated screens (default: all but "
                   "whatif)")
    p.add_argument("--size", default="120x32", help="terminal size COLSxROWS")
    args = p.parse_args(argv)
    cols, _, rows = args.size.partition("x")
    only = [s for s in args.only.split(",") if s] or None
    for path in asyncio.run(run(args.data, args.out, only, (int(cols), int(rows)),
                                args.whatif_data)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
