"""``kvpool-console --refresh``'s lower bound is the TUI's fastest redraw step: the CLI keeps
its own copy (its one-shot modes do not load Textual), this keeps the two equal."""

from __future__ import annotations

from kvpool_console import cli
from kvpool_console.app import REFRESH_STEPS


def test_the_cli_refresh_bound_is_the_tuis_fastest_step() -> None:
    assert cli._FASTEST_REFRESH_S == REFRESH_STEPS[0] == min(REFRESH_STEPS)
