"""What each row of the fleet table says: the columns, and the cells of an engine's row, an
agent's row (an expanded engine) and the fleet's totals row (``_fleet_table`` draws them).

Cells are ``rich.text.Text`` where they carry a style or text from the fleet (engine ids,
backends: never parsed as markup), plain ``str`` otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.style import Style
from rich.text import Text

from kvpool_agent.misses import (
    EVICTED,
    FIRST_USE,
    LOAD_FAILED,
    NEVER_SAVED,
    NOT_IN_POOL,
    NOT_LOADED,
    OTHER_DIGEST,
)
from kvpool_agent.vocabulary import KV_ROLE_FOR
from kvpool_console._text import plain, top_miss_text
from kvpool_console.alerts.silence import VERDICT_SEVERITY
from kvpool_console.model import fmt_age, fmt_bytes, fmt_lease
from kvpool_console.rows import AgentRow, EngineRow, Totals

__all__ = ["AS_LAST_REPORTED", "COLUMNS", "MISS_WIDTH", "TREND_WIDTH", "agent_row_cells",
           "engine_row_cells", "totals_row_cells", "trend"]

COLUMNS: tuple[tuple[str, str], ...] = (
    ("engine", "Engine"),
    ("state", "State"),
    ("hit", "Hit"),
    ("pool", "Pool/WM"),
    ("age", "Age"),
    ("fail", "Fail"),
    ("local", "Local"),
    ("miss", "Top miss"),
    ("role", "Role"),
    ("trend", "Trend"),
    ("tokens", "Hit/Looked tok"),
    ("loads", "Ld"),
    ("saves", "Sv"),
    ("lease", "Lease"),
    ("kv_role", "KV role"),
    ("ranks", "Ranks"),
    ("backend", "Backend"),
)
"""(column key, header) in display order: what triage needs first (engine, state, hit rate,
pool fill against the watermark, report age, load failures) fits in 80 columns; the rest
scroll."""

MISS_WIDTH = max(len(top_miss_text(reason, {reason: 1}, 1)) for reason in (
    NOT_IN_POOL, LOAD_FAILED, NOT_LOADED, EVICTED, FIRST_USE, NEVER_SAVED, OTHER_DIGEST))
"""Cells the Top miss column takes from the start: its widest text for the reasons an agent
counts and the hub's split gives (``other_digest 100%``). The split comes after the first
frame; a column sized to that frame's ``-`` widened when it came (a frame drawn clipped, and
a layout of the screen). A rarer, longer reason (a skip reason) still widens it."""

_Cells = dict[str, Text | str]
"""One row's cells by column key (every key of ``COLUMNS``)."""


def _ordered(cells: _Cells) -> list[Text | str]:
    # Text, never str: DataTable parses a str cell as markup each time it renders a row;
    # these values are plain already (``plain`` for those from the network).
    return [c if isinstance(c, Text) else Text(c, end="", no_wrap=True)
            for c in (cells[key] for key, _ in COLUMNS)]


_BLOCKS = "▁▂▃▄▅▆▇█"


TREND_WIDTH = 8
"""Samples the Trend column shows."""


def trend(values: Iterable[float], width: int = TREND_WIDTH) -> str:
    """The last ``width`` values in [0, 1] as block characters (a sparkline in one cell).
    Values outside are drawn at the nearest end, NaN as 0: the schema refuses such rates at
    decode, but a state built another way must not end the app either (``int(nan)``
    raises)."""
    top = len(_BLOCKS) - 1
    return "".join(_BLOCKS[min(int(v * len(_BLOCKS)), top) if 0.0 < v <= 1.0
                           else top if v > 1.0 else 0]
                   for v in list(values)[-width:])


def _tokens(hit: int, looked: int) -> str:
    def short(n: int) -> str:
        for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
            if n >= div:
                return f"{n / div:.1f}{unit}"
        return str(n)

    return f"{short(hit)}/{short(looked)}"


