"""The connector's configuration reference page is the one ``scripts/gen_config_reference.py``
writes from ``kvpool_connector/config.py``: a field added, renamed or re-documented without
regenerating the page fails here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from kvpool_connector.config import CONNECTOR_EXTRA_KEYS

ROOT = Path(__file__).resolve().parents[2]


def test_committed_page_is_the_generated_one(script: Callable[[str], ModuleType]) -> None:
    gen = script("gen_config_reference")
    committed = (ROOT / "docs" / "connector" / "config-reference.md").read_text()
    assert committed == gen.render(), (
        "docs/connector/config-reference.md is out of date: run "
        ".venv/bin/python scripts/gen_config_reference.py (or make docs-reference) and commit it")


def test_every_connector_key_has_a_row_and_a_section(script: Callable[[str], ModuleType]
                                                     ) -> None:
    text = script("gen_config_reference").render()
    for key in CONNECTOR_EXTRA_KEYS:
        assert f"| [`{key}`](#{key}) |" in text
        assert f"### `{key}`" in text


def test_a_field_without_a_docstring_entry_is_refused(
        monkeypatch: pytest.MonkeyPatch, script: Callable[[str], ModuleType]) -> None:
    gen = script("gen_config_reference")
    monkeypatch.setattr(gen.cfg.KVPoolConfig, "__doc__", "Settings.\n\n    Attributes:\n"
                        "        backend: the backend.\n")
    with pytest.raises(SystemExit, match="describe it there"):
        gen.render()
