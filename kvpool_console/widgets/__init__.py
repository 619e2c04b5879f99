"""Console widgets: Textual widgets specialised with the fleet's columns and update rules."""

from kvpool_console.widgets._fleet_table import FleetTable, trend

__all__ = ["FleetTable", "trend"]
