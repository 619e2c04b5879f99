"""``pool_no_segments`` (critical, one per pool): a Mooncake master that passes its health check
and holds no memory.

A master's memory is the segments its clients mount (``global_segment_size`` > 0: a
``mooncake_client`` store process, or engines contributing their own). When the store process
stops or dies the master drops its segment ``client_ttl`` after its last ping
(``mooncake_master --client_ttl``, 10 s by default; ``mooncake_client`` does not unmount on
SIGTERM or SIGINT): the master stays healthy, its ``/metrics`` say
``master_total_capacity_bytes 0`` and every put fails at once with NO_AVAILABLE_HANDLE, which
``backend_errors`` would otherwise explain as a full pool.

Only worker agents' readings count, and only read ones (``PoolStats.healthy`` is ``None``
before the first check and ``True`` only once ``/metrics`` was parsed and ``/health`` passed):
a worker's agent starts after its store client's setup, which mounts the worker's own segment
when it contributes one, so 0 bytes there is a pool without memory. A store agent
(``kvpool-agent store`` beside the master) of a pool whose memory comes from engines reads 0
until the first engine starts, and no save waits on it then. A failing health check is
``pool_unhealthy``'s, an HA pool without a serving leader ``no_leader``'s.

Agreement: an agent key reports its own engine's readings, so one key's forged ``PoolStats``
(healthy, 0 B) must not raise a critical alert for a pool other engines read holding memory,
nor its forged memory hide a real loss (the hub clamps a report's time to its own, but a key
reporting often enough is the newest reading most of the time). Each engine's newest worker
reading counts, when the hub received it at most ``STALE_AFTER_MS`` before the pool's newest
(``last_seen_ms``, the hub's receive times, not the agents' clocks: a key stamping ahead must
not leave out engines whose clocks run behind; a stopped engine's last reading does not
count): ``kvpool_agent.pool_readings.newest_readings``, the rule's one
owner, which the hub's ``kvpool_pool_*`` gauges (so ``KvpoolPoolNoSegments``) follow too; the
alert is critical when every such reading is 0 B, and a
warning naming both sides when some engines read memory (a store lost between two readings,
for a heartbeat, or a stale or forged reading)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvpool_agent.pool_readings import newest_readings
from kvpool_agent.protocol import STALE_AFTER_MS, EngineState, PoolStats
from kvpool_console.alerts.alert import Alert, engines_text, make_alert, pool_name

__all__ = ["NO_SEGMENTS_HINT", "no_segments_hint", "segment_alerts", "without_segments"]

NO_SEGMENTS_HINT = (
    "start the mooncake_client store process, or resume a stopped one (SIGCONT), with "
    "--global_segment_size above 0 and --master_server_address this pool's master; engines "
    "give memory only with global_segment_size above 0 in their Mooncake config")
"""The fix ``pool_no_segments`` gives, and ``backend_errors`` with NO_AVAILABLE_HANDLE on such a
pool."""


def without_segments(p: PoolStats | None) -> bool:
    """``p`` is a Mooncake master read and healthy (``/metrics`` parsed, ``/health`` passed)
    with 0 bytes of mounted segments; an HA pool's only while a master serves."""
    return (p is not None and p.backend == "mooncake" and p.healthy is True
            and p.total_bytes == 0 and (not p.masters or any(m.serving for m in p.masters)))


def _newest_worker(states: Iterable[EngineState]) -> EngineState | None:
    """The newest worker agent's state that carries pool stats."""
    return max((s for s in states if s.source.process_role == "worker" and s.pool is not None),
               key=lambda s: s.ts_ms, default=None)


def no_segments_hint(group: Iterable[EngineState], errors: Mapping[str, int]) -> str:
    """The ``backend_errors`` hint of an engine whose errors include NO_AVAILABLE_HANDLE while
    its newest worker reading shows a pool without segments: pointing at ``pool_no_segments``
    (the pool is empty, not full); ``""`` otherwise."""
    if "NO_AVAILABLE_HANDLE" not in errors:
        return ""
    newest = _newest_worker(group)
    if newest is None or not without_segments(newest.pool):
        return ""
    return "the pool has no store segment mounted (see pool_no_segments): " + NO_SEGMENTS_HINT


def _read(p: PoolStats | None) -> bool:
    """``p`` is a reading of a Mooncake master that passed its checks (``without_segments``
    but for the bytes)."""
    return (p is not None and p.backend == "mooncake" and p.healthy is True
            and (not p.masters or any(m.serving for m in p.masters)))


def segment_alerts(states: Mapping[str, EngineState], now_ms: float,
                   last_seen_ms: Mapping[str, float] | None = None) -> list[Alert]:
    """``pool_no_segments`` for each pool (subject its name, as the other pool rules) some of
    whose engines' newest worker readings (module docstring: agreement) are
    :func:`without_segments` and none of whose workers reads it unhealthy: critical when no
    engine's reading holds memory, else a warning naming the engines on each side; the message
    names its master and the engines whose workers report it. ``last_seen_ms``: agent id -> the
    hub's receive time of its last report (``FleetUpdate.last_seen_ms``), which judges
    freshness; an agent missing there is judged by its own ``ts_ms``."""
    engines: dict[str, set[str]] = {}
    unhealthy: set[str] = set()
    for s in states.values():
        p = s.pool
        if s.source.process_role != "worker" or p is None:
            continue
        name = pool_name(s)
        engines.setdefault(name, set()).add(s.source.engine_id)
        if p.healthy is False:
            unhealthy.add(name)
    out: list[Alert] = []
    # pool -> engine -> its newest worker reading, fresh ones only
    for name, by_engine in sorted(newest_readings(states.values(), ("worker",),
                                                          last_seen_ms).items()):
        fresh = {e: st for e, st in by_engine.items() if _read(st.pool)}
        zero = {e: st for e, st in fresh.items() if without_segments(st.pool)}
        if name in unhealthy or not zero:
            continue
        held = {e: st.pool.total_bytes for e, st in fresh.items()  # type: ignore[union-attr]
                if e not in zero}
        st = max(zero.values(), key=lambda s: (last_seen_ms or {}).get(s.source.agent_id,
                                                                         s.ts_ms))
        master = f"master {st.source.master}" if st.source.master else "the master"
        if held:
            out.append(make_alert(
                "pool_no_segments", "warning", name,
                f"engines {engines_text(zero)} read no store segment on {master} (pool "
                f"{name}: 0 B of memory) while engines {engines_text(held)} read "
                f"{max(held.values())} B (newest readings within "
                f"{STALE_AFTER_MS / 1e3:.0f} s of each other): the store lost between two "
                "readings, or a reading stale or forged (an agent key reports its own "
                "engine's); critical once every engine reads 0 B", NO_SEGMENTS_HINT, now_ms))
            continue
        out.append(make_alert(
            "pool_no_segments", "critical", name,
            f"no store segment is mounted on {master} (pool {name}: 0 B of memory; "
            f"engines {engines_text(engines[name])}): the store process holding the pool's "
            "memory is gone or stopped (the master drops a segment client_ttl after its "
            "client's last ping, 10 s by default); every save fails at once with "
            "NO_AVAILABLE_HANDLE and lookups find nothing", NO_SEGMENTS_HINT, now_ms))
    return out
