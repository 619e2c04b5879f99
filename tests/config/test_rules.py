"""Every rule of issue 5 has a minimal broken file in ``cases/`` and the exact finding it produces.

``expected_findings.json`` lists, per case file, every error and warning the validator must
report for it (severity, rule id, JSON path, message), no more and no less; ``info`` notes are
checked in ``test_examples.py``. ``ISSUE_RULES`` ties each rule of the issue to its cases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool_config import Finding, Options, load_json, validate_document, validate_files
from kvpool_config._model import KVPOOL_EXTRA_KEYS
from kvpool_config.rules import check_agent_address
from kvpool_connector.config import KVPoolConfig

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
CASES = HERE / "cases"
EXPECTED: list[dict[str, Any]] = json.loads((HERE / "expected_findings.json").read_text())

ISSUE_RULES: dict[str, list[str]] = {
    "malformed or truncated JSON gives one clear error": [
        "malformed.json",
        "truncated.json",
        "empty.json",
        "unknown_shape.json",
        "type_kv_port.json",
    ],
    "MultiConnector: transfer connector first, store connector second": [
        "connector_order.json",
        "ucm_order.json",
    ],
    "connector names outside the known set are reported": ["unknown_connector.json"],
    "unknown or misplaced keys (with the place they belong)": [
        "unknown_top_key.json",
        "misplaced_top_key.json",
        "misspelt_extra_key.json",
        "misplaced_store_key.json",
        "misplaced_connector_key.json",
        "deprecated_rpc_port.json",
        "env_misplaced.env.json",
    ],
    "kv_role per instance; MultiConnector children agree with the parent": [
        "kv_role_prefill.json",
        "kv_role_parent_only.json",
        "kv_role_plain.json",
        "child_role.json",
    ],
    "store connector backend equals kv_cache_store_config.backend; allowed values": [
        "backend_match.json",
        "backend_choice.json",
        "backend_ucm.json",
        "backend_yuanrong.json",
        "store_config_missing.json",
        "store_one_side.json",
    ],
    "mooncake eviction ratios required and in (0, 1]": [
        "eviction_missing.json",
        "eviction_range.json",
    ],
    "default_kv_lease_ttl exceeds ASCEND_CONNECT_TIMEOUT and ASCEND_TRANSFER_TIMEOUT": [
        "lease_ttl.json",
        "lease_ttl_string.json",
        "env_timeout_units.env.json",
        "env_timeout_int.env.json",
    ],
    "global_segment_size parses; whole GB with FabricMem": [
        "segment_parse.json",
        "segment_fabric.json",
        "env_consistency.env.json",
    ],
    "store_mode embedded|standalone": ["store_mode.json"],
    "ssd_offload_path absolute": ["ssd_path.json"],
    "SSD tier environment: absolute path, byte counts, staging buffer vs value and tier": [
        "offload_env.env.json",
        "offload_staging.env.json",
    ],
    "protocol is known": ["protocol.json", "protocol_npu.json", "mooncake_address.json"],
    "memcache local_service_mode inprocess|standalone": ["local_service_mode.json"],
    "kv_port inside the Ascend Direct Transport port range collides": ["ascend_port_window.json"],
    "no two services share a port": ["engine_port_conflict.json", "store_port_conflict.json"],
    "use_layerwise needs piecewise graph capture": ["layerwise_graph.json", "layerwise_role.json"],
    "prefill_pp_layer_partition sums to the model's layer count": ["pp_partition.json"],
    "block size multiple of the hash block size": ["block_size.json", "chunk_size.json"],
    "hybrid-attention model needs MooncakeHybridConnector": ["hybrid_connector.json"],
    "KVPoolConnector on a hybrid model: keep vLLM's hybrid allocator, no use_layerwise": [
        "hybrid_kvpool.json"],
    "UCM: kv_both on prefill only, decode does not load it": [
        "ucm_role.json",
        "ucm_decode.json",
        "ucm_mount.json",
        "ucm_capacity.json",
    ],
    "a kv_consumer's pool connector loads or saves, or a P/D transfer connector is beside it": [
        "consumer_unused.json"],
    "target_job_id: what happens, deploy_mode mismatch": ["target_job.json"],
    "kv_load_failure_policy recompute recommended, top level under MultiConnector": [
        "load_policy_unset.json",
        "load_policy_bad.json",
        "load_policy_child.json",
    ],
    "connector settings this project and vllm-ascend check at start-up": [
        "module_path.json",
        "agent_address.json",
        "qos_priority.json",
        "pythonhashseed.json",
    ],
}


def _findings(spec: dict[str, Any]) -> list[dict[str, str]]:
    target = load_json(CASES / spec["target"]) if "target" in spec else None
    options = Options(**spec.get("options", {}), target=target)
    env = CASES / spec["env"] if "env" in spec else None
    report = validate_files([CASES / spec["case"]], env_path=env, options=options)[-1]
    return sorted(
        (
            {"severity": f.severity, "rule": f.rule, "path": f.path, "message": f.message}
            for f in report.findings
            if f.severity != "info"
        ),
        key=lambda d: (d["path"], d["message"]),
    )


@pytest.mark.parametrize("spec", EXPECTED, ids=[s["case"] for s in EXPECTED])
def test_broken_case_produces_exactly_its_findings(spec: dict[str, Any]) -> None:
    expected = sorted(
        ({**e, "message": e["message"].replace("{cases}", str(CASES))} for e in spec["expected"]),
        key=lambda d: (d["path"], d["message"]),
    )
    assert _findings(spec) == expected


def test_every_issue_rule_has_a_case_and_every_case_a_rule() -> None:
    named = {case for cases in ISSUE_RULES.values() for case in cases}
    checked = {spec["case"] for spec in EXPECTED}
    assert named == checked
    for case in named:
        assert (CASES / case).is_file(), case


def test_lookup_rpc_port_unique_per_instance_on_one_host() -> None:
    reports = validate_files([CASES / "host_a.json", CASES / "host_b.json"])
    assert [f for f in reports[0].findings if f.severity != "info"] == []
    [clash] = reports[1].findings
    assert (clash.severity, clash.rule, clash.path) == (
        "error",
        "lookup-rpc-port",
        "$.kv_connector_extra_config.lookup_rpc_port",
    )
    assert clash.message == (
        f"lookup_rpc_port uses port 1, already used by lookup_rpc_port ({CASES}/host_a.json: "
        "$.kv_connector_extra_config.lookup_rpc_port) on the same host"
    )
    assert clash.fix == "give every instance on the host its own lookup_rpc_port"


def test_kvpool_lookup_port_unset_on_two_instances_is_no_clash(tmp_path: Path) -> None:
    """KVPoolConnector without lookup_rpc_port (or with 0) names its socket from vLLM's
    instance id; AscendStoreConnector's 0 is a real port and still clashes."""
    paths = []
    for i, (connector, extra) in enumerate([("KVPoolConnector", {}),
                                            ("KVPoolConnector", {"lookup_rpc_port": 0}),
                                            ("AscendStoreConnector", {"lookup_rpc_port": 0}),
                                            ("AscendStoreConnector", {"lookup_rpc_port": 0})]):
        doc = json.loads((CASES / "host_a.json").read_text())
        doc["kv_connector"] = connector
        doc["kv_connector_extra_config"] = {"backend": "mooncake", **extra}
        if connector != "KVPoolConnector":
            del doc["kv_connector_module_path"]
        paths.append(tmp_path / f"i{i}.json")
        paths[-1].write_text(json.dumps(doc))
    reports = validate_files(paths)
    assert [f.rule for r in reports for f in r.findings if f.rule == "lookup-rpc-port"] == [
        "lookup-rpc-port"]
    assert [f.rule for f in reports[3].findings] == ["lookup-rpc-port"]


