"""``kvpool-console pin`` / ``unpin`` / ``pins``: pinned prefixes of a model, through the hub.

``pin`` and ``unpin`` need the operator key (the hub refuses them on its read-only port and
audits them); ``pins`` is read-only. Without ``targets`` the hub sends each to one worker agent
per layout of the model (``kvpool_agent._fleet``), which computes every rank's keys and pins
them (``kvpool_connector.pins``). Bad input is one line naming the option and the fix, exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpool_agent.cli_parser import EXIT_USAGE
from kvpool_agent.protocol import CommandReply, PinArgs, PinInfo
from kvpool_console._pins import (
    DEFAULT_TTL_S,
    PIN_TIMEOUT_MS,
    PinInputError,
    chunk_size_of,
    done_line,
    pin_args,
    worker_models,
)
from kvpool_console._text import json_line, plain
from kvpool_console.model import fmt_bytes
from kvpool_console.source import FleetSource

__all__ = ["add_parsers", "check_input", "dash_led_tokens", "pins_document", "run"]

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 3


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``pin``, ``unpin`` and ``pins`` to ``kvpool-console``'s subcommands."""
    pn = sub.add_parser("pin", parents=[common],
                        help="keep a prompt prefix of a model resident in the pool (operator)")
    pn.add_argument("--model", required=True, help="the model's name as its engines report it")
    what = pn.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", default=None, metavar="IDS",
                      help="the prefix's token ids, comma-separated (e.g. 1,15043,29892): the "
                           "model tokenizer's, 0..4294967295")
    what.add_argument("--text", default=None,
                      help="the prefix as text, tokenized by the engine's own tokenizer")
    pn.add_argument("--chat-template", action="store_true",
                    help="with --text: pin the text as the engine sees a chat's system prompt")
    pn.add_argument("--id", dest="pin_id", default=None,
                    help="the pin's name (default: p- and a digest of the prefix)")
    pn.add_argument("--mode", choices=("soft", "hard"), default="soft",
                    help="soft: evicted after every unpinned value, until the TTL ends "
                         "(default); hard: never evicted")
    pn.add_argument("--ttl-s", type=float, default=DEFAULT_TTL_S, metavar="S",
                    help=f"soft pin TTL in seconds (default {DEFAULT_TTL_S:g}, at most 86400)")
    pn.add_argument("--json", action="store_true")
    pn.add_argument("--timeout-ms", type=int, default=PIN_TIMEOUT_MS, metavar="MS",
                    help=f"how long to wait for the workers (default {PIN_TIMEOUT_MS})")
    up = sub.add_parser("unpin", parents=[common],
                        help="drop a pin and remove its values from the pool (operator)")
    up.add_argument("--model", required=True)
    up.add_argument("--id", dest="pin_id", required=True, help="the pin's name (see pins)")
    up.add_argument("--json", action="store_true")
    up.add_argument("--timeout-ms", type=int, default=PIN_TIMEOUT_MS, metavar="MS")
    ls = sub.add_parser("pins", parents=[common], help="list the pinned prefixes")
    ls.add_argument("--model", default="", help="one model's pins (default: every model's)")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--timeout-ms", type=int, default=5_000, metavar="MS")


