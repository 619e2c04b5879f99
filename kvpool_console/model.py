"""The console's view model: fleet rows, totals and staleness from what ``FleetClient`` holds.

Input is the merged fleet state (agent id -> latest ``EngineState``, agent id -> hub receive
time in epoch ms). Agents are grouped by ``Source.engine_id``: the scheduler agent of an engine
carries its lookups (hit rate, matched tokens), its worker agents carry loads/saves. The same
rows feed the TUI tables and ``kvpool-console status --json``; nothing here touches Textual, so
it is tested with plain structs and benchmarked on its own.

Units: ``*_ms`` instants are wall-clock epoch milliseconds, ``age_ms`` spans in milliseconds,
bytes are bytes, tokens are tokens, rates are fractions in [0, 1].

What a frame shows (``EngineRow``, ``AgentRow``, ``PoolRow``, ``Totals``, ``FleetView``) is
``kvpool_console.rows``; this module builds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal

import msgspec

from kvpool_agent.misses import split_not_in_pool
from kvpool_agent.protocol import (
    CommandReply,
    EngineState,
    FlushResult,
    PolicySteering,
    ReuseView,
    Source,
    StartFailure,
)
from kvpool_console._miss_fixes import miss_fix
from kvpool_console._pool_rows import pool_rows
from kvpool_console._transport import saves_in_flight
from kvpool_console.alerts import DOWN_AFTER_MS, SEVERITY_RANK, STALE_AFTER_MS, Alert
from kvpool_console.alerts.adapters import engine_adapters
from kvpool_console.alerts.policy import engine_policy, policy_text
from kvpool_console.alerts.silence import silence_verdict
from kvpool_console.rows import AgentRow, EngineRow, FleetView, PoolRow, Totals

__all__ = [
    "SORT_KEYS",
    "FleetModel",
    "build_view",
    "fmt_age",
    "fmt_bytes",
    "fmt_lease",
    "health_rows",
    "loss_text",
    "namespace_text",
    "select_rows",
    "sum_flush",
    "top_reason",
]


def top_reason(miss_tokens: Mapping[str, int]) -> str:
    """The miss reason holding the most tokens (ties: the first by name), ``""`` for none."""
    best = max(sorted(miss_tokens.items()), key=lambda kv: kv[1], default=("", 0))
    return best[0] if best[1] > 0 else ""


def _ranks(st: EngineState) -> str:
    s = st.source
    return f"dp{s.dp_rank}.tp{s.tp_rank}.pp{s.pp_rank}"


def _span(ranks: set[int]) -> str:
    """0-based ranks as ``0``, ``0-3`` (contiguous) or ``0,2``."""
    lo, hi = min(ranks), max(ranks)
    if len(ranks) == 1:
        return str(lo)
    return f"{lo}-{hi}" if len(ranks) == hi - lo + 1 else ",".join(map(str, sorted(ranks)))


def namespace_text(model: str, digest: str, layout: Mapping[str, str | int]) -> str:
    """An engine's key namespace in one line: ``model @digest chunk 512 block 16`` (keys are
    ``kvpool@<model>@<digest>@<ranks>@<chunk hash>``, the chunk hash salted per request with
    ``cache_salt`` and the LoRA name); ``""`` until a worker reported its layout."""
    if not digest:
        return ""
    text = f"{model} @{digest}"
    for k in ("chunk_size", "block_size"):
        if k in layout:
            text += f" {k.removesuffix('_size')} {layout[k]}"
    return text


def health_rows(replies: list[CommandReply]) -> list[tuple[str, str, bool, str, str]]:
    """One row per health check of each reply: ``(agent id, check, ok, latency ms text,
    detail)``, sorted by agent id. A failed reply that carries checks shows each check with the
    backend's error (and the reply's error, when any, as a row of its own); one without checks
    shows its error, or ``"agent sent no health result"``."""
    rows: list[tuple[str, str, bool, str, str]] = []
    for r in sorted(replies, key=lambda r: r.agent_id):
        checks = r.health.checks if r.health is not None else []
        for c in checks:
            detail = c.detail + (f" (code {c.code})" if c.code is not None else "")
            rows.append((r.agent_id, c.name, c.ok, f"{c.latency_ms:.1f}", detail))
        if r.error or not checks:
            rows.append((r.agent_id, "reply", False, "",
                         r.error or "agent sent no health result"))
    return rows


def _in_flight(states: Iterable[EngineState], kind: str) -> int:
    return len({t.req_id for st in states for t in st.in_flight if t.kind == kind})


def _agent_row(st: EngineState, seen: float, now_ms: float, stale_after_ms: float) -> AgentRow:
    leases = [t.lease_expires_ms for t in st.in_flight if t.lease_expires_ms is not None]
    tr = st.transfers
    return AgentRow(
        agent_id=st.source.agent_id, process_role=st.source.process_role, ranks=_ranks(st),
        pid=st.source.pid, host=st.source.host, hit_rate=st.lookup.hit_rate,
        prompt_tokens=st.lookup.prompt_tokens, loaded_tokens=st.lookup.loaded_tokens,
        loads_in_flight=_in_flight([st], "load"), saves_in_flight=_in_flight([st], "save"),
        loads_failed=tr.loads_failed,
        load_bytes_per_s=tr.load_bytes_per_s, save_bytes_per_s=tr.save_bytes_per_s,
        next_lease_expiry_ms=min(leases) if leases else None, age_ms=now_ms - seen,
        stale=now_ms - seen > stale_after_ms, cpu_percent=st.process.cpu_percent,
        rss_bytes=st.process.rss_bytes, agent_events_dropped=st.process.dropped,
        layout_digest=st.source.layout_digest,
    )


def _agent_order(s: EngineState) -> tuple[bool, int, int, int, str]:
    """Scheduler first, then workers by rank, so the expanded view reads top-down."""
    src = s.source
    return src.process_role != "scheduler", src.dp_rank, src.pp_rank, src.tp_rank, src.agent_id


def _engine_totals(engine_id: str, group: list[EngineState]) -> EngineRow:
    """The engine's row from its agents' reports, with the time-dependent fields
    (``last_report_ms``, ``age_ms``, ``stale``, ``down``) and ``agents`` left empty; ``group``
    is in :func:`_agent_order`. One pass over the agents: at fleet scale (2,304 agents) this
    runs for every engine whose reports changed, every refresh."""
    head = group[0].source
    prompt = local = loaded = lookups = lookup_errors = recomputed = 0
    loads_failed = loads_finished = saves_failed = failed_after_hit = saves_skipped = 0
    load_bps = save_bps = weighted_1m = 0.0
    max_load = group[0].transfers.max_load_ms
    pool_st: EngineState | None = None
    lease: float | None = None
    load_reqs: set[str] = set()
    save_reqs: set[str] = set()
    dp: set[int] = set()
    tp: set[int] = set()
    pp: set[int] = set()
    workers = 0
    by_group: dict[str, dict[str, int]] = {"loaded": {}, "saved": {}}
    digests: set[str] = set()
    described: Source | None = None
    failure: StartFailure | None = None
    misses: dict[str, int] = {}
    versions: dict[str, set[str]] = {}
    for s in group:
        lk, tr, src = s.lookup, s.transfers, s.source
        for pkg, v in src.versions.items():
            versions.setdefault(pkg, set()).add(v)
        if lk.prompt_tokens:
            prompt += lk.prompt_tokens
            # hit_rate_1m is per agent; weight by since-start prompt tokens (only schedulers
            # look up).
            weighted_1m += lk.hit_rate_1m * lk.prompt_tokens
        local += lk.local_tokens
        loaded += lk.loaded_tokens
        lookups += lk.lookups
        lookup_errors += lk.lookup_errors
        recomputed += max(0, lk.prompt_tokens - lk.local_tokens - lk.loaded_tokens)
        for reason, n in lk.miss_tokens.items():
            misses[reason] = misses.get(reason, 0) + n
        loads_failed += tr.loads_failed
        loads_finished += tr.loads_finished
        saves_failed += tr.saves_failed
        saves_skipped += tr.saves_skipped
        failed_after_hit += tr.failed_after_hit
        load_bps += tr.load_bytes_per_s
        save_bps += tr.save_bytes_per_s
        max_load = max(max_load, tr.max_load_ms)
        for what, per in (("loaded", tr.loaded_bytes_by_group),
                          ("saved", tr.saved_bytes_by_group)):
            for g, n in per.items():
                by_group[what][g] = by_group[what].get(g, 0) + n
        if s.pool is not None and (pool_st is None or s.ts_ms > pool_st.ts_ms):
            pool_st = s
        for t in s.in_flight:
            (load_reqs if t.kind == "load" else save_reqs).add(t.req_id)
            if t.lease_expires_ms is not None and (lease is None or t.lease_expires_ms < lease):
                lease = t.lease_expires_ms
        if src.process_role == "worker":
            workers += 1
            dp.add(src.dp_rank)
            tp.add(src.tp_rank)
            pp.add(src.pp_rank)
            if src.layout_digest:
                digests.add(src.layout_digest)
                if described is None:
                    described = src
        f = s.start_failure
        if f is not None and (failure is None or f.ts_ms > failure.ts_ms):
            failure = f
    pool = pool_st.pool if pool_st is not None else None
    steering = engine_policy(group)
    # A store agent reports with a placeholder engine identity (kvpool_agent._store_agent).
    store = all(st.source.process_role == "store" for st in group)
    return EngineRow(
        engine_id=engine_id, role="store" if store else head.instance_role,
        kv_role="-" if store else head.kv_role,
        ranks=f"dp{_span(dp)} tp{_span(tp)} pp{_span(pp)}" if workers else "-",
        backend=head.backend, model=head.model, workers=workers,
        hit_rate=loaded / prompt if prompt else 0.0,
        hit_rate_1m=weighted_1m / prompt if prompt else 0.0,
        prompt_tokens=prompt, loaded_tokens=loaded, lookups=lookups,
        lookup_errors=lookup_errors, loads_in_flight=len(load_reqs),
        saves_in_flight=len(save_reqs), loads_failed=loads_failed,
        loads_finished=loads_finished, saves_failed=saves_failed,
        failed_after_hit=failed_after_hit, load_bytes_per_s=load_bps,
        save_bytes_per_s=save_bps,
        segment_used_bytes=pool.used_bytes if pool else 0,
        segment_total_bytes=pool.total_bytes if pool else 0,
        high_watermark=pool.high_watermark if pool else 0.0,
        lease_ttl_ms=pool.lease_ttl_ms if pool else 0,
        max_load_ms=max_load, next_lease_expiry_ms=lease,
        last_report_ms=0.0, age_ms=0.0, stale=False, down=False,
        layout_digest=",".join(sorted(digests)),
        layout=dict(described.layout) if described else {},
        local_tokens=local, local_hit_rate=local / prompt if prompt else 0.0,
        recomputed_tokens=recomputed,
        failed=f"{failure.name}: {failure.message}" if failure else "",
        failed_hint=failure.hint if failure else "",
        namespace=namespace_text(described.model, described.layout_digest,
                                 described.layout) if described else "",
        role_source=head.role_source,
        agent_ids=[s.source.agent_id for s in group],
        miss_tokens=misses, top_miss=top_reason(misses), adapters=engine_adapters(group),
        pool_evicted_keys=pool.evicted_keys if pool else 0, saves_skipped=saves_skipped,
        versions={p: "/".join(sorted(vs)) for p, vs in sorted(versions.items())},
        saves=saves_in_flight(group, max(s.ts_ms for s in group)),
        **_kv_facts(described.layout if described else {}),
        loaded_bytes_by_group=dict(sorted(by_group["loaded"].items())),
        saved_bytes_by_group=dict(sorted(by_group["saved"].items())),
        **_policy_facts(steering),
    )


def _policy_facts(p: PolicySteering | None) -> dict[str, Any]:
    """``EngineRow.policy*`` from an engine's ``PolicySteering`` (defaults without one)."""
    if p is None:
        return {}
    return {"policy": policy_text(p), "policy_value": _policy_value(p),
            "policy_in_charge": p.in_charge,
            "policy_service": p.service, "policy_silent_ms": p.silent_ms,
            "policy_records_sent": p.records_sent,
            "policy_records_dropped": p.records_dropped,
            "policy_removed_keys": p.service_removed_keys}


