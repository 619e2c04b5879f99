"""When a transfer is stuck, and which pools' stores have stalled.

A transfer is stuck once it has been in flight ``STUCK_MULTIPLE`` times what its bytes take at
the agent's recent rate of that kind, and never before ``STUCK_FLOOR_MS`` (``stuck_limit``).
A pool whose saves are stuck has a store (or a transport) that stopped answering: a save does
not wait on a lease. Its loads past the lease TTL are then that stall's symptom, not a TTL
below the load time: the ``lease_ttl`` rule leaves them to ``stuck_transfer``, which names the
store (helper 77: a SIGSTOPped ``mooncake_client`` first read "raise default_kv_lease_ttl").
So does every load of a pool whose agents report their store stalled (an open
``store_stalled`` window, ``EngineState.store_pauses``: a transfer stuck while nothing of its
process ended well): a frozen store whose engines were only loading, no save in flight, read
"raise default_kv_lease_ttl" too.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool_agent.protocol import (
    EngineState,
    PoolStats,
    Transfer,
    TransferStats,
    paused_ms,
)
from kvpool_agent.protocol import stuck_after_ms as _stuck_after_ms
from kvpool_agent.vocabulary import HINTS
from kvpool_console._transport import failures_text, transport_failures, transport_hint
from kvpool_console.alerts.alert import Alert, fmt_ms, make_alert
from kvpool_console.alerts.settings import STUCK_FLOOR_MS, STUCK_MULTIPLE

__all__ = ["outlived", "shortest_lease_ttl", "stalled_pools", "stuck_alerts", "stuck_limit"]


def stuck_limit(t: Transfer, tr: TransferStats, stuck_after_ms: float | None) -> tuple[float, str]:
    """How long ``t`` may be in flight (ms) before it is stuck, and why that long: the
    ``--stuck-after-ms`` threshold, else the wire contract's rule
    (``protocol.stuck_after_ms``, which agents open their ``store_stalled`` windows by)."""
    if stuck_after_ms is not None:
        return stuck_after_ms, "threshold"
    limit = _stuck_after_ms(t.kind, t.bytes, tr.load_bytes_per_s, tr.save_bytes_per_s)
    rate = tr.load_bytes_per_s if t.kind == "load" else tr.save_bytes_per_s
    if rate <= 0 or t.bytes <= 0:
        return limit, "floor; no recent transfer rate"
    why = f"{fmt_ms(t.bytes / rate * 1e3)} expected at {rate / 1e6:.1f} MB/s"
    if limit > STUCK_FLOOR_MS:
        return limit, f"{STUCK_MULTIPLE:g}x the {why}"
    return limit, f"floor; {why}"


def stalled_pools(states: Mapping[str, EngineState], last_seen_ms: Mapping[str, float],
                  now_ms: float, stuck_after_ms: float | None) -> frozenset[str]:
    """Pools (``Source.master``) where some agent that still reports has a save stuck
    (``stuck_limit``, its process's stopped time left out): their stores stopped answering.

    Also pools where such an agent reports its store stalled (an open ``store_stalled``
    window, ``EngineState.store_pauses``: one of its loads or saves got stuck by the same rule
    and nothing answered since). Only agents heard within their last ``STUCK_FLOOR_MS``: a
    silent agent's in-flight list is as old as its last report (its engine is ``stale``, not
    its pool)."""
    out: set[str] = set()
    for aid, s in states.items():
        master = s.source.master
        if not master or master in out:
            continue
        if now_ms - last_seen_ms.get(aid, s.ts_ms) > STUCK_FLOOR_MS:
            continue
        if any(w.kind == "store_stalled" and w.end_ms is None for w in s.store_pauses):
            out.add(master)
            continue
        stopped = [w for w in s.pauses if w.kind == "process_stalled"]
        for t in s.in_flight:
            if t.kind != "save":
                continue
            age = now_ms - t.started_ms - paused_ms(stopped, t.started_ms, now_ms)
            if age > STUCK_FLOOR_MS and age > stuck_limit(t, s.transfers, stuck_after_ms)[0]:
                out.add(master)
                break
    return frozenset(out)


def shortest_lease_ttl(group: list[EngineState]) -> int:
    """The shortest lease TTL the engine's agents report (ms; 0: unknown)."""
    return min((s.pool.lease_ttl_ms for s in group
                if s.pool is not None and s.pool.lease_ttl_ms > 0), default=0)