def test_ascend_base_port_moves_the_port_window() -> None:
    """The same kv_port 20001 is fine once ASCEND_BASE_PORT moves the window above it."""
    doc = load_json(CASES / "ascend_port_window.json")
    user = {
        "kv_cache_store_config": {
            "backend": "mooncake",
            "eviction_high_watermark_ratio": 0.9,
            "eviction_ratio": 0.1,
        },
        "motor_engine_union_config": {"engine_config": {"kv_transfer_config": doc}},
    }
    moved = {"motor_common_env": {"ASCEND_BASE_PORT": "40000", "PYTHONHASHSEED": "0"}}
    rules = {f.rule for f in validate_document(user, "user_config", env=moved)}
    assert "ascend-port-window" not in rules
    rules = {f.rule for f in validate_document(user, "user_config", env={"motor_common_env": {}})}
    assert "ascend-port-window" in rules


def test_kvpool_connector_keys_match_the_connector() -> None:
    """The validator's KVPoolConnector keys are the ones KVPoolConfig accepts, and a misspelt
    key the validator flags is one the connector rejects at start-up too."""
    values = {
        "backend": "mooncake",
        "chunk_size": 16,
        "use_layerwise": True,
        "load_async": True,
        "consumer_is_to_load": True,
        "consumer_is_to_put": True,
        "lookup_rpc_port": 3,
        "lookup_async": False,
        "lookup_timeout_ms": 100,
        "layerwise_timeout_ms": 100,
        "agent_address": "tcp://127.0.0.1:7600",
        "engine_id": "e",
        "lease_ttl_ms": 5000,
        "agent_keys": "/etc/kvpool/agent",
        "lookup_breaker_failures": 2,
        "lookup_breaker_open_ms": 1000,
        "save_budget": "64MB",
        "staging_buffer": "32MB",
        "save_nice": 10,
        "transfer_cpus": "6-7",
        "checksum": True,
        "instance_role": "prefill",
        "hash_algo": "xxh3_128",
        "model_fingerprint": "llama-3-8b-build-42",
        "reset_flush_scope": "engine",
        "admission": "adaptive",
        "admission_pool_tokens": 2_000_000,
        "eviction": "connector",
        "handover_wait_ms": 2000,
        "store_tp_size": 4,
        "store_pp_layer_partition": [10, 22],
        "pin_share": 0.2,
        "policy_service": "tcp://10.0.0.5:5600",
        "policy_stale_ms": 2000,
    }
    assert set(values) == KVPOOL_EXTRA_KEYS
    cfg = KVPoolConfig.from_dicts(values, kv_role="kv_both", block_size=16, model="m")
    assert (cfg.chunk_size, cfg.lookup_rpc_port, cfg.engine_id) == (16, 3, "e")
    assert cfg.lookup_async is False
    assert cfg.agent_keys == "/etc/kvpool/agent"
    assert cfg.save_budget_bytes == 64 << 20 and cfg.checksum is True
    assert cfg.staging_buffer_bytes == 32 << 20 and cfg.save_nice == 10
    assert cfg.transfer_cpus == "6-7"
    assert cfg.model_fingerprint == "llama-3-8b-build-42"
    assert (cfg.instance_role, cfg.hash_algo) == ("prefill", "xxh3_128")
    assert cfg.reset_flush_scope == "engine"
    assert (cfg.admission, cfg.admission_pool_tokens) == ("adaptive", 2_000_000)
    assert cfg.eviction == "connector"
    assert cfg.store_tp_size == 4 and cfg.store_pp_layer_partition == (10, 22)
    assert cfg.pin_share == 0.2
    assert (cfg.policy_service, cfg.policy_stale_ms) == ("tcp://10.0.0.5:5600", 2000)
    with pytest.raises(ValueError, match=r"pin_share"):
        KVPoolConfig.from_dicts({"pin_share": 1.5}, kv_role="kv_both", block_size=16, model="m")
    assert KVPoolConfig.from_dicts({}, kv_role="kv_both", block_size=16,
                                   model="m").reset_flush_scope == "none"
    with pytest.raises(ValueError, match="reset_flush_scope"):
        KVPoolConfig.from_dicts({"reset_flush_scope": "all"}, kv_role="kv_both", block_size=16,
                                model="m")
    with pytest.raises(ValueError, match="hash_algo"):
        KVPoolConfig.from_dicts({"hash_algo": "md5"}, kv_role="kv_both", block_size=16,
                                model="m")
    with pytest.raises(ValueError, match="save_budget: '1GiB' is not a size"):
        KVPoolConfig.from_dicts({"save_budget": "1GiB"}, kv_role="kv_both", block_size=16,
                                model="m")
    with pytest.raises(ValueError, match="lookup_rpc_prot: unknown field; did you mean"):
        KVPoolConfig.from_dicts({"lookup_rpc_prot": 1}, kv_role="kv_both", block_size=16, model="m")


