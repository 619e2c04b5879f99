"""``kvpool-policy`` bad input: one line naming the option and the fix, exit status 2, no
traceback, checked (keys, ports, the pool's capacity) before the Mooncake client starts."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvpool_policy.cli as policy_cli
from kvpool_agent.auth import generate_keys
from kvpool_agent.protocol import PoolStats
from kvpool_connector.backends.base import BackendError
from kvpool_replay import free_port_block

_POOL = ["--master", "127.0.0.1:1", "--admin-url", "http://127.0.0.1:1"]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "hub", "hub")
    generate_keys(tmp_path / "viewer", "viewer")
    (tmp_path / "viewer" / "hub.key").write_bytes((tmp_path / "hub" / "hub.key").read_bytes())
    (tmp_path / "viewer" / "hub.key").chmod(0o600)
    return tmp_path


@pytest.fixture
def no_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """The Mooncake client never starts: ``made`` records an attempt (which then fails)."""
    made: list[object] = []

    def backend(config: object) -> None:
        made.append(config)
        raise BackendError("stopped by the test")

    monkeypatch.setattr(policy_cli, "MooncakeBackend", backend)
    yield made


def _stats(monkeypatch: pytest.MonkeyPatch, stats: PoolStats) -> None:
    monkeypatch.setattr(policy_cli, "fetch_mooncake_stats", lambda *_a, **_k: stats)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    return line


@pytest.mark.parametrize("wait", ["inf", "-1", "nan", "0"])
def test_status_wait_must_be_finite_and_positive(wait: str, keys: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert policy_cli.main(["status", "--listen", "tcp://127.0.0.1:5600", "--keys",
                            str(keys / "viewer"), "--wait", wait]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"kvpool-policy: --wait {wait}") and "above 0" in line


@pytest.mark.parametrize("which, wanted", [
    ("missing", "no such directory"), ("viewer", "no hub.key_secret here")])
def test_serve_keys_checked_before_mooncake(which: str, wanted: str, keys: Path,
                                            no_backend: list[object],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = policy_cli.main(["serve", "--listen", "tcp://127.0.0.1:5600", "--keys",
                          str(keys / which), *_POOL])
    assert rc == 2 and no_backend == []
    line = _one_line(capsys)
    assert f"--keys {keys / which}: {wanted}" in line
    # The fleet's hub keys, not a new hub identity the engines do not trust.
    assert "kvpool-agent hub --keys DIR" in line and "keygen" not in line


def test_serve_port_in_use_checked_before_mooncake(keys: Path, no_backend: list[object],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port_block(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
        rc = policy_cli.main(["serve", "--listen", f"tcp://127.0.0.1:{port}", "--keys",
                              str(keys / "hub"), *_POOL])
    assert rc == 2 and no_backend == []
    assert f"port {port + 1} is in use" in _one_line(capsys)


@pytest.mark.parametrize("listen, wanted", [
    ("tcp://127.0.0.1:65535", "port 65535 leaves no PORT+1"),
    ("tcp://nosuchhost.invalid:5600", "host 'nosuchhost.invalid' does not resolve"),
    ("tcp://192.0.2.1:5600", "192.0.2.1 is not an address of this machine"),
])
def test_serve_listen_says_what_is_wrong(listen: str, wanted: str, keys: Path,
                                         no_backend: list[object],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc = policy_cli.main(["serve", "--listen", listen, "--keys", str(keys / "hub"), *_POOL])
    assert rc == 2 and no_backend == []
    line = _one_line(capsys)
    assert line.startswith("kvpool-policy: --listen") and wanted in line, line


def test_serve_transfer_timeout_names_the_option(keys: Path, no_backend: list[object],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc = policy_cli.main(["serve", "--listen", "tcp://127.0.0.1:5600", "--keys",
                          str(keys / "hub"), *_POOL, "--transfer-timeout-ms", "-1"])
    assert rc == 2 and no_backend == []
    line = _one_line(capsys)
    assert line.startswith("kvpool-policy: --transfer-timeout-ms -1") and "--master" not in line


@pytest.mark.parametrize("every", ["99", "60001"])
def test_serve_snapshot_interval_is_checked_before_mooncake(
        every: str, keys: Path, no_backend: list[object],
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = policy_cli.main(["serve", "--listen", "tcp://127.0.0.1:5600", "--keys",
                          str(keys / "hub"), *_POOL, "--snapshot-every-ms", every])
    assert rc == 2 and no_backend == []
    assert _one_line(capsys) == (f"kvpool-policy: --snapshot-every-ms {every}: must be "
                                 "100..60000 ms, e.g. 500 (the default)")


def test_serve_a_snapshot_interval_past_half_the_engines_stale_time_warns(
        keys: Path, no_backend: list[object], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _stats(monkeypatch, PoolStats(backend="mooncake", healthy=True, total_bytes=1 << 30))
    port = free_port_block(2)
    rc = policy_cli.main(["serve", "--listen", f"tcp://127.0.0.1:{port}", "--keys",
                          str(keys / "hub"), *_POOL, "--snapshot-every-ms", "2000"])
    assert len(no_backend) == 1 and rc == 2  # went on to start; the test's backend fails
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warning.startswith("kvpool-policy: warning: --snapshot-every-ms 2000: engines take "
                              "the service for down after policy_stale_ms")
    assert "(default 3000)" in warning and "policy_stale_ms of at least 4000" in warning


def test_serve_without_a_segment_says_so(keys: Path, no_backend: list[object],
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _stats(monkeypatch, PoolStats(backend="mooncake", healthy=True,
                                  health_detail='{"status":"ok"}'))
    port = free_port_block(2)
    rc = policy_cli.main(["serve", "--listen", f"tcp://127.0.0.1:{port}", "--keys",
                          str(keys / "hub"), *_POOL])
    assert rc == 2 and no_backend == []
    line = _one_line(capsys)
    assert "no store segment is mounted" in line and "mooncake_client" in line
    assert "--capacity" in line and "status" not in line


def test_serve_unreachable_admin_url_with_capacity_warns_and_starts(
        keys: Path, no_backend: list[object], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _stats(monkeypatch, PoolStats(backend="mooncake", healthy=False,
                                  health_detail="master admin unreachable"))
    port = free_port_block(2)
    rc = policy_cli.main(["serve", "--listen", f"tcp://127.0.0.1:{port}", "--keys",
                          str(keys / "hub"), *_POOL, "--capacity", "1GB"])
    assert len(no_backend) == 1 and rc == 2  # went on to start; the test's backend fails
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kvpool-policy: warning: --admin-url http://127.0.0.1:1: the "
                             "master did not answer")
    assert "no record of the pool's keys" in err[0]


def test_serve_fill_at_the_watermark_warns(keys: Path, no_backend: list[object],
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _stats(monkeypatch, PoolStats(backend="mooncake", healthy=True, total_bytes=1 << 30))
    port = free_port_block(2)
    rc = policy_cli.main(["serve", "--listen", f"tcp://127.0.0.1:{port}", "--keys",
                          str(keys / "hub"), *_POOL, "--fill", "1.0"])
    assert len(no_backend) == 1 and rc == 2
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert "--fill 1 is at or above" in warning and "eviction_high_watermark_ratio" in warning


@pytest.mark.parametrize("fill", ["auto", " AUTO ", "0.85"])
def test_serve_fill_auto_in_any_case_or_a_share_starts(
        fill: str, keys: Path, no_backend: list[object], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _stats(monkeypatch, PoolStats(backend="mooncake", healthy=True, total_bytes=1 << 30))
    port = free_port_block(2)
    rc = policy_cli.main(["serve", "--listen", f"tcp://127.0.0.1:{port}", "--keys",
                          str(keys / "hub"), *_POOL, "--fill", fill])
    assert len(no_backend) == 1 and rc == 2  # went on to start; the test's backend fails
    assert "warning" not in capsys.readouterr().err


def test_serve_capacity_above_the_mounted_pool_warns(
        keys: Path, no_backend: list[object], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--capacity`` above the master's watermark of what is mounted (800 MB on a 256 MiB
    store: a new user's try) is said, and so is a ``--fill`` it makes unused; a capacity
    under the watermark says nothing."""
    _stats(monkeypatch, PoolStats(backend="mooncake", healthy=True, total_bytes=256 << 20))
    port = free_port_block(2)
    rc = policy_cli.main(["serve", "--listen", f"tcp://127.0.0.1:{port}", "--keys",
                          str(keys / "hub"), *_POOL, "--capacity", "800MB", "--fill", "0.95"])
    assert len(no_backend) == 1 and rc == 2  # went on to start; the test's backend fails
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 2, warnings
    assert "--capacity 800MB is at or above 0.9 of the 268,435,456 bytes mounted" in warnings[0]
    assert "--fill 0.95 with --capacity" in warnings[1]
    rc = policy_cli.main(["serve", "--listen", f"tcp://127.0.0.1:{port}", "--keys",
                          str(keys / "hub"), *_POOL, "--capacity", "200MB"])
    assert len(no_backend) == 2 and rc == 2
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == []


def test_help_is_plain_text_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["serve", "--help"], ["status", "--help"]):
        with pytest.raises(SystemExit):
            policy_cli.main(argv)
        out = capsys.readouterr().out
        assert "``" not in out, out
    with pytest.raises(SystemExit):
        policy_cli.main(["serve", "--help"])
    serve = " ".join(capsys.readouterr().out.split())
    assert "auto (default: follows" in serve and "(default 50000)" in serve
    assert "(default 0.9, mooncake_master's)" in serve
    assert "every MS ms, 100..60000 (default 500;" in serve
    with pytest.raises(SystemExit):
        policy_cli.main(["status", "--help"])
    assert "(default 3.0:" in " ".join(capsys.readouterr().out.split())
