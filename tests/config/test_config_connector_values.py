"""``kvpool-config validate`` refuses what KVPoolConnector itself refuses at engine start (it
parses ``kv_connector_extra_config`` with the connector's own ``KVPoolConfig.from_dicts``):
before, a negative ``save_budget`` or a misspelt key validated clean (or as a warning saying
the connector ignores it) and the engine then did not start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_config.cli import main

_BASE = {
    "kv_connector": "KVPoolConnector",
    "kv_connector_module_path": "kvpool_connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"backend": "mooncake", "engine_id": "engine-a"},
}


@pytest.mark.parametrize(("extra", "path", "says"), [
    ({"save_budget": -5}, "save_budget", "-5 is not a size"),
    ({"save_budget": 0}, "save_budget", "more than 0 bytes"),
    ({"save_budget": True}, "save_budget", "True is not a size"),
    ({"lookup_timeout_ms": -1}, "lookup_timeout_ms", "greater than 0"),
    ({"save_budgt": "1MB"}, "save_budgt", "refuses it at start"),
])
def test_a_value_the_connector_refuses_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict[str, object], path: str,
    says: str,
) -> None:
    cfg = json.loads(json.dumps(_BASE))
    cfg["kv_connector_extra_config"].update(extra)
    f = tmp_path / "kv_transfer_config.json"
    f.write_text(json.dumps(cfg))
    assert main(["validate", "--json", str(f)]) == 2
    findings = json.loads(capsys.readouterr().out)["findings"]
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