_STATE_CELLS: dict[str, tuple[str, str]] = {
    "FAILED": ("FAILED", "bold red"),
    **{v.upper(): (v.upper(), "bold red" if sev == "critical" else "bold yellow")
       for v, sev in VERDICT_SEVERITY.items()},
    "CRITICAL": ("CRIT", "bold red"),
    "WARNING": ("WARN", "yellow"),
    "OK": ("OK", "green"),
}
"""``EngineRow.state`` -> (the word the cell shows, its style): a silent engine's verdict
(``HUNG``, ``GONE``, ``DOWN``, ``STALE``) in its severity's colour, the worst alert's
severity abbreviated."""


def _state(r: EngineRow) -> Text:
    word, style = _STATE_CELLS.get(r.state, (r.state, ""))
    return Text(word, style=style)


def _pool(used: int, total: int, watermark: float) -> Text:
    if not total:
        return Text("-")
    frac = used / total
    style = "red" if frac > watermark else ("yellow" if frac > 0.9 * watermark else "")
    return Text(f"{frac:.0%}/{watermark:.0%}", style=style)


AS_LAST_REPORTED = ("hit", "trend", "tokens", "loads", "saves", "fail", "pool", "lease",
                    "local", "miss")
"""Columns of an engine's row whose figures are its reports': a silent engine's (any verdict of
``alerts.silence``: ``EngineRow.silence`` set) are as of its last report, Age ago, and are
dimmed, as the detail screen says ``last reported N s ago`` beside them."""


def _dimmed(cell: Text | str) -> Text:
    """``cell`` drawn dim over its own style (a red Fail stays red). A style, not a span: a
    cell without spans keeps the table's fast redraw (``_fleet_table._shape``)."""
    if isinstance(cell, str):
        return Text(cell, style="dim", end="", no_wrap=True)
    out = cell.copy()
    out.style = f"{cell.style} dim".strip() if isinstance(cell.style, str) \
        else cell.style + Style(dim=True)
    return out


def _engine_cells(r: EngineRow, now_ms: float, history: Sequence[float],
                  expanded: bool) -> _Cells:
    cells = _current_engine_cells(r, now_ms, history, expanded)
    if r.silence:
        for key in AS_LAST_REPORTED:
            cells[key] = _dimmed(cells[key])
    return cells


def _current_engine_cells(r: EngineRow, now_ms: float, history: Sequence[float],
                          expanded: bool) -> _Cells:
    """An engine's cells as its reports give them (``_engine_cells`` dims a silent one's)."""
    mark = "▾" if expanded else ("▸" if r.agent_ids else " ")
    dim = "dim" if r.stale else ""
    return {
        "engine": plain(f"{mark} {r.engine_id}", style=dim),
        "state": _state(r),
        "role": r.role,
        "hit": f"{r.hit_rate:.0%}",
        "trend": trend(history),
        "tokens": _tokens(r.loaded_tokens, r.prompt_tokens),
        "loads": str(r.loads_in_flight),
        "saves": str(r.saves_in_flight),
        "fail": Text(str(r.loads_failed), style="red" if r.loads_failed else ""),
        "pool": _pool(r.segment_used_bytes, r.segment_total_bytes, r.high_watermark),
        "lease": Text(fmt_lease(r.next_lease_expiry_ms, now_ms),
                      style="red" if r.next_lease_expiry_ms is not None
                      and r.next_lease_expiry_ms <= now_ms else ""),
        "age": Text(fmt_age(r.age_ms), style="yellow" if r.stale else ""),
        "kv_role": Text(r.kv_role,
                        style="red" if KV_ROLE_FOR.get(r.role, r.kv_role) != r.kv_role else ""),
        "ranks": r.ranks,
        "backend": plain(r.backend),
        "local": f"{r.local_hit_rate:.0%}",
        "miss": top_miss_text(r.top_miss, r.miss_tokens, r.prompt_tokens),
    }


