"""The console's miss reasons with the hub's split (issue 41): each engine's not_in_pool split
by the hub's saved-chunk memory in the view model (status --json and the TUI read it), every
row still adding up to its prompt tokens; the Pool tab's reuse panel text."""

from __future__ import annotations

import msgspec
from fleetdata import MISSES, NOW_MS, sample_fleet, sample_reuse

from kvpool_console._miss_fixes import FIXES
from kvpool_console.model import build_view
from kvpool_console.widgets._reuse_panel import render_reuse


def test_the_hub_split_replaces_not_in_pool_and_keeps_every_token() -> None:
    states = sample_fleet(misses=True)
    plain = {r.engine_id: r for r in build_view(states, {}, NOW_MS).engines}
    view = build_view(states, {}, NOW_MS, reuse=sample_reuse())
    rows = {r.engine_id: r for r in view.engines}
    assert plain["prefill-0"].miss_tokens == MISSES["prefill-0"]
    assert plain["prefill-0"].top_miss == "not_in_pool"
    assert rows["prefill-0"].miss_tokens == {"evicted": 18_000, "never_saved": 10_000,
                                             "not_in_pool": 2_000, "tail": 9_000,
                                             "not_loaded": 3_000}
    assert rows["prefill-0"].top_miss == "evicted"
    assert rows["prefill-1"].miss_tokens == {"other_digest": 16_000, "first_use": 5_000,
                                             "never_saved": 3_000,
                                             "load_failed": 3_000, "tail": 3_000}
    assert rows["prefill-1"].top_miss == "other_digest"
    # No split for prefill-2: its reasons as its agent reported them.
    assert rows["prefill-2"].miss_tokens == MISSES["prefill-2"]
    for r in rows.values():
        assert r.prompt_tokens == r.local_tokens + r.loaded_tokens + sum(
            r.miss_tokens.values())
    t = view.totals
    assert t.miss_tokens["never_saved"] == 13_000 and t.miss_tokens["first_use"] == 5_000
    assert t.top_miss == "evicted"
    assert t.prompt_tokens == t.local_tokens + t.loaded_tokens + sum(t.miss_tokens.values())


def test_reuse_panel_says_hit_rate_ceiling_and_what_2x_buys() -> None:
    view = build_view(sample_fleet(misses=True), {}, NOW_MS, reuse=sample_reuse())
    text = render_reuse(view.reuse, view.engines).plain
    # tiny-llama's engines: 99,000 loaded of 178,000 looked up; ceiling 121,040 of 178,000.
    assert "tiny-llama: hit 55.6% since start, window ceiling 68.0% (178,000 tokens)" in text
    assert "2x the pool: +11.0 points; MIN at this size: 55.0% (LRU 45.0%)" in text
    # One bar line per capacity, LRU then MIN.
    lines = [ln.split() for ln in text.splitlines() if ln.strip().endswith("%")
             and ln.split()[0].endswith("x")]
    assert [(ln[0], ln[2], ln[4]) for ln in lines] == [
        ("0.25x", "21.0%", "30.0%"), ("0.5x", "33.0%", "44.0%"), ("1x", "45.0%", "55.0%"),
        ("2x", "56.0%", "63.0%"), ("4x", "64.0%", "67.0%"), ("8x", "68.0%", "68.0%")]
    assert "none from the hub yet" in render_reuse(None, view.engines).plain


def test_not_in_pool_waits_for_the_digest_only_while_no_worker_reported_it() -> None:
    """The fix said "first seconds, digest unknown" for as long as the hub left tokens
    unsplit; it says the digest is awaited only while no worker of the engine reported it."""
    states = sample_fleet(misses=True)
    early = {r.engine_id: r for r in build_view(states, {}, NOW_MS).engines}
    assert early["prefill-0"].top_miss == "not_in_pool"
    assert early["prefill-0"].top_miss_fix == "not split until a worker reports its layout digest"
    reported = {a: msgspec.structs.replace(st, source=msgspec.structs.replace(
        st.source, layout_digest="0123456789ab")) if st.source.process_role == "worker" else st
        for a, st in states.items()}
    view = build_view(reported, {}, NOW_MS)
    later = {r.engine_id: r for r in view.engines}
    assert later["prefill-0"].layout_digest == "0123456789ab"
    assert later["prefill-0"].top_miss_fix == FIXES["not_in_pool"] == (
        "not split by the hub: if many, its reports are dropped")
    assert "first seconds" not in later["prefill-0"].top_miss_fix
    # The fleet's line too: every engine with unsplit tokens has its digest.
    assert view.totals.top_miss == "not_in_pool"
    assert view.totals.top_miss_fix == FIXES["not_in_pool"]
