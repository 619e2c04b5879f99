"""Bad command-line input to ``kvpool-config`` is one line naming the option and the fix, exit
status 2, no traceback, and nothing written: an ``--out`` that cannot be written (before: a
FileNotFoundError, FileExistsError or IsADirectoryError traceback), a ``--master-host`` that is
no host (before: written into mooncake.json, which then failed to resolve), a ``--block-size``
or ``--num-layers`` below 1 (before: taken silently)."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool_config.cli import main
from kvpool_replay import free_port

ROOT = Path(__file__).resolve().parents[2]
USER_CONFIG = str(ROOT / "config" / "pd-mooncake" / "user_config.json")
_RENDER_OUT = "give a directory for mooncake_master.cmd and mooncake.json, e.g. --out ./mooncake"
_SCHEMA_OUT = ("give a file path in an existing directory, e.g. --out "
               "config/kvpool.schema.json")


def _err(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_schema_out_in_a_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no" / "such" / "x.json"
    assert _err(["schema", "--out", str(out)], capsys) == (
        2, "", f"error: --out {out}: no directory {out.parent}; {_SCHEMA_OUT}\n")
    assert not (tmp_path / "no").exists()


def test_schema_out_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _err(["schema", "--out", str(tmp_path)], capsys) == (
        2, "", f"error: --out {tmp_path}: is a directory; {_SCHEMA_OUT}\n")
    assert list(tmp_path.iterdir()) == []


def test_schema_out_the_os_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    # /proc exists but takes no new files: the OS's own reason is the message.
    assert _err(["schema", "--out", "/proc/kvpool-schema.json"], capsys) == (
        2, "", "error: --out /proc/kvpool-schema.json: cannot write it (No such file or "
        f"directory); {_SCHEMA_OUT}\n")


def test_render_out_is_an_existing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("mine\n")
    assert _err(["render", USER_CONFIG, "--out", str(readme)], capsys) == (
        2, "", f"error: --out {readme}: is a file, not a directory; {_RENDER_OUT}\n")
    assert readme.read_text() == "mine\n"


@pytest.mark.parametrize(("out", "reason"), [
    ("/proc/kvpool-render", "No such file or directory"),
    ("{tmp}/file/sub", "Not a directory"),
])
def test_render_out_the_os_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str, reason: str
) -> None:
    (tmp_path / "file").write_text("")
    out = out.format(tmp=tmp_path)
    assert _err(["render", USER_CONFIG, "--out", out], capsys) == (
        2, "", f"error: --out {out}: cannot write it ({reason}); {_RENDER_OUT}\n")


def test_render_out_in_a_real_process_prints_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_config.cli", "render", USER_CONFIG, "--out",
         str(tmp_path / "taken")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"error: --out {tmp_path / 'taken'}: is a file, not a directory; "
                           f"{_RENDER_OUT}\n")


_HOST_FIX = ("give the host the engines reach mooncake_master on, e.g. 10.0.0.5 (in Kubernetes "
             "the kv-store Service's name)")


@pytest.mark.parametrize(("host", "validate_says"), [
    ("bad host!", "'bad host!:50088': 'bad host!' is not a host name or IP address"),
    ("a:b", "'a:b:50088': 'a:b' is not a host name or IP address"),
    ("a..b", "'a..b:50088': 'a..b' is not a host name or IP address"),
    ("-x.example", "'-x.example:50088': '-x.example' is not a host name or IP address"),
    ("", "':50088' is not host:port or etcd://host:port"),
])
def test_render_refuses_a_master_host_validate_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], host: str, validate_says: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(["render", USER_CONFIG, "--out", str(out), f"--master-host={host}"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"kvpool-config render: error: argument --master-host: {host!r} is not a host name or "
        f"IP address: {_HOST_FIX} (see kvpool-config render --help)\n")
    assert not out.exists()
    # validate's rule on the address render would have written says the same.
    bad = tmp_path / "mooncake.json"
    bad.write_text(f'{{"master_server_address": "{host}:50088"}}')
    assert main(["validate", str(bad)]) == 2
    assert f"          master_server_address {validate_says}\n" in capsys.readouterr().out


@pytest.mark.parametrize(("host", "address"), [
    ("kv-store.mindie.svc.cluster.local", "kv-store.mindie.svc.cluster.local:50088"),
    ("10.0.0.5", "10.0.0.5:50088"),
    ("kv_store", "kv_store:50088"),
    ("[fd00::5]", "[fd00::5]:50088"),
    # An IPv6 literal is written in brackets, as Mooncake's client parses it (was ::1:50088).
    ("::1", "[::1]:50088"),
    ("fd00::5", "[fd00::5]:50088"),
    ("[10.0.0.5]", "10.0.0.5:50088"),
])
def test_render_takes_host_names_and_addresses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], host: str, address: str
) -> None:
    assert main(["render", USER_CONFIG, "--out", str(tmp_path), "--master-host", host]) == 0
    capsys.readouterr()
    assert f'"master_server_address": "{address}"' in (tmp_path / "mooncake.json").read_text()
    assert main(["validate", str(tmp_path / "mooncake.json"), "--strict"]) == 0


def test_render_refuses_a_store_port_of_true(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pydantic's lax int took ``true`` as 1: render wrote ``--rpc_port=True``."""
    doc = (ROOT / "config" / "pd-mooncake" / "user_config.json").read_text()
    user = tmp_path / "user_config.json"
    user.write_text(doc.replace('"port": 50088', '"port": true', 1))
    assert '"port": true' in user.read_text()
    assert _err(["render", str(user), "--out", str(tmp_path / "out")], capsys) == (
        2, "", "error: $.kv_cache_store_config.port: port true is not a port number; fix: use "
        "1024-65535, e.g. 50088\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "says"), [
    (["--block-size", "-3"], "argument --block-size: must be >= 1, got -3"),
    (["--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
    (["--num-layers", "0"], "argument --num-layers: must be >= 1, got 0"),
    (["--num-layers", "x"], "argument --num-layers: 'x' is not an integer"),
])
def test_validate_refuses_sizes_below_one(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["validate", USER_CONFIG, *argv])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"kvpool-config validate: error: {says} (see kvpool-config validate --help)\n")


