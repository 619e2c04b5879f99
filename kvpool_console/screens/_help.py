"""Help screen (``?``): a table of the keys and what they do, then what each column means.

The keys come from the bindings themselves (the app's ``BINDINGS``, hidden ones included, and
those of the engine detail, flush and pin screens), so a key added, moved or removed there shows up
here as it is; this module only says in words what each action does (``ACTION_HELP``). An action
without words here is still listed, with its binding's own description.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown, Static

from kvpool_console.screens._actions import ConfirmScreen, FlushScreen
from kvpool_console.screens._detail import EngineDetailScreen
from kvpool_console.screens._pins import PinScreen, UnpinScreen

__all__ = ["ACTION_HELP", "HelpScreen", "KeyHelp", "help_rows"]

ACTION_HELP: dict[str, tuple[str, str]] = {
    # action -> (group, what it does). Keys are not repeated here: they come from BINDINGS.
    "tab('fleet')": ("Screens", "fleet: a row per engine"),
    "tab('pool')": ("Screens", "pool: keys, bytes, watermark, evictions, segments"),
    "tab('events')": ("Screens", "events: alerts as they fire and clear"),
    "help": ("Screens", "help: every key and what it does"),
    "expand": ("Fleet", "show or hide the selected engine's worker agents"),
    "filter": ("Fleet", "filter engines by id, role, kv_role, backend, model or agent id"),
    "faults": ("Fleet", "only engines with an alert, or stale / down"),
    "sort": ("Fleet", "sort by the next column"),
    "reverse": ("Fleet", "reverse the sort"),
    "pause": ("Fleet", "freeze the screen (PAUSED); data keeps arriving"),
    "rate(-1)": ("Fleet", "refresh faster (down to 0.25 s)"),
    "rate(1)": ("Fleet", "refresh slower (up to 10 s)"),
    "health(False)": ("Commands", "health checks of the selected engine (no pool key touched)"),
    "health(True)": ("Commands", "health checks of every engine"),
    "flush": ("Commands", "flush pool keys: scope, dry-run count, confirm (operator key)"),
    "pins": ("Commands", "pinned prefixes of the selected engine's model, in the events log"),
    "pin": ("Commands", "pin a prefix of the selected engine's model: token ids or text, soft "
            "(TTL) or hard (operator key)"),
    "unpin": ("Commands", "unpin a prefix of the selected engine's model by its pin id; its "
              "values leave the pool (operator key)"),
    "triage": ("Commands", "triage: check the engine's hosts (this one locally, others over SSH), "
               "say hung / gone / why"),
    "quit": ("Console", "quit (--demo stops everything it started)"),
    "app.pop_screen": ("Engine detail", "back to the fleet"),
    "dry_run": ("Flush dialog", "count what the flush would remove"),
    "cancel": ("Flush dialog", "close without flushing"),
    "answer(True)": ("Confirm", "yes: run the flush"),
    "answer(False)": ("Confirm", "no: do not flush"),
    "close_dialog": ("Pin dialogs", "close (a pin or unpin already sent still finishes)"),
}
"""What each bound action does, in the help table's words, and the group it is listed under."""

_NOT_BINDINGS: list[tuple[str, str, str]] = [
    # Keys the app handles without a binding of its own.
    ("enter", "Fleet", "engine detail: sparklines, transfers, recent errors with their fix"),
    ("ctrl+p", "Console", "command palette: every action by name"),
]

_GROUPS = ("Screens", "Fleet", "Commands", "Console", "Engine detail", "Flush dialog", "Confirm",
           "Pin dialogs", "Other")

KEYED_HUB_TEXT = """\
**Keys a keyed hub needs** - a hub started with `--keys` requires a CURVE key on every port, so
`--keys DIR` must hold the hub's public key (`hub.key`) and one key pair of this console:
`viewer.key_secret` watches the fleet and runs health checks and flush dry runs;
`operator.key_secret` can also flush, pin, unpin, `health --probe` and `forget`. Without a key
a keyed hub refuses the console: it sees nothing. A hub without `--keys` binds loopback (unless
started with `--insecure`); a console without the operator key is read-only (flush, pin and
unpin disabled).
"""

