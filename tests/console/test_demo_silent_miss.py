"""No false ``silent_miss`` over a whole demo run (issue 41): the demo fleet
(``kvpool_replay.DemoCluster``: a real master and store, the hub, a prefill/decode pair and a
``kv_both`` engine replaying a conversation trace slice through ``KVPoolConnector``) hits near
its reuse ceiling, and the console's alert model, fed as the TUI feeds it (``ClientSource``,
``AlertModel.update`` with the hub's ``ReuseView``) every 0.25 s from start to the last
engine's end, never raises ``silent_miss`` while the rule is in a position to judge (window past
``SILENT_MIN_TOKENS``, ceiling past ``SILENT_CEILING``). The same run shows what the demo shows:
the ceiling, the what-if curve and each engine's top miss reason with its fix."""

from __future__ import annotations

import time

from kvpool_console.alerts import AlertModel
from kvpool_console.alerts.silent_miss import SILENT_CEILING, SILENT_MIN_TOKENS, SILENT_SHARE
from kvpool_console.model import build_view
from kvpool_console.source import ClientSource
from kvpool_replay import DemoCluster, default_trace_path

SPEEDUP = 1.5
"""The slice's 80 requests span about 7 s of the trace: at 1.5x the rule can judge for a few
seconds (at 8x a CI run judged one sample once: the rule became judgeable just before the end)."""


def test_a_demo_run_near_its_ceiling_raises_no_silent_miss() -> None:
    cluster = DemoCluster(default_trace_path("conversation_trace.jsonl"), engines=3,
                          speedup=SPEEDUP, limit=80)
    with cluster:
        src = ClientSource(cluster.hub_address, keys_dir=str(cluster.viewer_keys_dir),
                           pump=True)
        try:
            model = AlertModel()
            raised: list[str] = []
            judged: list[float] = []  # hit rate / ceiling at each sample the rule judged
            curves = 0
            deadline = time.monotonic() + 180
            while cluster.running() and time.monotonic() < deadline:
                time.sleep(0.25)
                states, seen = src.fleet()
                reuse = src.reuse()
                now = time.time() * 1e3
                raised += [f"{a.subject}: {a.message} | {a.hint}"
                           for a in model.update(states, seen, now, reuse)
                           if a.rule == "silent_miss"]
                for m in reuse.models if reuse is not None else []:
                    curves += bool(m.whatif)
                    engines = [s for s in states.values() if s.source.model == m.model]
                    prompt = sum(s.lookup.prompt_tokens for s in engines)
                    ceiling = m.ceiling_tokens / m.prompt_tokens if m.prompt_tokens else 0.0
                    if (prompt and m.prompt_tokens >= SILENT_MIN_TOKENS
                            and ceiling >= SILENT_CEILING):
                        hit = sum(s.lookup.hit_rate_1m * s.lookup.prompt_tokens
                                  for s in engines) / prompt
                        judged.append(hit / ceiling)
            assert not cluster.running(), "the demo's engines did not finish within 180 s"
            assert raised == []
            # The rule judged the run (three samples at least), above its line (SILENT_SHARE of
            # the ceiling): 0.78-0.90 of it in a run at load average 15-20 (loads that give up
            # under load are misses), nearer 0.9 on a quiet machine.
            assert len(judged) >= 3, judged
            assert min(judged) > SILENT_SHARE, judged
            assert curves > 0, "no what-if curve during the run"
            # What the demo's screens show: the ceiling and each engine's top reason and fix.
            states, seen = src.fleet()
            view = build_view(states, seen, time.time() * 1e3, reuse=src.reuse())
            assert view.reuse is not None and view.reuse.models
            (m,) = view.reuse.models
            assert m.ceiling_tokens > 0 and m.whatif
            rows = {r.engine_id: (r.top_miss, bool(r.top_miss_fix)) for r in view.engines}
            assert rows.keys() == {"prefill-0", "decode-1", "engine-2"}
            assert all(reason and fix for reason, fix in rows.values()), rows
            # A finished trace leaves the engines up and reporting, idle (a new user's demo
            # ended with every engine "gone", CRITICAL, after its trace): reports keep coming.
            ended = time.time() * 1e3
            deadline = time.monotonic() + 30
            while min(src.fleet()[1].values()) <= ended + 1_000:
                assert time.monotonic() < deadline, "the finished engines stopped reporting"
                time.sleep(0.1)
            assert all(p.poll() is None for p in cluster.processes.values())
            states, seen = src.fleet()
            gone = [a.rule for a in model.update(states, seen, time.time() * 1e3, src.reuse())
                    if a.rule in ("gone", "stale")]
            assert gone == []
        finally:
            src.close()
