"""Which pool an agent's reading is of, and which of a pool's readings the fleet believes.

Every agent with a pool client reports the ``PoolStats`` it read from its pool's master (a
worker, a scheduler, the store agent beside the master: ``kvpool-agent store``), every 2 s
(``agent._POOL_INTERVAL_S``) in reports every 0.25 s. The hub checks a report's ranges and
clamps its time to its own, never its values: one agent key may report a pool healthy with
0 B of memory while every other engine reads 10 GB, and, reporting often, be the pool's newest
reading most of the time (issue 42). This module owns the rule both readers of the pool follow:

- the console's ``pool_no_segments`` (``kvpool_console.alerts.segments``):
  :func:`newest_readings` of the pool's worker agents; critical only when all read 0 B;
- the hub's ``kvpool_pool_*`` families (``kvpool_agent._metrics``), hence the Prometheus rules
  over them (``config/prometheus/kvpool-rules.yml``: ``KvpoolPoolNoSegments``...):
  :func:`trusted_reading`.

The rule:

1. **Readings.** Per pool (:func:`pool_name`) and engine id, the engine's newest reading among
   its agents of the roles asked; an engine counts once, however many agents or agent ids it
   reports (an engine-bound key reports one engine). Only fresh ones: received at most
   ``STALE_AFTER_MS`` (3 s) before the pool's newest reading was received, so a stopped
   engine's last reading neither outvotes nor softens the others. Time is the reader's
   receive time of each agent's last report (the hub's ``last_seen_ms``; the console has it
   from the hub's ``FleetUpdate``), never an agent's own ``ts_ms``: an agent's clock is its
   own, and a key stamping its reports ahead (the hub clamps them to its now) would otherwise
   be the newest reading always and leave out every honest engine whose clock runs over 3 s
   behind the hub's, its forged reading then the pool's value alone. "Newest" below is by
   receive time too.
2. **The store agent.** A reading the caller vouches for as a store agent's (the hub: an agent
   of ``process_role`` ``"store"`` whose key is neither bound to one engine nor claiming a
   pool bound to other keys, ``Fleet.members``; any key may claim the role, and an unvouched
   store agent counts as an engine does) is the pool's value when it is fresh and checked
   (``healthy`` not ``None``), the newest such if several. The console knows no keys: it
   vouches for none.
3. **Agreement.** Else the fresh readings that were checked (``healthy`` not ``None``; all of
   them when none was) agree when they carry one :func:`shape`: the health check's outcome,
   the bytes of mounted segments and the disk tier's capacity. These change only when a
   segment mounts or drops, the disk tier changes or the master's health does: every honest
   reading of one master carries the same shape but for one polling interval (2 s) after
   such a change. The newest agreeing reading is the pool's value; its moving figures (keys,
   bytes used, evictions, reads) are that reading's.
4. **Disagreement.** Readings of two shapes or more: the pool has no value (``None``). The
   hub then exports none of the pool's figures, only ``kvpool_pool_readings_agree 0``: one
   key's forged 0 B does not raise ``KvpoolPoolNoSegments``, and its forged memory does not
   hide a real loss behind a value (``KvpoolPoolReadingsDisagree`` warns instead, as the
   console's ``pool_no_segments`` warning names both sides).

A pool reported by one engine alone cannot be cross-checked: its one reading is the value.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from kvpool_agent.protocol import STALE_AFTER_MS, EngineState, PoolStats

__all__ = [
    "PoolReading",
    "Shape",
    "newest_readings",
    "pool_name",
    "shape",
    "trusted_reading",
]

Shape = tuple[bool | None, int, int]
"""``(healthy, total_bytes, disk_total_bytes)`` of a reading (:func:`shape`)."""


def pool_name(st: EngineState) -> str:
    """Which pool an agent reports: ``backend@master`` when its ``Source.master`` is known (the
    pool's ``master_server_address``: the same pool for every engine and for the store agent,
    also when the master is down and reports no segments), else ``backend:segment,...`` (sorted
    segment names) when its reading has segments, else ``backend:engine_id`` (the engine's
    own)."""
    p = st.pool
    backend = p.backend if p is not None else st.source.backend
    if st.source.master:
        return f"{backend}@{st.source.master}"
    if p is not None and p.segments:
        return f"{backend}:" + ",".join(sorted(s.name for s in p.segments))
    return f"{backend}:{st.source.engine_id}"


def shape(p: PoolStats) -> Shape:
    """What every honest reading of one master says alike (module docstring, rule 3): the
    health check's outcome (``None``: not checked yet), the mounted segments' capacity and the
    disk tier's (bytes)."""
    return (p.healthy, p.total_bytes, p.disk_total_bytes)


