"""``scripts/screenshots.py`` draws every screen of the real console over the recorded demo
fleet; a screen that cannot be drawn (a widget that fails, a key that no longer opens it) fails
here. Runs into a temp dir: the committed pictures are left alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCREENS = {"fleet", "pool", "events", "detail", "flush", "triage", "help"}


def test_every_screen_is_drawn(tmp_path: Path,
                               script: Callable[[str], ModuleType]) -> None:
    shots = script("screenshots")
    assert shots.main(["--out", str(tmp_path)]) == 0
    assert {p.stem for p in tmp_path.glob("*.svg")} == SCREENS
    expect = {"fleet": "decode-1", "pool": "Segment", "events": "Sev", "detail": "namespace",
              "flush": "Dry run", "triage": "triage of engine", "help": "keyed hub"}
    for name, text in expect.items():
        svg = (tmp_path / f"{name}.svg").read_text()
        assert svg.startswith("<svg"), name
        # Textual writes each space of the terminal as &#160;
        assert text in svg.replace("&#160;", " "), (name, text)


def test_docs_use_every_committed_picture() -> None:
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    for name in SCREENS:
        assert (ROOT / "docs" / "img" / f"{name}.svg").is_file(), name
        assert f"img/{name}.svg" in docs, name
