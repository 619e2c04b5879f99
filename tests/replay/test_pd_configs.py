"""``pd_kv_transfer_configs``: the P/D pair's ``--kv-transfer-config`` per side, from
``config/local-pd/`` with a run's ports, hub and keys, and the overrides a benchmark uses to run
another connector (vLLM's ``MooncakeStoreConnector``) in the same pair."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from kvpool_replay._pd import pd_kv_transfer_configs

REPO = Path(__file__).resolve().parents[2]


def _file(side: str) -> dict:
    return json.loads((REPO / "config" / "local-pd" / f"{side}.kv_transfer_config.json")
                      .read_text())


def test_ours_are_the_example_files_with_this_runs_ports_hub_keys_and_chunk(
        tmp_path: Path) -> None:
    prefill, decode = pd_kv_transfer_configs("tcp://127.0.0.1:7711", 5101, 5102, 128,
                                             agent_keys=tmp_path)
    for got, side, port in ((prefill, "prefill", 5101), (decode, "decode", 5102)):
        want = _file(side)
        want["kv_connector_extra_config"].update(
            lookup_rpc_port=port, agent_address="tcp://127.0.0.1:7711", chunk_size=128,
            agent_keys=str(tmp_path))
        assert got == want
    assert prefill["kv_role"] == "kv_producer" and decode["kv_role"] == "kv_consumer"
    assert decode["kv_connector_extra_config"]["consumer_is_to_load"] is True


def test_without_a_hub_no_agent_address() -> None:
    prefill, decode = pd_kv_transfer_configs(None, 5101, 5102, 64)
    for ktc in (prefill, decode):
        assert "agent_address" not in ktc["kv_connector_extra_config"]
        assert "agent_keys" not in ktc["kv_connector_extra_config"]


def test_overrides_replace_top_level_keys_drop_none_and_replace_extra_config_whole() -> None:
    peer = {"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": None,
            "kv_connector_extra_config": {"load_async": True}}
    before = copy.deepcopy(peer)
    prefill, decode = pd_kv_transfer_configs("tcp://127.0.0.1:7711", 5101, 5102, 64,
                                             overrides=(peer, None))
    assert prefill == {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_producer",
        "kv_load_failure_policy": "recompute",
        # None of ours (backend, engine_id, hub...): only this run's lookup port is added.
        "kv_connector_extra_config": {"load_async": True, "lookup_rpc_port": 5101}}
    assert peer == before  # the caller's override is not changed by the port
    prefill["kv_connector_extra_config"]["load_async"] = False
    assert peer["kv_connector_extra_config"]["load_async"] is True  # nor shared with the result
    # The side without an override keeps ours.
    assert decode["kv_connector"] == "KVPoolConnector"
    assert decode["kv_connector_extra_config"]["engine_id"] == "decode-0"
