"""Console screens: engine detail, help and the action modals (health, flush)."""

from kvpool_console.screens.actions import ConfirmScreen, FlushScreen, HealthScreen
from kvpool_console.screens.detail import EngineDetailScreen
from kvpool_console.screens.help import HelpScreen

__all__ = ["ConfirmScreen", "EngineDetailScreen", "FlushScreen", "HealthScreen", "HelpScreen"]