def _policy_value(p: PolicySteering) -> str:
    """``EngineRow.policy_value``: ``service``, or why the master steers, in the words of
    ``policy_text``'s parenthesis (``service silent 12.0 s``, ``records not connected``)."""
    if p.in_charge == "service":
        return "service"
    return ("service_silent" if p.silent_ms >= p.stale_ms or p.records_connected
            else "records_not_connected")


def _kv_facts(layout: Mapping[str, str | int]) -> dict[str, Any]:
    """``EngineRow.kv_groups`` and ``mla`` from a worker's layout facts
    (``_layout_digest.LayoutFacts``: ``groups``, ``|``-joined; ``attn_backend``, whose MLA
    backends vLLM names ``*MLA*``)."""
    groups = str(layout.get("groups") or "")
    return {
        "kv_groups": [g.strip() for g in groups.split("|")] if groups else
        ["full"] if layout else [],
        "mla": "MLA" in str(layout.get("attn_backend", "")),
    }


def _aged(totals: EngineRow, group: list[EngineState], last_seen_ms: Mapping[str, float],
          now_ms: float, stale_after_ms: float, down_after_ms: float,
          with_agents: bool) -> EngineRow:
    """``totals`` (from :func:`_engine_totals`, not modified) aged at ``now_ms``, with agent
    rows when ``with_agents``."""
    seen = [last_seen_ms.get(s.source.agent_id, s.ts_ms) for s in group]
    last = max(seen)
    age = now_ms - last
    return msgspec.structs.replace(
        totals, last_report_ms=last, age_ms=age, stale=age > stale_after_ms,
        down=age > down_after_ms,
        agents=[_agent_row(s, t, now_ms, stale_after_ms) for s, t in zip(group, seen,
                                                                         strict=True)]
        if with_agents else [])