def outlived(t: Transfer, s: EngineState, as_of_ms: float, ttl: int) -> bool:
    """A load in flight longer than the lease TTL on a healthy pool, as of ``as_of_ms`` (the
    hub's receipt of the agent's newest report that still lists it): its lease ran out before
    it ended (it will fail LEASE_EXPIRED and be recomputed). Not the console's clock: an
    engine that stopped reporting (stopped, frozen) cannot say its load still runs, and the
    pause model names that. A pool failing its health check is the cause instead
    (``pool_unhealthy``)."""
    if t.kind != "load" or ttl <= 0 or as_of_ms - t.started_ms < ttl:
        return False
    # Time in the agent's own pause windows (its process stopped, the pool's health check
    # failing, its store stalled or without segments) is the pause's: it reports them with
    # the load (CI saw a load in flight 5.1 s through a 5 s SIGSTOP of its engine named as TTL
    # advice in the first report after it; a frozen mooncake_client's loads read "raise
    # default_kv_lease_ttl" until a save was stuck too).
    waited = as_of_ms - t.started_ms - paused_ms([*s.pauses, *s.store_pauses], t.started_ms,
                                                 as_of_ms)
    return waited >= ttl and not (s.pool is not None and s.pool.healthy is False)


def stuck_alerts(engine_id: str, group: list[EngineState], now_ms: float,
                 stuck_after_ms: float | None, stalled: frozenset[str]) -> list[Alert]:
    """``stuck_transfer`` (critical) for the engine's oldest transfer past its ``stuck_limit``,
    naming its likely owner: the transport (failed transfers counted), the master (health
    check failing), else the store process or the segment owners. A load past the lease TTL
    is the ``lease_ttl`` rule's, but on a pool in ``stalled`` (``stalled_pools``)."""
    stuck: list[tuple[float, Transfer, EngineState, float, str]] = []
    ttl = shortest_lease_ttl(group)
    for s in group:
        for t in s.in_flight:
            if s.source.master not in stalled and outlived(t, s, now_ms, ttl):
                continue  # the lease_ttl alert names it (issue 38: the cause, not a symptom)
            # Time its process was stopped is no transfer's: a stopped engine is ``stale``.
            age = now_ms - t.started_ms - paused_ms(
                [w for w in s.pauses if w.kind == "process_stalled"], t.started_ms, now_ms)
            # The limit is never below the floor: most transfers are skipped without it.
            if age > STUCK_FLOOR_MS or stuck_after_ms is not None:
                limit, why = stuck_limit(t, s.transfers, stuck_after_ms)
                if age > limit:
                    stuck.append((age, t, s, limit, why))
    if not stuck:
        return []
    age, t, s, limit, why = max(stuck, key=lambda x: x[0])
    reqs = {(x[1].req_id, x[1].kind) for x in stuck}
    more = f"; {len(reqs) - 1} more stuck" if len(reqs) > 1 else ""
    layers = (f", layer {t.layers_done}/{t.layers_total}" if t.layers_total else "")
    pool: PoolStats | None = s.pool
    master = s.source.master or "the master"
    failed = transport_failures(group)
    if failed:
        owner = f"the transport (failed transfers: {failures_text(failed)})"
        hint = transport_hint(failed)
    elif pool is not None and pool.healthy is False:
        owner = f"master {master} (pool health check failing: {pool.health_detail or '?'})"
        hint = HINTS["RPC_FAIL"]
    else:
        segs = ", ".join(x.name for x in pool.segments) if pool is not None and pool.segments \
            else "the segments' hosts"
        owner = (f"the store process holding the segments ({segs}) or {master}"
                 if t.kind == "save" else
                 f"the segment owner(s) ({segs}) or the transfer engine of this worker")
        # Not triage: it looks at the engine's host, and the engine is not what waits here.
        hint = ("check that the store process (mooncake_client, or the engines contributing "
                "segments) on those hosts runs and is not stopped (state T: `kill -CONT` it), "
                "and the network to it")
    return [make_alert(
        "stuck_transfer", "critical", engine_id,
        f"{t.kind} of {t.req_id} on {s.source.agent_id} in flight {fmt_ms(age)} "
        f"(> {fmt_ms(limit)}: {why}; {t.blocks} blocks{layers}){more}; likely owner: "
        f"{owner}", hint, now_ms)]