def _received_ms(st: EngineState, seen_ms: Mapping[str, float] | None) -> float:
    """When the reader received ``st``'s agent's last report: ``seen_ms[agent id]`` (the hub's
    ``last_seen_ms``), else (a reader without receive times, a test) its own ``ts_ms``."""
    if seen_ms is None:
        return st.ts_ms
    return seen_ms.get(st.source.agent_id, st.ts_ms)


def newest_readings(states: Iterable[EngineState], roles: Collection[str] = ("worker",),
                    seen_ms: Mapping[str, float] | None = None
                    ) -> dict[str, dict[str, EngineState]]:
    """Rule 1: pool name -> engine id -> that engine's newest state carrying ``PoolStats``
    among its agents of ``process_role`` in ``roles``, only those received at most
    ``STALE_AFTER_MS`` before the pool's newest. ``seen_ms``: agent id -> receive time of its
    last report (epoch ms, :func:`_received_ms`); pass it wherever the reader has it."""
    def at(st: EngineState) -> float:
        return _received_ms(st, seen_ms)

    newest: dict[str, dict[str, EngineState]] = {}
    for s in states:
        if s.pool is None or s.source.process_role not in roles:
            continue
        mine = newest.setdefault(pool_name(s), {})
        prev = mine.get(s.source.engine_id)
        if prev is None or at(s) > at(prev):
            mine[s.source.engine_id] = s
    out: dict[str, dict[str, EngineState]] = {}
    for name, by_engine in newest.items():
        latest = max(at(st) for st in by_engine.values())
        out[name] = {e: st for e, st in by_engine.items() if latest - at(st) <= STALE_AFTER_MS}
    return out


@dataclass(frozen=True)
class PoolReading:
    """A pool's value under the rule (module docstring).

    Attributes:
        name: the pool (:func:`pool_name`).
        backend: its backend, as its readings say (the newest's).
        stats: the reading exported as the pool's, ``None`` when the readings disagree.
        by: ``"store"`` (rule 2), ``"agreed"`` (rule 3; one engine alone too) or
            ``"disagree"`` (rule 4).
        shapes: each fresh engine's :func:`shape` (engine id -> shape), the readings weighed.
    """

    name: str
    backend: str
    stats: PoolStats | None
    by: Literal["store", "agreed", "disagree"]
    shapes: dict[str, Shape]


def trusted_reading(name: str, readings: dict[str, EngineState],
                    store: Callable[[EngineState], bool] = lambda st: False,
                    seen_ms: Mapping[str, float] | None = None) -> PoolReading:
    """The pool's value from its fresh readings (:func:`newest_readings`: engine id -> state):
    rule 2 for the newest reading ``store`` vouches for, else rules 3 and 4. Newest is by
    receive time (``seen_ms``, as for :func:`newest_readings`)."""
    assert readings, "a pool has at least one reading"

    def at(st: EngineState) -> float:
        return _received_ms(st, seen_ms)

    newest = max(readings.values(), key=at)
    assert newest.pool is not None
    backend = newest.pool.backend
    shapes = {e: shape(st.pool) for e, st in readings.items() if st.pool is not None}
    stores = [st for st in readings.values()
              if store(st) and st.pool is not None and st.pool.healthy is not None]
    if stores:
        return PoolReading(name, backend, max(stores, key=at).pool, "store", shapes)
    checked = {e: st for e, st in readings.items()
               if st.pool is not None and st.pool.healthy is not None} or readings
    if len({shapes[e] for e in checked}) > 1:
        return PoolReading(name, backend, None, "disagree", shapes)
    return PoolReading(name, backend, max(checked.values(), key=at).pool, "agreed", shapes)
