"""The hub's audit trail: one JSON line per operator command (who, what, scope, result).

Every line goes to the ``kvpool.hub`` log (WARNING for flushes and refusals, INFO otherwise)
and, when the hub has an ``audit_file``, is appended to it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import msgspec

from kvpool_agent.protocol import CommandReply, CommandRequest

__all__ = ["audit"]

log = logging.getLogger("kvpool.hub")


def audit(
    audit_file: Path | None,
    who: str,
    req: CommandRequest,
    targets: list[str],
    replies: list[CommandReply],
    *,
    refused: bool = False,
) -> None:
    """Record one command.

    Args:
        audit_file: file to append the line to, or ``None`` for the log only.
        who: ``key:<operator key id> (<sender>)`` on the CURVE port, ``plain:<sender>``
            otherwise.
        req: the command as the console sent it.
        targets: agent ids it went to.
        replies: one per target (or one from ``hub`` when it went nowhere).
        refused: the hub refused it (no operator key).

    The line: ``{"ts_ms", "who", "command", "request_id", "targets", "flush", "refused",
    "results": [{"agent", "ok", "error"?, "flush"?}]}``. Never raises: a file that cannot be
    written is logged as an error.
    """
    results = []
    for r in replies:
        item: dict[str, object] = {"agent": r.agent_id, "ok": r.ok}
        if r.error:
            item["error"] = r.error
        if r.flush is not None:
            item["flush"] = msgspec.to_builtins(r.flush)
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
    if req.command == "flush" or refused:
        log.warning("kvpool audit: %s", json.dumps(line))
    else:
        log.info("kvpool audit: %s", json.dumps(line))
    if audit_file is not None:
        try:
            with open(audit_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            log.error("kvpool hub: cannot append to audit file %s: %s", audit_file, e)
