"""One finding per problem, at its real path: a value checked by the file's model, its
section's model and its own rule was up to three errors on one path; a plain kv_transfer_config's
bad kv_role was a second error at ``$.kv_transfer_config.kv_role``, a path the file does not
have. A mooncake.json or kv_transfer_config without the key that identifies it was "unknown
file shape": its name or its other keys say which it is, so the finding is the missing key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool_config.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config"


def _errors(path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, str]]:
    assert main(["validate", "--json", str(path)]) == 2
    report = json.loads(capsys.readouterr().out)
    return [{k: f[k] for k in ("rule", "path", "message", "fix")}
            for f in report["findings"] if f["severity"] == "error"]


def _write(tmp_path: Path, name: str, doc: Any) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_a_bad_lease_ttl_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads((CONFIG / "pd-mooncake" / "user_config.json").read_text())
    doc["kv_cache_store_config"]["default_kv_lease_ttl"] = "15s"
    assert _errors(_write(tmp_path, "user_config.json", doc), capsys) == [{
        "rule": "lease-ttl",
        "path": "$.kv_cache_store_config.default_kv_lease_ttl",
        "message": "default_kv_lease_ttl must be a whole number of milliseconds, got '15s'",
        "fix": 'write it as a number: "default_kv_lease_ttl": 11000',
    }]


def test_a_type_error_without_a_rule_of_its_own_is_reported_once_by_its_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads((CONFIG / "pd-mooncake" / "user_config.json").read_text())
    doc["kv_cache_store_config"]["store_http_port"] = "abc"
    assert _errors(_write(tmp_path, "user_config.json", doc), capsys) == [{
        "rule": "type",
        "path": "$.kv_cache_store_config.store_http_port",
        "message": 'kv_cache_store_config: store_http_port has the wrong type (str "abc")',
        "fix": "see config/kvpool.schema.json for the expected type (Input should be a valid "
               "integer, unable to parse string as an integer)",
    }]


def test_a_bad_kv_role_is_one_error_at_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads((CONFIG / "local-demo" / "engine_a.kv_transfer_config.json").read_text())
    doc["kv_role"] = "kv_everything"
    assert _errors(_write(tmp_path, "kv_transfer_config.json", doc), capsys) == [{
        "rule": "kv-role",
        "path": "$.kv_role",
        "message": "kv_role 'kv_everything' is not one of kv_producer, kv_consumer, kv_both",
        "fix": 'use "kv_both"',
    }]


_NO_MASTER = {
    "rule": "master-address",
    "path": "$.master_server_address",
    "message": "master_server_address is missing",
    "fix": "add the master's HOST:PORT, e.g. \"<master_ip>:50088\" (the port mooncake_master "
           "listens on), or \"etcd://<etcd_ip>:2379\" for an HA pool (masters run with "
           "--enable_ha); or set MOONCAKE_MASTER=HOST:PORT in every engine's environment",
}
_NO_CONNECTOR = {
    "rule": "connector",
    "path": "$.kv_connector",
    "message": "kv_connector is missing",
    "fix": 'name the connector, e.g. "MultiConnector" or "KVPoolConnector"',
}


@pytest.mark.parametrize(("example", "key", "name", "error"), [
    ("local-demo/mooncake.json", "master_server_address", "mooncake.json", _NO_MASTER),
    ("local-demo/mooncake.json", "master_server_address", "client.json", _NO_MASTER),
    ("local-demo/engine_a.kv_transfer_config.json", "kv_connector",
     "engine_a.kv_transfer_config.json", _NO_CONNECTOR),
    ("local-demo/engine_a.kv_transfer_config.json", "kv_connector", "engine.json",
     _NO_CONNECTOR),
], ids=["mooncake-by-name", "mooncake-by-keys", "ktc-by-name", "ktc-by-keys"])
def test_a_missing_identifying_key_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], example: str, key: str, name: str,
    error: dict[str, str],
) -> None:
    doc = json.loads((CONFIG / example).read_text())
    del doc[key]
    path = _write(tmp_path, name, doc)
    assert _errors(path, capsys) == [error]
    assert main(["validate", str(path)]) == 2
    shape = "mooncake_config" if key == "master_server_address" else "kv_transfer_config"
    assert capsys.readouterr().out.startswith(f"{path} ({shape}): 1 error(s)")


def test_a_file_neither_name_nor_keys_identify_is_still_an_unknown_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "settings.json", {"model": "qwen3", "kv_role": "kv_both"})
    assert main(["validate", str(path)]) == 2
    assert f"  error: {path}:1:1: unknown file shape: expected a MindIE user_config.json" \
        in capsys.readouterr().out


def test_a_lookup_port_example_is_a_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads((CONFIG / "local-demo" / "engine_a.kv_transfer_config.json").read_text())
    doc["kv_connector_extra_config"]["lookup_rpc_port"] = "abc"
    assert _errors(_write(tmp_path, "kv_transfer_config.json", doc), capsys) == [{
        "rule": "type",
        "path": "$.kv_connector_extra_config.lookup_rpc_port",
        "message": "lookup_rpc_port 'abc' is not a port number",
        "fix": "use a number unique per instance on the host, e.g. 0 on one instance and 1 on "
               "the next",
    }]