def build_view(
    states: Mapping[str, EngineState],
    last_seen_ms: Mapping[str, float],
    now_ms: float,
    *,
    alerts: list[Alert] | None = None,
    stale_after_ms: float = STALE_AFTER_MS,
    down_after_ms: float = DOWN_AFTER_MS,
    agent_rows_for: Collection[str] | None = None,
    reuse: ReuseView | None = None,
) -> FleetView:
    """Group agents into engine rows, deduplicate pools and total the fleet.

    Args:
        states: agent id -> latest EngineState.
        last_seen_ms: agent id -> hub receive time (epoch ms); missing -> ``EngineState.ts_ms``.
        now_ms: the frame's wall clock (epoch ms); tests freeze it for stable snapshots.
        alerts: active alerts (``kvpool_console.alerts``); each engine row gets the worst
            severity among alerts whose subject is its engine id, and a silent one its
            ``stale`` alert's verdict (``EngineRow.silence``).
        stale_after_ms, down_after_ms: silence thresholds for ``stale`` and ``down``.
        agent_rows_for: engine ids whose rows carry ``agents`` (one ``AgentRow`` per agent);
            ``None``: every engine. The console asks only for the engines it shows expanded:
            2,304 agent rows a refresh cost more than the engine rows they would feed.
        reuse: the hub's reuse figures (``FleetClient.reuse``): each engine's ``not_in_pool``
            miss tokens are split as its ``not_in_pool`` says (``evicted``, ``other_digest``,
            ``never_saved``, ``first_use``; ``kvpool_agent._misses.split_not_in_pool``).

    Returns:
        A FleetView with engines sorted by engine id.
    """
    return _view(states, last_seen_ms, now_ms, alerts=alerts, stale_after_ms=stale_after_ms,
                 down_after_ms=down_after_ms, agent_rows_for=agent_rows_for, cache={},
                 reuse=reuse)[0]


