"""``kvpool-console``: the fleet TUI, its demo mode, and one-shot commands for scripts and SSH.

Usage::

    kvpool-console [--hub ADDR] [--keys DIR] [--refresh S]          # the TUI
    kvpool-console --demo [--trace PATH] [--engines N] [--speedup X] [--engine sim|vllm]
    kvpool-console status [--json] [--fail-on warning|critical]
    kvpool-console health [ENGINE ... | --all] [--json]
    kvpool-console flush --scope model|engine|all [--model M] [--engine E]
                         [--dry-run] [--force] [--yes]

``--hub`` defaults to ``$KVPOOL_HUB`` or ``tcp://127.0.0.1:7600`` (the hub's agent port; the
console uses P+1..P+3). ``--keys`` is a ``kvpool-agent keygen`` directory holding the operator
key; without it the console is read-only (a real flush is refused before anything is sent).

Exit status: 0 ok; 1 ``status --fail-on`` matched an active alert, a health check failed, or a
flush reported errors; 2 usage error or hub not reachable; 3 refused (read-only, not confirmed).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from kvpool_agent.protocol import CommandReply, FlushArgs
from kvpool_console.alerts import SEVERITY_RANK, evaluate
from kvpool_console.model import FleetView, build_view, fmt_age, fmt_bytes, fmt_lease
from kvpool_console.screens.actions import sum_flush
from kvpool_console.source import ClientSource, FleetSource, now_ms

__all__ = ["DEFAULT_HUB", "main", "status_document"]

DEFAULT_HUB = "tcp://127.0.0.1:7600"
"""Hub address when neither ``--hub`` nor ``$KVPOOL_HUB`` is given."""

EXIT_OK, EXIT_ALERT, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--hub", default=os.environ.get("KVPOOL_HUB", DEFAULT_HUB),
                        help="hub address tcp://HOST:P (default $KVPOOL_HUB or %(default)s)")
    common.add_argument("--keys", default=None, metavar="DIR",
                        help="operator key directory (kvpool-agent keygen); omit: read-only")
    common.add_argument("--wait", type=float, default=3.0, metavar="S",
                        help="seconds to wait for the hub's first snapshot (default 3)")
    p = argparse.ArgumentParser(prog="kvpool-console", parents=[common],
                                description="Watch and operate a kvpool KV-cache pool fleet.")
    p.add_argument("--refresh", type=float, default=1.0, metavar="S",
                   help="TUI redraw interval in seconds (default 1; + / - change it live)")
    p.add_argument("--demo", action="store_true",
                   help="start a local mooncake_master, engines replaying a trace, and watch them")
    p.add_argument("--trace", default=None, help="demo trace (default: the conversation trace)")
    p.add_argument("--engines", type=int, default=4, help="demo engines (default 4)")
    p.add_argument("--speedup", type=float, default=20.0,
                   help="demo replay speed-up: trace time / wall time (default 20)")
    p.add_argument("--engine", dest="engine_kind", choices=("sim", "vllm"), default="sim",
                   help="demo engine kind (default sim)")
    sub = p.add_subparsers(dest="cmd")
    st = sub.add_parser("status", parents=[common], help="print the fleet once")
    st.add_argument("--json", action="store_true", help="JSON for scripts and alerting")
    st.add_argument("--fail-on", choices=("warning", "critical"), default=None,
                    help="exit 1 when an alert of this severity (or worse) is active")
    he = sub.add_parser("health", parents=[common], help="run health checks")
    he.add_argument("engines", nargs="*", metavar="ENGINE", help="engine ids (default: all)")
    he.add_argument("--all", action="store_true", help="every engine")
    he.add_argument("--json", action="store_true")
    fl = sub.add_parser("flush", parents=[common], help="remove pool entries of a scope")
    fl.add_argument("--scope", choices=("model", "engine", "all"), required=True)
    fl.add_argument("--model", default=None, help="model name (scope model)")
    fl.add_argument("--engine", dest="engine_id", default=None, help="engine id (scope engine)")
    fl.add_argument("--dry-run", action="store_true", help="only count what would be removed")
    fl.add_argument("--force", action="store_true", help="also remove leased entries")
    fl.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    fl.add_argument("--json", action="store_true")
    return p


def status_document(view: FleetView) -> dict[str, Any]:
    """The ``status --json`` document: ``engines`` (one object per engine with at least
    engine_id, role, kv_role, backend, hit_rate, lookup_tokens, hit_tokens, loads_in_flight,
    load_errors, segment_used_bytes, segment_total_bytes, next_lease_expiry_ms, stale; plus
    its ``agents``), ``alerts``, ``pools``, ``totals`` and ``now_ms``."""
    doc: dict[str, Any] = msgspec.to_builtins(view)
    return {"now_ms": doc["now_ms"], "engines": doc["engines"], "alerts": doc["alerts"],
            "pools": doc["pools"], "totals": doc["totals"]}


def _connect(args: argparse.Namespace, err: Console) -> ClientSource | None:
    try:
        src = ClientSource(args.hub, keys_dir=args.keys, pump=args.cmd is None)
    except (ValueError, OSError) as e:
        err.print(f"[red]kvpool-console: {e}[/red]")
        return None
    # The TUI starts even before the hub is up (rows appear when it is); one-shots need data.
    if args.cmd is not None and not src.wait_ready(args.wait):
        err.print(f"[red]kvpool-console: no snapshot from the hub at {args.hub} within "
                  f"{args.wait:g} s: is `kvpool-agent hub --address {args.hub}` running? "
                  "(--hub or $KVPOOL_HUB)[/red]")
        src.close()
        return None
    return src


def _view(src: FleetSource) -> FleetView:
    states, seen = src.fleet()
    now = now_ms()
    return build_view(states, seen, now, alerts=evaluate(states, seen, now))


def _status(args: argparse.Namespace, src: FleetSource, out: Console) -> int:
    view = _view(src)
    if args.json:
        sys.stdout.write(msgspec.json.encode(status_document(view)).decode() + "\n")
    else:
        t = Table(title=f"kvpool fleet @ {src.address}", expand=False)
        for col in ("Engine", "State", "Role", "KV role", "Backend", "Hit", "Hit/Looked",
                    "Ld", "Sv", "Fail", "Pool", "Lease", "Age"):
            t.add_column(col)
        for r in view.engines:
            state = "DOWN" if r.down else "STALE" if r.stale else (r.severity or "ok").upper()
            pool = (f"{fmt_bytes(r.segment_used_bytes)}/{fmt_bytes(r.segment_total_bytes)}"
                    if r.segment_total_bytes else "-")
            t.add_row(r.engine_id, state, r.role, r.kv_role, r.backend, f"{r.hit_rate:.1%}",
                      f"{r.hit_tokens}/{r.lookup_tokens}", str(r.loads_in_flight),
                      str(r.saves_in_flight), str(r.load_errors), pool,
                      fmt_lease(r.next_lease_expiry_ms, view.now_ms), fmt_age(r.age_ms))
        out.print(t)
        tot = view.totals
        out.print(f"{tot.engines} engines ({tot.stale} stale, {tot.down} down), "
                  f"hit rate {tot.hit_rate:.1%}, {tot.loads_in_flight} loads in flight, "
                  f"{tot.load_errors} failed loads")
        for a in view.alerts:
            out.print(f"[{'red' if a.severity == 'critical' else 'yellow'}]{a.severity.upper()}"
                      f"[/] {a.subject}: {a.message}\n    hint: {a.hint}")
    if args.fail_on is not None:
        floor = SEVERITY_RANK[args.fail_on]
        if any(SEVERITY_RANK[a.severity] >= floor for a in view.alerts):
            return EXIT_ALERT
    return EXIT_OK


def _health(args: argparse.Namespace, src: FleetSource, out: Console, err: Console) -> int:
    states, _ = src.fleet()
    targets: list[str] = []
    if args.engines and not args.all:
        known = {s.source.engine_id for s in states.values()}
        unknown = [e for e in args.engines if e not in known]
        if unknown:
            err.print(f"[red]health: unknown engine(s) {', '.join(unknown)}; known: "
                      f"{', '.join(sorted(known)) or 'none'}[/red]")
            return EXIT_USAGE
        targets = sorted(a for a, s in states.items() if s.source.engine_id in args.engines)
    replies = src.command("health", targets=targets)
    failed = any(not r.ok or r.health is None or not r.health.ok for r in replies)
    if args.json:
        sys.stdout.write(msgspec.json.encode(replies).decode() + "\n")
        return EXIT_ALERT if failed else EXIT_OK
    t = Table(title="health")
    for col in ("Agent", "Check", "OK", "ms", "Detail"):
        t.add_column(col)
    for r in sorted(replies, key=lambda r: r.agent_id):
        if not r.ok or r.health is None:
            t.add_row(r.agent_id, "-", "[red]FAIL[/]", "", r.error or "no result")
            continue
        for c in r.health.checks:
            t.add_row(r.agent_id, c.name, "ok" if c.ok else "[red]FAIL[/]",
                      f"{c.latency_ms:.1f}", c.detail)
    out.print(t)
    return EXIT_ALERT if failed else EXIT_OK


def _flush_line(replies: list[CommandReply]) -> tuple[str, bool]:
    total, errors = sum_flush(replies)
    if total is None:
        return "flush failed: " + "; ".join(errors), False
    verb = "would remove" if total.dry_run else f"removed {total.removed_keys} of"
    line = (f"{verb} {total.keys} keys ({total.bytes} bytes), "
            f"{total.skipped_leased} leased skipped")
    if errors:
        line += "; errors: " + "; ".join(errors)
    return line, not errors


def _flush(args: argparse.Namespace, src: FleetSource, out: Console, err: Console) -> int:
    if args.scope == "model" and not args.model:
        err.print("[red]flush: --scope model needs --model MODEL[/red]")
        return EXIT_USAGE
    if args.scope == "engine" and not args.engine_id:
        err.print("[red]flush: --scope engine needs --engine ENGINE_ID[/red]")
        return EXIT_USAGE
    if not args.dry_run and not src.can_flush:
        err.print("[red]flush refused: read-only without the operator key; pass --keys DIR "
                  "(kvpool-agent keygen) or use --dry-run[/red]")
        return EXIT_REFUSED
    fa = FlushArgs(scope=args.scope, model=args.model, engine_id=args.engine_id,
                   dry_run=True, force=args.force)
    dry = src.command("flush", flush=fa)
    line, ok = _flush_line(dry)
    docs: list[Any] = [msgspec.to_builtins(dry)]
    if not args.json:
        out.print(f"dry run: {line}")
    if args.dry_run or not ok:
        if args.json:
            sys.stdout.write(msgspec.json.encode({"dry_run": docs[0]}).decode() + "\n")
        return EXIT_OK if ok else EXIT_ALERT
    if not args.yes:
        if not sys.stdin.isatty():
            err.print("[red]flush refused: not confirmed (pass --yes when not on a terminal)[/]")
            return EXIT_REFUSED
        answer = input(f"remove these entries of scope {args.scope}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            err.print("not flushed")
            return EXIT_REFUSED
    done = src.command("flush", flush=msgspec.structs.replace(fa, dry_run=False))
    line, ok = _flush_line(done)
    if args.json:
        sys.stdout.write(msgspec.json.encode(
            {"dry_run": docs[0], "flush": msgspec.to_builtins(done)}).decode() + "\n")
    else:
        out.print(line)
    return EXIT_OK if ok else EXIT_ALERT


def _run_tui(source: FleetSource, refresh_s: float) -> None:
    from kvpool_console.app import KVPoolConsole

    app = KVPoolConsole(source, refresh_s=refresh_s)

    def hangup(signum: int, _frame: object) -> None:
        # The terminal is gone (SSH dropped): there is nothing left to draw or restore, and
        # Textual's shutdown can block writing to the dead tty. Release the sockets and leave.
        source.close()
        os._exit(128 + signum)

    signal.signal(signal.SIGHUP, hangup)
    app.run()


def _demo(args: argparse.Namespace) -> int:
    from kvpool_console.demo import DemoCluster

    with DemoCluster(args.trace, engines=args.engines, speedup=args.speedup,
                     engine_kind=args.engine_kind) as cluster:
        _run_tui(ClientSource(cluster.hub_address, keys_dir=str(cluster.keys_dir), pump=True),
                 args.refresh)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvpool-console``; returns the exit status (see module docstring)."""
    args = _parser().parse_args(argv)
    out, err = Console(), Console(stderr=True)
    if args.demo:
        return _demo(args)
    src = _connect(args, err)
    if src is None:
        return EXIT_USAGE
    try:
        if args.cmd == "status":
            return _status(args, src, out)
        if args.cmd == "health":
            return _health(args, src, out, err)
        if args.cmd == "flush":
            return _flush(args, src, out, err)
        _run_tui(src, args.refresh)
        return EXIT_OK
    finally:
        src.close()


if __name__ == "__main__":
    sys.exit(main())
