"""The hub's audit trail: one JSON line per operator command (who, what, scope, result).

Every line goes to the ``kvpool.hub`` log (WARNING for flushes and refusals, INFO otherwise)
and, when the hub has an ``audit_file``, is appended to it; the file rotates by size
(``logging.handlers.RotatingFileHandler``: ``FILE``, ``FILE.1`` ... ``FILE.<backups>``).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import time
from pathlib import Path

import msgspec

from kvpool_agent.protocol import CommandReply, CommandRequest

__all__ = ["AUDIT_BACKUPS", "AUDIT_MAX_BYTES", "AuditTrail"]

AUDIT_MAX_BYTES = 64 * 1024 * 1024
"""Default size (bytes) at which the audit file rotates."""
AUDIT_BACKUPS = 5
"""Default number of rotated audit files kept."""

log = logging.getLogger("kvpool.hub")


class AuditTrail:
    """The audit file of one hub, rotated by size.

    Args:
        path: the file, or ``None`` for the log only.
        max_bytes: rotate when the next line would make the file larger (bytes, > 0).
        backups: rotated files kept (``path.1`` newest).
    """

    def __init__(self, path: Path | None, max_bytes: int = AUDIT_MAX_BYTES,
                 backups: int = AUDIT_BACKUPS) -> None:
        self.path = path
        self._handler: logging.handlers.RotatingFileHandler | None = None
        if path is not None:
            # delay: the file is created by the first command, as before.
            self._handler = logging.handlers.RotatingFileHandler(
                path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=True
            )
            self._handler.setFormatter(logging.Formatter("%(message)s"))

    def record(self, who: str, req: CommandRequest, targets: list[str],
               replies: list[CommandReply], *, refused: bool = False) -> None:
        """``audit`` into this trail's file."""
        audit(self._handler, who, req, targets, replies, refused=refused)

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._handler is not None:
            self._handler.close()


def audit(
    audit_file: logging.Handler | None,
    who: str,
    req: CommandRequest,
    targets: list[str],
    replies: list[CommandReply],
    *,
    refused: bool = False,
) -> None:
    """Record one command.

    Args:
        audit_file: handler writing the file (``AuditTrail``), or ``None`` for the log only.
        who: ``key:<operator key id> (<sender>)`` on the CURVE port, ``plain:<sender>``
            otherwise.
        req: the command as the console sent it.
        targets: agent ids it went to.
        replies: one per target (or one from ``hub`` when it went nowhere).
        refused: the hub refused it (no operator key).

    The line: ``{"ts_ms", "who", "command", "request_id", "targets", "flush", "refused",
    "probe"?, "results": [{"agent", "ok", "error"?, "flush"?, "forgotten"?}]}``. Never raises:
    a file that cannot be written is reported by the handler (``Handler.handleError``).
    """
    results = []
    for r in replies:
        item: dict[str, object] = {"agent": r.agent_id, "ok": r.ok}
        if r.error:
            item["error"] = r.error
        if r.flush is not None:
            item["flush"] = msgspec.to_builtins(r.flush)
        if r.forgotten:
            item["forgotten"] = r.forgotten
        results.append(item)
    line = {
        "ts_ms": time.time() * 1e3,
        "who": who,
        "command": req.command,
        "request_id": req.request_id,
        "targets": targets,
        "flush": msgspec.to_builtins(req.flush) if req.flush is not None else None,
        "refused": refused,
        "results": results,
    }
    if req.probe:
        line["probe"] = True
    if req.command == "flush" or refused:
        log.warning("kvpool audit: %s", json.dumps(line))
    else:
        log.info("kvpool audit: %s", json.dumps(line))
    if audit_file is not None:
        # The handler reports a file it cannot write through logging.raiseExceptions/stderr.
        audit_file.handle(logging.makeLogRecord({"msg": json.dumps(line), "args": None}))
