"""The engine detail screen's saves line (issue 38 item 4): the oldest save's age, the engine
blocks saves still hold, the bytes waiting in staging buffers, and transfers that failed in the
transport, by Mooncake error name and code, with what to change.

A store that does not answer shows as a growing oldest age with its bytes staged and no block
held (with staging, a save frees its blocks once copied); a transport that cannot carry the
bytes shows as ``TRANSFER_FAIL (-800)`` counts (``kvpool_console._transport``).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool_agent.protocol import EngineState
from kvpool_console._transport import failures_text, saves_in_flight, transport_hint
from kvpool_console.model import fmt_age, fmt_bytes

__all__ = ["saves_line"]


def saves_line(engine_id: str, states: Mapping[str, EngineState], now_ms: float) -> str:
    """``oldest save 1.5 s, 0 blocks held, 8.0 MiB staged; transport failures: TRANSFER_FAIL
    (-800) 3 (fix)`` for ``engine_id``'s agents in ``states``; ``""`` when its agents report
    neither (agents before issue 38, no failure)."""
    v = saves_in_flight((s for s in states.values() if s.source.engine_id == engine_id),
                        now_ms)
    parts = []
    if v.told:
        oldest = fmt_age(v.oldest_save_age_ms) if v.oldest_save_age_ms else "none"
        parts.append(f"oldest save {oldest}, {v.blocks_held} blocks held, "
                     f"{fmt_bytes(v.bytes_staged)} staged")
    if v.transport_failures:
        parts.append(f"transport failures: {failures_text(v.transport_failures)} "
                     f"({transport_hint(v.transport_failures)})")
    return "; ".join(parts)
