"""``kvpool-console status --json``'s document (``status_document``): the view's rows as JSON
values, with a silent engine's and agent's fields from its silence verdict, so an entry and the
totals tell one story (a GONE engine is ``silent``, not ``stale`` nor ``down``, and counted once,
under ``gone``)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvpool_console.alerts.silence import VERDICT_SEVERITY
from kvpool_console.rows import FleetView

__all__ = ["status_document"]


def _silence_fields(entry: dict[str, Any], verdict: str) -> None:
    """An engine's or agent's ``silent``, ``stale`` and ``down`` in ``status --json`` from its
    silence verdict (``""`` while it reports): ``silent`` once it is (any verdict), ``stale``
    and ``down`` only when that is the verdict, as ``totals`` counts them (a GONE engine is
    silent, not stale nor down; the rows' threshold flags are the screens')."""
    entry["silent"] = bool(verdict)
    entry["stale"] = verdict == "stale"
    entry["down"] = verdict == "down"


def status_document(view: FleetView) -> dict[str, Any]:
    """The ``status --json`` document: ``engines`` (one object per engine with at least
    engine_id, state (OK/WARNING/CRITICAL, or a silent engine's verdict HUNG/GONE/DOWN/STALE
    as its ``stale`` alert names it, or FAILED), silence (that verdict in lower case, ``""``
    while it reports), role, kv_role, backend, hit_rate,
    prompt_tokens, loaded_tokens, loads_in_flight, loads_failed, segment_used_bytes,
    segment_total_bytes, next_lease_expiry_ms, silent (no report past the stale threshold,
    whatever the verdict), stale and down (true only when that is its verdict, so ``totals``
    counts them: a GONE engine is ``silent``, neither ``stale`` nor ``down``), namespace,
    failed, local_tokens,
    local_hit_rate, recomputed_tokens, miss_tokens (by reason, not_in_pool split by the hub
    into evicted, other_digest, never_saved and first_use), top_miss, top_miss_fix (its fix
    for this engine), pool_evicted_keys, saves_skipped, versions, layout (its ``fingerprint``:
    the weights' identity), adapters (LoRA name -> content identity, ``lora:<hex>``) and, for
    an engine with ``admission: service``, who steers its saves (``policy``: ``service``, or
    why the master does, ``service_silent`` or ``records_not_connected``, or
    ``engine_silent`` once the engine is silent: who steers now is not known;
    ``policy_in_charge``: ``service`` or ``master`` as of its last report;
    ``policy_service``, ``policy_silent_ms``,
    ``policy_records_sent``, ``policy_records_dropped``, ``policy_removed_keys``; empty/0 for
    any other); plus its
    ``agents``, each with ``state`` (``""`` while it reports, else ``EngineRow.agent_state``:
    its engine's verdict, or STALE while the engine reports through others) and ``silent``,
    ``stale``, ``down`` from it as the engine's),
    ``alerts``, ``pools`` (each with ``lost_keys``, ``lost_bytes`` and ``losses``: what it
    lost with segments its master dropped, ``PoolRow``), ``totals`` (``hung``, ``gone``,
    ``down``, ``stale``: engines by verdict; ``silent`` their sum), ``hub_counters`` (the
    hub's own counters since it
    started: ``memory_sheds``, ``connection_sheds``, ``reports``...; ``{}`` from a hub that
    does not send them) and ``now_ms``."""
    doc: dict[str, Any] = msgspec.to_builtins(view)
    for engine, row in zip(doc["engines"], view.engines, strict=True):
        engine["state"] = row.state
        _silence_fields(engine, row.silence)
        for agent, a in zip(engine["agents"], row.agents, strict=True):
            agent["state"] = row.agent_state(a)
            _silence_fields(agent, agent["state"].lower())
        # Machine values: the screens' "policy: master (service silent 12.0 s)" is theirs.
        policy = engine.pop("policy_value")
        engine["policy"] = "engine_silent" if row.steered_by == "silent" else policy
    totals = doc["totals"]
    totals["silent"] = sum(totals[v] for v in VERDICT_SEVERITY)
    return {"now_ms": doc["now_ms"], "engines": doc["engines"], "alerts": doc["alerts"],
            "pools": doc["pools"], "totals": doc["totals"], "hub_counters": doc["hub_counters"]}
