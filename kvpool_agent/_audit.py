"""The hub's audit trail: one JSON line per command (who, what, scope, result), bounded.

Every line goes to the ``kvpool.hub`` log (WARNING for flushes, refusals and suspect answers,
INFO otherwise) and, when the hub has an ``audit_file``, is appended to a file that rotates by
size (``logging.handlers.RotatingFileHandler``: ``FILE``, ``FILE.1`` ... ``FILE.<backups>``):

- ``FILE``: commands of the operator port (``P+3``) and the flushes agents ran on their own;
- ``FILE.readonly`` (``READONLY_SUFFIX``, rotated on its own): commands of the read-only port
  (``P+2``), so no viewer can rotate the operator's lines away.

Bounds: a line names at most ``AUDIT_IDS_SHOWN`` targets, results and forgotten ids (with
``targets_count`` / ``results_count`` / ``failed_count`` / ``forgotten_count`` when cut), error
strings are clipped to ``AUDIT_ERROR_CHARS``, and a line is never longer than
``AUDIT_LINE_MAX_BYTES``. Each key (``budget_key``) writes at most ``key_bytes_per_min`` bytes
of lines into ``FILE.readonly`` and of agent lines into ``FILE`` per minute; what it sends
beyond is dropped and told by one ``{"suppressed": N, ...}`` line when its minute ends.
Operator-port lines are never suppressed (operator keys are trusted).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvpool_agent.protocol import CommandReply, CommandRequest

__all__ = [
    "AUDIT_BACKUPS",
    "AUDIT_ERROR_CHARS",
    "AUDIT_IDS_SHOWN",
    "AUDIT_KEY_BYTES_PER_MIN",
    "AUDIT_LINE_MAX_BYTES",
    "AUDIT_MAX_BYTES",
    "READONLY_SUFFIX",
    "AuditTrail",
]

AUDIT_MAX_BYTES = 64 * 1024 * 1024
"""Default size (bytes) at which each audit file rotates."""
AUDIT_BACKUPS = 5
"""Default number of rotated files kept per audit file."""
AUDIT_IDS_SHOWN = 8
"""Targets, results and forgotten ids one line names at most (the rest are counted)."""
AUDIT_ERROR_CHARS = 256
"""Longest error string a line keeps (characters)."""
AUDIT_LINE_MAX_BYTES = 32 * 1024
"""Longest audit line (bytes of JSON): 8 results with clipped errors fit in ~16 KiB."""
AUDIT_KEY_BYTES_PER_MIN = 256 * 1024
"""Default bytes of rate-limited lines one key writes per minute (~500 typical lines)."""
READONLY_SUFFIX = ".readonly"
"""Appended to the audit file's name for the read-only port's lines."""

_WINDOW_S = 60.0
_CHANGES = frozenset(("flush", "pin", "unpin"))
"""Commands whose lines are logged as warnings: they change what the pool holds."""
log = logging.getLogger("kvpool.hub")


@dataclass
class _Window:
    """One key's current minute: when it started (``time.monotonic()`` s), the bytes it
    wrote, and the lines (and their bytes) dropped over the budget."""

    start: float
    used: int = 0
    suppressed: int = 0
    suppressed_bytes: int = 0


class AuditTrail:
    """The audit files of one hub, rotated by size, rate-limited per key.

    Args:
        path: the operator's file (``FILE``; ``FILE.readonly`` beside it), or ``None`` for the
            log only.
        max_bytes: rotate a file when the next line would make it larger (bytes, > 0).
        backups: rotated files kept per file (``FILE.1`` newest).
        key_bytes_per_min: bytes of rate-limited lines one key writes per minute (> 0).

    Attributes:
        suppressed: lines dropped over a key's budget since start, per budget key.
    """

    def __init__(self, path: Path | None, max_bytes: int = AUDIT_MAX_BYTES,
                 backups: int = AUDIT_BACKUPS,
                 key_bytes_per_min: int = AUDIT_KEY_BYTES_PER_MIN) -> None:
        self.path = path
        self.key_bytes_per_min = key_bytes_per_min
        self.suppressed: dict[str, int] = {}
        self._handlers: dict[bool, logging.handlers.RotatingFileHandler] = {}
        self._windows: dict[tuple[str, bool], _Window] = {}
        if path is not None:
            for readonly in (False, True):
                # delay: a file is created by its first line, as before.
                h = logging.handlers.RotatingFileHandler(
                    Path(str(path) + READONLY_SUFFIX) if readonly else path, maxBytes=max_bytes,
                    backupCount=backups, encoding="utf-8", delay=True)
                h.setFormatter(logging.Formatter("%(message)s"))
                self._handlers[readonly] = h

    def record(self, who: str, req: CommandRequest, targets: list[str],
               replies: list[CommandReply], *, refused: bool = False, readonly: bool = False,
               budget_key: str | None = None) -> bool:
        """Write one command's line (``audit_line``), unless ``budget_key``'s minute is spent.

        Args:
            who: see ``audit_line``.
            req, targets, replies, refused: see ``audit_line``.
            readonly: a command of the read-only port: goes to ``FILE.readonly``.
            budget_key: whose budget the line counts against (the key's name, ``plain``
                without keys); ``None``: never suppressed (operator-port lines).

        Returns:
            Whether the line was written (False: suppressed). Never raises: a file that cannot
            be written is reported by the handler (``Handler.handleError``).
        """
        line = audit_line(who, req, targets, replies, refused=refused)
        text = json.dumps(line)
        if budget_key is not None and not self._spend(budget_key, readonly, len(text) + 1):
            return False
        warn = req.command in _CHANGES or refused or any(r.suspect for r in replies)
        log.log(logging.WARNING if warn else logging.INFO, "kvpool audit: %s", text)
        self._write(readonly, text)
        return True

    def _spend(self, key: str, readonly: bool, size: int) -> bool:
        now = time.monotonic()
        win = self._windows.get((key, readonly))
        if win is None or now - win.start >= _WINDOW_S:
            if win is not None:
                self._summarise(key, readonly, win)
            win = self._windows[(key, readonly)] = _Window(start=now)
        if win.used + size > self.key_bytes_per_min:
            win.suppressed += 1
            win.suppressed_bytes += size
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return False
        win.used += size
        return True

    def tick(self) -> None:
        """Write the summary of every key's minute that ended with lines suppressed, and
        forget ended minutes (the hub calls this about once a second)."""
        now = time.monotonic()
        for (key, readonly), win in list(self._windows.items()):
            if now - win.start >= _WINDOW_S:
                del self._windows[(key, readonly)]
                self._summarise(key, readonly, win)

    def _summarise(self, key: str, readonly: bool, win: _Window) -> None:
        if not win.suppressed:
            return
        text = json.dumps({"ts_ms": time.time() * 1e3, "who": key[:512],
                           "suppressed": win.suppressed, "suppressed_bytes": win.suppressed_bytes,
                           "window_s": _WINDOW_S, "budget_bytes": self.key_bytes_per_min})
        log.warning("kvpool audit: %s", text)
        self._write(readonly, text)

    def _write(self, readonly: bool, text: str) -> None:
        handler = self._handlers.get(readonly)
        if handler is not None:
            # The handler reports a file it cannot write through logging.raiseExceptions.
            handler.handle(logging.makeLogRecord({"msg": text, "args": None}))

    def close(self) -> None:
        """Write pending summaries, close the files. Idempotent."""
        for (key, readonly), win in list(self._windows.items()):
            self._summarise(key, readonly, win)
        self._windows.clear()
        for h in self._handlers.values():
            h.close()


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
            item["flush"] = msgspec.to_builtins(r.flush)
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
    warn = req.command in _CHANGES or refused
    log.log(logging.WARNING if warn else logging.INFO, "kvpool audit: %s", text)
    if audit_file is not None:
        audit_file.handle(logging.makeLogRecord({"msg": text, "args": None}))
