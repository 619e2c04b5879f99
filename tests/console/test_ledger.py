"""The counter catalogue (``kvpool_agent.ledger``) is the one ledger: every family the hub's
``/metrics`` exports and every counter of ``status --json`` is one catalogue fact, shown under
the fact's name with the fact's one help text, and the catalogue lists nothing they do not show.
vLLM's side is checked in ``tests/connector/test_connector_stats.py``."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, sample_fleet
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_agent._access_window import FLEET, Ceiling
from kvpool_agent._metrics import FleetCollector
from kvpool_agent.ledger import HUB_COUNTERS, facts_on, metric_fact
from kvpool_console.cli import status_document
from kvpool_console.model import build_view

# Numbers of the status document that count no event: ids, sizes, rates and headcounts now.
_NOT_COUNTERS = {"workers", "segment_used_bytes", "segment_total_bytes", "lease_ttl_ms",
                 "engines", "stores", "agents", "stale", "down", "hung", "gone", "silent",
                 "pid",
                 "rss_bytes",
                 "load_bytes_per_s", "save_bytes_per_s"}


def _fleet() -> dict:
    fleet = sample_fleet(misses=True)
    # One worker with saves in flight, so the save gauges are exported too, and a timed-out
    # load (counted in loads_failed and in loads_timed_out).
    key = next(k for k, s in fleet.items() if s.source.process_role == "worker")
    st = fleet[key]
    fleet[key] = msgspec.structs.replace(st, transfers=msgspec.structs.replace(
        st.transfers, oldest_save_age_ms=1200.0, save_blocks_held=8, save_bytes_staged=1 << 20,
        loads_failed=st.transfers.loads_failed + 1, loads_timed_out=1))
    return fleet


def test_every_hub_family_is_one_catalogue_fact() -> None:
    fleet = _fleet()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(
        lambda: {k: (s, NOW_MS) for k, s in fleet.items()}, dict, lambda: {"reports": 3},
        lambda: NOW_MS, reuse_ceilings=lambda: {FLEET: Ceiling(100, 40),
                                                 "tiny-llama": Ceiling(100, 40)},
        hub_labelled=lambda: {"hub_refused_handshakes": ("port", {"agents": 2}),
                              "hub_refused_by_key": ("key", {"viewer/ops": 1})}))
    families = list(text_string_to_metric_families(generate_latest(reg).decode()))
    shown = set()
    for fam in families:
        f = metric_fact("hub", fam.name)
        assert f is not None, f"{fam.name} is in no catalogue entry"
        assert fam.documentation == f.help, fam.name
        assert fam.type == f.kind, fam.name
        shown.add(f.name)
    assert HUB_COUNTERS.name in shown
    # The catalogue lists nothing the hub does not export.
    assert {f.name for f in facts_on("hub")} <= shown
    # One fact, one name: the old names of the same facts are gone.
    names = {fam.name for fam in families}
    assert "kvpool_prompt_tokens" in names and "kvpool_local_tokens" in names
    assert not names & {"kvpool_local_hit_tokens", "kvpool_saves_skipped_blocks",
                        "kvpool_pool_hit_tokens"}


def test_every_status_counter_is_one_catalogue_fact() -> None:
    fleet = _fleet()
    doc = status_document(build_view(fleet, {}, NOW_MS))
    status = {f.name for f in facts_on("status")}
    rows = [*doc["engines"], *(a for e in doc["engines"] for a in e["agents"]), doc["totals"]]
    assert len(doc["engines"]) >= 2
    for row in rows:
        counts = {k for k, v in row.items() if type(v) is int}
        assert counts - _NOT_COUNTERS <= status, counts - _NOT_COUNTERS - status
    for e in doc["engines"]:
        # Every status fact is on every engine (or, counted per process, on its agents).
        assert status <= set(e) | set(e["agents"][0]), status - set(e) - set(e["agents"][0])
        assert e["prompt_tokens"] == e["local_tokens"] + e["loaded_tokens"] + sum(
            e["miss_tokens"].values())
        assert "load_errors" not in e and "hit_tokens" not in e and "lookup_tokens" not in e
    # A timed-out load is one failed load, not two.
    failed = sum(s.transfers.loads_failed for s in fleet.values())
    assert sum(e["loads_failed"] for e in doc["engines"]) == doc["totals"]["loads_failed"] == failed
    assert failed > 0
