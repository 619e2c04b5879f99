"""``transfer_timeout_ms`` of the Mooncake config (issue 39 item 4): the connector reads it
(default 60000 ms, the store client's transfer timeout) and ``kvpool-config validate`` warns
when a mooncake.json sets it below that (rule ``transfer-timeout``), refuses a negative one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_config.cli import main
from kvpool_connector.backends.mooncake import TRANSFER_TIMEOUT_MS, MooncakeConfig


def _validate(tmp_path: Path, capsys: pytest.CaptureFixture[str], **extra: object
              ) -> tuple[int, list[dict[str, str]]]:
    f = tmp_path / "mooncake.json"
    f.write_text(json.dumps({"master_server_address": "127.0.0.1:50088", "protocol": "tcp",
                             "metadata_server": "P2PHANDSHAKE", **extra}))
    rc = main(["validate", "--json", str(f)])
    return rc, json.loads(capsys.readouterr().out)["findings"]


def test_the_connector_reads_it() -> None:
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
