"""Read a JSON config file, or say in one line why it cannot be read.

Parsing is the standard library's ``json`` module; this module only turns its exceptions into one
readable line (``FILE:LINE:COL: ...``) and refuses documents nested deeper than any config is,
which would otherwise end in a ``RecursionError`` in the parser or in a rule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MAX_DEPTH", "ConfigLoadError", "load_json"]

MAX_DEPTH = 100
"""Deepest nesting of arrays/objects accepted; deployment configs nest about 10 levels."""

_TOO_DEEP = (
    f"invalid JSON: arrays/objects nested more than {MAX_DEPTH} levels deep "
    "(a deployment config nests about 10)"
)


class ConfigLoadError(Exception):
    """A file that cannot be used at all: missing, unreadable, not JSON, or of unknown shape.

    ``str(err)`` is one line ``FILE:LINE:COL: what is wrong`` (line and column 1-based; both 0
    when the problem is not at a position, e.g. a missing file or too deep nesting).
    """

    def __init__(self, path: str, message: str, line: int = 0, column: int = 0) -> None:
        self.path = path
        self.message = message
        self.line = line
        self.column = column
        super().__init__(f"{path}:{line}:{column}: {message}")


def _deeper_than(doc: Any, limit: int) -> bool:
    """Whether arrays/objects in ``doc`` nest more than ``limit`` levels (iterative, so any
    depth the parser returns is measured without recursion)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in node)
    return False


def load_json(path: str | Path) -> Any:
    """Parse the JSON document in ``path``.

    Returns:
        The decoded document (dict, list, str, number, bool or None).

    Raises:
        ConfigLoadError: the file is missing or unreadable, is not UTF-8, is not valid JSON (a
            truncated file reports the position where the text ended), or nests arrays/objects
            more than :data:`MAX_DEPTH` levels deep.
    """
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigLoadError(name, f"cannot read file: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigLoadError(
            name, "not UTF-8 text; save the file as UTF-8", line, column
        ) from None
    if not text.strip():
        raise ConfigLoadError(name, "empty file; expected a JSON object", 1, 1)
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ConfigLoadError(name, _TOO_DEEP) from None
    except json.JSONDecodeError as exc:
        # json reports an unclosed string at its start; that only happens when the text ends.
        unclosed = exc.msg.startswith("Unterminated string")
        msg = "a string is not closed" if unclosed else exc.msg
        truncated = unclosed or exc.pos >= len(text.rstrip())
        hint = " (the file ends early: truncated?)" if truncated else ""
        raise ConfigLoadError(name, f"invalid JSON: {msg}{hint}", exc.lineno, exc.colno) from None
    if _deeper_than(doc, MAX_DEPTH):
        raise ConfigLoadError(name, _TOO_DEEP)
    return doc
