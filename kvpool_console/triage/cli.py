"""``kvpool-console triage ENGINE [--json] [--ssh-config FILE] [--ssh]``: the one-shot triage.

The engine's hosts, pids, log file, ports and master come from the hub (the agents' last
reports), as for ``status``; then every host is checked (``triage_engine``): this machine
locally, as the console's user, other hosts over SSH (``--ssh``: this machine too).

Exit status: 0 every process of the engine runs and reports; 1 a critical finding (hung,
gone, OOM-killed, a port held by another process, master unreachable); 2 unknown engine, no
SSH access to a host (one line on stderr says why), or hub not reachable.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from rich.console import Console

from kvpool_console._text import json_line, plain
from kvpool_console.model import build_view
from kvpool_console.source import FleetSource, now_ms
from kvpool_console.triage._diagnose import exit_status
from kvpool_console.triage._plan import PlanError
from kvpool_console.triage._render import render
from kvpool_console.triage._run import triage_engine

__all__ = ["add_parser", "reporting", "run"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``triage`` subcommand to ``kvpool-console``'s subparsers ``sub``."""
    tr = sub.add_parser("triage", parents=[common],
                        help="look at an engine's hosts (this one locally, others over SSH) "
                             "and diagnose it")
    tr.add_argument("engine", metavar="ENGINE", help="engine id")
    tr.add_argument("--json", action="store_true", help="the TriageReport as JSON")
    # No default here: the top level's would be overwritten (``--ssh-config F triage E``).
    tr.add_argument("--ssh-config", default=argparse.SUPPRESS, metavar="FILE",
                    help="ssh config file (default ~/.ssh/config)")
    tr.add_argument("--ssh", action="store_true",
                    help="log in over SSH to an engine on this host too (default: checked "
                         "locally, as this user)")


def reporting(engine_id: str, src: FleetSource) -> bool:
    """Whether ``engine_id``'s agents still report (the console's own stale rule)."""
    states, seen = src.fleet()
    row = next((r for r in build_view(states, seen, now_ms()).engines
                if r.engine_id == engine_id), None)
    return row is not None and not row.stale


def run(args: argparse.Namespace, src: FleetSource, out: Console, err: Console) -> int:
    """Run ``triage`` for ``args.engine`` and print the report; returns the exit status."""
    states, _ = src.fleet()
    try:
        report = asyncio.run(triage_engine(args.engine, states,
                                           reporting=reporting(args.engine, src),
                                           ssh_config=args.ssh_config, ssh=args.ssh))
    except PlanError as e:
        err.print(plain(f"triage: {e}", style="red"))
        return 2
    failed = [h.ssh_error for h in report.hosts if h.ssh_error]
    for line in failed:
        err.print(plain(f"triage: {line}", style="red"))
    if args.json:
        # json_line: log lines may hold DEL and C1 controls (U+009B is CSI), which JSON
        # leaves raw and a terminal obeys.
        sys.stdout.write(json_line(report) + "\n")
    elif len(failed) < len(report.hosts):
        out.print(render(report))
    return exit_status(report)
