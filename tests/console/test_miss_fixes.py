"""Each miss reason's fix (``kvpool_console._miss_fixes``), by the engine's own facts: an
eviction is the watermark's when the pool evicted keys, the policy service's when it steers the
engine's saves, else a removal; a never-saved chunk is a skipped save when saves were skipped;
no fix is wider than the detail screen's column (the longest of ``FIXES``)."""

from __future__ import annotations

from kvpool_console._miss_fixes import FIXES, NOT_IN_POOL_NO_DIGEST, miss_fix


def test_each_cause_names_its_own_fix() -> None:
    assert miss_fix("evicted", evicted_keys=17, service_steers=True) == (
        "pool too small (17 keys evicted): add memory; whatif 2x")
    assert miss_fix("evicted", service_steers=True) == (
        "the policy service removed it: add memory; see whatif 2x")
    assert miss_fix("evicted") == "saved, then removed (flush, unpin): see events, audit file"
    assert miss_fix("never_saved", saves_skipped=3) == (
        "3 block saves skipped: raise save_budget, see breaker")
    assert miss_fix("never_saved") == FIXES["never_saved"]
    assert miss_fix("first_use", saves_skipped=3, service_steers=True) == FIXES["first_use"]
    assert miss_fix("") == ""
    assert miss_fix("MULTIMODAL") == "skipped by this rule: its fix in docs/triage.md"
    # The digest is awaited only while no worker reported it.
    assert miss_fix("not_in_pool", digest_known=False) == NOT_IN_POOL_NO_DIGEST
    assert miss_fix("not_in_pool") == FIXES["not_in_pool"] != NOT_IN_POOL_NO_DIGEST
    assert miss_fix("evicted", digest_known=False) == miss_fix("evicted")


def test_no_fix_is_wider_than_the_longest_listed() -> None:
    widest = max(len(t) for t in FIXES.values())
    texts = [miss_fix(r, evicted_keys=k, saves_skipped=s, service_steers=p, digest_known=d)
             for r in [*FIXES, "MULTIMODAL"] for k in (0, 999_999) for s in (0, 99_999)
             for p in (False, True) for d in (False, True)]
    assert max(len(t) for t in texts) <= widest