_TotalsCache = dict[str, tuple[list[EngineState], EngineRow]]
"""engine id -> (its agents' states in ``_agent_order``, ``_engine_totals`` of them)."""


def _view(states: Mapping[str, EngineState], last_seen_ms: Mapping[str, float], now_ms: float,
          *, alerts: list[Alert] | None, stale_after_ms: float, down_after_ms: float,
          agent_rows_for: Collection[str] | None,
          cache: _TotalsCache, reuse: ReuseView | None = None
          ) -> tuple[FleetView, _TotalsCache]:
    """:func:`build_view` and the totals of this call's engines: an engine whose agents'
    states are the same objects as in ``cache`` (the previous call's; no new report:
    ``FleetClient`` replaces a state per report) reuses its totals. ``cache`` is not
    modified (the UI thread may read it while the feed thread builds the next view)."""
    groups: dict[str, list[EngineState]] = {}
    for st in states.values():
        groups.setdefault(st.source.engine_id, []).append(st)
    worst: dict[str, str] = {}
    silent: dict[str, str] = {}  # engine id -> its stale alert's verdict (alerts.silence)
    for a in alerts or []:
        if a.rule == "stale":
            silent[a.subject] = a.verdict
        cur = worst.get(a.subject)
        if a.severity != "info" and (cur is None or SEVERITY_RANK[a.severity] > SEVERITY_RANK[cur]):
            worst[a.subject] = a.severity
    fresh: _TotalsCache = {}
    rows = []
    for eid in sorted(groups):
        group = groups[eid]
        hit = cache.get(eid)
        if (hit is not None and len(hit[0]) == len(group)
                and {id(s) for s in hit[0]} == {id(s) for s in group}):
            group, totals = hit
        else:
            group.sort(key=_agent_order)
            totals = _engine_totals(eid, group)
        fresh[eid] = (group, totals)
        row = _aged(totals, group, last_seen_ms, now_ms, stale_after_ms, down_after_ms,
                    agent_rows_for is None or eid in agent_rows_for)
        row.severity = worst.get(eid)
        # The alert's verdict (it could look at the process); else the thresholds' alone.
        row.silence = silent.get(eid) or silence_verdict(
            row.age_ms, None, stale_after_ms=stale_after_ms, down_after_ms=down_after_ms) or ""
        # Split after the cache: the hub's split changes without a new report of the engine.
        split = reuse.not_in_pool.get(eid) if reuse is not None else None
        if split:
            row.miss_tokens = split_not_in_pool(row.miss_tokens, split)
            row.top_miss = top_reason(row.miss_tokens)
        row.top_miss_fix = miss_fix(row.top_miss, evicted_keys=row.pool_evicted_keys,
                                    saves_skipped=row.saves_skipped,
                                    service_steers=row.policy_in_charge == "service",
                                    digest_known=bool(row.layout_digest))
        rows.append(row)
    pools = pool_rows(states.values(), {a for a, s in states.items() if now_ms - last_seen_ms.get(
        a, s.ts_ms) > stale_after_ms})
    prompt = sum(r.prompt_tokens for r in rows)
    loaded = sum(r.loaded_tokens for r in rows)
    local = sum(r.local_tokens for r in rows)
    fleet_misses: dict[str, int] = {}
    for r in rows:
        for reason, n in r.miss_tokens.items():
            fleet_misses[reason] = fleet_misses.get(reason, 0) + n
    stores = sum(r.role == "store" for r in rows)
    totals_row = Totals(
        engines=len(rows) - stores, stores=stores, agents=len(states),
        stale=sum(r.silence == "stale" for r in rows),
        down=sum(r.silence == "down" for r in rows),
        hung=sum(r.silence == "hung" for r in rows),
        gone=sum(r.silence == "gone" for r in rows), hit_rate=loaded / prompt if prompt else 0.0,
        prompt_tokens=prompt,
        loads_in_flight=sum(r.loads_in_flight for r in rows),
        saves_in_flight=sum(r.saves_in_flight for r in rows),
        loads_failed=sum(r.loads_failed for r in rows),
        load_bytes_per_s=sum(r.load_bytes_per_s for r in rows),
        save_bytes_per_s=sum(r.save_bytes_per_s for r in rows),
        segment_used_bytes=sum(p.used_bytes for p in pools),
        segment_total_bytes=sum(p.total_bytes for p in pools),
        local_tokens=local, loaded_tokens=loaded,
        recomputed_tokens=sum(r.recomputed_tokens for r in rows),
        local_hit_rate=local / prompt if prompt else 0.0,
        miss_tokens=fleet_misses, top_miss=top_reason(fleet_misses),
        top_miss_fix=miss_fix(top_reason(fleet_misses),
                              evicted_keys=sum(p.evicted_keys for p in pools),
                              saves_skipped=sum(r.saves_skipped for r in rows),
                              service_steers=any(r.policy_in_charge == "service"
                                                 for r in rows),
                              # The fleet's first seconds: an engine with unsplit misses
                              # whose digest no worker reported yet.
                              digest_known=all(r.layout_digest for r in rows
                                               if r.miss_tokens.get("not_in_pool"))),
    )
    return FleetView(now_ms=now_ms, engines=rows, pools=pools, totals=totals_row,
                     alerts=list(alerts or []), reuse=reuse), fresh


