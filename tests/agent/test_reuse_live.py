"""The live reuse ceiling and what-if end to end (issue 41): a real agent's lookups with their
chunk hashes reach a real hub over ZMQ with CURVE in ``Report.accesses``; the hub's window
equals the trace's own prefix-reuse ceiling on the same slice, per model and fleet-wide, in
``/metrics`` too; ``kvpool-console whatif --json`` prints the exact LRU and MIN of the same
accesses at multiples of the real pool's capacity."""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_testlib import make_source, wait_until

from kvpool_agent import AGENT_KEYS_ENV, FleetHub, KeyPaths, start_agent
from kvpool_agent._access_window import FLEET, Ceiling
from kvpool_agent.auth import Role
from kvpool_agent.reuse import CURVE_FACTORS
from kvpool_connector.keys import chunk_hashes
from kvpool_console.cli import main as console_main
from kvpool_replay import (
    LocalMooncakeMaster,
    belady_hits,
    default_trace_path,
    free_port,
    load_trace,
    lru_hits,
    prefix_ceiling,
    request_tokens,
)

CHUNK = 512


@pytest.fixture
def reuse_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetHub]:
    kp = fleet_keys["hub"]
    monkeypatch.setenv(AGENT_KEYS_ENV, str(fleet_keys["agent"].root))
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(fleet_keys["viewer"].root))
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  metrics_port=free_port(), reuse_refresh_s=0.1, whatif_refresh_s=0.1) as h:
        yield h