COLUMNS_TEXT = """\
**Fleet columns** - *State* OK / WARN / CRIT (worst alert), FAILED (did not start) or STALE /
DOWN (no report for 5 s / 30 s). *Hit* pool hit tokens / looked-up tokens since start, *Trend*
the last minute's hit rate. *Ld* / *Sv* loads and saves in flight (requests), *Fail* failed or
timed-out loads. *Pool/WM* pool usage vs `eviction_high_watermark_ratio`. *Local* prompt tokens
vLLM's own prefix cache held / looked-up tokens. *Lease* time left before the earliest lease of
an in-flight load expires (`default_kv_lease_ttl`). *Age* time since the last report.
"""


@dataclass(frozen=True)
class KeyHelp:
    """One row of the help table: the keys (as shown), the group, what they do."""

    keys: str
    group: str
    text: str


def help_rows(app: App[Any], key_display: Callable[[Binding], str] | None = None
              ) -> list[KeyHelp]:
    """The help table's rows from ``app``'s bindings and those of the screens it opens.

    Keys bound to the same action share a row (``q, ^c``); rows are grouped as
    ``ACTION_HELP`` says, in the bindings' order within a group. ``key_display`` shows a key
    (default: as the app's footer does, ``app.get_key_display``).
    """
    show = key_display or app.get_key_display
    sources: list[tuple[str | None, Iterable[BindingType]]] = [
        (None, app.BINDINGS),
        ("Engine detail", EngineDetailScreen.BINDINGS),
        ("Flush dialog", FlushScreen.BINDINGS),
        ("Confirm", ConfirmScreen.BINDINGS),
        ("Pin dialogs", PinScreen.BINDINGS),
        ("Pin dialogs", UnpinScreen.BINDINGS),
    ]
    keys: dict[tuple[str, str], list[str]] = {}
    texts: dict[tuple[str, str], str] = {}
    for default_group, bindings in sources:
        for b in Binding.make_bindings(bindings):
            group, text = ACTION_HELP.get(b.action, (default_group or "Other",
                                                     b.description or b.action))
            slot = (group, b.action)
            shown = show(b)
            if shown not in keys.setdefault(slot, []):
                keys[slot].append(shown)
            texts[slot] = text
    rows = [KeyHelp(", ".join(keys[slot]), slot[0], texts[slot]) for slot in keys]
    rows += [KeyHelp(show(Binding(k, "")), g, t) for k, g, t in _NOT_BINDINGS]
    order = {g: i for i, g in enumerate(_GROUPS)}
    # Stable sort: within a group the bindings keep their order.
    return sorted(rows, key=lambda r: order.get(r.group, len(_GROUPS)))


def _table(rows: list[KeyHelp]) -> Table:
    table = Table(box=None, show_header=True, header_style="bold", pad_edge=False,
                  expand=True)
    table.add_column("Key", style="bold cyan", no_wrap=True)
    table.add_column("What it does", ratio=1)
    group = None
    for r in rows:
        if r.group != group:
            if group is not None:
                table.add_row("", "")
            table.add_row(Text(r.group, style="bold underline"), "")
            group = r.group
        table.add_row(Text(r.keys), Text(r.text))
    return table


class HelpScreen(ModalScreen[None]):
    """Modal help; any of ``escape``, ``q``, ``?`` closes it."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen #help-keys {
        margin: 0 1 1 1;
    }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Markdown("# kvpool-console")
            yield Static(_table(help_rows(self.app)), id="help-keys")
            yield Markdown(KEYED_HUB_TEXT + "\n" + COLUMNS_TEXT)

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
