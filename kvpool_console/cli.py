"""``kvpool-console``: the fleet TUI, its demo mode, and one-shot commands for scripts and SSH.

Usage::

    kvpool-console [--hub ADDR] [--keys DIR] [--refresh S] [--ssh-config FILE]  # the TUI
    kvpool-console --demo [--trace PATH] [--engines N] [--speedup X] [--engine sim|vllm|pd]
    kvpool-console status [--json] [--fail-on warning|critical] [--observe S]
    kvpool-console health [ENGINE ... | --all] [--probe] [--json] [--timeout-ms MS]
    kvpool-console forget ENGINE ...                                # operator: drop from hub
    kvpool-console flush --scope model|engine|all [--model M] [--engine E]
                         [--dry-run] [--force --accept-torn-reads] [--yes] [--timeout-ms MS]
    kvpool-console pin --model M (--tokens IDS | --text TEXT [--chat-template]) [--id ID]
                       [--mode soft|hard] [--ttl-s S] [--json]       # operator
    kvpool-console unpin --model M --id ID [--json]                 # operator
    kvpool-console pins [--model M] [--json]
    kvpool-console triage ENGINE [--json] [--ssh-config FILE] [--ssh]  # kvpool_console.triage
    kvpool-console whatif [--json]                 # reuse ceiling, LRU/MIN at 0.25x..8x pool

``--hub`` defaults to ``$KVPOOL_HUB`` or ``tcp://127.0.0.1:7600`` (the hub's agent port; the
console uses P+1..P+3); like ``--keys`` and ``--wait`` it may come before or after the command.
``--keys`` is the console's keys directory: the hub's public ``hub.key`` and an operator
(``kvpool-agent keygen --role operator``) or viewer pair. Only an operator key allows a real
flush, ``health --probe``, ``forget``, ``pin`` and ``unpin`` (``kvpool_console._pin_cli``);
with a viewer key or none they are refused before anything is sent. A hub running with keys
serves nothing to a console without one.

Exit status: 0 ok; 1 ``status --fail-on`` matched an active alert, a health check failed, a
flush, pin or unpin reported errors, or ``whatif`` got no reuse figures within ``--wait``; 2 usage
error, hub not reachable or demo not startable (bad trace or option, a process that exited at
start, no free ports); 3 refused (read-only, not confirmed); 128+N left on signal N (SIGHUP,
SIGTERM; SIGINT before a demo's TUI drew), after stopping everything a demo started and
restoring the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvpool_agent.cli_parser import EXIT_USAGE, CommandParser, int_at_least, number_in
from kvpool_agent.protocol import CommandReply, FlushArgs, visible
from kvpool_console import _pin_cli as pin_cli
from kvpool_console import _whatif_cli as whatif_cli
from kvpool_console._liveness import local_process_alive
from kvpool_console._status_doc import status_document
from kvpool_console._text import json_line, plain
from kvpool_console.alerts import SEVERITY_RANK, WATERMARK_MARGIN, AlertModel, AlertSettings
from kvpool_console.alerts.alert import SEVERITY_STYLE
from kvpool_console.alerts.policy import service_removed, steering_summary
from kvpool_console.model import (
    build_view,
    fmt_age,
    fmt_bytes,
    fmt_lease,
    health_rows,
    loss_text,
    sum_flush,
)
from kvpool_console.rows import FleetView
from kvpool_console.signals import Stopped, StopSignals, stop_signals
from kvpool_console.source import ClientSource, FleetSource, now_ms
from kvpool_console.triage import cli as triage_cli

__all__ = ["DEFAULT_HUB", "main", "status_document"]

DEFAULT_HUB = "tcp://127.0.0.1:7600"
"""Hub address when neither ``--hub`` nor ``$KVPOOL_HUB`` is given."""

EXIT_OK, EXIT_ALERT, EXIT_REFUSED = 0, 1, 3
_KNOWN_SHOWN = 10  # engine ids an unknown-name message lists, keys the status text lists
_REST_OF_SNAPSHOT_MS = 500  # forget waits this long for a snapshot's later frames

PIPE_WIDTH = 200
"""Table width when stdout is not a terminal (Rich would assume 80 columns and squeeze the
status table's 13 columns to a letter each)."""

FLUSH_TIMEOUT_MS = 30_000
"""Default ``flush --timeout-ms``: a flush of a loaded pool (dry run, then the removal) takes
longer than the 5 s other commands get."""


def _common(top: bool) -> CommandParser:
    """Options accepted both before and after the command. Only the top level has defaults:
    a subparser's default would overwrite a value given before the command."""
    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    common = CommandParser(add_help=False)
    common.add_argument("--hub", default=default(None),
                        help=f"hub address tcp://HOST:P (default $KVPOOL_HUB or {DEFAULT_HUB})")
    common.add_argument("--keys", default=default(None), metavar="DIR",
                        help="keys directory: hub.key and an operator or viewer key pair "
                        "(kvpool-agent keygen --role operator|viewer); only operator changes "
                        "the pool (default: $KVPOOL_KEYS_DIR)")
    common.add_argument("--wait", type=number_in(_LEAST_WAIT_S, unit="seconds"),
                        default=default(3.0), metavar="S",
                        help="seconds to wait for the hub's first snapshot (default 3)")
    common.add_argument("--watermark-ratio", type=number_in(0, 1), default=default(None),
                        metavar="R", help="pool usage fraction that raises pool_watermark "
                        "(default: the pool's eviction_high_watermark_ratio)")
    common.add_argument("--watermark-margin", type=number_in(0, 1),
                        default=default(WATERMARK_MARGIN), metavar="M",
                        help="pool_watermark clears below ratio - M "
                             f"(default {WATERMARK_MARGIN})")
    common.add_argument("--stuck-after-ms", type=int_at_least(1), default=default(None),
                        metavar="MS", help="a load or save in flight longer than this is stuck "
                        "(default: 2x what its bytes take at its agent's recent rate, at least "
                        "2500)")
    return common


_FASTEST_REFRESH_S = 0.25
"""The TUI's fastest redraw (``kvpool_console.app.REFRESH_STEPS[0]``; not imported here: the
one-shot modes do not load Textual)."""
_LEAST_WAIT_S = 0.1
"""The shortest ``--wait`` (s): below it the hub's first snapshot cannot come in time, and
``--wait 0`` blamed an unreachable hub."""


def _parser() -> argparse.ArgumentParser:
    common = _common(top=False)
    p = CommandParser(prog="kvpool-console", parents=[_common(top=True)],
                      description="Watch and operate a kvpool KV-cache pool fleet.")
    p.add_argument("--refresh", type=number_in(_FASTEST_REFRESH_S, unit="seconds"), default=1.0,
                   metavar="S", help="TUI redraw interval in seconds, at least "
                   f"{_FASTEST_REFRESH_S:g} (default 1; + / - change it live)")
    p.add_argument("--ssh-config", default=None, metavar="FILE",
                   help="ssh config file for triage (key t) and the triage command "
                        "(default ~/.ssh/config)")
    p.add_argument("--demo", action="store_true",
                   help="start a local mooncake_master with the pool-wide policy service "
                   "beside it (kvpool-policy serve; not with --engine pd), engines replaying a "
                   "trace under it (admission: service), and watch them")
    p.add_argument("--trace", default=None,
                   help="demo trace (default: conversation_trace.jsonl from $KVPOOL_TRACES_DIR, "
                        "else ../shared/traces, else the copy shipped with kvpool)")
    p.add_argument("--engines", type=int_at_least(1), default=4, help="demo engines (default 4)")
    p.add_argument("--speedup", type=number_in(0), default=5.0,
                   help="demo replay speed-up: trace time / wall time (default 5)")
    p.add_argument("--engine", dest="engine_kind", choices=("sim", "vllm", "pd"), default="sim",
                   help="demo engine kind (default sim); pd: a real prefill/decode pair of "
                        "vllm serve engines behind the P/D proxy, the pool as the hand-over")
    sub = p.add_subparsers(dest="cmd")
    st = sub.add_parser("status", parents=[common], help="print the fleet once")
    st.add_argument("--json", action="store_true", help="JSON for scripts and alerting")
    st.add_argument("--fail-on", choices=("warning", "critical"), default=None,
                    help="exit 1 when an alert of this severity (or worse) is active")
    st.add_argument("--observe", type=number_in(0), default=0.0, metavar="S",
                    help="watch the fleet for S seconds before printing, as the TUI does: "
                         "pauses, evictions and alerts raised in that window (default 0)")
    he = sub.add_parser("health", parents=[common], help="run health checks")
    he.add_argument("engines", nargs="*", metavar="ENGINE", help="engine ids (default: all)")
    he.add_argument("--all", action="store_true", help="every engine")
    he.add_argument("--probe", action="store_true",
                    help="also write, read and remove a probe key in the pool (operator key)")
    he.add_argument("--json", action="store_true")
    he.add_argument("--timeout-ms", type=int_at_least(1), default=5_000, metavar="MS",
                    help="how long to wait for the agents' replies (default 5000)")
    fl = sub.add_parser("flush", parents=[common], help="remove pool entries of a scope")
    fl.add_argument("--scope", choices=("model", "engine", "all"), required=True,
                    help="model: every key of --model; engine: --engine's own keys; all: every "
                         "kvpool key of every pool")
    fl.add_argument("--model", default=None, help="model name (scope model)")
    fl.add_argument("--engine", dest="engine_id", default=None, help="engine id (scope engine)")
    fl.add_argument("--dry-run", action="store_true",
                    help="only count what would be removed (scope all: listed by the pool's "
                         "store agent when one runs; a viewer key gets a count up to 10 s old)")
    fl.add_argument("--force", action="store_true",
                    help="also remove leased entries, which engines may be reading now (needs "
                         "--accept-torn-reads)")
    fl.add_argument("--accept-torn-reads", action="store_true",
                    help="acknowledge what --force risks: a load still copying a removed entry "
                         "can read memory a new value reuses")
    fl.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    fl.add_argument("--json", action="store_true",
                    help="the dry run's (and the flush's) answers as one JSON line")
    fl.add_argument("--timeout-ms", type=int_at_least(1), default=FLUSH_TIMEOUT_MS, metavar="MS",
                    help=f"how long to wait for each flush round (default {FLUSH_TIMEOUT_MS})")
    fg = sub.add_parser("forget", parents=[common],
                        help="drop engines from the hub now (e.g. after a scale-down)")
    fg.add_argument("engines", nargs="+", metavar="ENGINE", help="engine (or agent) ids")
    pin_cli.add_parsers(sub, common)
    triage_cli.add_parser(sub, common)
    whatif_cli.add_parser(sub, common)
    return p


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv`` and resolve ``--hub``: the command line (either position), else
    ``$KVPOOL_HUB``, else ``DEFAULT_HUB``."""
    args = _parser().parse_args(pin_cli.dash_led_tokens(sys.argv[1:] if argv is None else argv))
    args.hub = args.hub or os.environ.get("KVPOOL_HUB") or DEFAULT_HUB
    return args


def _connect(args: argparse.Namespace, err: Console) -> ClientSource | None:
    try:
        src = ClientSource(args.hub, keys_dir=args.keys, pump=args.cmd is None,
                           refresh_s=args.refresh if args.cmd is None else None)
    except (ValueError, OSError) as e:
        err.print(plain(f"kvpool-console: {e}", style="red"))
        return None
    # The TUI starts even before the hub is up (rows appear when it is); one-shots need data.
    if args.cmd is not None and not src.wait_ready(args.wait):
        err.print(plain(f"kvpool-console: no snapshot from the hub at {args.hub} within "
                        f"{args.wait:g} s: is `kvpool-agent hub --address {args.hub}` running "
                        "(--hub or $KVPOOL_HUB), and is this console's key authorized on it "
                        "(--keys or $KVPOOL_KEYS_DIR; a keyed hub refuses a console without "
                        "one)?", style="red"))
        src.close()
        return None
    return src


_OBSERVE_STEP_S = 0.25
"""Sampling interval of ``status --observe`` (the hub sends deltas at 4 Hz)."""


def _alert_settings(args: argparse.Namespace) -> AlertSettings:
    """The alert options of the command line (``--watermark-ratio``, ``--watermark-margin``,
    ``--stuck-after-ms``); callers building their own Namespace may leave them out."""
    defaults = AlertSettings()
    return AlertSettings(
        watermark_ratio=getattr(args, "watermark_ratio", defaults.watermark_ratio),
        watermark_margin=getattr(args, "watermark_margin", defaults.watermark_margin),
        stuck_after_ms=getattr(args, "stuck_after_ms", defaults.stuck_after_ms))


def _view(src: FleetSource, args: argparse.Namespace) -> FleetView:
    model = AlertModel(dataclasses.replace(_alert_settings(args), alive=local_process_alive))
    # The TUI's alert model, fed for the observation window: what it saw raised, paused or
    # evicting there it shows as the TUI does; before the window it knows what agents report.
    until = time.monotonic() + getattr(args, "observe", 0.0)
    while True:
        states, seen = src.fleet()
        now = now_ms()
        reuse = src.reuse()
        alerts = model.update(states, seen, now, reuse)
        if time.monotonic() >= until:
            view = build_view(states, seen, now, alerts=alerts, reuse=reuse)
            view.hub_counters = src.hub_counters()
            return view
        time.sleep(_OBSERVE_STEP_S)


def _percent(rate: float) -> str:
    """``rate`` (a fraction) as ``"12.3%"``; a rate above 0 that rounds to 0.0% is
    ``"<0.1%"``, so one engine with a huge token count cannot show hits as none."""
    return "<0.1%" if 0.0 < rate < 0.0005 else f"{rate:.1%}"


def _status(args: argparse.Namespace, src: FleetSource, out: Console) -> int:
    view = _view(src, args)
    # Handshakes the hub refused per port (no key, or one not authorized there): only a hub
    # with keys counts them.
    refused = dict(src.client.refused_connections) if isinstance(src, ClientSource) else {}
    # What the hub refused per authorized key (over a budget or bound, or its binding): the
    # names for an operator key only, the total for every console.
    by_key = src.client.refused_names() if isinstance(src, ClientSource) else {}
    total = src.client.refused_total if isinstance(src, ClientSource) else 0
    if args.json:
        doc = {**status_document(view), "refused_connections": refused,
               "refused_by_key": by_key, "refused_total": total}
        sys.stdout.write(json_line(doc) + "\n")
    else:
        t = Table(title=f"kvpool fleet @ {src.address}", expand=False)
        for col in ("Engine", "State", "Role", "KV role", "Backend", "Hit", "Hit/Looked",
                    "Ld", "Sv", "Fail", "Pool", "Lease", "Age", "Namespace"):
            t.add_column(col)
        for r in view.engines:
            pool = (f"{fmt_bytes(r.segment_used_bytes)}/{fmt_bytes(r.segment_total_bytes)}"
                    if r.segment_total_bytes else "-")
            store = r.role == "store"  # looks nothing up: no hit rate
            t.add_row(plain(r.engine_id), r.state, r.role, r.kv_role, plain(r.backend),
                      "-" if store else _percent(r.hit_rate),
                      "-" if store else f"{r.loaded_tokens}/{r.prompt_tokens}",
                      str(r.loads_in_flight),
                      str(r.saves_in_flight), str(r.loads_failed), pool,
                      fmt_lease(r.next_lease_expiry_ms, view.now_ms), fmt_age(r.age_ms),
                      plain(r.namespace or "-"))
        out.print(t)
        tot = view.totals
        stores = f", {tot.stores} store agent{'s' * (tot.stores != 1)}" if tot.stores else ""
        silent = "".join(f"{n} {word}, " for n, word in ((tot.hung, "hung"), (tot.gone, "gone"))
                         if n)
        out.print(f"{tot.engines} engines{stores} ({silent}{tot.stale} stale, {tot.down} down), "
                  f"hit rate {_percent(tot.hit_rate)} (local {_percent(tot.local_hit_rate)}), "
                  f"{tot.loads_in_flight} loads in flight, "
                  f"{tot.loads_failed} failed loads")
        if any(r.policy_in_charge for r in view.engines):
            steering, master = steering_summary(
                ((r.engine_id, r.steered_by, r.policy) for r in view.engines),
                service_removed((r.policy_service, r.policy_removed_keys)
                                for r in view.engines))
            out.print(plain(steering, style="yellow" if master else ""))
        for pr in view.pools:
            health = ("" if pr.healthy is None else ", healthy" if pr.healthy
                      else f", UNHEALTHY: {pr.health_detail}")
            out.print(plain(f"pool {pr.name}: {pr.keys:,} keys, "
                            f"{fmt_bytes(pr.used_bytes)}/{fmt_bytes(pr.total_bytes)}, "
                            f"{pr.evicted_keys:,} evicted, reported by {pr.reported_by} "
                            f"agent(s)"
                            + (f" ({pr.silent_by} more silent)" if pr.silent_by else "")
                            + health))
            if pr.losses:
                out.print(plain("  " + loss_text(pr, view.now_ms), style="red"))
        if any(refused.values()):
            out.print(Text("hub refused connections without an authorized key: " + ", ".join(
                f"{port} {n}" for port, n in sorted(refused.items()) if n), style="yellow"))
        if by_key:
            shown = sorted(by_key.items(), key=lambda kv: (-kv[1], kv[0]))
            out.print(Text("hub refused by key (over a budget or bound, or its binding): "
                           + ", ".join(f"{visible(k, one_line=True)} {n}"
                                       for k, n in shown[:_KNOWN_SHOWN])
                           + (f" (and {len(shown) - _KNOWN_SHOWN} more keys)"
                              if len(shown) > _KNOWN_SHOWN else ""), style="yellow"))
        elif total:
            out.print(Text(f"hub refused keys {total:,} times (over a budget or bound, or "
                           "their binding; names for an operator key)", style="yellow"))
        for a in view.alerts:
            # Subject and message name engines and quote agents' errors: data, not markup.
            line = Text(a.severity.upper(), style=SEVERITY_STYLE[a.severity])
            line.append_text(plain(f" {a.subject}: {a.message}\n    hint: {a.hint}"))
            out.print(line)
    if args.fail_on is not None:
        floor = SEVERITY_RANK[args.fail_on]
        if any(SEVERITY_RANK[a.severity] >= floor for a in view.alerts):
            return EXIT_ALERT
    return EXIT_OK


def _needs_key(what: str, src: FleetSource, err: Console) -> bool:
    """Refuse ``what`` without the operator key (before sending: the hub refuses it too)."""
    if src.can_flush:
        return False
    err.print(f"[red]{what} refused: read-only without the operator key; pass --keys DIR "
              "with operator.key_secret (kvpool-agent keygen --role operator)[/red]")
    return True


def _forget(args: argparse.Namespace, src: FleetSource, out: Console, err: Console) -> int:
    if _needs_key("forget", src, err):
        return EXIT_REFUSED
    states, _ = src.fleet()
    known = {s.source.engine_id for s in states.values()} | set(states)
    unknown = [e for e in args.engines if e not in known]
    if unknown and isinstance(src, ClientSource):
        # A large fleet's join snapshot comes in several frames: take the rest, then judge.
        src.client.updates(_REST_OF_SNAPSHOT_MS)
        states, _ = src.fleet()
        known = {s.source.engine_id for s in states.values()} | set(states)
        unknown = [e for e in args.engines if e not in known]
    if unknown:  # before anything is forgotten: a typo among the names forgets none of them
        engines = sorted({s.source.engine_id for s in states.values()})
        shown = ", ".join(engines[:_KNOWN_SHOWN]) or "none"
        more = f" (and {len(engines) - _KNOWN_SHOWN} more)" if len(engines) > _KNOWN_SHOWN else ""
        err.print(plain(f"forget: unknown engine(s) or agent(s) {', '.join(unknown)}; nothing "
                        f"forgotten; engines: {shown}{more}", style="red"))
        return EXIT_USAGE
    replies = src.command("forget", targets=list(args.engines))
    r = replies[0] if replies else None
    if r is None or not r.ok:
        err.print(f"forget: {r.error if r is not None else 'no reply'}", style="red",
                  markup=False, highlight=False)
        return EXIT_ALERT
    out.print(f"forgot {len(r.forgotten)} agent(s): {', '.join(r.forgotten)}",
              markup=False, highlight=False)
    return EXIT_OK


def _health(args: argparse.Namespace, src: FleetSource, out: Console, err: Console) -> int:
    if args.probe and _needs_key("health --probe", src, err):
        return EXIT_REFUSED
    states, _ = src.fleet()
    targets: list[str] = []
    if args.engines and not args.all:
        known = {s.source.engine_id for s in states.values()}
        unknown = [e for e in args.engines if e not in known]
        if unknown:
            err.print(plain(f"health: unknown engine(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(known)) or 'none'}", style="red"))
            return EXIT_USAGE
        targets = sorted(a for a, s in states.items() if s.source.engine_id in args.engines)
    replies = src.command("health", targets=targets, timeout_ms=args.timeout_ms,
                          probe=args.probe)
    failed = any(not r.ok or r.health is None or not r.health.ok for r in replies)
    if args.json:
        sys.stdout.write(msgspec.json.encode(replies).decode() + "\n")
        return EXIT_ALERT if failed else EXIT_OK
    t = Table(title="health")
    for col in ("Agent", "Check", "OK", "ms", "Detail"):
        t.add_column(col)
    for agent, check, ok, ms, detail in health_rows(replies):
        t.add_row(plain(agent), plain(check), "ok" if ok else "[red]FAIL[/]", ms, plain(detail))
    out.print(t)
    return EXIT_ALERT if failed else EXIT_OK


def _flush_line(replies: list[CommandReply]) -> tuple[str, bool]:
    suspect = [f"{r.agent_id}: {r.suspect}" for r in replies if r.suspect]
    if suspect:
        # The hub found an answer its pool's own key count contradicts: not done.
        return "flush SUSPECT, not confirmed: " + "; ".join(suspect), False
    total, errors = sum_flush(replies)
    if total is None:
        return "flush failed: " + "; ".join(errors), False
    verb = "would remove" if total.dry_run else f"removed {total.removed_keys} of"
    line = (f"{verb} {total.keys} keys ({total.bytes} bytes), "
            f"{total.skipped_leased} leased skipped")
    listed = sorted({(r.flush.listed_by, r.flush.listed_ms_ago) for r in replies
                     if r.ok and r.flush is not None and r.flush.listed_by})
    if listed:  # answers the hub copied from one listing: whose, and how old
        line += "; listed by " + ", ".join(f"{who} {ms / 1e3:.1f} s ago" for who, ms in listed)
    if errors:
        line += "; errors: " + "; ".join(errors)
    return line, not errors


FORCE_RISK = (
    "--force removes entries engines may be reading now: a load still copying one after its "
    "lease lapsed can take memory a new value reuses as its KV (wrong output, no error). Stop "
    "or drain the engines that read this pool first, then add --accept-torn-reads; without "
    "--force a flush skips leased entries and is safe while engines serve")
"""Why ``flush --force`` needs ``--accept-torn-reads`` (a Mooncake read holds a lease, not a
reference: a forced ``remove`` frees what a transfer may still copy; issue 39)."""


def _flush(args: argparse.Namespace, src: FleetSource, out: Console, err: Console) -> int:
    if args.force and not args.dry_run and not args.accept_torn_reads:
        err.print(plain(f"flush refused: {FORCE_RISK}"))
        return EXIT_USAGE
    if args.scope == "model" and not args.model:
        err.print("[red]flush: --scope model needs --model MODEL[/red]")
        return EXIT_USAGE
    if args.scope == "engine" and not args.engine_id:
        err.print("[red]flush: --scope engine needs --engine ENGINE_ID[/red]")
        return EXIT_USAGE
    if args.scope == "engine":
        # An engine's scope is flushed by its own worker: only a reporting engine can be.
        known = {s.source.engine_id for s in src.fleet()[0].values()}
        if args.engine_id not in known:
            err.print(plain(f"flush: unknown engine {args.engine_id}; known: "
                            f"{', '.join(sorted(known)) or 'none'}", style="red"))
            return EXIT_USAGE
    if not args.dry_run and not src.can_flush:
        err.print("[red]flush refused: read-only without the operator key; pass --keys DIR "
                  "(kvpool-agent keygen --role operator) or use --dry-run[/red]")
        return EXIT_REFUSED
    fa = FlushArgs(scope=args.scope, model=args.model, engine_id=args.engine_id,
                   dry_run=True, force=args.force)
    dry = src.command("flush", flush=fa, timeout_ms=args.timeout_ms)
    line, ok = _flush_line(dry)
    docs: list[Any] = [msgspec.to_builtins(dry)]
    if not args.json:
        out.print(plain(f"dry run: {line}"))
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
    done = src.command("flush", flush=msgspec.structs.replace(fa, dry_run=False),
                       timeout_ms=args.timeout_ms)
    line, ok = _flush_line(done)
    if args.json:
        sys.stdout.write(msgspec.json.encode(
            {"dry_run": docs[0], "flush": msgspec.to_builtins(done)}).decode() + "\n")
    else:
        out.print(plain(line))
    return EXIT_OK if ok else EXIT_ALERT


def _run_tui(source: FleetSource, args: argparse.Namespace, sig: StopSignals) -> None:
    from kvpool_console.app import KVPoolConsole

    sig.app = KVPoolConsole(source, refresh_s=args.refresh, ssh_config=args.ssh_config,
                            alert_settings=_alert_settings(args))
    try:
        sig.app.run()
    finally:
        sig.app = None


DEMO_MODULE = "kvpool_replay.demo"
"""The program ``--demo`` hands over to (``python -m DEMO_MODULE``)."""


def _demo(args: argparse.Namespace) -> NoReturn:
    """Hand ``--demo`` over to ``python -m kvpool_replay.demo`` with the demo options, replacing
    this process (``os.execv``).

    The demo starts mooncake_master, a fleet hub and engine processes (torch, vLLM): that is
    kvpool_replay's job, and the console imports only kvpool_agent. So the console runs the demo
    as a program of its own rather than importing it; an entry point would load it into this
    process all the same and exists only once the package metadata is reinstalled. The demo then
    runs this console's ``main`` on the fleet it started. Replacing the process keeps its id,
    terminal, session and parent: the signals that reach it (SIGTERM, the terminal's SIGHUP),
    its exit status and the terminal's restore are the demo's own, exactly as when the demo ran
    in this process. This parser checked the options first, so a bad one still fails here, in
    one line. Never returns.
    """
    argv = [sys.executable, "-m", DEMO_MODULE, "--engines", str(args.engines),
            "--speedup", repr(args.speedup), "--engine", args.engine_kind,
            "--refresh", repr(args.refresh)]
    if args.trace:
        argv += ["--trace", args.trace]
    # Whatever is buffered would be lost with this process image.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvpool-console``; returns the exit status (see module docstring)."""
    args = _parse(argv)
    out = Console() if sys.stdout.isatty() else Console(width=PIPE_WIDTH)
    # soft_wrap: an error is one line even when stderr is a pipe (Rich would wrap at 80).
    err = Console(stderr=True, soft_wrap=True)
    with stop_signals() as sig:
        rc = EXIT_OK
        # The finally blocks on the way out of _run stopped whatever it had started.
        with contextlib.suppress(Stopped):
            rc = _run(args, out, err, sig)
        return 128 + sig.signum if sig.signum is not None else rc


def _run(args: argparse.Namespace, out: Console, err: Console, sig: StopSignals) -> int:
    if args.demo:
        _demo(args)
    if args.cmd in ("pin", "unpin", "pins") and (bad := pin_cli.check_input(args, err)):
        return bad  # bad input is refused before the hub is asked (exit 2, with or without one)
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
        if args.cmd == "forget":
            return _forget(args, src, out, err)
        if args.cmd in ("pin", "unpin", "pins"):
            return pin_cli.run(args, src, out, err)
        if args.cmd == "triage":
            return triage_cli.run(args, src, out, err)
        if args.cmd == "whatif":
            return whatif_cli.run(args, src, out, err)
        _run_tui(src, args, sig)
        return EXIT_OK
    finally:
        src.close()


if __name__ == "__main__":
    sys.exit(main())
