"""The engine detail screen's identity line (issue 39 item 5): which weights made this engine's
values, and which engines of its model run the same weights or others.

The weights' fingerprint is the layout fact ``fingerprint`` each worker reports
(``Source.layout``, ``kvpool_connector.fingerprint``: ``<source>:<hex>``, the source
``safetensors``, ``configured`` or ``unshared``); ``kvpool-console status --json`` carries it as
``engines[].layout.fingerprint``. Then the LoRA adapters the engine served, each by content
(``LookupStats.adapters``: ``lora:<hex>``, ``kvpool-config fingerprint --adapter DIR`` prints a
directory's; ``engines[].adapters`` in ``status --json``).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool_agent.protocol import OTHER_NAME, EngineState
from kvpool_console.alerts.rules import FINGERPRINT_FACT, UNSHARED
from kvpool_console.rows import EngineRow

__all__ = ["identity_line"]

_MAX_NAMED = 4
"""Engines named per fingerprint; the rest counted."""


def _engines(ids: list[str]) -> str:
    shown = ", ".join(sorted(ids)[:_MAX_NAMED])
    return shown + (f" +{len(ids) - _MAX_NAMED}" if len(ids) > _MAX_NAMED else "")


def identity_line(row: EngineRow, states: Mapping[str, EngineState]) -> str:
    """``weights <fingerprint>``, then the other engines of the same model on the same weights
    and those on other weights (they never share values), from every worker's layout facts in
    ``states``; then ``adapters: <name>=<identity>, ...``. ``""`` while neither is known."""
    mine = str(row.layout.get(FINGERPRINT_FACT, ""))
    adapters = _adapters(row.adapters)
    if not mine:
        return adapters
    by_fp: dict[str, set[str]] = {}
    for s in states.values():
        src = s.source
        fp = src.layout.get(FINGERPRINT_FACT)
        if fp is None or src.engine_id == row.engine_id or src.model != row.model:
            continue
        by_fp.setdefault(str(fp), set()).add(src.engine_id)
    text = f"weights {mine}"
    if mine.startswith(f"{UNSHARED}:"):
        text += " (shares with no engine: set model_fingerprint, or load a local safetensors " \
                "directory)"
    elif same := by_fp.pop(mine, set()):
        text += f", as {_engines(list(same))}"
    if by_fp:
        text += "; other weights of " + row.model + ": " + "; ".join(
            f"{fp} on {_engines(list(ids))}" for fp, ids in sorted(by_fp.items())) \
            + " (never shared with these)"
    return f"{text}; {adapters}" if adapters else text


def _adapters(adapters: Mapping[str, str]) -> str:
    # An adapter without an identity is named alone (never "name="), the rest counted.
    named = [f"{n}={i}" if i else n for n, i in adapters.items() if n != OTHER_NAME][:_MAX_NAMED]
    more = len(adapters) - len(named)
    return f"adapters: {', '.join([*named, *([f'+{more}'] if more else [])])}" if adapters else ""
