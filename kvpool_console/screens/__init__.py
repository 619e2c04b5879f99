"""Console screens: engine detail, help and the action modals (health, flush)."""

from kvpool_console.screens._actions import ConfirmScreen, FlushScreen, HealthScreen
from kvpool_console.screens._detail import EngineDetail, EngineDetailScreen
from kvpool_console.screens._help import HelpScreen

__all__ = ["ConfirmScreen", "EngineDetail", "EngineDetailScreen", "FlushScreen", "HealthScreen",
           "HelpScreen"]