def _agent_cells(a: AgentRow, r: EngineRow, now_ms: float) -> _Cells:
    """A silent agent's (``a.stale``) row is dimmed with its Age yellow, as its engine's, and
    shows no CPU share: that is a rate over its last interval, and a process stopped or gone
    (state T, no pid) uses none now; its counters stay, as of its last report (Age)."""
    dim = "dim" if a.stale else ""
    return {
        "engine": Text(f"  └ {a.ranks if a.process_role == 'worker' else a.process_role}",
                       style=dim),
        # A silent agent of a silent engine is one of its processes: the engine's verdict.
        "state": Text(state, style=_STATE_CELLS[state][1]) if (state := r.agent_state(a))
        else "",
        "role": a.process_role,
        "hit": f"{a.hit_rate:.0%}" if a.prompt_tokens else "",
        "trend": "",
        "tokens": _tokens(a.loaded_tokens, a.prompt_tokens) if a.prompt_tokens else "",
        "loads": Text(str(a.loads_in_flight), style=dim),
        "saves": Text(str(a.saves_in_flight), style=dim),
        "fail": Text(str(a.loads_failed), style="red" if a.loads_failed else ""),
        "pool": Text("-", style=dim) if a.stale else f"{a.cpu_percent:.0f}%cpu",
        "lease": fmt_lease(a.next_lease_expiry_ms, now_ms),
        "age": Text(fmt_age(a.age_ms), style="yellow" if a.stale else ""),
        "kv_role": f"pid {a.pid}",
        "ranks": a.ranks,
        "backend": fmt_bytes(a.rss_bytes),
        "local": "",
        "miss": "",
    }


def _totals_state(t: Totals) -> Text:
    """The totals row's State cell: the silent engines by their verdict (``Totals.gone``,
    ``hung``, ``down``, ``stale``) in the words and styles the State column gives them
    (``1 HUNG 1 DOWN 2 STALE``); empty when none is. It counts nothing else (alerts, start
    failures): ``ok`` here read as "every engine OK" under CRIT rows, ``1st 0dn`` as a rank."""
    cell = Text(end="", no_wrap=True)
    for n, verdict in ((t.gone, "GONE"), (t.hung, "HUNG"), (t.down, "DOWN"), (t.stale, "STALE")):
        if n:
            cell.append(f"{' ' if cell else ''}{n} {verdict}", style=_STATE_CELLS[verdict][1])
    return cell


def _totals_cells(t: Totals, history: Sequence[float]) -> _Cells:
    # A share, as the engines' rows above it; "391M/489M" under "Pool/WM" read as a watermark.
    used = f"{t.segment_used_bytes / t.segment_total_bytes:.0%} of " \
        f"{fmt_bytes(t.segment_total_bytes)}" if t.segment_total_bytes else "-"
    return {
        "engine": Text(f"Σ {t.engines} engines", style="bold"),
        "state": _totals_state(t),
        "role": "",  # the status bar counts the agents; "15ag" under Role read as a role
        "hit": Text(f"{t.hit_rate:.0%}", style="bold"),
        "trend": trend(history),
        "tokens": _tokens(t.loaded_tokens, t.prompt_tokens),
        "loads": str(t.loads_in_flight),
        "saves": str(t.saves_in_flight),
        "fail": Text(str(t.loads_failed), style="bold red" if t.loads_failed else "bold"),
        "pool": used,
        "lease": "",
        "age": "",
        "kv_role": "",
        "ranks": "",
        "backend": "",
        "local": Text(f"{t.local_hit_rate:.0%}", style="bold"),
        "miss": top_miss_text(t.top_miss, t.miss_tokens, t.prompt_tokens),
    }


def engine_row_cells(r: EngineRow, now_ms: float, history: Sequence[float],
                      expanded: bool) -> list[Text | str]:
    return _ordered(_engine_cells(r, now_ms, history, expanded))


def agent_row_cells(a: AgentRow, r: EngineRow, now_ms: float) -> list[Text | str]:
    return _ordered(_agent_cells(a, r, now_ms))


def totals_row_cells(t: Totals, history: Sequence[float]) -> list[Text | str]:
    return _ordered(_totals_cells(t, history))
