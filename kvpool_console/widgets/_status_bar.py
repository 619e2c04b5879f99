"""The status bar: mode badges, hub silence, fleet size and alert counts, sort, refresh, filter."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import var
from textual.widgets import Static

from kvpool_console.model import SORT_KEYS
from kvpool_console.rows import FleetView

__all__ = ["StatusBar"]


class StatusBar(Static):
    """One line computed from the app's state; the app binds its attributes of the same names
    (``data_bind``), so the line follows every change without being told to redraw.

    Args:
        address: the hub address, named while no agent has reported yet.
        read_only: the console has no operator key (flush disabled).
        id: the widget's id.
    """

    paused = var(False)
    faults_only = var(False)
    filter_text = var("")
    sort_index = var(0)
    sort_reverse = var(False)
    refresh_s = var(1.0)
    hub_silent_ms: var[float | None] = var[float | None](None)
    """How long the hub has been silent (ms), once past the app's threshold; else None."""
    # always_update: a view is new every refresh and comparing two costs a full walk.
    view: var[FleetView | None] = var[FleetView | None](None, always_update=True)
    line: var[Text] = var(Text)
    """The rendered line, computed from the attributes above."""

    def __init__(self, address: str, *, read_only: bool, id: str | None = None) -> None:
        super().__init__(id=id)
        self._address = address
        self._read_only = read_only

    def compute_line(self) -> Text:
        text = Text()
        badges = [(" PAUSED ", "bold white on red", self.paused),
                  (" READ-ONLY ", "bold black on yellow", self._read_only),
                  (" FAULTS ONLY ", "bold black on cyan", self.faults_only)]
        for label, style, on in badges:
            if on:
                text.append(label, style=style)
                text.append(" ")
        if self.hub_silent_ms is not None:
            text.append(f" HUB SILENT {self.hub_silent_ms / 1e3:.0f}s ", style="bold white on red")
            text.append(" ")
        v = self.view
        if v is None or not v.totals.agents:
            text.append(f"no agent reported yet to {self._address}  ", style="yellow")
        else:
            crit = sum(a.severity == "critical" for a in v.alerts)
            warn = sum(a.severity == "warning" for a in v.alerts)
            info = len(v.alerts) - crit - warn
            stores = f"{v.totals.stores} stores " if v.totals.stores else ""
            text.append(f"{v.totals.engines} engines {stores}{v.totals.agents} agents  ")
            text.append(f"alerts {crit}C/{warn}W{f'/{info}I' if info else ''}  ",
                        style="bold red" if crit else "")
        arrow = "↓" if self.sort_reverse else "↑"
        text.append(f"sort {SORT_KEYS[self.sort_index]}{arrow}  every {self.refresh_s:g}s")
        if self.filter_text:
            text.append(f"  filter '{self.filter_text}'")
        return text

    def watch_line(self, line: Text) -> None:
        # One line high and as wide as the screen (console.tcss): its size never changes,
        # so no layout pass of the whole screen (tens of ms at fleet scale) each refresh.
        self.update(line, layout=False)
