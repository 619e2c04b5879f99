"""Strings from the network (agent reports, command replies, SSH output) made safe to display.

Such a string is data: it must neither be read as Rich/Textual markup (``[/x]`` raises
``MarkupError`` and kills the app; ``[link=...]`` would make a link) nor reach the terminal
with its control characters (``ESC ]0;`` retitles the window, ``ESC [2J`` clears it). Which
characters are controls, and how they are shown, is ``kvpool_agent.protocol.visible``'s (the
hub's ``/metrics`` uses it too).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec
from rich.text import Text

from kvpool_agent.protocol import visible

__all__ = ["json_line", "plain", "top_miss_text", "visible"]

_JSON_RAW_CONTROL = re.compile(r"[\x7f-\x9f]")
"""What JSON leaves raw in a string that a terminal obeys: DEL and the C1 controls (U+009B is
CSI). JSON itself escapes C0."""


def plain(value: str, style: str = "") -> Text:
    """``value`` as a ``Text`` shown literally: no markup parsing, controls made
    :func:`visible`."""
    return Text(visible(value), style=style)


def json_line(doc: object) -> str:
    """``doc`` (msgspec structs, dicts, lists, numbers, strings) as one line of JSON in which
    every control character is a ``\\u`` escape, so printing it to a terminal is safe and a
    JSON reader gets the same strings back. NaN and infinities are ``null`` (msgspec's
    choice: JSON has neither).

    Raises:
        TypeError: ``doc`` holds a value msgspec cannot encode.
    """
    # Outside strings JSON is ASCII, so a raw DEL or C1 is inside a string: its escape there
    # decodes to the same character.
    text = msgspec.json.encode(doc).decode()
    return _JSON_RAW_CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def top_miss_text(reason: str, misses: Mapping[str, int], prompt: int) -> str:
    """The reason holding the most miss tokens with its share of the prompt tokens
    (``evicted 42%``), for the fleet table; ``-`` before any miss."""
    if not reason or not prompt:
        return "-"
    return f"{reason} {misses.get(reason, 0) / prompt:.0%}"
