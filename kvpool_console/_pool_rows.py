"""The console's pool rows (``PoolRow``): each pool once, however many agents report it, from the
newest reading, with its pins by layout and the losses of the agent that read its master longest;
``reported_by`` counts the agents reporting it now, ``silent_by`` those silent past the stale
threshold (their reading is as of their last report). ``kvpool_console.model`` builds the rest of
the view."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from kvpool_agent.protocol import EngineState, PoolStats
from kvpool_console.alerts import pool_name
from kvpool_console.rows import PoolRow

__all__ = ["pool_rows"]


def pool_rows(states: Iterable[EngineState], silent: Collection[str]) -> list[PoolRow]:
    """A row per pool from ``states``; ``silent``: agent ids silent past the stale threshold
    (counted in ``PoolRow.silent_by``, not ``reported_by``)."""
    newest: dict[str, tuple[EngineState, int]] = {}
    quiet: dict[str, int] = {}
    # Pool -> layout digest -> (pinned bytes, pins): the agents of one layout hold its pins.
    pinned: dict[str, dict[str, tuple[int, int]]] = {}
    # Pool -> the reading with the most lost: each agent counts the losses it saw since it
    # started, so the one reading the master longest has them all.
    lost: dict[str, PoolStats] = {}
    for st in states:
        if st.pool is None:
            continue
        name = pool_name(st)
        if st.pool.lost_bytes or st.pool.lost_keys:
            prev_lost = lost.get(name)
            if prev_lost is None or (st.pool.lost_bytes, st.pool.lost_keys) > (
                    prev_lost.lost_bytes, prev_lost.lost_keys):
                lost[name] = st.pool
        if st.pool.pinned_bytes or st.pool.pins:
            layouts = pinned.setdefault(name, {})
            digest = st.source.layout_digest
            layouts[digest] = max(layouts.get(digest, (0, 0)),
                                  (st.pool.pinned_bytes, st.pool.pins))
        prev = newest.get(name)
        gone = st.source.agent_id in silent
        quiet[name] = quiet.get(name, 0) + gone
        n = (prev[1] if prev else 0) + (not gone)
        newest[name] = (st, n) if prev is None or st.ts_ms > prev[0].ts_ms else (prev[0], n)
    out = []
    for name, (st, n) in sorted(newest.items()):
        p = st.pool
        assert p is not None
        lp = lost.get(name)
        out.append(PoolRow(
            name=name, backend=p.backend, keys=p.keys, used_bytes=p.used_bytes,
            total_bytes=p.total_bytes, evicted_keys=p.evicted_keys,
            evicted_bytes=p.evicted_bytes, high_watermark=p.high_watermark,
            lease_ttl_ms=p.lease_ttl_ms, healthy=p.healthy, health_detail=p.health_detail,
            segments=[(s.name, s.used_bytes, s.total_bytes) for s in p.segments],
            reported_by=n, silent_by=quiet[name], masters=list(p.masters),
            pinned_bytes=sum(b for b, _ in pinned.get(name, {}).values()),
            pins=sum(k for _, k in pinned.get(name, {}).values()),
            disk_keys=p.disk_keys, disk_used_bytes=p.disk_used_bytes,
            disk_total_bytes=p.disk_total_bytes, memory_hits=p.memory_hits,
            disk_hits=p.disk_hits, memory_hit_bytes=p.memory_hit_bytes,
            disk_hit_bytes=p.disk_hit_bytes, lost_keys=lp.lost_keys if lp else 0,
            lost_bytes=lp.lost_bytes if lp else 0, losses=list(lp.losses) if lp else []))
    return out
