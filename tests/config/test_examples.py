"""The examples in ``config/`` validate clean; the real published samples
(``config/mindie-samples``) read without error and everything the validator says about them is
true; the JSON Schema is current and accepts them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from kvpool_config import Options, schema_text, validate_files
from kvpool_config.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config"
REAL = CONFIG / "mindie-samples"
"""MindIE Motor's samples as published: real findings, not clean examples."""
SCHEMA_FILE = CONFIG / "kvpool.schema.json"
DASHBOARDS = CONFIG / "grafana"
"""Grafana dashboards, not deployment configs (checked in tests/console/test_hub_metrics.py)."""
EXAMPLES = sorted(p for p in CONFIG.rglob("*.json")
                  if p != SCHEMA_FILE and {DASHBOARDS, REAL}.isdisjoint(p.parents))


def _group(path: Path) -> tuple[list[Path], Path | None, Options]:
    """How an example is validated: a user_config with its sibling env.json; the mixed example
    as a kv_both instance; the local demo's files together (instances on one host)."""
    env = path.parent / "env.json"
    if path.name == "user_config.json":
        return [path], env if env.exists() else None, Options()
    siblings = sorted(p for p in path.parent.glob("*.json") if p.name != "env.json")
    role = "mixed" if path.parent.name == "mixed-kv-both" else None
    return siblings, None, Options(role=role)


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(CONFIG)) for p in EXAMPLES])
def test_config_example_validates_clean(path: Path) -> None:
    files, env, options = _group(path)
    reports = validate_files(files, env_path=env, options=options)
    problems = [(r.path, f) for r in reports for f in r.findings if f.severity != "info"]
    assert problems == []
    assert all(r.shape is not None for r in reports)


def test_config_examples_cover_the_issue_list() -> None:
    names = {str(p.relative_to(CONFIG)) for p in EXAMPLES}
    assert {
        "pd-mooncake/user_config.json",
        "pd-memcache/user_config.json",
        "mixed-kv-both/kv_transfer_config.json",
        "ucm/user_config.json",
        "local-demo/engine_a.kv_transfer_config.json",
        "local-demo/mooncake.json",
    } <= names
    assert (CONFIG / "agent-console" / "kvpool-agent.env").is_file()


def test_strict_cli_exit_zero_on_examples(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        [
            "validate",
            str(CONFIG / "pd-mooncake/user_config.json"),
            "--env",
            str(CONFIG / "pd-mooncake/env.json"),
            "--strict",
        ]
    )
    assert status == 0
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out


def test_real_ucm_sample_findings_are_true() -> None:
    """What the validator says about MindIE Motor's published UCM P/D sample, and why it is true:

    - kv_port "20001" (prefill connectors[0] and decode): Mooncake's Ascend Direct Transport binds
      a random free port in [20000 + 100*dev, 20000 + 100*(dev+1)] per NPU when ASCEND_BASE_PORT
      is unset (env.json does not set it), so 20001 is in NPU 0's window.
    - posix_capacity_gb 1024 on a 512Gi volume: MindIE's UCM guide asks for less than the
      volume's capacity.
    - prefill loads UCM and sets no kv_load_failure_policy: vLLM's default is "fail".
    - notes: kv_cache_store_config.backend mooncake serves P/D transfer in the UCM case (MindIE
      README FAQ); ASCEND_*_TIMEOUT are unset in the env sample (only HCCL_* are), so
      Mooncake's 10000 ms applies, below the 11000 ms default lease.
    """
    reports = validate_files(
        [REAL / "ucm_pd.user_config.json"], env_path=REAL / "glm_5.2_A3.env.json"
    )
    env_report, user_report = reports
    assert (env_report.shape, env_report.findings) == ("env", [])
    got = sorted((f.severity, f.rule, f.path) for f in user_report.findings)
    prefill = "$.motor_engine_prefill_config.engine_config.kv_transfer_config"
    assert got == sorted(
        [
            (
                "warning",
                "ascend-port-window",
                "$.motor_engine_decode_config.engine_config.kv_transfer_config.kv_port",
            ),
            (
                "warning",
                "ascend-port-window",
                f"{prefill}.kv_connector_extra_config.connectors[0].kv_port",
            ),
            (
                "warning",
                "ucm",
                f"{prefill}.kv_connector_extra_config.connectors[1]."
                "kv_connector_extra_config.ucm_connectors[0].ucm_connector_config.posix_capacity_gb",
            ),
            ("warning", "load-failure-policy", f"{prefill}.kv_load_failure_policy"),
            ("info", "ucm", "$.kv_cache_store_config.backend"),
            ("info", "lease-ttl", "$.kv_cache_store_config.default_kv_lease_ttl"),
            ("info", "lease-ttl", "$.kv_cache_store_config.default_kv_lease_ttl"),
        ]
    )
    by_rule = {f.rule: f for f in user_report.findings if f.severity == "warning"}
    assert "20000-21600" in by_rule["ascend-port-window"].message
    assert "16 NPUs" in by_rule["ascend-port-window"].message  # p_pod_npu_num / d_pod_npu_num
    assert by_rule["ucm"].message.startswith("posix_capacity_gb 1024 does not fit the 512Gi volume")


def test_real_samples_read_alone_without_error() -> None:
    reports = validate_files(sorted(REAL.glob("*.json")))
    assert [r.shape for r in reports] == ["env", "user_config"]
    assert not [f for r in reports for f in r.findings if f.severity == "error"]


def test_schema_file_is_current() -> None:
    assert SCHEMA_FILE.read_text() == schema_text(), (
        "config/kvpool.schema.json is stale: run kvpool-config schema --out "
        "config/kvpool.schema.json"
    )


def test_schema_accepts_examples_and_real_samples_and_rejects_bad_values() -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in [*EXAMPLES, *sorted(REAL.glob("*.json"))]:
        errors = list(validator.iter_errors(json.loads(path.read_text())))
        assert errors == [], (path, errors[:1])
    bad = [
        {"kv_connector": "KVPoolConnector", "kv_role": "kv_maker"},
        {"kv_cache_store_config": {"store_mode": "hybrid"}},
        {"kv_cache_store_config": {"eviction_ratio": 1.5}},
        {"kv_cache_store_config": {"local_service_mode": "sidecar"}},
        {"kv_connector": "MultiConnector", "kv_load_failure_policy": "retry"},
        {"master_server_address": "127.0.0.1:50088", "global_segment_size": "lots"},
    ]
    for doc in bad:
        assert list(validator.iter_errors(doc)), doc
