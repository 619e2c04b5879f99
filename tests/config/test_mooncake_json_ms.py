"""Two millisecond settings of the Mooncake config, each read by the connector and checked by
``kvpool-config validate`` on a mooncake.json.

``transfer_timeout_ms`` (issue 39 item 4): default 60000 ms, the store client's transfer timeout;
a warning when set below that (rule ``transfer-timeout``), an error when negative.

``max_kv_soft_pin_ttl`` (issue 40 item 3): the TTL a hard pin's chunks already in the pool are
upserted with; a warning when above mooncake_master's default ``--max_kv_soft_pin_ttl`` (rule
``soft-pin-ttl``: such a master refuses it with -600 INVALID_PARAMS), an error when not a
positive whole number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_config.cli import main
from kvpool_connector.backends.mooncake import (
    HARD_PIN_UPSERT_TTL_MS,
    TRANSFER_TIMEOUT_MS,
    MooncakeConfig,
)


def _validate(tmp_path: Path, capsys: pytest.CaptureFixture[str], **extra: object
              ) -> tuple[int, list[dict[str, str]]]:
    f = tmp_path / "mooncake.json"
    f.write_text(json.dumps({"master_server_address": "127.0.0.1:50088", "protocol": "tcp",
                             "metadata_server": "P2PHANDSHAKE", **extra}))
    rc = main(["validate", "--json", str(f)])
    return rc, json.loads(capsys.readouterr().out)["findings"]


def test_the_connector_reads_the_transfer_timeout() -> None:
    cfg = MooncakeConfig.load({"mooncake": {"master_server_address": "127.0.0.1:1",
                                            "transfer_timeout_ms": 90_000}})
    assert cfg.transfer_timeout_ms == 90_000
    assert TRANSFER_TIMEOUT_MS == 60_000
    assert MooncakeConfig(master_server_address="127.0.0.1:1").transfer_timeout_ms == 60_000


@pytest.mark.parametrize("value", [None, TRANSFER_TIMEOUT_MS, 120_000])
def test_the_default_or_more_is_clean(value: int | None, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    extra = {} if value is None else {"transfer_timeout_ms": value}
    rc, findings = _validate(tmp_path, capsys, **extra)
    assert [f for f in findings if "transfer_timeout" in f["path"]] == [], findings
    assert rc == 0, findings


def test_below_the_store_clients_timeout_is_a_warning(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _, findings = _validate(tmp_path, capsys, transfer_timeout_ms=5_000)
    (f,) = [f for f in findings if f["path"] == "$.transfer_timeout_ms"]
    assert (f["severity"], f["rule"]) == ("warning", "transfer-timeout")
    assert "5000" in f["message"] and "60000 ms" in f["message"]
    assert "leave transfer_timeout_ms out" in f["fix"]


def test_a_negative_one_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, findings = _validate(tmp_path, capsys, transfer_timeout_ms=-1)
    assert rc == 2
    assert [f["severity"] for f in findings if f["path"] == "$.transfer_timeout_ms"] == [
        "error"]


def test_the_connector_reads_the_soft_pin_ttl() -> None:
    cfg = MooncakeConfig.load({"mooncake": {"master_server_address": "127.0.0.1:1",
                                            "max_kv_soft_pin_ttl": 3_000}})
    assert cfg.max_kv_soft_pin_ttl == 3_000
    assert HARD_PIN_UPSERT_TTL_MS == 86_400_000
    assert MooncakeConfig(master_server_address="127.0.0.1:1").max_kv_soft_pin_ttl == 86_400_000


@pytest.mark.parametrize("value", [None, 3_000, HARD_PIN_UPSERT_TTL_MS])
def test_a_soft_pin_ttl_at_the_default_or_less_is_clean(value: int | None, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    extra = {} if value is None else {"max_kv_soft_pin_ttl": value}
    rc, findings = _validate(tmp_path, capsys, **extra)
    assert [f for f in findings if "soft_pin" in f["path"]] == [], findings
    assert rc == 0, findings


def test_above_the_masters_default_is_a_warning(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _, findings = _validate(tmp_path, capsys, max_kv_soft_pin_ttl=2 * HARD_PIN_UPSERT_TTL_MS)
    (f,) = [f for f in findings if f["path"] == "$.max_kv_soft_pin_ttl"]
    assert (f["severity"], f["rule"]) == ("warning", "soft-pin-ttl")
    assert "172800000" in f["message"] and "-600 INVALID_PARAMS" in f["message"]
    assert "--max_kv_soft_pin_ttl=172800000" in f["fix"]


@pytest.mark.parametrize("value", [0, -5, "1d"])
def test_not_a_positive_number_is_an_error(value: object, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc, findings = _validate(tmp_path, capsys, max_kv_soft_pin_ttl=value)
    assert rc == 2
    assert [f["severity"] for f in findings if f["path"] == "$.max_kv_soft_pin_ttl"] == ["error"]


@pytest.mark.parametrize("value", [0, -5, True, 1e30, "1d"])
def test_a_wrong_value_is_a_range_message(value: object, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Not a type error pointing at the schema: the field, what it must be, the default; a
    bool is not a number of ms (pydantic's lax int would read ``true`` as 1 ms)."""
    rc, findings = _validate(tmp_path, capsys, max_kv_soft_pin_ttl=value)
    assert rc == 2
    (f,) = [f for f in findings if f["path"] == "$.max_kv_soft_pin_ttl"]
    assert (f["severity"], f["rule"]) == ("error", "range"), f
    assert "max_kv_soft_pin_ttl" in f["message"]
    assert "a positive whole number of ms" in f["message"]
    assert "input string" not in f["message"] + f["fix"]
    assert "86400000" in f["fix"] and "schema" not in f["fix"]


def test_transfer_timeout_reports_its_range_the_same_way(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, findings = _validate(tmp_path, capsys, transfer_timeout_ms=-1)
    assert rc == 2
    (f,) = [f for f in findings if f["path"] == "$.transfer_timeout_ms"]
    assert f["rule"] == "range" and "transfer_timeout_ms -1 is not a whole number of ms" in \
        f["message"]


@pytest.mark.parametrize("value", [True, 0, -5, 1.5, "3000"])
def test_the_connector_refuses_what_is_not_a_positive_whole_ms(value: object) -> None:
    with pytest.raises(ValueError, match="max_kv_soft_pin_ttl"):
        MooncakeConfig.load({"mooncake": {"master_server_address": "127.0.0.1:1",
                                          "max_kv_soft_pin_ttl": value}})
