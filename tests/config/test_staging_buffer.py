"""``staging_buffer`` (issue 38): KVPoolConnector parses it as ``auto`` (the default: four values,
64 MiB to 1 GiB) or a size, and ``kvpool-config validate`` refuses what the connector refuses
(exit 2, the field named) and warns above 1 GiB (two buffers per worker in host memory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_config.cli import main
from kvpool_config.rules import check_staging_buffer
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.staging import StagingBuffer

_BASE = {
    "kv_connector": "KVPoolConnector",
    "kv_connector_module_path": "kvpool_connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"backend": "mooncake", "engine_id": "engine-a"},
}


def _validate(tmp_path: Path, capsys: pytest.CaptureFixture[str], value: object
              ) -> tuple[int, list[dict[str, str]]]:
    cfg = json.loads(json.dumps(_BASE))
    cfg["kv_connector_extra_config"]["staging_buffer"] = value
    f = tmp_path / "kv_transfer_config.json"
    f.write_text(json.dumps(cfg))
    rc = main(["validate", "--json", str(f)])
    return rc, json.loads(capsys.readouterr().out)["findings"]


def _parse(extra: dict[str, object]) -> KVPoolConfig:
    return KVPoolConfig.from_dicts(extra, kv_role="kv_both", block_size=16, model="m")


def test_connector_parses_the_size_and_defaults_to_auto() -> None:
    assert _parse({}).staging_buffer_bytes is None
    assert _parse({"staging_buffer": " Auto"}).staging_buffer_bytes is None
    assert _parse({"staging_buffer": "160MB"}).staging_buffer_bytes == 160 << 20
    with pytest.raises(ValueError, match="staging_buffer: must be more than 0 bytes"):
        _parse({"staging_buffer": 0})
    with pytest.raises(ValueError, match=r'staging_buffer: .automatic. is not a size.*"auto"'):
        _parse({"staging_buffer": "automatic"})


MIB = 1 << 20


@pytest.mark.parametrize(("configured", "value", "nbytes"), [
    (None, 2 * MIB, 64 * MIB),  # Llama-3-8B, 16-token chunks: the 64 MiB floor
    (None, 32 * MIB, 128 * MIB),  # 256-token chunks: four values
    (None, 320 * MIB, 1024 * MIB),  # Llama-3-70B, 1,024-token chunks: the 1 GiB cap
    (None, 1280 * MIB, 1280 * MIB),  # 4,096-token chunks: one value, past the cap
    (64 * MIB, 32 * MIB, 64 * MIB),  # a size set is kept...
    (1 * MIB, 8 * MIB, 8 * MIB),  # ...raised to one value
])
def test_the_buffer_holds_four_values_by_default_and_a_set_size_otherwise(
        configured: int | None, value: int, nbytes: int) -> None:
    assert StagingBuffer.sized(configured, value) == nbytes


@pytest.mark.parametrize(("value", "says"), [
    (0, "more than 0 bytes"), ("lots", "'lots' is not a size"),
    (True, "staging_buffer: true is not a size"),
])
def test_validate_refuses_what_the_connector_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], value: object, says: str) -> None:
    rc, findings = _validate(tmp_path, capsys, value)
    errors = [x for x in findings if x["severity"] == "error"]
    assert rc == 2 and len(errors) == 1, findings
    assert errors[0]["path"] == "$.kv_connector_extra_config.staging_buffer"
    assert says in errors[0]["message"]


def test_validate_warns_above_1gib_and_is_clean_at_the_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, findings = _validate(tmp_path, capsys, "2GB")
    (warn,) = [x for x in findings if x["rule"] == "staging-buffer"]
    assert warn["severity"] == "warning" and "4096 MiB per worker" in warn["message"]
    for fine in ("64MB", "auto"):
        rc, findings = _validate(tmp_path, capsys, fine)
        assert rc == 0 and not [x for x in findings if x["rule"] == "staging-buffer"], fine
    assert check_staging_buffer(1 << 30, path="$.x") is None
    assert check_staging_buffer((1 << 30) + 1, path="$.x") is not None


_FIX = 'use a size like "256MB", or "auto" (the default)'


@pytest.mark.parametrize(("value", "message", "fix"), [
    # YAML's empty ``staging_buffer:``: four pydantic errors before, one per union member.
    (None, "staging_buffer: null is not a size", _FIX),
    (True, "staging_buffer: true is not a size", _FIX),
    # Taken as 1 byte before.
    (1.5, "staging_buffer: 1.5 is not a whole number of bytes",
     'set staging_buffer, e.g. "256MB", or "auto"'),
    ("1.5", "staging_buffer: '1.5' is not a whole number of bytes",
     'set staging_buffer, e.g. "256MB", or "auto"'),
])
def test_a_null_a_bool_or_a_fraction_of_a_byte_is_one_finding_naming_the_key_and_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], value: object, message: str,
        fix: str) -> None:
    rc, findings = _validate(tmp_path, capsys, value)
    errors = [x for x in findings if x["severity"] == "error"]
    assert rc == 2 and len(errors) == 1, findings
    assert errors[0]["path"] == "$.kv_connector_extra_config.staging_buffer"
    assert errors[0]["message"].startswith(message) and errors[0]["fix"] == fix
    with pytest.raises(ValueError) as refused:
        _parse({"staging_buffer": value})
    assert str(refused.value).startswith(f"kv_connector_extra_config.{message}")
    assert "\n" not in str(refused.value)


def test_a_whole_number_of_bytes_is_taken_whatever_its_form() -> None:
    assert _parse({"staging_buffer": 2.0}).staging_buffer_bytes == 2
    assert _parse({"staging_buffer": "1.5K"}).staging_buffer_bytes == 1536
    assert _parse({"staging_buffer": "1.5GB"}).staging_buffer_bytes == 3 << 29
