"""Retirement of counter alerts: active only while their counters keep growing."""

from __future__ import annotations

from kvpool_console.alerts.alert import Alert
from kvpool_console.alerts.settings import COUNTER_WINDOW_MS

__all__ = ["AlertTracker"]

_COUNTER_RULES = frozenset({"failed_after_hit", "lookup_errors", "backend_errors"})


class AlertTracker:
    """Keeps counter alerts active only while their counters keep growing.

    ``update`` takes the alerts of one :func:`evaluate` call plus a fingerprint of each
    counter-rule alert (its message, which embeds the counts); a counter alert whose message
    did not change for ``window_ms`` is retired. Other alerts pass through. ``new`` holds the
    alerts that became active (or changed severity) in the last update, ``cleared`` those that
    were active before it and are not now (as they last read), for the events log.

    Args:
        window_ms: how long a counter alert stays active after its counters last grew.
    """

    def __init__(self, window_ms: float = COUNTER_WINDOW_MS) -> None:
        self.window_ms = window_ms
        self._changed_at: dict[str, tuple[str, float]] = {}
        self._active: dict[str, Alert] = {}
        self.new: list[Alert] = []
        self.cleared: list[Alert] = []

    def update(self, alerts: list[Alert], now_ms: float) -> list[Alert]:
        """Filter ``alerts`` (from :func:`evaluate` at ``now_ms``); returns the active ones."""
        keep: list[Alert] = []
        for a in alerts:
            if a.rule in _COUNTER_RULES:
                prev = self._changed_at.get(a.key)
                if prev is None or prev[0] != a.message:
                    self._changed_at[a.key] = (a.message, now_ms)
                elif now_ms - prev[1] > self.window_ms:
                    continue
            keep.append(a)
        active = {a.key: a for a in keep}
        self.new = [a for k, a in active.items()
                    if k not in self._active or self._active[k].severity != a.severity]
        self.cleared = [a for k, a in self._active.items() if k not in active]
        self._active = active
        return keep

    @property
    def active_keys(self) -> frozenset[str]:
        """Keys of the alerts active after the last ``update`` (``evaluate(active=...)``)."""
        return frozenset(self._active)
