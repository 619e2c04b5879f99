"""Help screen (``?``): key bindings and what each column means."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

__all__ = ["HELP_TEXT", "HelpScreen"]

HELP_TEXT = """\
# kvpool-console

**Keys** - `1` Fleet, `2` Pool, `3` Events, `enter` engine detail, `space` expand workers,
`/` filter, `x` faults only, `s` / `r` sort column / reverse, `p` pause, `+` / `-` refresh
rate, `h` health of the selected engine, `H` health of all, `f` flush (operator key only),
`ctrl+p` command palette, `q` quit.

**Fleet columns** - *State* OK / WARN / CRIT (worst alert) or STALE / DOWN (no report for 5 s /
30 s). *Hit* pool hit tokens / looked-up tokens since start, *Trend* the last minute's hit
rate. *Ld* / *Sv* loads and saves in flight (requests), *Fail* failed or timed-out loads.
*Pool/WM* pool usage vs `eviction_high_watermark_ratio`. *Local* prompt tokens vLLM's own
prefix cache held / looked-up tokens. *Lease* time left before the earliest
lease of an in-flight load expires (`default_kv_lease_ttl`). *Age* time since the last report.

**Read-only** - without `--keys DIR` (the operator's CURVE key pair) flush is disabled;
watching and health checks need no key.
"""


class HelpScreen(ModalScreen[None]):
    """Modal help; any of ``escape``, ``q``, ``?`` closes it."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Markdown(HELP_TEXT)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
