"""``silent_miss``: the traffic could hit far more than the pool serves (issue 41 item 3).

The hub's reuse figures (``kvpool_agent.protocol.ReuseView``: per model, the share of the
window's prompt tokens an unbounded shared pool would have hit) against the model's engines'
pool hit rate over their last minute (``LookupStats.hit_rate_1m``, weighted by prompt tokens).
The alert is raised for a model when, over at least ``SILENT_MIN_TOKENS`` looked-up tokens in the
hub's window, the ceiling is at least ``SILENT_CEILING`` and the hit rate below
``SILENT_SHARE`` of it; it names the likeliest cause, checked in this order (the first that holds
is named, with its fix):

1. engines of the model write keys under different layout digests (namespaces or fingerprints
   split: they cannot share);
2. its engines run different kvpool or store-client versions (``alerts.versions``: a Mooncake
   client/master mismatch once served a silent 0%);
3. saves were skipped (``TransferStats.saves_skipped``: a save budget, a breaker);
4. the top miss reason (``LookupStats.miss_tokens``, ``not_in_pool`` split by the hub's
   ``ReuseView.not_in_pool``; ``first_use`` and ``tail`` left out: the ceiling does not count
   them either) is a skip rule (media, breaker...), failed loads or
   ``other_digest`` (another layout saved the chunks: an engine gone or restarted on another
   layout still holds them);
5. the pool evicted and its what-if LRU at 1x stays below 90% of the ceiling (or no what-if
   yet): too small;
6. the top miss reason is ``evicted`` (saved, then removed: flushes, unpins);
7. otherwise the missing chunks were never in the pool (saves not made or not reaching it;
   ``never_saved`` on top: asked for before, so the admission's refusals count here).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool_agent.misses import split_not_in_pool
from kvpool_agent.protocol import EngineState, ModelReuse, ReuseView
from kvpool_console.alerts.alert import Alert, make_alert
from kvpool_console.alerts.versions import SHARING_PACKAGES

__all__ = ["SILENT_CEILING", "SILENT_MIN_TOKENS", "SILENT_SHARE", "silent_miss_alerts"]

SILENT_CEILING = 0.2
"""A ceiling (share of prompt tokens) at least this high is reuse worth serving."""

SILENT_SHARE = 0.5
"""A hit rate below this share of the ceiling is far below it."""

SILENT_MIN_TOKENS = 50_000
"""Looked-up tokens of the model in the hub's window before the rule judges (a few requests
say nothing)."""

_UNAVOIDABLE = frozenset({"first_use", "tail"})
"""Miss reasons no pool serves (compulsory misses, partial chunks): never the cause named."""

_MISS_FIXES = {
    "load_failed": "loads fail after the lookup found the chunks: see failed_after_hit "
                   "(raise default_kv_lease_ttl above load times)",
    "lookup_error": "lookups fail: see lookup_errors (is the master reachable?)",
    "other_digest": "another layout digest of the model saved these chunks: align the "
                    "engines' layouts and model_fingerprint (see namespace_split)",
}


def _cause(m: ModelReuse, engines: list[EngineState],
           split: Mapping[str, Mapping[str, int]]) -> tuple[str, str]:
    """(what the likeliest cause is, its fix) for a silent miss of ``m.model``; ``split``:
    the hub's ``not_in_pool`` split by engine id."""
    digests = {s.source.layout_digest for s in engines
               if s.source.process_role == "worker" and s.source.layout_digest}
    if len(digests) > 1:
        return (f"its engines write {len(digests)} layouts ({', '.join(sorted(digests))}): "
                "namespaces or fingerprints split",
                "align the engines' layouts and model_fingerprint (see namespace_split, "
                "model_versions)")
    for pkg in SHARING_PACKAGES:
        versions = {s.source.versions[pkg] for s in engines if s.source.versions.get(pkg)}
        if len(versions) > 1:
            return (f"its engines run {pkg} {', '.join(sorted(versions))}",
                    "run one version on every engine, matching the master's (see "
                    "version_skew)")
    skipped = sum(s.transfers.saves_skipped for s in engines)
    if skipped:
        return (f"{skipped} block saves were skipped",
                "raise the save budget (save_budget) or fix what trips the save breaker")
    misses: dict[str, int] = {}
    for s in engines:
        for reason, n in split_not_in_pool(s.lookup.miss_tokens,
                                           split.get(s.source.engine_id)).items():
            if reason not in _UNAVOIDABLE:
                misses[reason] = misses.get(reason, 0) + n
    top = max(sorted(misses.items()), key=lambda kv: kv[1], default=("", 0))[0]
    if top in _MISS_FIXES:
        return f"most misses are {top}", _MISS_FIXES[top]
    if top and top.isupper():
        return (f"most misses are lookups skipped by {top}",
                f"see the {top} skip rule (lookup_skipped) in the engine's detail")
    evicted = max((s.pool.evicted_keys for s in engines if s.pool is not None), default=0)
    one = next((p for p in m.whatif if p.capacity_tokens == m.pool_capacity_tokens), None)
    ceiling = m.ceiling_tokens / m.prompt_tokens
    if evicted and (one is None or one.lru_hit_rate < 0.9 * ceiling):
        two = next((p for p in m.whatif if p.capacity_tokens == 2 * m.pool_capacity_tokens),
                   None)
        gain = (f": 2x the pool would hit {two.lru_hit_rate:.0%}"
                if two is not None else "")
        return (f"the pool is too small (it evicted {evicted} keys){gain}",
                "add segment memory (global_segment_size) or segments; kvpool-console whatif")
    if top == "evicted":
        return ("most misses are chunks saved, then removed before the lookup",
                "look for flushes and unpins (events log, audit file); kvpool-console whatif")
    return ("the missing chunks were never in the pool",
            "check that engines save (kv_role kv_producer/kv_both, saves_finished) to the "
            "pool their lookups read, and the admission (admission: all saves every chunk)")


def silent_miss_alerts(reuse: ReuseView | None, states: Mapping[str, EngineState],
                       now_ms: float) -> list[Alert]:
    """One ``silent_miss`` warning per model whose hit rate sits far below its reuse
    ceiling (module docstring); none without the hub's figures."""
    if reuse is None:
        return []
    out = []
    for m in reuse.models:
        if m.prompt_tokens < SILENT_MIN_TOKENS:
            continue
        ceiling = m.ceiling_tokens / m.prompt_tokens
        engines = [s for s in states.values() if s.source.model == m.model]
        prompt = sum(s.lookup.prompt_tokens for s in engines)
        if ceiling < SILENT_CEILING or not prompt:
            continue
        hit = sum(s.lookup.hit_rate_1m * s.lookup.prompt_tokens for s in engines) / prompt
        if hit >= SILENT_SHARE * ceiling:
            continue
        cause, fix = _cause(m, engines, reuse.not_in_pool)
        out.append(make_alert(
            "silent_miss", "warning", m.model,
            f"hit rate {hit:.0%} vs a reuse ceiling of {ceiling:.0%} over the hub's window; "
            f"likeliest cause: {cause}", fix, now_ms))
    return out
