"""``kvpool-config validate`` refuses what KVPoolConnector itself refuses at engine start (it
parses ``kv_connector_extra_config`` with the connector's own ``KVPoolConfig.from_dicts``):
before, a negative ``save_budget`` or a misspelt key validated clean (or as a warning saying
the connector ignores it) and the engine then did not start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_config.cli import main
from kvpool_connector.config import CONNECTOR_EXTRA_KEYS

_BASE = {
    "kv_connector": "KVPoolConnector",
    "kv_connector_module_path": "kvpool_connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"backend": "mooncake", "engine_id": "engine-a"},
}


def _validate(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict[str, object]
              ) -> tuple[Path, list[dict[str, object]]]:
    """``kvpool-config validate --json`` of the base kv_transfer_config with ``extra`` in its
    connector config (exit 2 asserted): the file and its findings."""
    cfg = json.loads(json.dumps(_BASE))
    cfg["kv_connector_extra_config"].update(extra)
    f = tmp_path / "kv_transfer_config.json"
    f.write_text(json.dumps(cfg))
    assert main(["validate", "--json", str(f)]) == 2
    return f, json.loads(capsys.readouterr().out)["findings"]


@pytest.mark.parametrize(("extra", "path", "says"), [
    ({"save_budget": -5}, "save_budget", "-5 is not a size"),
    ({"save_budget": 0}, "save_budget", "more than 0 bytes"),
    ({"save_budget": True}, "save_budget", "True is not a size"),
    # pydantic's four union errors before; 1.5 was taken as 1 byte.
    ({"save_budget": None}, "save_budget", "null is not a size"),
    ({"save_budget": 1.5}, "save_budget", "1.5 is not a whole number of bytes"),
    ({"lookup_timeout_ms": -1}, "lookup_timeout_ms", "greater than 0"),
    ({"save_budgt": "1MB"}, "save_budgt", "refuses it at start"),
])
def test_a_value_the_connector_refuses_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict[str, object], path: str,
    says: str,
) -> None:
    _, findings = _validate(tmp_path, capsys, extra)
    errors = [x for x in findings if x["severity"] == "error"]
    assert len(errors) == 1, errors
    assert errors[0]["path"] == f"$.kv_connector_extra_config.{path}"
    assert says in errors[0]["message"]


def test_the_same_config_with_a_valid_value_is_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = json.loads(json.dumps(_BASE))
    cfg["kv_connector_extra_config"]["save_budget"] = "64MB"
    f = tmp_path / "kv_transfer_config.json"
    f.write_text(json.dumps(cfg))
    assert main(["validate", str(f)]) == 0


_REFUSED = "KVPoolConnector refuses it and the engine does not start"


@pytest.mark.parametrize(("extra", "path", "message", "fix"), [
    ({"lookup_rpc_port": 70000}, "lookup_rpc_port",
     "lookup_rpc_port 70000: input should be less than or equal to 65535",
     "use a value of at most 65535"),
    ({"lookup_rpc_port": -5}, "lookup_rpc_port",
     "lookup_rpc_port -5: input should be greater than or equal to 0",
     "use a value of at least 0"),
    ({"chunk_size": "big"}, "chunk_size",
     'chunk_size "big": input should be a valid integer, unable to parse string as an integer',
     "use an integer"),  # chunk_size has no default: it follows vLLM's block size
    ({"save_nice": "3"}, "save_nice", 'save_nice "3": input should be a valid integer',
     "use an integer (no quotes), e.g. 0"),
    ({"admission": True}, "admission",
     "admission true: input should be 'all', 'adaptive' or 'service'",
     "use one of all, adaptive, service"),
    ({"store_pp_layer_partition": [10, -2]}, "store_pp_layer_partition[1]",
     "store_pp_layer_partition[1] -2: input should be greater than 0", "use a value above 0"),
    ({"admission": "service", "policy_service": "tcp://127.0.0.1:0"}, "policy_service",
     "policy_service: 'tcp://127.0.0.1:0' is not tcp://HOST:PORT (records on PORT, snapshots "
     "on PORT+1)",
     "set policy_service, e.g. tcp://10.0.0.5:5600"),
    ({"transfer_cpus": "a-b"}, "transfer_cpus",
     "transfer_cpus: 'a-b' is not a CPU or a range like 6-7",
     "use 'auto', 'inherit' or a CPU list like \"6-7\""),
])
def test_a_refused_value_gets_a_concrete_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict[str, object], path: str,
    message: str, fix: str,
) -> None:
    """The fix was "fix it: KVPoolConnector refuses it..." for every value; now it comes from
    pydantic's error (its type and bound, the field's default as the example) or from the
    connector's own message."""
    f, findings = _validate(tmp_path, capsys, extra)
    assert [x for x in findings if x["severity"] == "error"] == [{
        "file": str(f), "severity": "error", "rule": "connector-config",
        "path": f"$.kv_connector_extra_config.{path}", "message": f"{message}; {_REFUSED}",
        "fix": fix,
    }]


