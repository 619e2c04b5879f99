"""The recorded fleet the documentation's screenshots are drawn over (``docs/data/*.json``)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvpool_agent.protocol import EngineState

__all__ = ["FleetRecording", "load_recording"]


class FleetRecording(msgspec.Struct):
    """Every agent's latest state as a hub held it at ``recorded_ms`` (epoch ms)."""

    recorded_ms: float
    hub_address: str
    note: str
    states: dict[str, EngineState]
    seen_ms: dict[str, float]


def load_recording(path: Path) -> FleetRecording:
    return msgspec.json.decode(path.read_bytes(), type=FleetRecording)
