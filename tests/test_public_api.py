"""The public surface of every kvpool package, pinned (like httpx's exported-members test).

A name added to or dropped from a package's ``__all__`` must change this file too, so a change
of the public API is always a visible decision. Modules whose name starts with ``_`` are private;
every other module lists its public names in ``__all__``, and each of them exists.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

PINNED: dict[str, list[str]] = {
    "kvpool_agent": [
        "AGENT_ADDRESS_ENV", "AGENT_KEYS_ENV", "AgentHandle", "CommandError", "FleetClient",
        "FleetEntry", "FleetHub", "KeyPaths", "NullReporter", "PoolOperations", "Reporter",
        "UNAUTHORISED", "generate_keys", "hub_ports", "local_fleet_keys", "start_agent",
    ],
    "kvpool_connector": ["KVPoolConnector"],
    # Empty on purpose: importing the console package must not load Textual; it is used
    # through its CLI and its modules.
    "kvpool_console": [],
    "kvpool_config": [
        "ConfigLoadError", "FileReport", "Finding", "Options", "RenderError", "Rendered",
        "Shape", "detect_shape", "kvpool_schema", "load_json", "render_mooncake",
        "schema_text", "validate_document", "validate_files",
    ],
    "kvpool_policy": [
        "AccessRecord", "Decision", "PoolPolicy", "per_engine_hits", "policy_hits",
        "simulate_row",
    ],
    "kvpool_replay": [
        "CONNECTOR_EVICTION_LEASE_MS", "DEMO_SHAPE", "DemoCluster", "DiskTier", "EngineResult",
        "EngineSpec", "LocalMooncakeMaster", "LocalPolicyService",
        "LocalPoolStore", "LocalYuanrongWorker", "ModelShape", "ReplayConfig", "ReplayReport",
        "ReuseResult", "TraceError", "TraceRequest", "belady_hits", "build_tiny_model",
        "default_trace_path",
        "engine_env", "free_port", "free_port_block", "load_trace", "lru_hits",
        "mooncake_extra_config", "prefix_ceiling", "reference_for", "request_tokens", "run_replay",
    ],
}


def _public_modules(package: str) -> list[str]:
    """Every module under ``package`` whose dotted path has no ``_``-prefixed part."""
    out = []
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            out.append(info.name)
    return out


@pytest.mark.parametrize("package", sorted(PINNED))
def test_package_exports_are_pinned(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PINNED[package])
    for name in module.__all__:
        assert getattr(module, name, None) is not None, f"{package}.{name} is in __all__ only"


@pytest.mark.parametrize("package", sorted(PINNED))
def test_every_public_module_declares_what_it_exports(package: str) -> None:
    modules = _public_modules(package)
    assert modules, f"{package} has no public module"
    for name in modules:
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{name} is public (no leading _) but has no __all__"
        missing = [n for n in exported if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names {missing}, which it does not define"


MODULES_USED_ACROSS_PACKAGES: dict[str, list[str]] = {
    # kvpool_connector.operations audits its own reset flush with the hub's line format.
    "kvpool_agent.audit": ["AUDIT_ERROR_CHARS", "AUDIT_IDS_SHOWN", "AUDIT_LINE_MAX_BYTES",
                           "CHANGES", "audit", "audit_line"],
    # The policy service caps its snapshot subscribers per key with the hub's mechanism.
    "kvpool_agent.key_caps": ["ADMIT_WINDOW_S", "MAX_AGENT_CONNECTIONS_PER_FLEET_KEY",
                              "MAX_AGENT_CONNECTIONS_PER_KEY", "MAX_CONNECTIONS_PER_KEY",
                              "MAX_SUBSCRIBERS_PER_KEY", "CappedAdmission", "KeyCaps",
                              "KeyKind", "Refusal", "admit_message", "key_kind", "shut_down"],
    # kvpool_policy's offline model runs the connector's own admission and eviction.
    "kvpool_connector.admission": ["AdaptiveAdmission", "AdmissionMode", "AdmissionPolicy",
                                   "AdmitAll", "admission_for", "doorkeeper_seen"],
    "kvpool_connector.eviction": ["RECENT_EVICTIONS", "ConnectorEviction", "EvictionMode",
                                  "watermark_conflict"],
    # The pool-wide policy service (kvpool_policy.service) and the engines share its wire,
    # and it removes keys under the connector's removal rule.
    "kvpool_connector.policy_wire": [
        "FULL_EVERY_S", "MAX_BATCH_BYTES", "MAX_HASHES", "MAX_RECORDS", "SNAPSHOT_EVERY_S",
        "WIRE_VERSION", "AdmissionSnapshot", "DeltaError", "PolicyLayout", "PolicyRecord",
        "RecordBatch", "SnapshotReader", "apply_delta", "changed_words", "policy_ports"],
    "kvpool_connector.removal_rule": ["REMOVAL_GRACE", "LeasedKeys", "grace_s_of"],
    # The connector's vLLM metrics and the policy service's /metrics name their facts from
    # the one catalogue.
    "kvpool_agent.ledger": ["CountedBy", "FACTS", "Fact", "HUB_COUNTERS", "Kind", "Surface",
                            "fact", "facts_on", "metric_fact"],
    # kvpool_replay's ReplayConfig and LocalPolicyService name the service's admissions.
    "kvpool_policy.policy": ["S3FIFO", "AccessRecord", "AdmissionKind", "Decision",
                             "EvictionKind", "LeafFirstLRU", "PolicyKey", "PoolPolicy"],
    # Every command's parser: a usage error is one line (one owner).
    "kvpool_agent.cli_parser": ["EXIT_USAGE", "CommandParser", "int_at_least", "number_in"],
    # The hub's and the policy service's /metrics endpoint (one owner).
    "kvpool_agent.metrics_http": ["MetricsEndpoint"],
    # The console's pool names and pool_no_segments follow the hub's pool rule (one owner).
    "kvpool_agent.pool_readings": ["PoolReading", "Shape", "newest_readings", "pool_name",
                                   "shape", "trusted_reading"],
    # The connector's Mooncake backend counts dry runs with the store agent's listing, and
    # builds its keys under the KV key namespace (one owner each).
    "kvpool_agent.pool_listing": ["ALL_KEYS_PATTERN", "KEY_RE", "QUERY_BATCH", "count_keys",
                                  "key_sizes", "list_keys", "size_group"],
    # kvpool_replay's reference figures are the agent's cache models (one owner).
    "kvpool_agent.reuse": ["CURVE_FACTORS", "Admission", "CurvePoint", "ReuseResult",
                           "belady_hits", "capacity_curve", "claimable_chunks", "lru_hits",
                           "prefix_ceiling"],
}
"""Public modules another kvpool package imports from, their ``__all__`` pinned too."""


@pytest.mark.parametrize("module", sorted(MODULES_USED_ACROSS_PACKAGES))
def test_modules_used_across_packages_are_pinned(module: str) -> None:
    assert sorted(importlib.import_module(module).__all__) == sorted(
        MODULES_USED_ACROSS_PACKAGES[module])
