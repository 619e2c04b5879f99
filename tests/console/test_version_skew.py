"""Version skew (issue 41 item 5): ``version_skew`` when engines of one model run different
kvpool or store-client versions, none when they agree; ``silent_miss`` names skew and the hub's
miss split (``other_digest``, ``evicted``) as causes; the detail row shows the versions."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine, pool

from kvpool_agent.protocol import EngineState, ModelReuse, ReuseView, WhatIfPoint
from kvpool_console.alerts import evaluate
from kvpool_console.alerts.silent_miss import SILENT_MIN_TOKENS, silent_miss_alerts
from kvpool_console.model import build_view

NEW = {"kvpool": "0.2.0", "mooncake": "0.3.13", "protocol": "2", "vllm": "0.32.0"}


def _versions(states: dict[str, EngineState], **by_agent: dict[str, str]
              ) -> dict[str, EngineState]:
    """Every agent reports ``NEW``, updated by ``by_agent[agent id with / as __]``."""
    return {aid: msgspec.structs.replace(st, source=msgspec.structs.replace(
        st.source, versions={**NEW, **by_agent.get(aid.replace("/", "__"), {})}))
        for aid, st in states.items()}


def _skew(states: dict[str, EngineState]) -> list[str]:
    return [f"{a.subject}: {a.message} | {a.hint}"
            for a in evaluate(states, {}, NOW_MS) if a.rule == "version_skew"]


def test_skew_across_engines_of_one_model_is_named() -> None:
    fleet = {**engine("e1"), **engine("e2"), **engine("q1", model="qwen")}
    assert _skew(_versions(fleet)) == []
    # e2's workers run an older Mooncake client; another model's versions are its own.
    old = {"mooncake": "0.3.7"}
    skewed = _versions(fleet, **{"e2__dp0.tp0.pp0": old, "e2__dp0.tp1.pp0": old,
                                 "q1__scheduler": {"kvpool": "0.1.0"}})
    (e2,) = [a for a in _skew(skewed) if a.startswith("tiny-llama")]
    assert ("engines of tiny-llama run different versions (mooncake 0.3.13: e1, e2; "
            "0.3.7: e2)") in e2
    assert "silent 0% hit rate" in e2
    (q,) = [a for a in _skew(skewed) if a.startswith("qwen")]
    assert "kvpool 0.1.0: q1; 0.2.0: q1" in q
    # vLLM's version does not decide sharing: no alert for it alone.
    assert _skew(_versions(fleet, e1__scheduler={"vllm": "0.31.0"})) == []
    # Agents before the field report none: nothing to compare.
    assert _skew(fleet) == []
    # The engine row shows them, versions its agents differ in joined.
    rows = {r.engine_id: r for r in build_view(skewed, {}, NOW_MS).engines}
    assert rows["e2"].versions == {"kvpool": "0.2.0", "mooncake": "0.3.13/0.3.7",
                                   "protocol": "2", "vllm": "0.32.0"}


def _reuse(split: dict[str, dict[str, int]]) -> ReuseView:
    prompt, cap = 10 * SILENT_MIN_TOKENS, 100_000
    points = [WhatIfPoint(capacity_tokens=int(cap * f), lru_hit_rate=0.55, min_hit_rate=0.6)
              for f in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)]
    return ReuseView(ts_ms=NOW_MS, prompt_tokens=prompt, ceiling_tokens=int(prompt * 0.6),
                     models=[ModelReuse(model="tiny-llama", chunk_size=256, prompt_tokens=prompt,
                                        ceiling_tokens=int(prompt * 0.6),
                                        pool_capacity_tokens=cap, whatif=points)],
                     not_in_pool=split)


def test_silent_miss_names_skew_and_the_hub_split() -> None:
    # 10,000 prompt tokens, 400 loaded: 9,600 not in the pool; the pool evicted (17 keys) but
    # its what-if at 1x is near the ceiling, so "too small" does not hold.
    base = {aid: msgspec.structs.replace(st, lookup=msgspec.structs.replace(
        st.lookup, loaded_tokens=400, miss_tokens={"not_in_pool": 9_600}))
        for aid, st in engine("e1", hits=400, hit_1m=0.04, pool_stats=pool()).items()}

    def cause(states: dict[str, EngineState], split: dict[str, dict[str, int]]) -> str:
        (a,) = silent_miss_alerts(_reuse(split), states, NOW_MS)
        return f"{a.message} | {a.hint}"

    assert "never in the pool" in cause(base, {})
    assert ("likeliest cause: most misses are other_digest | another layout digest of the "
            "model saved these chunks") in cause(base, {"e1": {"other_digest": 9_000}})
    assert "saved, then removed" in cause(base, {"e1": {"evicted": 9_000, "never_saved": 600}})
    # Never-saved chunks are the last cause: the split does not change it.
    assert "never in the pool" in cause(base, {"e1": {"never_saved": 9_600}})
    # First uses are no cause (no pool serves them): the largest other reason is named.
    assert "saved, then removed" in cause(base, {"e1": {"first_use": 8_000, "evicted": 1_600}})
    skewed = _versions(base, **{"e1__dp0.tp1.pp0": {"mooncake": "0.3.7"}})
    assert "its engines run mooncake 0.3.13, 0.3.7" in cause(skewed, {})