def _infos(findings: list[Finding]) -> dict[str, str]:
    return {f.rule: f.message for f in findings if f.severity == "info"}


def test_info_notes_say_what_will_happen() -> None:
    target = load_json(CASES / "target_job.target.json")
    [report] = validate_files([CASES / "target_job.json"], options=Options(target=target))
    notes = _infos(report.findings)
    assert notes["target-job-id"] == (
        "deploy.py reuses the kv_store of namespace 'service-a' if its kv_store Service and a "
        "Running kv_store pod exist there; otherwise it falls back to deploying a new kv_store "
        "in 'service-b'. Reuse needs the target deployed with the same deploy_mode "
        "(multi_deployment)"
    )
    assert notes["store-port"] == "port unset: deploy.py uses 50088 for the kv_store service"
    same = load_json(CASES / "target_job.json")
    same["kv_cache_store_config"]["target_job_id"] = "service-b"
    notes = _infos(validate_document(same, "user_config"))
    assert notes["target-job-id"] == (
        "target_job_id equals this service's job_id 'service-b': deploy.py deploys a new "
        "kv_store pod in this namespace"
    )
    demo = load_json(ROOT / "config/local-demo/engine_a.kv_transfer_config.json")
    demo["kv_connector_extra_config"]["backend"] = "memcache"
    assert _infos(validate_document(demo, "kv_transfer_config"))["backend"].startswith(
        "the memcache backend needs Ascend drivers"
    )