def test_hub_ceiling_equals_the_trace_ceiling(reuse_hub: FleetHub, hub_address: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    reqs = load_trace(default_trace_path("conversation_trace.jsonl"), limit=120)
    items = [(r.input_length, chunk_hashes(request_tokens(r), CHUNK)) for r in reqs]
    ref = prefix_ceiling(items, CHUNK)
    assert 0 < ref.hit_tokens < ref.input_tokens
    a = start_agent(make_source("eng-a", role="scheduler", model="llama"), address=hub_address)
    b = start_agent(make_source("eng-b", role="scheduler", model="qwen"), address=hub_address)
    try:
        for i, (n, hashes) in enumerate(items):
            a.reporter.lookup(f"r{i}", n, 0, 0, 0.1, chunk_size=CHUNK, chunks=hashes)
        # Another model: its own pool. A skipped lookup or one without hashes is no access.
        for i in range(3):
            b.reporter.lookup(f"q{i}", 33, 0, 0, 0.1, chunk_size=16, chunks=["ab" * 16] * 2)
        b.reporter.lookup("q-skip", 33, 0, 0, 0.0, skipped="MULTIMODAL")
        b.reporter.lookup("q-none", 33, 0, 0, 0.1)
        want = {"llama": Ceiling(ref.input_tokens, ref.hit_tokens), "qwen": Ceiling(99, 64),
                FLEET: Ceiling(ref.input_tokens + 99, ref.hit_tokens + 64)}
        wait_until(lambda: reuse_hub.reuse.ceilings() == want)
        assert reuse_hub.reuse.ceilings() == want
        assert reuse_hub.reuse.window_stats() == (len(items) + 3,
                                                  sum(len(h) for _, h in items) + 6, 0)
        # The hub forwards states without the accesses; the agent dropped none.
        for aid in ("eng-a/scheduler", "eng-b/scheduler"):
            st, _ = reuse_hub.fleet()[aid]
            assert st.lookup.accesses_dropped == 0
        # Every prompt token is local, a hit or a miss with one reason (nothing was loaded).
        wait_until(lambda: reuse_hub.fleet()["eng-b/scheduler"][0].lookup.lookups == 4)
        lk_a = reuse_hub.fleet()["eng-a/scheduler"][0].lookup
        lk_b = reuse_hub.fleet()["eng-b/scheduler"][0].lookup
        claimable = sum(min(len(h), (n - 1) // CHUNK) * CHUNK for n, h in items)
        assert lk_a.miss_tokens == {"not_in_pool": claimable,
                                    "tail": ref.input_tokens - claimable}
        assert lk_b.miss_tokens == {"not_in_pool": 96, "tail": 3, "MULTIMODAL": 33,
                                    "unattributed": 33}
        for lk in (lk_a, lk_b):
            assert lk.prompt_tokens == lk.local_tokens + lk.loaded_tokens + sum(
                lk.miss_tokens.values())
        # status --json: each engine's reasons and top reason, the fleet's in totals.
        assert console_main(["status", "--json", "--hub", hub_address]) == 0
        doc = json.loads(capsys.readouterr().out)
        rows = {e["engine_id"]: e for e in doc["engines"]}
        assert rows["eng-a"]["miss_tokens"] == lk_a.miss_tokens
        assert (rows["eng-a"]["top_miss"], rows["eng-b"]["top_miss"]) == ("not_in_pool",
                                                                          "not_in_pool")
        tot = doc["totals"]
        assert tot["prompt_tokens"] == tot["local_tokens"] + tot["loaded_tokens"] + sum(
            tot["miss_tokens"].values())
        assert tot["top_miss"] == "not_in_pool"
        text = httpx.get(reuse_hub.metrics.url if reuse_hub.metrics else "", timeout=5.0).text
        assert f'kvpool_reuse_ceiling_ratio{{model="llama"}} {ref.hit_rate}' in text
        assert f"kvpool_fleet_reuse_ceiling_ratio {want[FLEET].hit_rate}" in text
        assert ('kvpool_miss_tokens_total{engine="eng-b",model="qwen",reason="MULTIMODAL",'
                'role="mixed"} 33.0') in text
    finally:
        a.stop()
        b.stop()


def test_whatif_json_is_lru_and_min_at_the_real_pool_capacity(
        reuse_hub: FleetHub, hub_address: str, agent_master: LocalMooncakeMaster,
        mooncake_backend: Any, pool_buffer: Any, model: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The real pool holds keys: its average key size and capacity give the model's capacity.
    base = ctypes.addressof(pool_buffer)
    keys = [f"{model}/reuse-{i}" for i in range(4)]
    assert mooncake_backend.batch_put_from(keys, [[base]] * 4, [[64 * 1024]] * 4) == [0] * 4
    worker = start_agent(make_source("eng-w", model=model), address=hub_address,
                         pool_admin_url=agent_master.admin_url)
    sched = start_agent(make_source("eng-w", role="scheduler", model=model),
                        address=hub_address)
    reqs = load_trace(default_trace_path("conversation_trace.jsonl"), limit=60)
    items = [(r.input_length, chunk_hashes(request_tokens(r), CHUNK)) for r in reqs]
    try:
        wait_until(lambda: (e := reuse_hub.fleet().get(worker.source.agent_id)) is not None
                   and e[0].pool is not None and e[0].pool.keys > 0)
        for i, (n, hashes) in enumerate(items):
            sched.reporter.lookup(f"r{i}", n, 0, 0, 0.1, chunk_size=CHUNK, chunks=hashes)

        def curve() -> list[Any]:
            v = reuse_hub.reuse.view()
            return [m for m in v.models if m.whatif and m.prompt_tokens == sum(
                n for n, _ in items)] if v else []

        wait_until(curve)
        assert console_main(["whatif", "--json", "--hub", hub_address]) == 0
        doc = json.loads(capsys.readouterr().out)
        (m,) = [m for m in doc["models"] if m["model"] == model]
        cap = m["pool_capacity_tokens"]
        assert cap > 0 and cap % CHUNK == 0
        assert m["ceiling_hit_rate"] == prefix_ceiling(items, CHUNK).hit_rate
        assert [p["capacity_tokens"] for p in m["points"]] == [
            int(cap * f) for f in CURVE_FACTORS]
        for p in m["points"]:
            assert p["lru_hit_rate"] == lru_hits(items, CHUNK, p["capacity_tokens"]).hit_rate
            assert p["min_hit_rate"] == belady_hits(items, CHUNK, p["capacity_tokens"]).hit_rate
        # The table names the gain of twice the pool and MIN at its size.
        one, two = m["points"][2], m["points"][3]
        assert console_main(["whatif", "--hub", hub_address]) == 0
        text = capsys.readouterr().out
        assert (f"2x the pool: {(two['lru_hit_rate'] - one['lru_hit_rate']) * 100:+.1f} points; "
                f"MIN at this size: {one['min_hit_rate']:.1%}") in text
        # The curve's age against the ceiling (they are computed apart: a MIN above the
        # ceiling read as a bound broken to a new user).
        assert re.search(r"\n\(curve \d+ s older than the ceiling\)\n", text), text
    finally:
        sched.stop()
        worker.stop()
        mooncake_backend.batch_remove(keys)
