"""The help screen's key table is built from the bindings: every key the app binds is listed,
the hidden ones included, and the text says what a keyed hub needs."""

from __future__ import annotations

from kvpool_console.app import KVPoolConsole
from kvpool_console.screens._help import ACTION_HELP, KEYED_HUB_TEXT, help_rows
from kvpool_console.source import StaticSource


def _rows() -> dict[str, str]:
    app = KVPoolConsole(StaticSource({}), refresh_s=3600)
    return {r.text: r.keys for r in help_rows(app)}


def test_every_app_binding_has_a_row_in_words() -> None:
    rows = _rows()
    for binding in KVPoolConsole.BINDINGS:
        action = binding.action  # type: ignore[union-attr]
        assert action in ACTION_HELP, f"help: no words for action {action!r}"
        assert ACTION_HELP[action][1] in rows


def test_hidden_keys_are_listed() -> None:
    rows = _rows()
    assert rows[ACTION_HELP["triage"][1]] == "t"
    assert rows[ACTION_HELP["health(True)"][1]] == "H"
    assert rows[ACTION_HELP["quit"][1]] == "q, ^c"
    assert rows[ACTION_HELP["tab('events')"][1]] == "3"


def test_keyed_hub_needs_a_key_to_watch() -> None:
    assert "viewer.key_secret" in KEYED_HUB_TEXT and "hub.key" in KEYED_HUB_TEXT
    assert "needs no key" not in KEYED_HUB_TEXT
