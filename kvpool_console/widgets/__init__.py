"""Console widgets: the fleet table, the Pool and Events tabs, the status bar."""

from kvpool_console.widgets._events_view import EventsView
from kvpool_console.widgets._fleet_table import (
    TOTALS,
    AgentKey,
    EngineKey,
    FleetRowKey,
    FleetTable,
    TotalsKey,
)
from kvpool_console.widgets._pool_view import PoolView
from kvpool_console.widgets._status_bar import StatusBar

__all__ = ["TOTALS", "AgentKey", "EngineKey", "EventsView", "FleetRowKey", "FleetTable",
           "PoolView", "StatusBar", "TotalsKey"]
