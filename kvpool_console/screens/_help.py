"""Help screen (``?``): a table of the keys and what they do, then what each column means; and
the command palette's entries (``ctrl+p``), from the same table.

The keys come from the bindings themselves (the app's ``BINDINGS``, hidden ones included, and
those of the engine detail, flush and pin screens), so a key added, moved or removed there shows up
here as it is; this module only says in words what each action does and what the palette names
it (``ACTION_HELP``). An action without words here is still listed, with its binding's own
description. The palette lists every bound action the keys can run where it was opened
(``palette_entries``), so an action has one key, one text and one palette name, all in the help
screen, the palette and the docs' key table (``scripts/gen_console_keys.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from rich.table import Table
from rich.text import Text
from textual.actions import parse as parse_action
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Markdown, Static

from kvpool_console.model import SORT_KEYS
from kvpool_console.screens._actions import ConfirmScreen, FlushScreen
from kvpool_console.screens._detail import EngineDetailScreen
from kvpool_console.screens._pins import PinScreen, UnpinScreen

__all__ = ["ACTION_HELP", "ActionHelp", "HelpScreen", "KeyHelp", "PaletteEntry", "help_rows",
           "palette_entries"]


class ActionHelp(NamedTuple):
    """What one bound action is called and does."""

    group: str
    """The help table's group it is listed under."""
    text: str
    """What it does, in the help table's and the palette's words."""
    title: str
    """Its name in the command palette (what an operator types there)."""


ACTION_HELP: dict[str, ActionHelp] = {
    # action -> (group, what it does, palette name). Keys are not repeated here: they come
    # from BINDINGS.
    "tab('fleet')": ActionHelp("Screens", "fleet: a row per engine", "Fleet screen"),
    "tab('pool')": ActionHelp("Screens", "pool: keys, bytes, watermark, evictions, segments",
                              "Pool screen"),
    "tab('events')": ActionHelp("Screens", "events: alerts as they fire and clear",
                                "Events screen"),
    "help": ActionHelp("Screens", "help: every key and what it does", "Help: keys and columns"),
    "expand": ActionHelp("Fleet", "show or hide the selected engine's worker agents",
                         "Expand / collapse: selected engine's agents"),
    "filter": ActionHelp("Fleet", "filter engines by id, role, kv_role, backend, model or "
                         "agent id", "Filter engines"),
    "faults": ActionHelp("Fleet", "only engines with an alert, or stale / down",
                         "Toggle faults only"),
    # Sort and reverse say more than their palette names: an entry whose words are its name
    # shows no help line there.
    "sort": ActionHelp("Fleet", f"sort by the next column in turn: {', '.join(SORT_KEYS)} "
                       "(the status bar shows which; a click on a header sorts by it)",
                       "Sort by the next column"),
    "reverse": ActionHelp("Fleet", "reverse the sort: ascending (↑ in the status bar) or "
                          "descending (↓)", "Reverse the sort"),
    "pause": ActionHelp("Fleet", "freeze the screen (PAUSED); data keeps arriving",
                        "Pause / resume"),
    "rate(-1)": ActionHelp("Fleet", "refresh faster (down to 0.25 s)", "Refresh faster"),
    "rate(1)": ActionHelp("Fleet", "refresh slower (up to 10 s)", "Refresh slower"),
    "detail": ActionHelp("Fleet", "engine detail: sparklines, transfers, recent errors with "
                         "their fix", "Engine detail: selected engine"),
    "health(False)": ActionHelp("Commands", "health checks of the selected engine (no pool "
                                "key touched)", "Health check: selected engine"),
    "health(True)": ActionHelp("Commands", "health checks of every engine",
                               "Health check: all engines"),
    "flush": ActionHelp("Commands", "flush pool keys: scope, dry-run count, confirm "
                        "(operator key)", "Flush pool entries"),
    "pins": ActionHelp("Commands", "pinned prefixes of the selected engine's model, in the "
                       "events log", "Pins: selected engine's model"),
    "pin": ActionHelp("Commands", "pin a prefix of the selected engine's model: token ids or "
                      "text, soft (TTL) or hard (operator key)",
                      "Pin a prefix: selected engine's model"),
    "unpin": ActionHelp("Commands", "unpin a prefix of the selected engine's model by its pin "
                        "id; its values leave the pool (operator key)",
                        "Unpin a prefix: selected engine's model"),
    "triage": ActionHelp("Commands", "triage: check the engine's hosts (this one locally, "
                         "others over SSH), say hung / gone / why", "Triage: selected engine"),
    "quit": ActionHelp("Console", "quit (--demo stops everything it started)", "Quit"),
    "command_palette": ActionHelp("Console", "command palette: every action by name", ""),
    "app.pop_screen": ActionHelp("Engine detail", "back to the fleet", "Back to the fleet"),
    "dry_run": ActionHelp("Flush dialog", "count what the flush would remove",
                          "Dry run: count what the flush would remove"),
    "cancel": ActionHelp("Flush dialog", "close without flushing", "Close without flushing"),
    "answer(True)": ActionHelp("Confirm", "yes: run the flush", "Yes: run the flush"),
    "answer(False)": ActionHelp("Confirm", "no: do not flush", "No: do not flush"),
    "close_dialog": ActionHelp("Pin dialogs", "close (a pin or unpin already sent still "
                               "finishes)", "Close the dialog"),
}
"""What each bound action does, in the help table's words, the group it is listed under and
its name in the command palette."""

