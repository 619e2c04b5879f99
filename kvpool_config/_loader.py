"""Read a JSON config file, or say in one line why it cannot be read.

Parsing is the standard library's ``json`` module; this module only turns its exceptions into one
readable line (``FILE:LINE:COL: ...``) and refuses documents nested deeper than any config is,
which would otherwise end in a ``RecursionError`` in the parser or in a rule. Only regular files
of at most :data:`MAX_FILE_BYTES` are read: a FIFO would block the reader for ever, a device
(``/dev/zero``, or a symlink to it) never ends.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "ConfigLoadError", "load_json"]

MAX_FILE_BYTES = 16 * 1024 * 1024
"""Largest config file read (16 MiB); a deployment config is a few KiB."""

_FIX = "pass the path of the JSON config file itself"
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))

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


def _not_regular(name: str, mode: int) -> ConfigLoadError:
    kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
    return ConfigLoadError(name, f"not a regular file but {kind}; {_FIX}")


def _read(path: str | Path) -> bytes:
    """The bytes of the regular file ``path`` (symlinks followed), at most
    :data:`MAX_FILE_BYTES`.

    Raises:
        ConfigLoadError: missing, unreadable, not a regular file, or too large.
    """
    name = str(path)
    try:
        # Checked before opening: opening a socket fails, a FIFO without O_NONBLOCK waits for
        # a writer. Checked again on the open file, which may have been swapped meanwhile.
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(name, mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(name, st.st_mode)
            # Read one byte more than allowed: a file that grew since fstat is refused too.
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigLoadError(name, f"cannot read file: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigLoadError(name, f"file larger than {MAX_FILE_BYTES >> 20} MiB (a deployment "
                              f"config is a few KiB); {_FIX}")
    return raw


class _OutOfRange(ValueError):
    """A JSON number no config holds (NaN, Infinity, one that overflows a float)."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _OutOfRange(f"the number {text[:20]}{'...' if len(text) > 20 else ''} is out of "
                          "range")
    return value


def _no_constant(text: str) -> float:
    raise _OutOfRange(f"{text} is not JSON (write a number)")


def load_json(path: str | Path) -> Any:
    """Parse the JSON document in ``path``.

    Returns:
        The decoded document (dict, list, str, number, bool or None).

    Raises:
        ConfigLoadError: the file is missing or unreadable, is not a regular file (a
            directory, FIFO, device, socket: symlinks are followed) or larger than
            :data:`MAX_FILE_BYTES`, is not UTF-8, is not valid JSON (a truncated file reports
            the position where the text ended), holds NaN, Infinity, a number that
            overflows a float or an integer longer than Python's int-string limit (4300
            digits), or nests arrays/objects more than :data:`MAX_DEPTH` levels deep.
    """
    name = str(path)
    raw = _read(path)
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
        doc = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise ConfigLoadError(name, _TOO_DEEP) from None
    except _OutOfRange as exc:
        raise ConfigLoadError(name, f"invalid JSON: {exc}") from None
    except json.JSONDecodeError as exc:
        # json reports an unclosed string at its start; that only happens when the text ends.
        unclosed = exc.msg.startswith("Unterminated string")
        msg = "a string is not closed" if unclosed else exc.msg
        truncated = unclosed or exc.pos >= len(text.rstrip())
        hint = " (the file ends early: truncated?)" if truncated else ""
        raise ConfigLoadError(name, f"invalid JSON: {msg}{hint}", exc.lineno, exc.colno) from None
    except ValueError:
        # The int-string limit: json raises a bare ValueError for an integer of more digits.
        raise ConfigLoadError(name, f"invalid JSON: an integer of more than "
                              f"{sys.get_int_max_str_digits()} digits (no config value has "
                              "that many)") from None
    if _deeper_than(doc, MAX_DEPTH):
        raise ConfigLoadError(name, _TOO_DEEP)
    return doc
