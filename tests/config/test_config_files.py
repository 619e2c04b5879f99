"""``kvpool-config`` reads regular files only, at most 16 MiB, and numbers a config can hold:
a FIFO, a device (or a symlink to one), a directory, a huge file, a 5,000-digit integer, NaN
or 1e400 is one clear line naming the file and exit 2, never a hang, a MemoryError or a
traceback. Each case runs the real console script in a subprocess with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool_config import ConfigLoadError, load_json
from kvpool_config._loader import MAX_FILE_BYTES

ROOT = Path(__file__).resolve().parents[2]
GOOD = '{"kv_connector": "KVPoolConnector", "kv_role": "kv_both"}'


def _validate(*argv: str, command: str = "validate") -> subprocess.CompletedProcess[str]:
    # The timeout is the assertion that nothing blocks: a FIFO without a writer would hang.
    return subprocess.run([sys.executable, "-m", "kvpool_config.cli", command, *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def _one_error_line(proc: subprocess.CompletedProcess[str], path: Path, needle: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "MemoryError" not in out
    errors = [ln for ln in out.splitlines() if "error:" in ln]
    assert len(errors) == 1, out
    assert f"{path}:0:0: " in errors[0] and needle in errors[0], errors[0]


def _fifo(tmp: Path) -> Path:
    p = tmp / "config.json"
    os.mkfifo(p)
    return p


def _zero(tmp: Path) -> Path:
    p = tmp / "config.json"
    p.symlink_to("/dev/zero")
    return p


def _directory(tmp: Path) -> Path:
    p = tmp / "config.json"
    p.mkdir()
    return p


def _huge(tmp: Path) -> Path:
    p = tmp / "config.json"
    with p.open("wb") as f:  # sparse: costs no disk
        f.truncate(MAX_FILE_BYTES + 1)
    return p


@pytest.mark.parametrize(("make", "needle"), [
    (_fifo, "not a regular file but a FIFO (named pipe); pass the path of the JSON config"),
    (_zero, "not a regular file but a character device; pass the path"),
    (_directory, "not a regular file but a directory; pass the path"),
    (_huge, "file larger than 16 MiB"),
], ids=["fifo", "symlink-to-dev-zero", "directory", "over-16-MiB"])
def test_not_a_config_file_is_one_line_and_exit_2(make: Callable[[Path], Path], needle: str,
                                                  tmp_path: Path) -> None:
    path = make(tmp_path)
    _one_error_line(_validate(str(path)), path, needle)
    # The same gate for --env, --target and render.
    good = tmp_path / "good.json"
    good.write_text(GOOD)
    _one_error_line(_validate(str(good), "--env", str(path)), path, needle)
    _one_error_line(_validate(str(good), "--target", str(path)), path, needle)
    _one_error_line(_validate(str(path), command="render"), path, needle)


@pytest.mark.parametrize(("value", "needle"), [
    ("9" * 5000, "an integer of more than 4300 digits"),
    ("-" + "1" * 5000, "an integer of more than 4300 digits"),
    ("1e400", "the number 1e400 is out of range"),
    ("NaN", "NaN is not JSON"),
    ("-Infinity", "-Infinity is not JSON"),
], ids=["5000-digits", "negative-5000-digits", "1e400", "NaN", "-Infinity"])
def test_numbers_no_config_holds_are_one_line_and_exit_2(value: str, needle: str,
                                                         tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(GOOD[:-1] + f', "kv_port": {value}}}')
    _one_error_line(_validate(str(path)), path, needle)
    with pytest.raises(ConfigLoadError, match=needle):
        load_json(path)


def test_a_regular_file_through_a_symlink_is_still_read(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text(GOOD)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert load_json(link) == load_json(real) == {"kv_connector": "KVPoolConnector",
                                                  "kv_role": "kv_both"}
    proc = _validate(str(link))
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"{link} (kv_transfer_config)" in proc.stdout
