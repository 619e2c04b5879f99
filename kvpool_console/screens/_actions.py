"""Action modals: health check results and the flush flow (scope -> dry run -> confirm -> result).

A modal asks for its command with a message (``HealthRequested``, ``FlushRequested``) that
bubbles up to the app; the app runs it in a thread worker, so the UI keeps refreshing while
agents answer, and posts the answer (``HealthFinished``, ``FlushFinished``) back to the modal,
which shows it in place.
"""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, DataTable, Label, RadioButton, RadioSet, Static

from kvpool_agent.protocol import CommandReply, FlushArgs, FlushResult
from kvpool_console._messages import (
    FlushFinished,
    FlushRequested,
    HealthFinished,
    HealthRequested,
)
from kvpool_console._text import plain
from kvpool_console.model import fmt_bytes, health_rows, sum_flush

__all__ = ["ConfirmScreen", "FlushScreen", "HealthScreen"]


class HealthScreen(ModalScreen[None]):
    """Asks for a health check of ``targets`` and shows one row per agent and check.

    Args:
        title: what is checked (``"health: engine e1"``).
        targets: agent ids (empty: every agent).
    """

    BINDINGS = [Binding("escape,q", "close", "Close")]

    def __init__(self, title: str, targets: list[str]) -> None:
        super().__init__()
        self._title = title
        self._targets = targets
        self.replies: list[CommandReply] | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(plain(self._title), classes="dialog-title")
            yield Static("running…", id="health-status")
            yield DataTable(id="health-table", cursor_type="row")
            yield Button("Close", id="close")

    def on_mount(self) -> None:
        self.query_one("#health-table", DataTable).add_columns(
            "Agent", "Check", "OK", "ms", "Detail")
        self.post_message(HealthRequested(self, self._title, self._targets))

    @on(HealthFinished)
    def _show(self, answer: HealthFinished) -> None:
        status = self.query_one("#health-status", Static)
        if answer.error is not None:  # a failed command is a result to show, not a crash
            status.update(plain(answer.error, style="bold red"))
            return
        replies = answer.replies
        self.replies = replies
        table = self.query_one("#health-table", DataTable)
        bad = 0
        for agent, check, ok, ms, detail in health_rows(replies):
            bad += not ok
            table.add_row(plain(agent), plain(check),
                          Text("ok", style="green") if ok else Text("FAIL", style="bold red"),
                          ms, plain(detail))
        verdict = "all checks passed" if not bad else f"{bad} checks failed"
        status.update(Text(f"{len(replies)} agents answered: {verdict}",
                           style="green" if not bad and replies else "bold red"))

    @on(Button.Pressed, "#close")
    def action_close(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """Yes/no confirmation; dismisses with True only on "Yes" (or ``y``)."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self._question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(plain(self._question), id="question")
            with Horizontal(classes="buttons"):
                yield Button("Yes, remove", variant="error", id="yes")
                yield Button("No", variant="primary", id="no")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class FlushScreen(ModalScreen[FlushResult | None]):
    """Flush flow: pick the scope, see the dry-run count, confirm, see what was removed.

    Args:
        engine_id, model: the selected engine and its model (scopes ``engine``/``model``);
            ``None`` hides the scopes that need them.

    Dismisses with the final (non-dry-run) FlushResult, or None when cancelled.
    """

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("d", "dry_run", "Dry run")]

    def __init__(self, engine_id: str | None, model: str | None) -> None:
        super().__init__()
        self.engine_id = engine_id
        self.model = model
        self.dry: FlushResult | None = None
        self.result: FlushResult | None = None

    def _scopes(self) -> list[tuple[str, str]]:
        # Narrowest first: the first scope is preselected, so opened on an engine row the
        # dialog never starts on a wider scope than the row the operator picked.
        out = []
        if self.engine_id:
            out.append(("engine", f"engine {self.engine_id}"))
        if self.model:
            out.append(("model", f"model {self.model}"))
        out.append(("all", "all kvpool keys"))
        return out

    def compose(self) -> ComposeResult:
        # Scrolls when the terminal is too small (40x12 over SSH): the buttons stay reachable
        # by Tab, and every status update scrolls itself into view.
        with VerticalScroll(classes="dialog"):
            yield Label("Flush pool entries", classes="dialog-title")
            with RadioSet(id="scope"):
                for i, (key, label) in enumerate(self._scopes()):
                    yield RadioButton(plain(label), value=i == 0, name=key, id=f"scope-{key}")
            yield Checkbox("force (also remove leased entries)", id="force")
            yield Static("press Dry run to count what the scope holds", id="flush-status")
            with Horizontal(classes="buttons"):
                yield Button("Dry run", id="dry")
                yield Button("Flush…", variant="error", id="go", disabled=True)
                yield Button("Cancel", id="cancel")

    def args(self, *, dry_run: bool) -> FlushArgs:
        """The FlushArgs the current choices mean."""
        pressed = self.query_one("#scope", RadioSet).pressed_button
        scope = pressed.name if pressed is not None and pressed.name else "all"
        return FlushArgs(scope=scope,  # type: ignore[arg-type]
                         model=self.model if scope == "model" else None,
                         engine_id=self.engine_id if scope == "engine" else None,
                         dry_run=dry_run, force=self.query_one("#force", Checkbox).value)

    def _status(self, text: str, style: str = "") -> None:
        status = self.query_one("#flush-status", Static)
        status.update(plain(text, style=style))
        status.scroll_visible(animate=False)

    @on(RadioSet.Changed)
    @on(Checkbox.Changed)
    def _choice_changed(self) -> None:
        # A dry-run count only vouches for the scope it was made for.
        self.dry = None
        self.query_one("#go", Button).disabled = True
        self._status("press Dry run to count what the scope holds")

    @on(Button.Pressed, "#dry")
    def action_dry_run(self) -> None:
        self._status("dry run…")
        self.post_message(FlushRequested(self, self.args(dry_run=True)))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(self.result)

    @on(Button.Pressed, "#go")
    def _go(self) -> None:
        if self.dry is None:
            return
        a = self.args(dry_run=False)
        what = {"model": f"model {a.model}", "engine": f"engine {a.engine_id}",
                "all": "ALL kvpool keys"}[a.scope]
        question = (f"Remove {self.dry.keys} keys ({fmt_bytes(self.dry.bytes)}) of {what}?"
                    + (" Leased entries too (force): an engine still copying one may take "
                       "memory a new value reuses as its KV. Stop the engines reading this "
                       "pool first." if a.force else ""))

        def answered(yes: bool | None) -> None:
            if yes:
                self._status("flushing…")
                self.post_message(FlushRequested(self, a))
            else:
                self._status("not flushed")

        self.app.push_screen(ConfirmScreen(question), answered)

    @on(FlushFinished)
    def _show(self, answer: FlushFinished) -> None:
        if answer.error is not None:  # shown in place: e.g. read-only console, hub unreachable
            self._status(answer.error, "bold red")
            return
        total, errors = sum_flush(answer.replies)
        err = ("; errors: " + "; ".join(errors)) if errors else ""
        if total is None:
            self._status(f"flush failed{err}", "bold red")
            return
        if answer.args.dry_run:
            self.dry = total
            self.query_one("#go", Button).disabled = total.keys == 0
            self._status(f"dry run: would remove {total.keys} keys ({fmt_bytes(total.bytes)}), "
                         f"{total.skipped_leased} leased would be skipped{err}",
                         "yellow" if errors else "")
        else:
            self.result = total
            self.dry = None
            self.query_one("#go", Button).disabled = True
            self._status(f"removed {total.removed_keys} of {total.keys} keys "
                         f"({fmt_bytes(total.bytes)}), {total.skipped_leased} leased "
                         f"skipped{err}", "bold green" if not errors else "bold yellow")
