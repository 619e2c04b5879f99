"""The Events tab: the active alerts, and a log of alerts as they fire and of operator actions."""

from __future__ import annotations

import time
from collections.abc import Iterable

from rich.text import Text
from textual.app import ComposeResult
from textual.reactive import var
from textual.widgets import DataTable, RichLog, TabPane

from kvpool_console._text import plain, visible
from kvpool_console.alerts import Alert
from kvpool_console.alerts.alert import SEVERITY_STYLE

__all__ = ["EventsView"]


def _hms(ms: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ms / 1e3))


def _severity(a: Alert) -> tuple[str, str]:
    return a.severity.upper()[:4], SEVERITY_STYLE[a.severity]


class EventsView(TabPane):
    """Active alerts (redrawn whenever :attr:`alerts` is set; the app sets it while this tab is
    the active one) over the events log (:meth:`log_alerts`, :meth:`log_action`), which is
    written whichever tab is active. Takes TabPane's arguments (``title``, ``id``).
    """

    # always_update: each refresh redraws the table, as the other tabs do.
    alerts: var[list[Alert]] = var[list[Alert]](list, always_update=True, init=False)
    """The active alerts, in the alert rules' order."""

    def compose(self) -> ComposeResult:
        yield DataTable(id="alerts-table", cursor_type="row")
        yield RichLog(id="events-log", wrap=True, max_lines=2000)

    def on_mount(self) -> None:
        self.query_one("#alerts-table", DataTable).add_columns("Sev", "Subject", "Alert", "Hint")

    def watch_alerts(self, alerts: list[Alert]) -> None:
        table = self.query_one("#alerts-table", DataTable)
        table.clear()
        for a in alerts:
            label, style = _severity(a)
            table.add_row(Text(label, style=style), plain(a.subject), plain(a.message),
                          plain(a.hint))

    def log_alerts(self, alerts: Iterable[Alert], now_ms: float,
                   cleared: Iterable[Alert] = ()) -> None:
        """Append one line per alert that fired at ``now_ms`` (epoch ms), then one per alert
        that cleared then (``CLEAR``, its rule and last message)."""
        log = self.query_one("#events-log", RichLog)
        for a in alerts:
            label, style = _severity(a)
            line = Text(f"{_hms(now_ms)} ")
            line.append(label, style=style)
            line.append(visible(f" {a.subject}: {a.message}"))
            line.append(visible(f" — {a.hint}"), style="dim")
            log.write(line)
        for a in cleared:
            line = Text(f"{_hms(now_ms)} ")
            line.append("CLEAR", style="green")
            line.append(visible(f" {a.subject}: {a.rule} ({a.message})"), style="dim")
            log.write(line)

    def log_action(self, message: str, now_ms: float, style: str = "") -> None:
        """Append an operator action or its result, stamped ``now_ms`` (epoch ms)."""
        self.query_one("#events-log", RichLog).write(plain(f"{_hms(now_ms)} {message}",
                                                           style=style))
