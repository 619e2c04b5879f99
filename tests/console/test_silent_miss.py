"""``silent_miss`` (``kvpool_console.alerts.silent_miss``) on fleet states and the hub's reuse
figures: raised when the hit rate sits far below the ceiling, naming the likeliest cause and its
fix; silent when hits are near the ceiling or the window is too small; through AlertModel."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine, pool

from kvpool_agent.protocol import EngineState, ModelReuse, ReuseView, WhatIfPoint
from kvpool_console.alerts import AlertModel
from kvpool_console.alerts.silent_miss import SILENT_MIN_TOKENS, silent_miss_alerts

CAP = 100_000


def _reuse(ceiling: float, lru_1x: float = 0.1, prompt: int = 10 * SILENT_MIN_TOKENS,
           model: str = "tiny-llama") -> ReuseView:
    points = [WhatIfPoint(capacity_tokens=int(CAP * f), lru_hit_rate=min(ceiling, lru_1x * f),
                          min_hit_rate=min(ceiling, 1.5 * lru_1x * f))
              for f in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)]
    return ReuseView(ts_ms=NOW_MS, prompt_tokens=prompt, ceiling_tokens=int(prompt * ceiling),
                     models=[ModelReuse(model=model, chunk_size=256, prompt_tokens=prompt,
                                        ceiling_tokens=int(prompt * ceiling),
                                        pool_capacity_tokens=CAP, whatif=points)])


def _with(states: dict[str, EngineState], lookup: dict[str, object] | None = None,
          transfers: dict[str, object] | None = None,
          digest: dict[str, str] | None = None) -> dict[str, EngineState]:
    """Each agent's state with ``lookup``/``transfers`` fields replaced (workers' transfers)
    and the workers' layout digest (``digest`` by agent id, else ``aaaaaaaaaaaa``)."""
    out = {}
    for aid, st in states.items():
        lk = msgspec.structs.replace(st.lookup, **(lookup or {}))
        tr = st.transfers
        src = st.source
        if src.process_role == "worker":
            tr = msgspec.structs.replace(tr, **(transfers or {}))
            src = msgspec.structs.replace(
                src, layout_digest=(digest or {}).get(aid, "aaaaaaaaaaaa"))
        out[aid] = msgspec.structs.replace(st, lookup=lk, transfers=tr, source=src)
    return out


def _one(reuse: ReuseView, states: dict[str, EngineState]) -> str:
    (a,) = silent_miss_alerts(reuse, states, NOW_MS)
    assert (a.rule, a.severity, a.subject) == ("silent_miss", "warning", "tiny-llama")
    return f"{a.message} | {a.hint}"


def test_each_cause_is_named_with_its_fix() -> None:
    base = engine("e1", hit_1m=0.05, pool_stats=pool())  # pool() evicted 17 keys
    # Split: two layouts among the model's workers.
    split = _with(base, digest={"e1/dp0.tp1.pp0": "bbbbbbbbbbbb"})
    text = _one(_reuse(0.6), split)
    assert "hit rate 5% vs a reuse ceiling of 60%" in text
    assert "2 layouts (aaaaaaaaaaaa, bbbbbbbbbbbb)" in text and "model_fingerprint" in text
    # Saves skipped (a tiny save budget).
    text = _one(_reuse(0.6), _with(base, transfers={"saves_skipped": 40}))
    assert "80 block saves were skipped" in text and "save_budget" in text
    # A skip rule holds most misses.
    text = _one(_reuse(0.6), _with(base, lookup={"miss_tokens": {"MULTIMODAL": 9, "tail": 1}}))
    assert "lookups skipped by MULTIMODAL" in text
    # Evictions and an LRU at 1x far below the ceiling: too small, with what 2x would give.
    text = _one(_reuse(0.6, lru_1x=0.1), base)
    assert "pool is too small (it evicted 17 keys): 2x the pool would hit 20%" in text
    assert "global_segment_size" in text
    # No eviction, nothing skipped: never in the pool.
    quiet = {a: msgspec.structs.replace(s, pool=pool(keys=1)) for a, s in base.items()}
    quiet = {a: msgspec.structs.replace(s, pool=msgspec.structs.replace(
        s.pool, evicted_keys=0)) if s.pool else s for a, s in quiet.items()}
    assert "never in the pool" in _one(_reuse(0.6), quiet)


def test_no_alert_near_the_ceiling_or_on_little_traffic() -> None:
    near = engine("e1", hit_1m=0.5)
    assert silent_miss_alerts(_reuse(0.6), near, NOW_MS) == []  # 50% >= half of 60%
    low = engine("e1", hit_1m=0.05)
    assert silent_miss_alerts(_reuse(0.15), low, NOW_MS) == []  # ceiling under 20%
    assert silent_miss_alerts(_reuse(0.6, prompt=SILENT_MIN_TOKENS - 1), low, NOW_MS) == []
    assert silent_miss_alerts(None, low, NOW_MS) == []
    assert silent_miss_alerts(_reuse(0.6, model="other"), low, NOW_MS) == []


def test_alert_model_raises_it_from_the_hubs_figures() -> None:
    states = engine("e1", hit_1m=0.05)
    seen = {a: NOW_MS for a in states}
    model = AlertModel()
    assert not [a for a in model.update(states, seen, NOW_MS) if a.rule == "silent_miss"]
    got = [a for a in model.update(states, seen, NOW_MS + 1, _reuse(0.6)) if a.rule ==
           "silent_miss"]
    assert [a.key for a in got] == ["silent_miss:tiny-llama"]
