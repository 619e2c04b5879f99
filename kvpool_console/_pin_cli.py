"""``kvpool-console pin`` / ``unpin`` / ``pins``: pinned prefixes of a model, through the hub.

``pin`` and ``unpin`` need the operator key (the hub refuses them on its read-only port and
audits them); ``pins`` is read-only. Without ``targets`` the hub sends each to one worker agent
per layout of the model (``kvpool_agent._fleet``), which computes every rank's keys and pins
them (``kvpool_connector.pins``). Bad input is one line naming the option and the fix, exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Mapping
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from kvpool_agent.protocol import (
    MAX_PIN_TEXT_CHARS,
    MAX_PIN_TOKENS,
    MAX_SOFT_PIN_TTL_MS,
    CommandReply,
    EngineState,
    PinArgs,
)
from kvpool_console._text import json_line, plain
from kvpool_console.model import fmt_bytes
from kvpool_console.source import FleetSource

__all__ = ["PIN_TIMEOUT_MS", "add_parsers", "pins_summary", "run"]

PIN_TIMEOUT_MS = 30_000
"""Default ``--timeout-ms`` of ``pin`` / ``unpin``: an unpin waits out readers' leases."""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3

_OPTION = {"model": "--model", "pin_id": "--id", "token_ids": "--tokens", "text": "--text",
           "ttl_ms": "--ttl-s", "mode": "--mode"}
"""``PinArgs`` field -> the option that sets it (named in a bad-input line)."""


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``pin``, ``unpin`` and ``pins`` to ``kvpool-console``'s subcommands."""
    pn = sub.add_parser("pin", parents=[common],
                        help="keep a prompt prefix of a model resident in the pool (operator)")
    pn.add_argument("--model", required=True, help="the model's name as its engines report it")
    what = pn.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", default=None, metavar="IDS",
                      help="the prefix's token ids, comma-separated (e.g. 1,15043,29892)")
    what.add_argument("--text", default=None,
                      help="the prefix as text, tokenized by the engine's own tokenizer")
    pn.add_argument("--chat-template", action="store_true",
                    help="with --text: pin the text as the engine sees a chat's system prompt")
    pn.add_argument("--id", dest="pin_id", default=None,
                    help="the pin's name (default: p- and a digest of the prefix)")
    pn.add_argument("--mode", choices=("soft", "hard"), default="soft",
                    help="soft: evicted after every unpinned value, until the TTL ends "
                         "(default); hard: never evicted")
    pn.add_argument("--ttl-s", type=float, default=1800.0, metavar="S",
                    help="soft pin TTL in seconds (default 1800, at most 86400)")
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


class _BadInput(ValueError):
    """One line for the operator: the option and its fix."""


