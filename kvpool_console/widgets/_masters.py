"""The Pool tab's masters table: every master of an HA pool, which one leads and serves, and
the election view each has seen (``PoolStats.masters``, from the masters' ``/health``).
Hidden while no pool has more than one master."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from kvpool_console._text import plain
from kvpool_console.rows import FleetView

__all__ = ["MastersTable"]


class MastersTable(DataTable[Text | str]):
    """One row per master of every HA pool in a ``FleetView``."""

    def on_mount(self) -> None:
        self.add_columns("Pool", "Master", "Role", "State", "Leader", "View", "Error")
        self.display = False

    def show(self, view: FleetView) -> None:
        """Redraw from ``view``; shown only when some pool lists its masters."""
        self.clear()
        for p in view.pools:
            for m in p.masters:
                role = (Text("leader", style="bold green") if m.serving else
                        Text("unreachable", style="bold red") if not m.reachable else
                        plain(m.role or "-"))
                self.add_row(plain(p.name), plain(m.admin_url), role, plain(m.ha_state or "-"),
                             plain(m.leader_address or "-"), str(m.view_version),
                             plain(m.error or "-"))
        self.display = self.row_count > 0
