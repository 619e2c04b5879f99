"""The docs' table of console keys is the one ``scripts/gen_console_keys.py`` writes from the
app's bindings (the same rows the help screen shows)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_keys_table_is_the_generated_one() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_console_keys", ROOT / "scripts" / "gen_console_keys.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_console_keys"] = gen
    spec.loader.exec_module(gen)
    committed = (ROOT / "docs" / "snippets" / "console-keys.md").read_text()
    assert committed == gen.render(), (
        "docs/snippets/console-keys.md is out of date: run .venv/bin/python "
        "scripts/gen_console_keys.py (or make docs-reference) and commit it")
    assert "| Commands | `t` |" in committed  # the hidden triage key is listed
