"""The hub's audit trail: one JSON line per command (who, what, scope, result), bounded.

Every line goes to the ``kvpool.hub`` log (WARNING for flushes, refusals and suspect answers,
INFO otherwise) and, when the hub has an ``audit_file``, is appended to one of three files, each
rotating by size on its own (``logging.handlers.RotatingFileHandler``: ``FILE``, ``FILE.1`` ...
``FILE.<backups>``), so no lesser key can rotate the operator's lines away:

- ``FILE``: commands of the operator port (``P+3``) only;
- ``FILE.readonly`` (``READONLY_SUFFIX``): commands of the read-only port (``P+2``);
- ``FILE.agents`` (``AGENTS_SUFFIX``): the flushes agents say they ran on their own (claims
  of agent keys: an agent key wrote 256 KiB a minute into ``FILE`` before, the operator's
  history gone in ~26 h, issue 42).

Lines are ``kvpool_agent.audit.audit_line``'s (bounded there). Each key (``budget_key``)
writes at most ``key_bytes_per_min`` bytes of lines into ``FILE.readonly`` and
``FILE.agents`` per minute; what it sends beyond is dropped and told by one
``{"suppressed": N, ...}`` line when its minute ends. Operator-port lines are never suppressed
(operator keys are trusted).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvpool_agent.audit import CHANGES, audit_line
from kvpool_agent.protocol import CommandReply, CommandRequest

__all__ = [
    "AGENTS_SUFFIX",
    "AUDIT_BACKUPS",
    "AUDIT_KEY_BYTES_PER_MIN",
    "AUDIT_MAX_BYTES",
    "READONLY_SUFFIX",
    "AuditTrail",
    "Channel",
]

AUDIT_MAX_BYTES = 64 * 1024 * 1024
"""Default size (bytes) at which each audit file rotates."""
AUDIT_BACKUPS = 5
"""Default number of rotated files kept per audit file."""
AUDIT_KEY_BYTES_PER_MIN = 256 * 1024
"""Default bytes of rate-limited lines one key writes per minute (~500 typical lines)."""
READONLY_SUFFIX = ".readonly"
"""Appended to the audit file's name for the read-only port's lines."""
AGENTS_SUFFIX = ".agents"
"""Appended to the audit file's name for the flushes agents ran on their own."""

Channel = Literal["operator", "readonly", "agents"]
"""Which file a line goes to (module docstring)."""
_SUFFIX: dict[Channel, str] = {"operator": "", "readonly": READONLY_SUFFIX,
                               "agents": AGENTS_SUFFIX}
_WINDOW_S = 60.0
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
        path: the operator's file (``FILE``; ``FILE.readonly`` and ``FILE.agents`` beside
            it), or ``None`` for the log only.
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
        self._handlers: dict[Channel, logging.handlers.RotatingFileHandler] = {}
        self._windows: dict[tuple[str, Channel], _Window] = {}
        if path is not None:
            for channel, suffix in _SUFFIX.items():
                # delay: a file is created by its first line, as before.
                h = logging.handlers.RotatingFileHandler(
                    Path(str(path) + suffix), maxBytes=max_bytes,
                    backupCount=backups, encoding="utf-8", delay=True)
                h.setFormatter(logging.Formatter("%(message)s"))
                self._handlers[channel] = h

    def record(self, who: str, req: CommandRequest, targets: list[str],
               replies: list[CommandReply], *, refused: bool = False,
               channel: Channel = "operator",
               budget_key: str | None = None) -> bool:
        """Write one command's line (``audit_line``), unless ``budget_key``'s minute is spent.

        Args:
            who: see ``audit_line``.
            req, targets, replies, refused: see ``audit_line``.
            channel: the file the line goes to (module docstring).
            budget_key: whose budget the line counts against (the key's name, ``plain``
                without keys, ``agent:<name>`` for an agent key); ``None``: never
                suppressed (operator-port lines).

        Returns:
            Whether the line was written (False: suppressed). Never raises: a file that cannot
            be written is reported by the handler (``Handler.handleError``).
        """
        line = audit_line(who, req, targets, replies, refused=refused)
        text = json.dumps(line)
        if budget_key is not None and not self._spend(budget_key, channel, len(text) + 1):
            return False
        warn = req.command in CHANGES or refused or any(r.suspect for r in replies)
        log.log(logging.WARNING if warn else logging.INFO, "kvpool audit: %s", text)
        self._write(channel, text)
        return True

    def _spend(self, key: str, channel: Channel, size: int) -> bool:
        now = time.monotonic()
        win = self._windows.get((key, channel))
        if win is None or now - win.start >= _WINDOW_S:
            if win is not None:
                self._summarise(key, channel, win)
            win = self._windows[(key, channel)] = _Window(start=now)
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
        for (key, channel), win in list(self._windows.items()):
            if now - win.start >= _WINDOW_S:
                del self._windows[(key, channel)]
                self._summarise(key, channel, win)

    def _summarise(self, key: str, channel: Channel, win: _Window) -> None:
        if not win.suppressed:
            return
        text = json.dumps({"ts_ms": time.time() * 1e3, "who": key[:512],
                           "suppressed": win.suppressed, "suppressed_bytes": win.suppressed_bytes,
                           "window_s": _WINDOW_S, "budget_bytes": self.key_bytes_per_min})
        log.warning("kvpool audit: %s", text)
        self._write(channel, text)

    def _write(self, channel: Channel, text: str) -> None:
        handler = self._handlers.get(channel)
        if handler is not None:
            # The handler reports a file it cannot write through logging.raiseExceptions.
            handler.handle(logging.makeLogRecord({"msg": text, "args": None}))

    def close(self) -> None:
        """Write pending summaries, close the files. Idempotent."""
        for (key, channel), win in list(self._windows.items()):
            self._summarise(key, channel, win)
        self._windows.clear()
        for h in self._handlers.values():
            h.close()


