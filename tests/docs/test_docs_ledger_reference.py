"""The counter catalogue in ``docs/architecture.md`` is the one
``scripts/gen_ledger_reference.py`` writes from ``kvpool_agent/ledger.py``: a fact added, renamed
or re-documented without regenerating the page fails here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from kvpool_agent.ledger import FACTS

ROOT = Path(__file__).resolve().parents[2]


def test_committed_catalogue_is_the_generated_one(script: Callable[[str], ModuleType]) -> None:
    gen = script("gen_ledger_reference")
    committed = (ROOT / "docs" / "architecture.md").read_text()
    assert committed == gen.render(committed), (
        "docs/architecture.md's counter catalogue is out of date: run "
        ".venv/bin/python scripts/gen_ledger_reference.py and commit it")
    for f in FACTS:
        assert f"| `{f.name}` | {f.kind} | {f.unit} |" in committed


def test_a_page_without_markers_is_refused(script: Callable[[str], ModuleType]) -> None:
    with pytest.raises(SystemExit, match="markers"):
        script("gen_ledger_reference").render("# Architecture\n")
