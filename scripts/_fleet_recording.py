"""The recorded fleet the documentation's screenshots are drawn over (``docs/data/*.json``)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvpool_agent.protocol import EngineState, ReuseView

__all__ = ["FleetRecording", "load_recording"]


class FleetRecording(msgspec.Struct):
    """Every agent's latest state as a hub held it at ``recorded_ms`` (epoch ms), and the
    hub's last reuse figures then (``reuse``: its ceiling, what-if curve and each engine's
    ``not_in_pool`` split; ``None`` in recordings made before it was kept)."""

    recorded_ms: float
    hub_address: str
    note: str
    states: dict[str, EngineState]
    seen_ms: dict[str, float]
    reuse: ReuseView | None = None


def load_recording(path: Path) -> FleetRecording:
    return msgspec.json.decode(path.read_bytes(), type=FleetRecording)