def test_two_refused_values_are_two_findings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Before, the second field's error ended up inside the first one's message."""
    cfg = json.loads(json.dumps(_BASE))
    cfg["kv_connector_extra_config"].update({"chunk_size": 0, "pin_share": 2})
    f = tmp_path / "kv_transfer_config.json"
    f.write_text(json.dumps(cfg))
    assert main(["validate", "--json", str(f)]) == 2
    errors = [(x["path"], x["fix"]) for x in json.loads(capsys.readouterr().out)["findings"]
              if x["severity"] == "error"]
    assert errors == [("$.kv_connector_extra_config.chunk_size", "use a value above 0"),
                      ("$.kv_connector_extra_config.pin_share",
                       "use a value of at most 1.0")]


@pytest.mark.parametrize(("extra", "path", "fix"), [
    ({"save_budget": -5}, "save_budget",
     'set save_budget to a value KVPoolConnector takes, e.g. "256MB" (its default), or leave '
     "it out"),
    ({"staging_buffer": -1}, "staging_buffer",
     'set staging_buffer to a value KVPoolConnector takes, e.g. "auto" (its default), or '
     "leave it out"),
    ({"save_budget": "1 gallon"}, "save_budget",
     'set save_budget, e.g. "1GB", "512 MB", "1.5g" (1K = 1024 bytes; no KiB/GiB)'),
])
def test_a_check_whose_message_names_no_fix_gets_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict[str, object], path: str,
    fix: str,
) -> None:
    """The connector's own checks (``parse_size``: "-5 is not a size: a byte count is a number
    >= 0") gave a finding with an empty fix; now the field's default is the example."""
    _, findings = _validate(tmp_path, capsys, extra)
    assert [(x["path"], x["fix"]) for x in findings if x["severity"] == "error"] == [
        (f"$.kv_connector_extra_config.{path}", fix)]


@pytest.mark.parametrize("key", sorted(CONNECTOR_EXTRA_KEYS))
def test_every_refused_field_names_itself_and_a_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str,
) -> None:
    """Every connector key, given values of each wrong kind: each error finding is at the
    field's path and has a fix (pydantic's errors, the connector's own checks and its
    cross-field checks alike)."""
    refused = 0
    for bad in (-5, 0, "zz", True, [1], {"a": 1}, 70000):
        cfg = json.loads(json.dumps(_BASE))
        cfg["kv_connector_extra_config"][key] = bad
        f = tmp_path / "kv_transfer_config.json"
        f.write_text(json.dumps(cfg))
        main(["validate", "--json", str(f)])
        errors = [x for x in json.loads(capsys.readouterr().out)["findings"]
                  if x["severity"] == "error"]
        refused += bool(errors)
        for x in errors:
            assert x["path"].startswith("$.kv_connector_extra_config."), (key, bad, x)
            assert x["fix"].strip(), (key, bad, x)
    # Every key refuses some of these (a string key refuses a list, a bool one a number).
    assert refused > 0, key
