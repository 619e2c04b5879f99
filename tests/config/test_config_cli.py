"""``kvpool-config`` end to end: exit statuses, ``--json``, one-line load errors, ``render``
started for real (the rendered ``mooncake_master`` command runs, and a real
``MooncakeDistributedStore`` set up from the rendered ``mooncake.json`` stores and reads a key),
and ``schema``."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool_config import schema_text
from kvpool_config.cli import main
from kvpool_config.rules import check_lease_ttl
from kvpool_connector.sizes import parse_size
from kvpool_replay import free_port

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).parent / "cases"
CONFIG = ROOT / "config"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(argv)
    return status, capsys.readouterr().out


def test_exit_status_clean_warnings_strict_errors(capsys: pytest.CaptureFixture[str]) -> None:
    clean = str(CONFIG / "mixed-kv-both/kv_transfer_config.json")
    warn = str(CASES / "load_policy_unset.json")
    error = str(CASES / "connector_order.json")
    assert _run(["validate", clean, "--strict"], capsys)[0] == 0
    assert _run(["validate", warn], capsys)[0] == 0
    assert _run(["validate", warn, "--strict"], capsys)[0] == 1
    status, out = _run(["validate", error], capsys)
    assert status == 2
    assert "error   $.kv_connector_extra_config.connectors  [connector-order]" in out
    assert "fix: swap connectors[0] and connectors[1]" in out


def test_json_output_for_ci(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _run(["validate", str(CASES / "eviction_range.json"), "--json"], capsys)
    report = json.loads(out)
    assert status == report["exit_status"] == 2
    assert report["files"] == [{"path": str(CASES / "eviction_range.json"), "shape": "user_config"}]
    [error] = [f for f in report["findings"] if f["severity"] == "error"]
    assert error == {
        "file": str(CASES / "eviction_range.json"),
        "severity": "error",
        "rule": "eviction-ratio",
        "path": "$.kv_cache_store_config.eviction_ratio",
        "message": "eviction_ratio 1.5 is not a fraction in (0, 1]",
        "fix": "use a value such as 0.1",
    }
    assert report["summary"] == {"error": 1, "warning": 0, "info": 2}


@pytest.mark.parametrize(
    ("case", "line"),
    [
        (
            "malformed.json",
            "malformed.json:2:37: invalid JSON: Expecting property name enclosed in double quotes",
        ),
        (
            "truncated.json",
            "truncated.json:3:14: invalid JSON: a string is not closed (the file "
            "ends early: truncated?)",
        ),
        ("empty.json", "empty.json:1:1: empty file; expected a JSON object"),
    ],
)
def test_bad_json_is_one_clear_line(
    case: str, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = _run(["validate", str(CASES / case)], capsys)
    assert status == 2
    errors = [ln for ln in out.splitlines() if ln.strip().startswith("error")]
    assert errors == [f"  error: {CASES}/{line}"]


def test_truncated_file_in_a_real_process_prints_no_traceback() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpool_config.cli",
            "validate",
            str(CASES / "truncated.json"),
            "--env",
            str(CASES / "missing.env.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert (
        f"{CASES}/missing.env.json:0:0: cannot read file: No such file or directory" in proc.stdout
    )
    assert "a string is not closed (the file ends early: truncated?)" in proc.stdout


_TOO_DEEP = (
    "invalid JSON: arrays/objects nested more than 100 levels deep "
    "(a deployment config nests about 10)"
)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 200_000,  # the parser itself would run out of stack
        '{"kv_connector": "KVPoolConnector", "kv_role": ' + "[" * 150 + "]" * 150 + "}",
    ],
    ids=["parser-depth", "valid-but-deep"],
)
def test_deeply_nested_json_is_one_clear_line(tmp_path: Path, text: str) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text(text)
    for command in ("validate", "render"):
        proc = subprocess.run(
            [sys.executable, "-m", "kvpool_config.cli", command, str(deep)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2
        assert "Traceback" not in proc.stdout + proc.stderr
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "error:" in ln]
        assert lines == [f"{'  ' if command == 'validate' else ''}error: {deep}:0:0: {_TOO_DEEP}"]


def test_schema_command_writes_the_published_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "schema.json"
    assert _run(["schema", "--out", str(out)], capsys)[0] == 0
    assert out.read_text() == schema_text() == (CONFIG / "kvpool.schema.json").read_text()


def test_rule_functions_are_importable_one_by_one() -> None:
    assert check_lease_ttl(11000, 10000, 10000) is None
    finding = check_lease_ttl(8000, None, 9000, where="env.json")
    assert finding is not None
    assert (finding.severity, finding.rule) == ("error", "lease-ttl")
    assert finding.message.startswith(
        "default_kv_lease_ttl 8000 ms does not exceed ASCEND_CONNECT_TIMEOUT 10000 ms "
        "(Mooncake's default)"
    )


def test_render_refuses_what_it_cannot_render(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["render", str(CONFIG / "pd-memcache/user_config.json")]) == 2
    assert "render writes Mooncake files only" in capsys.readouterr().err
    assert main(["render", str(CASES / "eviction_missing.json")]) == 2
    assert (
        "$.kv_cache_store_config.eviction_high_watermark_ratio: eviction_high_watermark_ratio "
        "is missing"
    ) in capsys.readouterr().err


def test_render_prints_the_guide_values(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _run(["render", str(CONFIG / "pd-mooncake/user_config.json")], capsys)
    assert status == 0
    assert (
        "mooncake_master --rpc_port=50088 --eviction_high_watermark_ratio=0.9 "
        "--eviction_ratio=0.1 --default_kv_lease_ttl=15000"
    ) in out
    conf = json.loads(out.split("MOONCAKE_CONFIG_PATH=/path/to/mooncake.json)\n", 1)[1])
    assert conf == {
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "ascend",
        "device_name": "",
        "master_server_address": "127.0.0.1:50088",
        "global_segment_size": "4GB",
    }


@pytest.fixture
def rendered(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A user_config for this machine (tcp, 127.0.0.1), rendered into ``tmp_path/out``."""
    port = free_port()
    user = {
        "kv_cache_store_config": {
            "backend": "mooncake",
            "port": port,
            "protocol": "tcp",
            "global_segment_size": "64MB",
            "local_buffer_size": "16MB",
            "eviction_high_watermark_ratio": 0.9,
            "eviction_ratio": 0.1,
            "default_kv_lease_ttl": 12000,
        }
    }
    (tmp_path / "user_config.json").write_text(json.dumps(user))
    assert main(["render", str(tmp_path / "user_config.json"), "--out", str(tmp_path / "out")]) == 0
    yield tmp_path / "out", port


