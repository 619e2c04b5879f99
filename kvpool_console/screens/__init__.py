"""Console screens: engine detail, help and the action modals (health, flush, pin, unpin)."""

from kvpool_console.screens._actions import ConfirmScreen, FlushScreen, HealthScreen
from kvpool_console.screens._detail import EngineDetail, EngineDetailScreen
from kvpool_console.screens._help import HelpScreen
from kvpool_console.screens._pins import PinScreen, UnpinScreen

__all__ = ["ConfirmScreen", "EngineDetail", "EngineDetailScreen", "FlushScreen", "HealthScreen",
           "HelpScreen", "PinScreen", "UnpinScreen"]