def dash_led_tokens(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--tokens -5,3`` given as ``--tokens=-5,3``: argparse takes an argument
    that starts with ``-`` (and is not a plain negative number) for an option, and said only
    ``--tokens: expected one argument``. A token id is never negative, so the list is then
    refused as a bad list (``pin: --tokens: token ids are integers in 0..4294967295``)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if argv[i] == "--tokens" and value[:1] == "-" and value[1:2].isdigit():
            out.append(f"--tokens={value}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _checked(args: argparse.Namespace, err: Console) -> PinArgs | None:
    """The command's ``PinArgs`` from its options, checked as far as they can be without the
    fleet; ``None`` after printing the one line naming the bad option and the fix."""
    try:
        pa = pin_args(args.cmd, args.model, tokens=getattr(args, "tokens", None),
                      text=getattr(args, "text", None),
                      chat_template=getattr(args, "chat_template", False),
                      pin_id=getattr(args, "pin_id", None) or "",
                      mode=getattr(args, "mode", "soft"),
                      ttl_s=getattr(args, "ttl_s", DEFAULT_TTL_S))
    except PinInputError as e:
        err.print(plain(f"{args.cmd}: {e}", style="red"))
        return None
    if args.timeout_ms < 1:
        err.print(plain(f"{args.cmd}: --timeout-ms: must be >= 1", style="red"))
        return None
    return pa


def check_input(args: argparse.Namespace, err: Console) -> int | None:
    """``EXIT_USAGE`` after one line on stderr when the command's options are bad in
    themselves (token ids, TTL, pin id: ``pin_args``), before the hub is asked anything;
    ``None`` when they are fine as far as that goes."""
    return EXIT_USAGE if _checked(args, err) is None else None


def run(args: argparse.Namespace, src: FleetSource, out: Console, err: Console) -> int:
    """Run ``pin``, ``unpin`` or ``pins``; returns the exit status (0 ok, 1 an agent refused
    or failed, 2 bad input, 3 no operator key)."""
    pa = _checked(args, err)
    if pa is None:
        return EXIT_USAGE
    states, _ = src.fleet()
    models = worker_models(states)
    if pa.model and pa.model not in models:
        err.print(plain(f"{args.cmd}: --model: no worker reports model {pa.model!r}; known: "
                        f"{', '.join(sorted(models)) or 'none'}", style="red"))
        return EXIT_USAGE
    if args.cmd != "pins" and not src.can_flush:
        err.print(plain(f"{args.cmd} refused: read-only without the operator key; pass --keys "
                        "DIR with operator.key_secret (kvpool-agent keygen --role operator)",
                        style="red"))
        return EXIT_REFUSED
    if args.cmd == "pin" and pa.token_ids:
        try:  # the prefix against the model's chunk size, now that its workers are known
            pin_args("pin", args.model, tokens=args.tokens, chunk_size=chunk_size_of(
                states, pa.model))
        except PinInputError as e:
            err.print(plain(f"{args.cmd}: {e}", style="red"))
            return EXIT_USAGE
    replies = src.command(args.cmd, pin=pa, timeout_ms=args.timeout_ms)
    failed = [r for r in replies if not r.ok or r.pins is None]
    if args.json:
        sys.stdout.write(json_line(pins_document(replies, args.cmd)) + "\n")
    elif args.cmd == "pins":
        _print_pins(replies, out, pa.model)
    else:
        for r in replies:
            if r.ok and r.pins is not None:
                out.print(plain(done_line(args.cmd, r)))
    for r in failed:
        err.print(plain(f"{args.cmd} failed on {r.agent_id}: {r.error or 'no result'}",
                        style="red"))
    return EXIT_FAILED if failed else EXIT_OK


def _pin(p: PinInfo) -> dict[str, object]:
    """One pin as ``--json`` prints it (``pins_document``)."""
    soft = p.mode == "soft"
    return {"pin_id": p.pin_id, "model": p.model, "layout_digest": p.layout_digest,
            "mode": p.mode, "ttl_s": p.ttl_ms / 1e3 if soft else None,
            "expires_ms": p.expires_ms if soft and p.expires_ms else None,
            "tokens": p.tokens, "keys": p.keys, "bytes": p.bytes}


def pins_document(replies: list[CommandReply], cmd: str = "pins") -> dict[str, object]:
    """What ``pin``, ``unpin`` and ``pins`` print with ``--json`` (docs/operating.md, "pins
    --json"): one shape, not the wire replies.

    ``pins``: one per pin and agent (agents of one layout hold the same pins), with
    ``pin_id``, ``model``, ``layout_digest``, ``mode`` (``soft`` / ``hard``), ``ttl_s`` (a
    soft pin's TTL in seconds, ``None`` for a hard one), ``expires_ms`` (a soft pin's end,
    epoch ms; ``None`` for a hard pin or from an agent of an earlier release), ``tokens``
    (pinned, whole chunks), ``keys`` (every rank's chunk keys), ``bytes`` (of their values)
    and ``agent_id`` (the worker holding it): after a ``pin`` or ``unpin``, the pins the agent
    holds then. ``agents``: per agent that answered, ``pinned_bytes`` (its layout's pins
    together) and ``pool_bytes`` (the pool's capacity as it read it; ``None`` when it read
    none: a master whose ``/metrics`` did not answer, or an agent of an earlier release, which
    sent 0 on a listing); for ``pin`` also ``pin`` (the pin made), ``pinned_now`` (keys pinned
    at once), ``pending`` (pinned when saved) and ``failed`` (refused by the store); for
    ``unpin`` ``pin`` (the pin dropped) and ``removed_keys``. ``errors``: ``agent_id`` and
    ``error`` of each agent that did not answer with pins."""
    pins: list[dict[str, object]] = []
    agents: list[dict[str, object]] = []
    errors: list[dict[str, object]] = []
    for r in replies:
        if not r.ok or r.pins is None:
            errors.append({"agent_id": r.agent_id, "error": r.error or "no result"})
            continue
        agent: dict[str, object] = {"agent_id": r.agent_id,
                                    "pinned_bytes": r.pins.pinned_bytes,
                                    "pool_bytes": r.pins.pool_bytes or None}
        if cmd in ("pin", "unpin"):
            agent["pin"] = _pin(r.pins.pin) if r.pins.pin is not None else None
        if cmd == "pin":
            agent |= {"pinned_now": r.pins.pinned_now, "pending": r.pins.pending,
                      "failed": r.pins.failed}
        elif cmd == "unpin":
            agent["removed_keys"] = r.pins.removed_keys
        agents.append(agent)
        pins.extend(_pin(p) | {"agent_id": r.agent_id} for p in r.pins.pins)
    return {"pins": pins, "agents": agents, "errors": errors}


def _print_pins(replies: list[CommandReply], out: Console, model: str) -> None:
    """The pins as a table, or one line when the agents that answered hold none (as the TUI
    says it)."""
    if not any(r.pins.pins for r in replies if r.pins is not None):
        if any(r.ok and r.pins is not None for r in replies):
            out.print(plain(f"pins of {model or 'every model'}: none"))
        return
    t = Table(title="pins")
    for col in ("Pin", "Model", "Layout", "Mode", "TTL s", "Ends in s", "Tokens", "Keys",
                "Bytes", "Agent"):
        t.add_column(col)
    now_ms = time.time() * 1e3
    for r in replies:
        for p in r.pins.pins if r.pins is not None else []:
            soft = p.mode == "soft"
            t.add_row(plain(p.pin_id), plain(p.model), p.layout_digest, p.mode,
                      f"{p.ttl_ms / 1e3:g}" if soft else "-",
                      f"{max(0.0, p.expires_ms - now_ms) / 1e3:.0f}"
                      if soft and p.expires_ms else "-", str(p.tokens),
                      str(p.keys), fmt_bytes(p.bytes), plain(r.agent_id))
    out.print(t)