def test_rendered_files_start_a_real_master_and_client(rendered: tuple[Path, int]) -> None:
    out, port = rendered
    argv = shlex.split((out / "mooncake_master.cmd").read_text())
    assert argv[0] == "mooncake_master"
    metrics = free_port()
    # The rendered flags must be ones the installed master accepts; only the admin port is
    # added so the test does not collide with other masters on 9003.
    binary = str(Path(sys.executable).parent / "mooncake_master")
    proc = subprocess.Popen(
        [binary, *argv[1:], f"--metrics_port={metrics}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, "mooncake_master exited: a rendered flag was rejected"
            try:
                if httpx.get(f"http://127.0.0.1:{metrics}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mooncake_master did not come up"
            time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        assert main(["validate", str(out / "mooncake.json"), "--strict"]) == 0
        conf = json.loads((out / "mooncake.json").read_text())
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(
            "127.0.0.1",
            conf["metadata_server"],
            parse_size(conf["global_segment_size"]),
            parse_size(conf["local_buffer_size"]),
            conf["protocol"],
            conf["device_name"],
            conf["master_server_address"],
        )
        assert rc == 0
        try:
            assert store.put("kvpool-config-render-test", b"rendered") == 0
            assert store.get("kvpool-config-render-test") == b"rendered"
        finally:
            store.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
