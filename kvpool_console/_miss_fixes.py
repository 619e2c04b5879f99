"""The fix of each miss reason (issue 41), the short form of ``docs/triage.md``'s miss-reason
table: what the detail screen's miss table, the fleet's top reason and ``status --json``
(``top_miss_fix``) say.

Two reasons have more than one cause, told apart by the engine's own facts: ``evicted`` is the
master's watermark eviction when the engine's pool evicted keys (``PoolStats.evicted_keys``,
counted by the master since it started: a flush or an unpin is not counted there), else the
policy service's removal when the service steers the engine's saves
(``EngineRow.policy_in_charge``), else a removal (flush, unpin); ``never_saved`` (asked for
before, never saved) is a skipped save when the engine's workers skipped saves
(``TransferStats.saves_skipped``: a save budget, the save breaker), else the admission's
refusal, a failed save or one still in flight. ``first_use`` (nothing asked for the chunk
before) has no fix: a compulsory miss. ``not_in_pool`` (the hub did not split it) waits for
the engine's layout digest while no worker reported it (``EngineRow.layout_digest`` empty, an
engine's first seconds: the hub splits an engine's lookups once it knows the digest,
``kvpool_agent._saved_chunks``); after that it is lookups the hub did not split (reports
dropped or not in yet, a hub before the split: ``docs/triage.md``).
A pool that both evicted and was flushed reads as evicted at its watermark.
"""

from __future__ import annotations

__all__ = ["FIXES", "NOT_IN_POOL_NO_DIGEST", "miss_fix"]

FIXES: dict[str, str] = {
    "never_saved": "asked before, unsaved: admission, save in flight, errors",
    "first_use": "first request of this prefix: no pool serves it",
    "evicted": "saved, then gone (watermark, flush, unpin): see whatif 2x",
    "other_digest": "another layout digest saved it: align model, dtype, layout",
    "not_in_pool": "not split by the hub: if many, its reports are dropped",
    "tail": "past the last whole chunk: a smaller chunk_size shortens it",
    "lookup_error": "the pool's lookup failed: health --all (master reachable?)",
    "load_failed": "found, not loaded (lease lost): raise default_kv_lease_ttl",
    "not_loaded": "found, no load outcome yet: stuck_transfer when it grows",
    "unattributed": "a connector without chunk hashes: upgrade it",
}
"""Reason -> its fix when the engine's facts say nothing more (a skip reason not listed: its
rule's own fix). ``miss_fix``'s texts are no longer than the longest of these (the detail
screen's column)."""

NOT_IN_POOL_NO_DIGEST = "not split until a worker reports its layout digest"
"""``not_in_pool``'s fix while the engine's layout digest is unknown: its first seconds, or for
good when its workers report to no agent (module docstring)."""


def miss_fix(reason: str, *, evicted_keys: int = 0, saves_skipped: int = 0,
             service_steers: bool = False, digest_known: bool = True) -> str:
    """The fix of ``reason`` for an engine whose pool evicted ``evicted_keys`` keys at its
    watermark, whose workers skipped ``saves_skipped`` block saves, whose saves the policy
    service steers (``service_steers``) and whose layout digest a worker reported
    (``digest_known``; module docstring); ``""`` for no reason."""
    if not reason:
        return ""
    if reason == "not_in_pool" and not digest_known:
        return NOT_IN_POOL_NO_DIGEST
    if reason == "evicted":
        if evicted_keys:
            return f"pool too small ({evicted_keys} keys evicted): add memory; whatif 2x"
        if service_steers:
            return "the policy service removed it: add memory; see whatif 2x"
        return "saved, then removed (flush, unpin): see events, audit file"
    if reason == "never_saved" and saves_skipped:
        return f"{saves_skipped} block saves skipped: raise save_budget, see breaker"
    return FIXES.get(reason, "skipped by this rule: its fix in docs/triage.md")
