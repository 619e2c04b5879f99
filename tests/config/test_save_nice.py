"""``save_nice`` (issue 38): the connector takes 0-19 nice levels (default 0) and refuses
anything else in one line naming the key; ``kvpool-config validate`` refuses what it refuses
(exit 2, the field's path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_config.cli import main
from kvpool_connector.config import KVPoolConfig


def _parse(extra: dict[str, object]) -> KVPoolConfig:
    return KVPoolConfig.from_dicts(extra, kv_role="kv_both", block_size=16, model="m")


def test_connector_takes_0_to_19_and_defaults_to_0() -> None:
    assert _parse({}).save_nice == 0
    assert _parse({"save_nice": 19}).save_nice == 19
    for bad in (20, -1, "low", True, "5", 5.0):
        with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.save_nice"):
            _parse({"save_nice": bad})


@pytest.mark.parametrize("value", [20, -1, "low", True])
def test_validate_refuses_what_the_connector_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], value: object) -> None:
    f = tmp_path / "kv_transfer_config.json"
    f.write_text(json.dumps({
        "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": "mooncake", "engine_id": "engine-a",
                                      "save_nice": value}}))
    rc = main(["validate", "--json", str(f)])
    errors = [x for x in json.loads(capsys.readouterr().out)["findings"]
              if x["severity"] == "error"]
    assert rc == 2 and len(errors) == 1, errors
    assert errors[0]["path"] == "$.kv_connector_extra_config.save_nice"