_NOT_BINDINGS: list[tuple[str, str]] = [
    # (key, action): keys the app handles without a binding of its own. Enter on a fleet row
    # is the table's (it posts EngineChosen; ``detail`` does the same from the palette).
    ("enter", "detail"),
    ("ctrl+p", "command_palette"),
]

_GROUPS = ("Screens", "Fleet", "Commands", "Console", "Engine detail", "Flush dialog", "Confirm",
           "Pin dialogs", "Other")

_SCREENS: list[tuple[str, type[Screen[Any]]]] = [
    ("Engine detail", EngineDetailScreen),
    ("Flush dialog", FlushScreen),
    ("Confirm", ConfirmScreen),
    ("Pin dialogs", PinScreen),
    ("Pin dialogs", UnpinScreen),
]
"""The screens whose keys the help table lists, with their default group."""

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
**Fleet columns** - *State* OK / WARN / CRIT (worst alert), FAILED (did not start) or, once
silent (no report for 3 s), its stale alert's verdict: HUNG (its process runs here but sends
nothing) or GONE (not running), else STALE, and DOWN after 30 s. *Hit* pool hit tokens /
looked-up tokens since start, *Trend* the last minute's hit rate. *Ld* / *Sv* loads and saves
in flight (requests), *Fail* failed or timed-out loads. *Pool/WM* pool usage vs
`eviction_high_watermark_ratio`. *Local* prompt tokens vLLM's own prefix cache held / looked-up
tokens. *Lease* time left before the earliest lease of an in-flight load expires
(`default_kv_lease_ttl`). *Age* time since the last report: a silent engine's figures are
dimmed, as of then.
"""


@dataclass(frozen=True)
class KeyHelp:
    """One row of the help table: the keys (as shown), the group, what they do, and the
    action's name in the command palette (``""``: not in it)."""

    keys: str
    group: str
    text: str
    title: str = ""


def _help_of(b: Binding, default_group: str | None) -> ActionHelp:
    """``b``'s action's words; an action without any: its binding's own description."""
    words = b.description or b.action
    return ACTION_HELP.get(b.action, ActionHelp(default_group or "Other", words, words))