@pytest.mark.parametrize("extra", [{"consumer_is_to_load": "true"},  # the connector reads it
                                   {"consumer_is_to_put": True}])
def test_a_consumer_that_loads_or_saves_uses_the_pool(tmp_path: Path,
                                                      extra: dict[str, Any]) -> None:
    doc = json.loads((CASES / "consumer_unused.json").read_text())
    doc["kv_connector_extra_config"] = {"backend": "mooncake", **extra}
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(doc))
    (report,) = validate_files([path])
    assert [f.rule for f in report.findings if f.rule == "consumer-unused"] == []
    # The case itself, unchanged, is warned about (test_broken_case_produces_exactly_...).
    (broken,) = validate_files([CASES / "consumer_unused.json"])
    assert [f.rule for f in broken.findings if f.severity != "info"] == ["consumer-unused"]


def test_an_engine_held_segment_is_a_note() -> None:
    """An engine whose Mooncake config gives the pool memory (global_segment_size above 0, not
    store_mode standalone) is told its segment goes with it: a note, not a warning (the
    examples keep validating clean under --strict)."""
    engine = load_json(ROOT / "config/local-demo/mooncake.json")
    notes = [f for f in validate_document(engine, "mooncake_config") if f.rule == "engine-segment"]
    assert [(f.severity, f.path) for f in notes] == [("info", "$.global_segment_size")]
    assert notes[0].message.startswith(
        "global_segment_size '512MB': every engine gives the pool a segment of its own memory, "
        "which goes with the engine: the pool's objects in it are lost when the engine stops")
    assert "client_ttl, 10 s by default" in notes[0].message
    assert "separate mooncake_client store process" in notes[0].message
    for client in ({**engine, "global_segment_size": 0, "store_mode": "standalone"},
                   {**engine, "global_segment_size": "1GB", "store_mode": "standalone"},
                   {**engine, "global_segment_size": 0}):
        assert _infos(validate_document(client, "mooncake_config")).get("engine-segment") \
            is None
    # MindIE: kv_cache_store_config embedded (the default) puts the segment in the engines.
    user = load_json(ROOT / "config/pd-mooncake/user_config.json")
    (note,) = [f for f in validate_document(user, "user_config") if f.rule == "engine-segment"]
    assert (note.severity, note.path) == ("info", "$.kv_cache_store_config.global_segment_size")
    assert note.message.startswith("global_segment_size '4GB': every engine gives the pool")
    user["kv_cache_store_config"]["store_mode"] = "standalone"
    assert "engine-segment" not in _infos(validate_document(user, "user_config"))


@pytest.mark.parametrize(("address", "ok"), [
    ("tcp://10.0.0.5:7600", True), ("tcp://[::1]:7600", True), ("tcp://*:7600", False),
    ("tcp://:7600", False), ("10.0.0.5:7600", False), ("tcp://10.0.0.5:70000", False),
])
def test_agent_address_is_an_address_to_connect_to(address: str, ok: bool) -> None:
    """The wildcard ``*`` is the hub's listen form (``kvpool-agent hub --address``); an engine
    cannot connect to it (``kvpool-replay --agent-address`` checks with the same rule)."""
    got = check_agent_address(address, path="$.agent_address")
    assert (got is None) == ok, got
