"""By-name maps an agent reports, kept within the wire's bound (``protocol.MAX_NAMES``
entries): a name past ``MAX_NAMES - 1`` distinct ones folds into ``OTHER_NAME``."""

from __future__ import annotations

from kvpool_agent.protocol import MAX_ID_CHARS, MAX_NAMES, OTHER_NAME, clip

__all__ = ["count_name", "keep_name"]


def count_name(counts: dict[str, int], name: str) -> None:
    """Add one to ``counts[name]``; a name past ``MAX_NAMES - 1`` distinct ones counts under
    ``OTHER_NAME``, so the map stays within the wire's bound (``protocol.NameCounts``)."""
    if name not in counts and len(counts) >= MAX_NAMES - 1:
        name = OTHER_NAME
    counts[name] = counts.get(name, 0) + 1


def keep_name(names: dict[str, str], name: str, value: str) -> None:
    """``names[name] = value`` (both clipped to a one-line ``protocol.Name``), the latest per
    name; a name past ``MAX_NAMES - 1`` distinct ones is not kept: ``names[OTHER_NAME] = ""``
    says some were left out (``LookupStats.adapters``)."""
    name = clip(name, MAX_ID_CHARS, one_line=True)
    if name not in names and len(names) >= MAX_NAMES - 1:
        names[OTHER_NAME] = ""
    else:
        names[name] = clip(value, MAX_ID_CHARS, one_line=True)
