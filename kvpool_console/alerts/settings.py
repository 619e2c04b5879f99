"""Every threshold the alert rules use, with its default and why, and :class:`AlertSettings`:
the one value the command line, the TUI and the one-shot modes hand to :class:`AlertModel`
and :func:`evaluate`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Silence thresholds are the wire contract's: the hub's /metrics call an agent stale alike.
# So is the stuck rule: agents open their store_stalled pause windows by it
# (protocol.stuck_after_ms).
from kvpool_agent.protocol import (
    DOWN_AFTER_MS,
    STALE_AFTER_MS,
    STUCK_FLOOR_MS,
    STUCK_MULTIPLE,
    Source,
)

__all__ = ["COUNTER_WINDOW_MS", "DOWN_AFTER_MS", "STALE_AFTER_MS", "STUCK_FLOOR_MS",
           "STUCK_MULTIPLE", "WATERMARK_MARGIN", "AlertSettings"]

WATERMARK_MARGIN = 0.05
"""Hysteresis of ``pool_watermark``: raised above the ratio, cleared only below the ratio minus
this (usage swings a few percent around the ratio while eviction works: no flapping)."""

COUNTER_WINDOW_MS = 60_000.0
"""A counter alert stays active this long (ms) after the newest error it counts."""

@dataclass(frozen=True, kw_only=True)
class AlertSettings:
    """The alert rules' settings (``kvpool-console`` options; defaults above).

    Attributes:
        stale_after_ms: silence after which an engine is ``stale`` (warning).
        down_after_ms: silence after which it is ``down`` (critical).
        watermark_ratio: usage fraction above which ``pool_watermark`` is raised; ``None``:
            the pool's own ``eviction_high_watermark_ratio``.
        watermark_margin: an active ``pool_watermark`` clears only below ratio - margin.
        stuck_after_ms: age (ms) after which an in-flight load or save is ``stuck_transfer``;
            ``None``: ``STUCK_MULTIPLE`` times what its bytes take at its agent's recent rate,
            at least ``STUCK_FLOOR_MS``.
        window_ms: a counter alert retires once the newest error it counts is older;
            ``pool_evicting`` and ``pool_failover`` this long after their last growth.
        alive: tells whether a silent engine's process still runs (``True``: hung, ``False``:
            gone, ``None``: cannot tell, e.g. another host); ``None``: never asked.
    """

    stale_after_ms: float = STALE_AFTER_MS
    down_after_ms: float = DOWN_AFTER_MS
    watermark_ratio: float | None = None
    watermark_margin: float = WATERMARK_MARGIN
    stuck_after_ms: float | None = None
    window_ms: float = COUNTER_WINDOW_MS
    alive: Callable[[Source], bool | None] | None = None
