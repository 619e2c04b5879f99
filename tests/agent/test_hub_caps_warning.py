"""``kvpool-agent hub --max-subscribers-per-key N`` without ``--keys``: the per-key caps count
connections per CURVE key, so without keys they cannot apply: one warning line, the hub still
starts."""

from __future__ import annotations

import logging

import pytest

import kvpool_agent.cli as agent_cli


class _Started(Exception):
    pass


def _no_hub(*_: object, **__: object) -> None:
    raise _Started


@pytest.mark.parametrize("extra, warned", [
    (["--max-subscribers-per-key", "3"], "--max-subscribers-per-key 3"),
    (["--max-connections-per-key", "2"], "--max-connections-per-key 2"),
    (["--max-agent-connections-per-key", "64"], "--max-agent-connections-per-key 64"),
    (["--max-agent-connections-per-fleet-key", "0"],
     "--max-agent-connections-per-fleet-key 0"),
    ([], None),
])
def test_caps_without_keys_warn_and_start(extra: list[str], warned: str | None,
                                          monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(agent_cli, "FleetHub", _no_hub)
    with caplog.at_level(logging.WARNING, logger="kvpool.hub"), pytest.raises(_Started):
        agent_cli.main(["hub", "--address", "tcp://127.0.0.1:7600", *extra])
    lines = [r.getMessage() for r in caplog.records if "per-key caps" in r.getMessage()]
    if warned is None:
        assert lines == []
    else:
        (line,) = lines
        assert warned in line and "only with --keys" in line and "\n" not in line


@pytest.mark.parametrize("flag", ["--max-subscribers-per-key", "--max-connections-per-key",
                                  "--max-agent-connections-per-key",
                                  "--max-agent-connections-per-fleet-key"])
def test_a_cap_below_0_is_one_line_naming_the_flag_and_exit_2(
        flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(agent_cli, "FleetHub", _no_hub)
    assert agent_cli.main(["hub", "--address", "tcp://127.0.0.1:7600", flag, "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvpool-agent hub: {flag}: -1 is below 0 (0: no cap)"], err
