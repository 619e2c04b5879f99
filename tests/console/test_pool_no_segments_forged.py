"""Round-7 attack on ``pool_no_segments`` (critical): an agent key reports its own engine's
``PoolStats`` (the hub checks their ranges and clamps a report's time to its own, never their
values), and the newest worker reading of a pool decided the alert. One key reporting often,
healthy and 0 B, raised a false critical for a pool two engines of longer standing read holding
10 GB; reporting memory, it hid a real loss every other engine read. Now every engine's newest
worker reading counts (within ``STALE_AFTER_MS`` of the pool's newest): a disagreement is a
warning naming both sides, critical only when every engine reads 0 B."""

from __future__ import annotations

import msgspec
from fleetdata import GB, NOW_MS, engine, pool

from kvpool_agent.protocol import STALE_AFTER_MS, EngineState, PoolStats
from kvpool_console.alerts import evaluate

MASTER = "127.0.0.1:50051"
POOL = f"mooncake@{MASTER}"


def _on(fleet: dict[str, EngineState], p: PoolStats) -> dict[str, EngineState]:
    return {k: msgspec.structs.replace(
        s, source=msgspec.structs.replace(s.source, master=MASTER), pool=p)
        for k, s in fleet.items()}


def _empty() -> PoolStats:
    return msgspec.structs.replace(pool(used=0, total=0, keys=0), segments=[])


def _liar(p: PoolStats, ts_ms: float = NOW_MS) -> dict[str, EngineState]:
    """One worker of engine ``x`` (its own engine-bound key), the pool's newest reading."""
    return {k: msgspec.structs.replace(s, ts_ms=ts_ms)
            for k, s in _on(engine("x", tp=1), p).items()}


def _no_segments(fleet: dict[str, EngineState]) -> list[tuple[str, str]]:
    return [(a.severity, a.message) for a in evaluate(fleet, {}, NOW_MS)
            if a.rule == "pool_no_segments" and a.subject == POOL]


def test_one_keys_forged_empty_reading_is_no_critical_alert() -> None:
    honest = _on(engine("a") | engine("b"), pool(total=10 * GB))
    assert _no_segments(honest) == []
    ((severity, message),) = _no_segments(honest | _liar(_empty()))
    assert severity == "warning"
    assert message.startswith(f"engines x read no store segment on master {MASTER}")
    assert f"while engines a, b read {10 * GB} B" in message


def test_one_keys_forged_memory_does_not_hide_a_real_loss() -> None:
    lost = _on(engine("a") | engine("b"), _empty())
    assert [s for s, _ in _no_segments(lost)] == ["critical"]
    ((severity, message),) = _no_segments(lost | _liar(pool(total=10 * GB)))
    assert severity == "warning"
    assert message.startswith("engines a, b read no store segment") and "engines x read" in message


def test_a_stopped_engines_old_reading_does_not_soften_a_real_loss() -> None:
    """An engine silent past ``STALE_AFTER_MS`` before the pool's newest reading: its last
    reading (memory, before the store went) is not a disagreement."""
    lost = _on(engine("a") | engine("b"), _empty())
    old = _liar(pool(total=10 * GB), NOW_MS - 300 - STALE_AFTER_MS - 1)
    assert [s for s, _ in _no_segments(lost | old)] == ["critical"]
