"""The engine detail screen's miss-reason table (issue 41): where every prompt token went.

One row for vLLM's own cache (``local``), one for the pool's hits (``loaded``), then one per
miss reason, most tokens first, each with its tokens, its share of the engine's prompt tokens
and the fix (``_miss_fixes.miss_fix``: the engine's evictions, skipped saves and digest). The
rows add up to the prompt tokens (``kvpool_agent._misses``), the last row says so.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from kvpool_console._miss_fixes import FIXES, miss_fix
from kvpool_console._text import plain
from kvpool_console.rows import EngineRow

__all__ = ["MissTable"]


class MissTable(DataTable[str | Text]):
    """Tokens by where they went for one engine (module docstring); ``show`` redraws it."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row")
        # Columns before mount: the screen may redraw before this table is mounted.
        self.add_columns("Tokens went", "Tokens", "Share")
        self.add_column("Fix", width=max(len(f) for f in FIXES.values()))

    def show(self, row: EngineRow) -> None:
        """The rows of ``row`` (its ``miss_tokens`` already split by the hub's memory)."""
        self.clear()
        prompt = row.prompt_tokens

        def share(n: int) -> str:
            return f"{n / prompt:.1%}" if prompt else "-"

        self.add_row("local (vLLM cache)", str(row.local_tokens), share(row.local_tokens), "")
        self.add_row(Text("loaded (pool hit)", style="green"), str(row.loaded_tokens),
                     share(row.loaded_tokens), "")
        for reason, n in sorted(row.miss_tokens.items(), key=lambda kv: (-kv[1], kv[0])):
            self.add_row(plain(reason, style="bold" if reason == row.top_miss else ""), str(n),
                         share(n), plain(miss_fix(
                             reason, evicted_keys=row.pool_evicted_keys,
                             saves_skipped=row.saves_skipped,
                             service_steers=row.policy_in_charge == "service",
                             digest_known=bool(row.layout_digest))))
        total = row.local_tokens + row.loaded_tokens + sum(row.miss_tokens.values())
        self.add_row(Text("= prompt tokens", style="dim"), str(total), share(total), "")
