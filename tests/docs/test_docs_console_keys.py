"""The docs' table of console keys is the one ``scripts/gen_console_keys.py`` writes from the
app's bindings (the same rows the help screen shows)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def test_committed_keys_table_is_the_generated_one(script: Callable[[str], ModuleType]) -> None:
    gen = script("gen_console_keys")
    committed = (ROOT / "docs" / "snippets" / "console-keys.md").read_text()
    assert committed == gen.render(), (
        "docs/snippets/console-keys.md is out of date: run .venv/bin/python "
        "scripts/gen_console_keys.py (or make docs-reference) and commit it")
    assert "| Commands | `t` |" in committed  # the hidden triage key is listed
