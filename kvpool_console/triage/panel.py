"""The triage panel of the engine detail screen: runs ``triage_engine`` and shows the report.

The app's ``t`` action opens the engine's detail screen (when on the fleet screen) and calls
:func:`show_triage`; the panel is mounted above the footer, the checks run in an async worker
on the app's event loop (``asyncssh`` is asyncio), and the screen keeps refreshing meanwhile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from kvpool_agent.protocol import EngineState
from kvpool_console._messages import TriageFinished
from kvpool_console._text import plain
from kvpool_console.triage._model import TriageReport
from kvpool_console.triage._plan import PlanError
from kvpool_console.triage._render import render
from kvpool_console.triage._run import triage_engine

__all__ = ["TriagePanel", "show_triage"]


class TriagePanel(VerticalScroll):
    """Scrollable triage result of one engine; ``report`` is set once the run finished, and
    ``TriageFinished`` posted (the app logs its summary in the events log).

    Args:
        engine_id: the engine triaged.
        states: the fleet as last sampled (agent id -> EngineState).
        reporting: whether the engine's agents still report.
        ssh_config: an ssh config file instead of ``~/.ssh/config``.
        ssh: log in over SSH to a host that is this machine too.
    """

    DEFAULT_CSS = """
    TriagePanel {
        height: auto;
        max-height: 60%;
        border-top: solid $primary;
        padding: 0 1;
    }
    """

    def __init__(self, engine_id: str, states: Mapping[str, EngineState], *,
                 reporting: bool, ssh_config: str | None = None, ssh: bool = False) -> None:
        super().__init__(id="triage-panel")
        self.engine_id = engine_id
        self.report: TriageReport | None = None
        self._args = (dict(states), reporting, ssh_config, ssh)

    def compose(self) -> ComposeResult:
        yield Static(plain(f"triage of {self.engine_id}: checking its hosts…"),
                     id="triage-body")

    def on_mount(self) -> None:
        self.run_worker(self._go(), exclusive=True, group="triage")

    async def _go(self) -> None:
        states, reporting, ssh_config, ssh = self._args
        body = self.query_one("#triage-body", Static)
        try:
            report = await triage_engine(self.engine_id, states, reporting=reporting,
                                         ssh_config=ssh_config, ssh=ssh)
        except PlanError as e:
            body.update(plain(f"triage: {e}", style="bold red"))
            self.post_message(TriageFinished(self.engine_id, f"not run: {e}"))
            return
        self.report = report
        body.update(render(report, log_lines=15))
        order = {"critical": 0, "warning": 1, "info": 2}
        top = sorted(report.diagnosis, key=lambda f: order[f.severity])
        self.post_message(TriageFinished(self.engine_id, f"{top[0].severity} {top[0].text}"
                                    if top else "nothing found"))


async def show_triage(screen: Screen[Any], engine_id: str,
                      states: Mapping[str, EngineState], *, reporting: bool,
                      ssh_config: str | None = None, ssh: bool = False) -> TriagePanel:
    """Mount a fresh ``TriagePanel`` for ``engine_id`` on ``screen`` (replacing an earlier
    one) above its footer, which starts the run; returns the panel."""
    for old in screen.query(TriagePanel):
        await old.remove()
    panel = TriagePanel(engine_id, states, reporting=reporting, ssh_config=ssh_config, ssh=ssh)
    footers = screen.query(Footer)
    await screen.mount(panel, before=footers.first() if footers else None)
    return panel
