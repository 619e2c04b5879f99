"""The suite-time plugin (tests/_timing.py) on a tiny suite of its own, run by a child pytest:
the per-directory times it prints, the budget that fails a run, and a bad budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
HOLD_S = 0.3
"""What the tiny suite's slow test holds, seconds: the quantity the plugin must measure."""


def _tiny_suite(root: Path) -> None:
    (root / "fast").mkdir()
    (root / "fast" / "test_fast.py").write_text("def test_fast():\n    assert True\n")
    (root / "slow").mkdir()
    (root / "slow" / "test_slow.py").write_text(
        "import time\n\n\ndef test_slow():\n"
        f"    end = time.monotonic() + {HOLD_S}\n"
        "    while time.monotonic() < end:\n"
        "        time.sleep(0.01)\n")


def _pytest(root: Path, *args: str, budget: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_TEST_BUDGET_S"}
    if budget is not None:
        env["KVPOOL_TEST_BUDGET_S"] = budget
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the plugin alone: a child starts in ~1 s
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_timing", "-p", "no:cacheprovider",
         "--rootdir", str(root), "-q", *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False)


def _times(stdout: str) -> dict[str, float]:
    """``{directory: seconds}`` and ``"total"`` from the plugin's section."""
    section = stdout.split("test time per directory", 1)[1]
    return {name.split(" ")[0]: float(s)
            for s, name in re.findall(r"^\s*([0-9.]+) s  (\S+.*)$", section, re.M)}


def test_times_per_directory_and_total_within_budget(tmp_path: Path) -> None:
    _tiny_suite(tmp_path)
    out = _pytest(tmp_path, budget=None)
    assert out.returncode == 0, out.stdout + out.stderr
    times = _times(out.stdout)
    assert set(times) == {"fast", "slow", "total"}
    assert times["slow"] >= HOLD_S > times["fast"]
    assert times["total"] >= times["slow"] + times["fast"]
    assert "budget 1500 s, KVPOOL_TEST_BUDGET_S" in out.stdout
    assert "budget exceeded" not in out.stdout
    # One file: its directory only.
    out = _pytest(tmp_path, "fast/test_fast.py", budget="60")
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(_times(out.stdout)) == {"fast", "total"}


def test_over_budget_fails_the_run_with_one_line(tmp_path: Path) -> None:
    _tiny_suite(tmp_path)
    out = _pytest(tmp_path, budget="0.05")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 passed" in out.stdout
    total = _times(out.stdout)["total"]
    assert total >= HOLD_S
    lines = [ln for ln in out.stdout.splitlines() if "budget exceeded" in ln]
    assert lines == [f"suite time budget exceeded: {total:.1f} s > 0.05 s (KVPOOL_TEST_BUDGET_S); "
                     "make the slowest directories above cheaper or raise KVPOOL_TEST_BUDGET_S"]


@pytest.mark.parametrize("budget", ["soon", "0", "inf"])
def test_bad_budget_exits_2_naming_the_variable(tmp_path: Path, budget: str) -> None:
    _tiny_suite(tmp_path)
    out = _pytest(tmp_path, budget=budget)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == (
        f"Exit: KVPOOL_TEST_BUDGET_S must be a number of seconds > 0, got {budget!r}: set e.g. "
        "KVPOOL_TEST_BUDGET_S=3000, or unset it for the default 1500 s")
    assert "Traceback" not in out.stdout + out.stderr
