"""The live reuse ceiling end to end (issue 41): a real agent's lookups with their chunk hashes
reach a real hub over ZMQ with CURVE in ``Report.accesses``; the hub's window equals the trace's
own prefix-reuse ceiling on the same slice, per model and fleet-wide, in ``/metrics`` too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from agent_testlib import make_source, wait_until

from kvpool_agent import AGENT_KEYS_ENV, FleetHub, KeyPaths, start_agent
from kvpool_agent._access_window import FLEET, Ceiling
from kvpool_agent.auth import Role
from kvpool_connector.keys import chunk_hashes
from kvpool_replay import (
    default_trace_path,
    free_port,
    load_trace,
    prefix_ceiling,
    request_tokens,
)

CHUNK = 512


@pytest.fixture
def reuse_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetHub]:
    kp = fleet_keys["hub"]
    monkeypatch.setenv(AGENT_KEYS_ENV, str(fleet_keys["agent"].root))
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  metrics_port=free_port(), reuse_refresh_s=0.1) as h:
        yield h


def test_hub_ceiling_equals_the_trace_ceiling(reuse_hub: FleetHub, hub_address: str) -> None:
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
        text = httpx.get(reuse_hub.metrics.url if reuse_hub.metrics else "", timeout=5.0).text
        assert f'kvpool_reuse_ceiling_ratio{{model="llama"}} {ref.hit_rate}' in text
        assert f"kvpool_fleet_reuse_ceiling_ratio {want[FLEET].hit_rate}" in text
    finally:
        a.stop()
        b.stop()