def _token_ids(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise _BadInput("--tokens: no token ids; give them comma-separated, e.g. 1,15043,29892")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise _BadInput(f"--tokens: {text[:40]!r} is not comma-separated integers; e.g. "
                        "--tokens 1,15043,29892") from None
    if any(not 0 <= t < 2**32 for t in ids):
        raise _BadInput("--tokens: token ids are integers in 0..4294967295")
    if len(ids) > MAX_PIN_TOKENS:
        raise _BadInput(f"--tokens: {len(ids)} token ids, at most {MAX_PIN_TOKENS} per pin")
    return ids


def _pin_args(args: argparse.Namespace) -> PinArgs:
    """``PinArgs`` of the command line, checked as the hub and agents check them.

    Raises:
        _BadInput: an option's value is invalid (the line names it and the fix).
    """
    fields: dict[str, Any] = {"model": args.model, "pin_id": getattr(args, "pin_id", None) or ""}
    if args.cmd == "pin":
        if args.text is not None:
            if not args.text:
                raise _BadInput("--text: empty; give the prefix's text")
            if len(args.text) > MAX_PIN_TEXT_CHARS:
                raise _BadInput(f"--text: {len(args.text)} characters, at most "
                                f"{MAX_PIN_TEXT_CHARS} per pin")
            fields.update(text=args.text, chat_template=args.chat_template)
            seed = args.text.encode()
        else:
            fields["token_ids"] = _token_ids(args.tokens)
            seed = ",".join(map(str, fields["token_ids"])).encode()
        if not 0 < args.ttl_s * 1e3 <= MAX_SOFT_PIN_TTL_MS:
            raise _BadInput(f"--ttl-s: {args.ttl_s:g} s; give 0 < S <= "
                            f"{MAX_SOFT_PIN_TTL_MS // 1000} (Mooncake's max_kv_soft_pin_ttl)")
        fields.update(mode=args.mode, ttl_ms=max(1, round(args.ttl_s * 1e3)))
        fields["pin_id"] = fields["pin_id"] or f"p-{hashlib.sha256(seed).hexdigest()[:12]}"
    try:
        return msgspec.convert(fields, PinArgs)
    except msgspec.ValidationError as e:
        field = str(e).rpartition("$.")[2].split("[")[0]
        raise _BadInput(f"{_OPTION.get(field, field)}: {str(e).split(' - at ')[0]}; "
                        "ids are one word of letters, digits and _.:/@+=~- not starting "
                        "with -") from None


def _worker_models(states: Mapping[str, EngineState]) -> set[str]:
    return {s.source.model for s in states.values()
            if s.source.process_role == "worker" and s.source.model}


def run(args: argparse.Namespace, src: FleetSource, out: Console, err: Console) -> int:
    """Run ``pin``, ``unpin`` or ``pins``; returns the exit status (0 ok, 1 an agent refused
    or failed, 2 bad input, 3 no operator key)."""
    try:
        pa = _pin_args(args)
    except _BadInput as e:
        err.print(plain(f"{args.cmd}: {e}", style="red"))
        return EXIT_USAGE
    if args.timeout_ms < 1:
        err.print(plain(f"{args.cmd}: --timeout-ms: must be >= 1", style="red"))
        return EXIT_USAGE
    states, _ = src.fleet()
    models = _worker_models(states)
    if pa.model and pa.model not in models:
        err.print(plain(f"{args.cmd}: --model: no worker reports model {pa.model!r}; known: "
                        f"{', '.join(sorted(models)) or 'none'}", style="red"))
        return EXIT_USAGE
    if args.cmd != "pins" and not src.can_flush:
        err.print(plain(f"{args.cmd} refused: read-only without the operator key; pass --keys "
                        "DIR with operator.key_secret (kvpool-agent keygen --role operator)",
                        style="red"))
        return EXIT_REFUSED
    replies = src.command(args.cmd, pin=pa, timeout_ms=args.timeout_ms)
    failed = [r for r in replies if not r.ok or r.pins is None]
    if args.json:
        sys.stdout.write(json_line(replies) + "\n")
    elif args.cmd == "pins":
        _print_pins(replies, out)
    else:
        for r in replies:
            if r.ok and r.pins is not None:
                out.print(plain(_done_line(args.cmd, r)))
    for r in failed:
        err.print(plain(f"{args.cmd} failed on {r.agent_id}: {r.error or 'no result'}",
                        style="red"))
    return EXIT_FAILED if failed else EXIT_OK


def _done_line(cmd: str, r: CommandReply) -> str:
    """What one worker did, in one line (the numbers the audit line has)."""
    res = r.pins
    assert res is not None and res.pin is not None
    p = res.pin
    where = f"{p.model} layout {p.layout_digest} ({r.agent_id})"
    if cmd == "unpin":
        return (f"unpinned {p.pin_id!r} of {where}: {res.removed_keys} of {p.keys} keys "
                f"removed; pins of this layout now {fmt_bytes(res.pinned_bytes)}")
    mode = "hard" if p.mode == "hard" else f"soft, TTL {p.ttl_ms / 1e3:g} s"
    line = (f"pinned {p.pin_id!r} of {where}, {mode}: {p.tokens} tokens, {p.keys} keys "
            f"({fmt_bytes(p.bytes)}): {res.pinned_now} in the pool now, {res.pending} pinned "
            f"when saved; pins of this layout {fmt_bytes(res.pinned_bytes)} of the pool's "
            f"{fmt_bytes(res.pool_bytes)}")
    if res.failed:
        line += f"; {res.failed} keys the store refused"
    return line


def pins_summary(model: str, replies: list[CommandReply]) -> str:
    """One line of ``pins`` replies (the TUI's events log): every pin, then each failure."""
    held = [f"{p.pin_id} ({p.model} layout {p.layout_digest}, {p.mode}, {p.tokens} tokens, "
            f"{fmt_bytes(p.bytes)})"
            for r in replies if r.ok and r.pins is not None for p in r.pins.pins]
    line = f"pins of {model or 'every model'}: " + (", ".join(held) or "none")
    failed = [f"{r.agent_id}: {r.error}" for r in replies if not r.ok]
    return line + ("; failed: " + "; ".join(failed) if failed else "")


def _print_pins(replies: list[CommandReply], out: Console) -> None:
    t = Table(title="pins")
    for col in ("Pin", "Model", "Layout", "Mode", "TTL s", "Tokens", "Keys", "Bytes", "Agent"):
        t.add_column(col)
    for r in replies:
        for p in r.pins.pins if r.pins is not None else []:
            t.add_row(plain(p.pin_id), plain(p.model), p.layout_digest, p.mode,
                      f"{p.ttl_ms / 1e3:g}" if p.mode == "soft" else "-", str(p.tokens),
                      str(p.keys), fmt_bytes(p.bytes), plain(r.agent_id))
    out.print(t)