SortKey = Literal["engine", "role", "hit", "tokens", "loads", "errors", "usage", "lease", "age"]
SORT_KEYS: tuple[SortKey, ...] = (
    "engine", "role", "hit", "tokens", "loads", "errors", "usage", "lease", "age")
"""Sort keys the fleet table cycles through (``s``), in that order."""


def _sort_value(r: EngineRow, key: str) -> tuple[float | str, str]:
    v: float | str
    if key == "role":
        v = r.role
    elif key == "hit":
        v = r.hit_rate
    elif key == "tokens":
        v = r.prompt_tokens
    elif key == "loads":
        v = r.loads_in_flight + r.saves_in_flight
    elif key == "errors":
        v = r.loads_failed + r.lookup_errors
    elif key == "usage":
        v = r.segment_used_bytes / r.segment_total_bytes if r.segment_total_bytes else 0.0
    elif key == "lease":
        v = r.next_lease_expiry_ms if r.next_lease_expiry_ms is not None else float("inf")
    elif key == "age":
        v = r.age_ms
    else:
        v = r.engine_id
    return v, r.engine_id


def select_rows(rows: list[EngineRow], *, text: str = "", faults_only: bool = False,
                sort: str = "engine", reverse: bool = False) -> list[EngineRow]:
    """Filter and sort engine rows for display.

    ``text`` matches case-insensitively as a substring of engine id, role, kv_role, backend,
    model or any agent id; ``faults_only`` keeps stale/down rows and rows with an alert;
    ``sort`` is one of ``SORT_KEYS`` (ties broken by engine id).

    Raises:
        ValueError: ``sort`` is not one of ``SORT_KEYS``.
    """
    if sort not in SORT_KEYS:
        raise ValueError(f"sort: {sort!r} is not one of {', '.join(SORT_KEYS)}")
    needle = text.strip().lower()
    out = []
    for r in rows:
        if faults_only and not (r.stale or r.severity is not None):
            continue
        if needle:
            hay = " ".join([r.engine_id, r.role, r.kv_role, r.backend, r.model,
                            *r.agent_ids]).lower()
            if needle not in hay:
                continue
        out.append(r)
    out.sort(key=lambda r: _sort_value(r, sort), reverse=reverse)
    return out


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5K"``: binary units, 3 significant characters, for narrow columns."""
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" or abs(n) >= 100 else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def fmt_age(ms: float) -> str:
    """Report age: ``"0.4s"``, ``"12s"``, ``"3m"``, ``"2h"``."""
    s = max(ms, 0.0) / 1e3
    if s < 10:
        return f"{s:.1f}s"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.0f}h"