@pytest.mark.parametrize(("address", "item", "bracketed"), [
    ("::1:50051", "[::1]:50051", "[::1]:50051"),
    ("fd00::5:50051", "[fd00::5]:50051", "[fd00::5]:50051"),
    ("etcd://10.0.0.9:2379;fd00::9:2379", "[fd00::9]:2379",
     "etcd://10.0.0.9:2379;[fd00::9]:2379"),
])
def test_validate_warns_of_an_ipv6_master_without_brackets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], address: str, item: str,
    bracketed: str,
) -> None:
    """What render wrote before: the host:port split is a guess (``fd00::5:5005`` is itself an
    IPv6 address); a warning naming the bracketed form, none for the bracketed address."""
    f = tmp_path / "mooncake.json"

    def rules(text: str) -> list[tuple[str, str, str]]:
        f.write_text(json.dumps({"master_server_address": text}))
        assert main(["validate", "--json", str(f)]) == 0
        return [(x["severity"], x["path"], x["fix"])
                for x in json.loads(capsys.readouterr().out)["findings"]
                if x["rule"] == "master-address"]

    assert rules(address) == [("warning", "$.master_server_address", f"write it as {item!r}")]
    assert rules(bracketed) == []


def test_rendered_ipv6_master_listens_where_its_clients_connect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--master-host ::1``: the rendered ``mooncake_master`` command, run as written (a real
    master on a free port), accepts a connection at the ``[::1]:port`` the rendered
    ``mooncake.json`` names (it bound 0.0.0.0 alone, and clients were refused)."""
    port = free_port()
    doc = json.loads((ROOT / "config" / "pd-mooncake" / "user_config.json").read_text())
    doc["kv_cache_store_config"]["port"] = port
    user = tmp_path / "user_config.json"
    user.write_text(json.dumps(doc))
    out = tmp_path / "out"
    assert main(["render", str(user), "--out", str(out), "--master-host", "::1"]) == 0
    capsys.readouterr()
    assert json.loads((out / "mooncake.json").read_text())["master_server_address"] == (
        f"[::1]:{port}")
    argv = shlex.split((out / "mooncake_master.cmd").read_text())
    assert "--rpc_address=::" in argv
    # Its admin port moved off the default 9003, which another test's master may hold.
    master = subprocess.Popen([str(Path(sys.executable).with_name("mooncake_master")),
                               *argv[1:], f"--metrics_port={free_port()}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert master.poll() is None, "mooncake_master exited"
            try:
                socket.create_connection(("::1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"nothing answers at [::1]:{port}"
                time.sleep(0.1)
    finally:
        master.kill()
        master.wait()
