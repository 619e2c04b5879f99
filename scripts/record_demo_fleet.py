"""Record the fleet of ``kvpool-console --demo`` for the documentation's screenshots.

Starts the demo fleet (``kvpool_replay.DemoCluster``: a local ``mooncake_master`` and store,
a fleet hub with CURVE keys, prefill/decode/mixed engines replaying the conversation trace
through the connector), lets it run ``--seconds``, then writes every agent's latest state as
the hub holds it, with the hub's reuse figures (the miss split), to
``docs/data/demo-fleet.json``. ``scripts/screenshots.py`` draws the console
over that file, so the pictures show a real fleet and stay the same between runs.

    .venv/bin/python scripts/record_demo_fleet.py [--seconds 120] [--out docs/data/demo-fleet.json]

Needs the Mooncake binaries, like ``make demo``, and reads the trace ``default_trace_path()``
names (the copy shipped in ``kvpool_replay/traces`` unless overridden); takes ``--seconds``
plus about 30 s of start-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fleet_recording import FleetRecording

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120.0, help="how long the demo runs first")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--speedup", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "data" / "demo-fleet.json")
    args = p.parse_args(argv)

    from kvpool_replay import DemoCluster

    cluster = DemoCluster(engines=args.engines, speedup=args.speedup, engine_kind="sim",
                          progress=lambda line: print(f"record: {line}", file=sys.stderr))
    try:
        cluster.start()
        time.sleep(args.seconds)
        hub = cluster.hub
        fleet = hub.fleet()  # type: ignore[attr-defined]
        reuse = hub.reuse.view()  # type: ignore[attr-defined]
        now_ms = time.time() * 1e3
    finally:
        cluster.stop()
        cluster.cleanup()
    rec = FleetRecording(
        recorded_ms=now_ms,
        hub_address="tcp://127.0.0.1:7600",
        note=(f"kvpool-console --demo fleet ({args.engines} engines, conversation trace, "
              f"speed-up {args.speedup:g}) after {args.seconds:g} s, recorded by "
              "scripts/record_demo_fleet.py"),
        states={aid: st for aid, (st, _) in fleet.items()},
        seen_ms={aid: seen for aid, (_, seen) in fleet.items()},
        reuse=reuse,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(msgspec.json.format(msgspec.json.encode(rec), indent=1) + b"\n")
    print(f"record: {len(rec.states)} agents written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
