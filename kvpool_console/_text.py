"""Strings from the network (agent reports, command replies, SSH output) made safe to display.

Such a string is data: it must neither be read as Rich/Textual markup (``[/x]`` raises
``MarkupError`` and kills the app; ``[link=...]`` would make a link) nor reach the terminal
with its control characters (``ESC ]0;`` retitles the window, ``ESC [2J`` clears it).
"""

from __future__ import annotations

import re

from rich.text import Text

__all__ = ["plain", "visible"]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 controls except tab and newline, DEL, and C1 controls (ECMA-48 section 5)."""


def visible(value: str) -> str:
    """``value`` with each control character but tab and newline replaced by its Python
    escape, e.g. ``"\\x1b[2J"`` -> ``"\\\\x1b[2J"`` (the four characters ``\\x1b``)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value)


def plain(value: str, style: str = "") -> Text:
    """``value`` as a ``Text`` shown literally: no markup parsing, controls made
    :func:`visible`."""
    return Text(visible(value), style=style)