def loss_text(p: PoolRow, now_ms: float) -> str:
    """``pool P lost ~N keys (B) with segment S dropped 12s ago (...)``: the pool's latest
    segment loss, and its total when it lost more than once; ``""`` without one. The Pool
    tab and ``status`` print it."""
    if not p.losses:
        return ""
    last = p.losses[-1]
    total = (f"; ~{p.lost_keys:,} keys ({fmt_bytes(p.lost_bytes)}) lost in all"
             if len(p.losses) > 1 or p.lost_keys != last.keys else "")
    return (f"pool {p.name} lost ~{last.keys:,} keys ({fmt_bytes(last.bytes)}) with segment "
            f"{last.segment}, dropped by its master {fmt_age(now_ms - last.ts_ms)} ago (its "
            f"store stopped or gone past client_ttl; not evicted){total}")


def fmt_lease(expiry_ms: float | None, now_ms: float) -> str:
    """Time left before the earliest lease expires: ``"4.2s"``, ``"EXPIRED"`` or ``"-"``."""
    if expiry_ms is None:
        return "-"
    left = expiry_ms - now_ms
    return "EXPIRED" if left <= 0 else f"{left / 1e3:.1f}s"


def sum_flush(replies: list[CommandReply]) -> tuple[FlushResult | None, list[str]]:
    """Add up one flush command's ``replies`` (one per agent that ran it).

    Returns:
        ``(total, errors)``: ``total`` sums keys, bytes, removed and leased-skipped counts over
        the agents that returned a result (``dry_run`` only if every one was a dry run), or is
        None when none did; ``errors`` lists ``"agent_id: error"`` for every other reply.
    """
    results = [r.flush for r in replies if r.ok and r.flush is not None]
    errors = [f"{r.agent_id}: {r.error or 'no flush result'}" for r in replies
              if not r.ok or r.flush is None]
    if not results:
        return None, errors
    return FlushResult(dry_run=all(x.dry_run for x in results),
                       keys=sum(x.keys for x in results), bytes=sum(x.bytes for x in results),
                       removed_keys=sum(x.removed_keys for x in results),
                       skipped_leased=sum(x.skipped_leased for x in results)), errors