def help_rows(app: App[Any], key_display: Callable[[Binding], str] | None = None
              ) -> list[KeyHelp]:
    """The help table's rows from ``app``'s bindings and those of the screens it opens.

    Keys bound to the same action share a row (``q, ^c``); rows are grouped as
    ``ACTION_HELP`` says, in the bindings' order within a group. ``key_display`` shows a key
    (default: as the app's footer does, ``app.get_key_display``).
    """
    show = key_display or app.get_key_display
    sources: list[tuple[str | None, Iterable[BindingType]]] = [
        (None, app.BINDINGS), *((group, screen.BINDINGS) for group, screen in _SCREENS)]
    keys: dict[tuple[str, str], list[str]] = {}
    helps: dict[tuple[str, str], ActionHelp] = {}
    for default_group, bindings in sources:
        for b in Binding.make_bindings(bindings):
            words = _help_of(b, default_group)
            slot = (words.group, b.action)
            shown = show(b)
            if shown not in keys.setdefault(slot, []):
                keys[slot].append(shown)
            helps[slot] = words
    rows = [KeyHelp(", ".join(keys[slot]), slot[0], helps[slot].text, helps[slot].title)
            for slot in keys]
    rows += [KeyHelp(show(Binding(k, "")), ACTION_HELP[a].group, ACTION_HELP[a].text,
                     ACTION_HELP[a].title) for k, a in _NOT_BINDINGS]
    order = {g: i for i, g in enumerate(_GROUPS)}
    # Stable sort: within a group the bindings keep their order.
    return sorted(rows, key=lambda r: order.get(r.group, len(_GROUPS)))


@dataclass(frozen=True)
class PaletteEntry:
    """One command palette entry: ``action`` run on ``namespace`` (``app`` or ``screen``: the
    screen the palette was opened over), named ``title``, ``text`` and its keys as help."""

    title: str
    text: str
    keys: str
    action: str
    namespace: str


def _own_bindings(screen: Screen[Any]) -> list[Binding]:
    """The bindings ``screen``'s class declares (Textual's own screen bindings, focus and
    copy, left out)."""
    for cls in type(screen).__mro__:
        if cls in (Screen, ModalScreen):
            return []
        if "BINDINGS" in vars(cls):
            return list(Binding.make_bindings(vars(cls)["BINDINGS"]))
    return []


def palette_entries(app: App[Any], screen: Screen[Any]) -> list[PaletteEntry]:
    """Every action a key runs over ``screen`` (the screen the palette was opened over), one
    entry each, named and explained as the help table does: over the fleet screen every
    ``app.BINDINGS`` action and enter's ``detail``; over an engine's detail its own keys and
    the app's actions but the fleet screen's own (filter, faults, sort, expand, tabs:
    ``EngineDetailScreen.FLEET_ACTIONS``, which would act on the fleet hidden under it); over
    a dialog its own keys and the app's priority keys (quit), the only app keys that reach
    past a dialog. The palette itself is not an entry."""
    modal = screen.is_modal
    sources: list[tuple[str, list[Binding]]] = [("screen", _own_bindings(screen))]
    # Over an engine's detail the fleet screen's own actions are not offered: they would act
    # on the fleet hidden under it (``EngineDetailScreen.FLEET_ACTIONS``).
    hidden = screen.FLEET_ACTIONS if isinstance(screen, EngineDetailScreen) else frozenset()
    app_bindings = [b for b in Binding.make_bindings(app.BINDINGS)
                    if (b.priority or not modal) and parse_action(b.action)[1] not in hidden]
    sources.append(("app", app_bindings))
    if not modal and not isinstance(screen, EngineDetailScreen):
        sources.append(("app", [Binding(k, a) for k, a in _NOT_BINDINGS]))
    found: dict[tuple[str, str], tuple[Binding, list[str]]] = {}
    for namespace, bindings in sources:
        for b in bindings:
            if b.action != "command_palette":
                found.setdefault((namespace, b.action), (b, []))[1].append(
                    app.get_key_display(b))
    entries = []
    for (namespace, action), (first, shown) in found.items():
        words = _help_of(first, None)
        entries.append(PaletteEntry(words.title, words.text, ", ".join(dict.fromkeys(shown)),
                                    action, namespace))
    return entries


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
