"""One command's audit line (who, what, scope, result) in a bounded form, and ``audit``, the
helper a connector process logs its own flushes with (the hub's rotated, budgeted files are
``kvpool_agent._audit``).

Bounds: a line names at most ``AUDIT_IDS_SHOWN`` targets, results and forgotten ids (with
``targets_count`` / ``results_count`` / ``failed_count`` / ``forgotten_count`` when cut), error
strings are clipped to ``AUDIT_ERROR_CHARS``, and a line is never longer than
``AUDIT_LINE_MAX_BYTES``.
"""

from __future__ import annotations

import json
import logging
import time

import msgspec

from kvpool_agent.protocol import CommandReply, CommandRequest

__all__ = [
    "AUDIT_ERROR_CHARS",
    "AUDIT_IDS_SHOWN",
    "AUDIT_LINE_MAX_BYTES",
    "CHANGES",
    "audit",
    "audit_line",
]

AUDIT_IDS_SHOWN = 8
"""Targets, results and forgotten ids one line names at most (the rest are counted)."""
AUDIT_ERROR_CHARS = 256
"""Longest error string a line keeps (characters)."""
AUDIT_LINE_MAX_BYTES = 32 * 1024
"""Longest audit line (bytes of JSON): 8 results with clipped errors fit in ~16 KiB."""
CHANGES = frozenset(("flush", "pin", "unpin"))
"""Commands whose lines are logged as warnings: they change what the pool holds."""
log = logging.getLogger("kvpool.hub")


def _clip(text: str) -> str:
    return text if len(text) <= AUDIT_ERROR_CHARS else text[:AUDIT_ERROR_CHARS - 1] + "…"


def audit_line(
    who: str,
    req: CommandRequest,
    targets: list[str],
    replies: list[CommandReply],
    *,
    refused: bool = False,
) -> dict[str, object]:
    """One command's audit line, at most ``AUDIT_LINE_MAX_BYTES`` as JSON.

    Args:
        who: ``key:<key name> (<sender>)`` with keys, ``plain:<sender>`` without,
            ``agent:<agent id> (<its claim>)`` for an agent's own flush.
        req: the command as the console sent it.
        targets: agent ids it went to (a refused command: the ids it named).
        replies: one per target (or one from ``hub`` when it went nowhere).
        refused: the hub refused it (no operator key, a full budget).

    The line: ``{"ts_ms", "who", "command", "request_id", "targets", "targets_count"?, "flush",
    "refused", "probe"?, "pin"?, "results": [{"agent", "ok", "error"?, "flush"?, "suspect"?,
    "pins"?, "forgotten"?, "forgotten_count"?}], "results_count"?, "failed_count"?}``; the
    ``*_count`` fields appear when their list was cut to ``AUDIT_IDS_SHOWN`` (failures listed
    first).
    """
    shown = replies
    if len(replies) > AUDIT_IDS_SHOWN:
        shown = ([r for r in replies if not r.ok] + [r for r in replies if r.ok])[:AUDIT_IDS_SHOWN]
    results = []
    for r in shown:
        item: dict[str, object] = {"agent": r.agent_id, "ok": r.ok}
        if r.error:
            item["error"] = _clip(r.error)
        if r.flush is not None:
            # Whose listing a copied dry-run answer is: written only when it is a copy.
            item["flush"] = {k: v for k, v in msgspec.to_builtins(r.flush).items()
                             if v or k not in ("listed_by", "listed_ms_ago")}
        if r.suspect:
            item["suspect"] = _clip(r.suspect)
        if r.pins is not None:
            item["pins"] = _pin_result(r)
        if r.forgotten:
            item["forgotten"] = r.forgotten[:AUDIT_IDS_SHOWN]
            total = max(r.forgotten_count, len(r.forgotten))
            if total > AUDIT_IDS_SHOWN:
                item["forgotten_count"] = total
        results.append(item)
    line: dict[str, object] = {
        "ts_ms": time.time() * 1e3,
        "who": who[:1024],
        "command": req.command,
        "request_id": req.request_id,
        "targets": targets[:AUDIT_IDS_SHOWN],
        "flush": msgspec.to_builtins(req.flush) if req.flush is not None else None,
        "refused": refused,
        "results": results,
    }
    if len(targets) > AUDIT_IDS_SHOWN:
        line["targets_count"] = len(targets)
    if len(replies) > AUDIT_IDS_SHOWN:
        line["results_count"] = len(replies)
        line["failed_count"] = sum(1 for r in replies if not r.ok)
    if req.probe:
        line["probe"] = True
    if req.pin is not None:
        # Counts, not the token ids or the text: a line stays short whatever was pinned.
        a = req.pin
        line["pin"] = {"model": a.model, "pin_id": a.pin_id, "mode": a.mode,
                       "ttl_ms": a.ttl_ms if a.mode == "soft" else 0,
                       "token_ids": len(a.token_ids),
                       "text_chars": None if a.text is None else len(a.text),
                       "chat_template": a.chat_template}
    if len(json.dumps(line)) > AUDIT_LINE_MAX_BYTES:
        # Only non-ASCII errors escaped six bytes a character get here: keep the counts.
        line["results"] = [{"agent": r.agent_id, "ok": r.ok} for r in shown]
        line["results_count"] = len(replies)
    return line


def _pin_result(r: CommandReply) -> dict[str, object]:
    """A ``pin`` / ``unpin`` / ``pins`` result's counts (the pin it made, what it did)."""
    assert r.pins is not None
    out: dict[str, object] = {k: getattr(r.pins, k) for k in (
        "pinned_now", "pending", "failed", "removed_keys", "pinned_bytes", "pool_bytes")}
    out["pins"] = len(r.pins.pins)
    if r.pins.pin is not None:
        p = r.pins.pin
        out.update(layout_digest=p.layout_digest, tokens=p.tokens, keys=p.keys, bytes=p.bytes)
    return out


def audit(
    audit_file: logging.Handler | None,
    who: str,
    req: CommandRequest,
    targets: list[str],
    replies: list[CommandReply],
    *,
    refused: bool = False,
) -> None:
    """Log one command's line (``audit_line``) to ``kvpool.hub`` and, when given, hand it to
    ``audit_file`` (a connector process logs its own reset flush this way, without budgets).
    Never raises."""
    text = json.dumps(audit_line(who, req, targets, replies, refused=refused))
    warn = req.command in CHANGES or refused
    log.log(logging.WARNING if warn else logging.INFO, "kvpool audit: %s", text)
    if audit_file is not None:
        audit_file.handle(logging.makeLogRecord({"msg": text, "args": None}))
