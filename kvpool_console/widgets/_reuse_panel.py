"""The Pool tab's reuse panel (issue 41): per model, the hit rate next to the hub's live reuse
ceiling, and the what-if curve (exact LRU and Belady's MIN at 0.25x..8x the pool's estimated
capacity) drawn as one bar per capacity, with ``2x the pool: +N points; MIN at this size: M``.

Figures come from the hub's last ``ReuseView`` (``kvpool_agent._reuse_service``: the ceiling
over its window of recent lookups, the curve recomputed at most every minute); the hit rate is
the engines' own since their start (``EngineRow.loaded_tokens / prompt_tokens``), so the two
cover different spans: a pool just restarted reads low against a ceiling over the window.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvpool_agent.protocol import ModelReuse, ReuseView
from kvpool_console._text import plain
from kvpool_console._whatif_cli import curve_age, summary
from kvpool_console.rows import EngineRow

__all__ = ["MODELS_SHOWN", "ReusePanel", "render_reuse"]

MODELS_SHOWN = 3
"""Models the panel draws (the most looked-up; ``kvpool-console whatif`` lists every one)."""

_BAR = 20
"""Cells of a 100% bar."""


def _bar(rate: float, width: int = _BAR) -> str:
    filled = round(width * min(max(rate, 0.0), 1.0))
    return "█" * filled + "░" * (width - filled)


def _hit_rate(rows: list[EngineRow], model: str) -> float | None:
    mine = [r for r in rows if r.model == model]
    prompt = sum(r.prompt_tokens for r in mine)
    return sum(r.loaded_tokens for r in mine) / prompt if prompt else None


def _model(t: Text, m: ModelReuse, rows: list[EngineRow], view: ReuseView) -> None:
    ceiling = m.ceiling_tokens / m.prompt_tokens if m.prompt_tokens else 0.0
    hit = _hit_rate(rows, m.model)
    t.append_text(plain(m.model, style="bold"))
    # Two spans (module docstring): said on the line, or a hit above its ceiling reads wrong.
    t.append(f": hit {hit:.1%} since start" if hit is not None else ": hit -")
    t.append(f", window ceiling {ceiling:.1%}", style="bold")
    t.append(f" ({m.prompt_tokens:,} tokens)\n")
    if not m.whatif:
        t.append(f"  {summary(m)}\n", style="dim")
        return
    t.append(f"  {'capacity':>10} {'LRU':<{_BAR + 7}} {'MIN':<{_BAR + 7}}\n", style="dim")
    for p in m.whatif:
        factor = p.capacity_tokens / m.pool_capacity_tokens if m.pool_capacity_tokens else 0.0
        here = p.capacity_tokens == m.pool_capacity_tokens
        t.append(f"  {factor:>9g}x ", style="bold" if here else "")
        t.append(_bar(p.lru_hit_rate), style="green")
        t.append(f" {p.lru_hit_rate:>5.1%} ")
        t.append(_bar(p.min_hit_rate), style="cyan")
        t.append(f" {p.min_hit_rate:>5.1%}\n")
    t.append(f"  {summary(m)}\n")
    t.append(f"  ({curve_age(view, m)})\n", style="dim")


def render_reuse(reuse: ReuseView | None, rows: list[EngineRow]) -> Text:
    """The panel's text: up to ``MODELS_SHOWN`` models of ``reuse`` with their engines' hit
    rates from ``rows``; a line saying why when the hub sent no figures."""
    t = Text()
    if reuse is None or not reuse.models:
        t.append("reuse ceiling and what-if: none from the hub yet (no lookup with chunk "
                 "hashes reached it, or a hub before them)", style="dim")
        return t
    fleet = reuse.ceiling_tokens / reuse.prompt_tokens if reuse.prompt_tokens else 0.0
    t.append(f"Reuse: fleet ceiling {fleet:.1%} over the hub's last {reuse.accesses:,} "
             f"lookups\n")
    for m in reuse.models[:MODELS_SHOWN]:
        _model(t, m, rows, reuse)
    return t


class ReusePanel(Static):
    """``render_reuse`` as a widget; ``show`` redraws it."""

    def show(self, reuse: ReuseView | None, rows: list[EngineRow]) -> None:
        self.update(render_reuse(reuse, rows))
