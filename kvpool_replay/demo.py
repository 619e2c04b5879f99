"""``kvpool-console --demo``: a local fleet replaying a trace, watched in the console's TUI.

``kvpool-console --demo`` replaces its own process with ``python -m kvpool_replay.demo`` and the
demo options (``kvpool_console.cli``; the console never imports this package). Here a
``DemoCluster`` starts (master, store, fleet hub requiring fresh per-role CURVE keys, engines
holding the agent key; it prints where the keys are and the hub address), then the
console's own TUI watches it: ``kvpool_console.cli.main(["--hub", HUB, "--keys", DIR])``, as an
operator would run it against a real fleet. Everything the demo started stops on the way out,
and with a ``kill -9`` of this process too (``DemoCluster``'s tether, ``_tether``).

Usage (what the console passes on; every option but ``--trace`` is always given)::

    python -m kvpool_replay.demo --engines N --speedup X --engine sim|vllm|pd --refresh S
                                 [--trace PATH]

Exit status, as documented for ``kvpool-console``: 0 ok; 2 demo not startable (missing or invalid
trace, Mooncake binaries missing, a process that exited at start, no free ports); 128+N left on
signal N (SIGHUP, SIGTERM, or SIGINT: a Ctrl-C before the TUI drew), after stopping everything
the demo started and restoring the terminal; then (but after a SIGHUP, with no terminal left)
one line says what it stopped. Messages start with ``kvpool-console --demo:``, the command the
user typed.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from kvpool_agent.cli_parser import EXIT_USAGE, CommandParser
from kvpool_console.cli import main as console_main
from kvpool_console.signals import Stopped, stop_signals
from kvpool_replay._cluster import DemoCluster
from kvpool_replay._processes import reaping_exits
from kvpool_replay._trace import TraceError, default_trace_path

__all__ = ["main"]

PROG = "kvpool-console --demo"
EXIT_OK = 0


def _parser() -> argparse.ArgumentParser:
    # The console validated these and shows their defaults in its --help: no second copy here.
    p = CommandParser(prog=PROG, description="Start a local demo fleet replaying a "
                      "trace and watch it in the kvpool console.")
    p.add_argument("--trace", default=None,
                   help="Mooncake trace (default: conversation_trace.jsonl from "
                        "$KVPOOL_TRACES_DIR, else ../shared/traces, else the copy shipped in "
                        "kvpool_replay/traces)")
    p.add_argument("--engines", type=int, required=True, help="engines (>= 1)")
    p.add_argument("--speedup", type=float, required=True,
                   help="trace time / wall time (0 = as fast as possible)")
    p.add_argument("--engine", dest="engine_kind", choices=("sim", "vllm", "pd"), required=True)
    p.add_argument("--refresh", type=float, required=True, metavar="S",
                   help="TUI redraw interval in seconds")
    return p


def _start_and_watch(cluster: DemoCluster, trace: Path, refresh_s: float, err: Console) -> int:
    """Start ``cluster``, then run the console's TUI on it; the TUI's exit status."""
    try:
        cluster.start()
    except TraceError as e:
        err.print(f"[red]{PROG}: --trace {trace} is not a valid Mooncake trace: {e}; pass "
                  "--trace PATH to a valid one[/red]")
        return EXIT_USAGE
    except FileNotFoundError as e:
        err.print(f"[red]{PROG}: {e}[/red]")
        return EXIT_USAGE
    except RuntimeError as e:
        # A process that exited at start (its log's tail follows the first line) or no free
        # ports (seen with ~28,000 connections in TIME-WAIT): start() stopped what it started.
        err.print(f"{PROG}: the demo could not start: {e}", markup=False, highlight=False)
        return EXIT_USAGE
    # The TUI blocks this thread: an engine killed meanwhile is reaped here, not left a zombie
    # until the demo stops (the console still says GONE: no such process).
    with reaping_exits(cluster.processes.values()):
        return console_main(["--hub", cluster.hub_address, "--keys", str(cluster.keys_dir),
                             "--refresh", repr(refresh_s)])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    # soft_wrap: an error is one line even when stderr is a pipe (Rich would wrap at 80).
    err = Console(stderr=True, soft_wrap=True)
    trace = Path(args.trace) if args.trace else default_trace_path()
    if not trace.is_file():
        origin = "--trace" if args.trace else "the default trace"
        err.print(f"[red]{PROG}: {origin} {trace} not found: pass --trace PATH or set "
                  "KVPOOL_TRACES_DIR to the directory holding conversation_trace.jsonl (unset, "
                  "the copy shipped in kvpool_replay/traces is used)[/red]")
        return EXIT_USAGE

    def progress(line: str) -> None:
        # Start-up takes tens of seconds before the TUI can draw: say what is happening.
        err.print(f"{PROG}: {line}", markup=False, highlight=False)

    cluster = DemoCluster(trace, engines=args.engines, speedup=args.speedup,
                          engine_kind=args.engine_kind, progress=progress)
    rc = EXIT_OK
    with stop_signals() as sig:
        # Not ``with cluster``: a failing start() (bad trace) would skip __exit__ and leave the
        # work directory behind; start() already stops what it started, cleanup() the rest.
        try:
            rc = _start_and_watch(cluster, trace, args.refresh, err)
        except Stopped:
            pass
        except KeyboardInterrupt:
            # Ctrl-C before the TUI drew (the TUI reads it as its quit key): the same orderly
            # stop as a SIGTERM's, not a traceback.
            rc = 128 + signal.SIGINT
        finally:
            sig.cleaning_up = True
            # A second Ctrl-C must not abort the clean-up either (children run in their own
            # sessions: the terminal's SIGINT never reaches them).
            before = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                cluster.stop()
                cluster.cleanup()
            finally:
                signal.signal(signal.SIGINT, before)
    # A SIGTERM or SIGHUP that came while the TUI ran was the TUI's own (the console's
    # stop_signals() inside ours took it): the console returned 128+N, ours saw nothing.
    signalled = sig.signum is not None or rc > 128
    if rc == EXIT_OK or signalled:
        # The TUI's screen is gone: say the demo ended and left nothing behind.
        service = ", policy service" if cluster.policy_service else ""
        progress(f"stopped: its engines, master, store{service} and hub are gone and its work "
                 "directory removed")
    # The TUI reports a signal it handled itself as 128+N; one that came outside it is ours.
    if sig.signum is not None and rc < 128:
        return 128 + sig.signum
    return rc


if __name__ == "__main__":
    sys.exit(main())