class FleetModel:
    """Current fleet state plus short histories for trends (sparklines).

    ``sample`` is called once per console refresh with the client's merged state; it rebuilds
    the view and appends each engine's ``hit_rate_1m`` and load+save throughput (bytes/s) to
    ring buffers of ``history`` samples, and the fleet hit rate to ``fleet_hit_history``.

    Args:
        history: samples kept per engine (at 1 s refresh: the last ``history`` seconds).
        stale_after_ms, down_after_ms: silence thresholds passed to :func:`build_view`.
    """

    def __init__(self, history: int = 60, *, stale_after_ms: float = STALE_AFTER_MS,
                 down_after_ms: float = DOWN_AFTER_MS) -> None:
        self.history = history
        self.stale_after_ms = stale_after_ms
        self.down_after_ms = down_after_ms
        self.hit_history: dict[str, deque[float]] = {}
        self.throughput_history: dict[str, deque[float]] = {}
        self.fleet_hit_history: deque[float] = deque(maxlen=history)
        self.view: FleetView | None = None
        self._totals: _TotalsCache = {}
        self._seen: Mapping[str, float] = {}

    def sample(self, states: Mapping[str, EngineState], last_seen_ms: Mapping[str, float],
               now_ms: float, alerts: list[Alert] | None = None, *,
               agent_rows_for: Collection[str] | None = None,
               reuse: ReuseView | None = None) -> FleetView:
        """Build the view for ``now_ms`` and extend the histories; returns the view.

        ``agent_rows_for`` and ``reuse`` are :func:`build_view`'s. An engine none of whose
        agents reported since the previous sample keeps its totals (only its age is new)."""
        view, self._totals = _view(states, last_seen_ms, now_ms, alerts=alerts,
                                   stale_after_ms=self.stale_after_ms,
                                   down_after_ms=self.down_after_ms,
                                   agent_rows_for=agent_rows_for, cache=self._totals,
                                   reuse=reuse)
        self._seen = last_seen_ms
        for r in view.engines:
            if r.stale:
                continue
            self.hit_history.setdefault(r.engine_id, deque(maxlen=self.history)).append(
                r.hit_rate_1m)
            self.throughput_history.setdefault(r.engine_id, deque(maxlen=self.history)).append(
                r.load_bytes_per_s + r.save_bytes_per_s)
        self.fleet_hit_history.append(view.totals.hit_rate)
        self.view = view
        return view

    def agent_rows(self, engine_id: str) -> list[AgentRow]:
        """The agent rows of ``engine_id`` as of the last :meth:`sample` (scheduler first, then
        workers by rank); empty for an engine it did not see."""
        hit = self._totals.get(engine_id)
        if hit is None or self.view is None:
            return []
        now = self.view.now_ms
        return [_agent_row(s, self._seen.get(s.source.agent_id, s.ts_ms), now,
                           self.stale_after_ms) for s in hit[0]]
