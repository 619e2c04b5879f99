"""Pin and unpin dialogs: a prefix of the selected engine's model kept resident in the pool, or
a pin dropped, as ``kvpool-console pin`` / ``unpin`` do it.

The operator's input is checked by the one-shot modes' builder (``kvpool_console._pins``), so
bad input gets the same one line naming the field, and nothing is sent. A checked request goes
up to the app as a :class:`~kvpool_console._messages.PinRequested`; the app runs it in a
thread worker (an unpin waits out readers' leases, up to ``PIN_TIMEOUT_MS``), logs each
worker's line in the events log and posts :class:`~kvpool_console._messages.PinFinished` back,
shown here in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, Static

from kvpool_agent.protocol import CommandReply, PinArgs
from kvpool_console._messages import PinFinished, PinRequested
from kvpool_console._pins import (
    DEFAULT_TTL_S,
    TUI_FIELDS,
    PinInputError,
    done_line,
    parse_ttl_s,
    pin_args,
)
from kvpool_console._text import plain

__all__ = ["PinScreen", "UnpinScreen"]

_WHAT = [("token ids, comma-separated", "tokens"), ("text (the engine's tokenizer)", "text")]
_MODES = [("soft: evicted after every unpinned value, until the TTL ends", "soft"),
          ("hard: never evicted", "hard")]
_PLACEHOLDER = {"tokens": "token ids, e.g. 1,15043,29892", "text": "the prefix's text"}


def result_lines(command: str, replies: list[CommandReply]) -> list[tuple[str, bool]]:
    """``(line, ok)`` per worker that answered ``pin`` / ``unpin``: what it did
    (``_pins.done_line``) or why it refused; one failed line when none answered."""
    if not replies:
        return [(f"{command} failed: no worker answered", False)]
    return [(done_line(command, r), True) if r.ok and r.pins is not None and r.pins.pin
            else (f"{command} failed on {r.agent_id}: {r.error or 'no result'}", False)
            for r in replies]


class _PinDialog(ModalScreen[None]):
    """What both dialogs share: the model, the status line, sending once at a time, the
    answer shown in place."""

    BINDINGS = [Binding("escape", "close_dialog", "Close")]
    command: Literal["pin", "unpin"] = "pin"

    def __init__(self, model: str, chunk_size: int = 0) -> None:
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size  # tokens (``_pins.chunk_size_of``; 0: unknown)
        self.replies: list[CommandReply] | None = None
        """The workers' replies to the last request sent (None before one was answered)."""
        self.sent: PinArgs | None = None
        """The arguments of the last request sent (None: nothing sent)."""

    def _status(self, text: str, style: str = "") -> None:
        status = self.query_one(".pin-status", Static)
        status.update(plain(text, style=style))
        status.scroll_visible(animate=False)

    def _send(self, build: Callable[[], PinArgs]) -> None:
        """Ask the app to run the request ``build`` makes of the fields (it raises
        ``PinInputError`` on a bad field: shown, nothing sent)."""
        go = self.query_one(".pin-go", Button)
        if go.disabled:
            return  # the previous request is still running
        try:
            args = build()
        except PinInputError as e:  # one line naming the field; nothing sent
            self._status(str(e), "bold red")
            return
        self.sent = args
        go.disabled = True
        self._status(f"{self.command} {args.pin_id!r} of {args.model}…")
        self.post_message(PinRequested(self, self.command, args))

    @on(PinFinished)
    def _show(self, answer: PinFinished) -> None:
        self.query_one(".pin-go", Button).disabled = False
        if answer.error is not None:  # e.g. read-only console, hub unreachable
            self._status(answer.error, "bold red")
            return
        self.replies = answer.replies
        lines = result_lines(self.command, answer.replies)
        ok = all(good for _, good in lines)
        self._status("\n".join(line for line, _ in lines), "bold green" if ok else "bold red")

    @on(Button.Pressed, ".pin-cancel")
    def action_close_dialog(self) -> None:
        self.dismiss(None)


class PinScreen(_PinDialog):
    """Pin a prefix of ``model``: token ids or text (with the chat template or not), soft
    with a TTL (s) or hard, an optional pin id; as ``kvpool-console pin``.

    Args:
        model: the model's name as its engines report it.
        chunk_size: its chunk size in tokens (0: unknown): fewer token ids are refused here.
    """

    command: Literal["pin", "unpin"] = "pin"

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog"):
            yield Label(plain(f"Pin a prefix of {self.model}"), classes="dialog-title")
            yield Select(_WHAT, value="tokens", allow_blank=False, id="pin-what")
            yield Input(placeholder=_PLACEHOLDER["tokens"], id="pin-prefix")
            yield Checkbox("chat template (text as a chat's system prompt)", id="pin-chat",
                           disabled=True)
            yield Select(_MODES, value="soft", allow_blank=False, id="pin-mode")
            yield Input(f"{DEFAULT_TTL_S:g}", placeholder="soft pin TTL (s)", id="pin-ttl")
            yield Input(placeholder="pin id (default: p- and a digest of the prefix)",
                        id="pin-id")
            yield Static("token ids or text of the prefix, then Pin", classes="pin-status",
                         id="pin-status")
            with Horizontal(classes="buttons"):
                yield Button("Pin", variant="warning", classes="pin-go", id="pin-go")
                yield Button("Close", classes="pin-cancel", id="pin-cancel")

    @on(Select.Changed, "#pin-what")
    def _what_changed(self, event: Select.Changed) -> None:
        text = event.value == "text"
        self.query_one("#pin-prefix", Input).placeholder = _PLACEHOLDER[
            "text" if text else "tokens"]
        self.query_one("#pin-chat", Checkbox).disabled = not text

    @on(Select.Changed, "#pin-mode")
    def _mode_changed(self, event: Select.Changed) -> None:
        self.query_one("#pin-ttl", Input).disabled = event.value == "hard"

    @on(Button.Pressed, "#pin-go")
    @on(Input.Submitted)
    def _go(self) -> None:
        self._send(self._args)

    def _args(self) -> PinArgs:
        """The pin the fields mean (``PinInputError`` on a bad one)."""
        prefix = self.query_one("#pin-prefix", Input).value
        text = self.query_one("#pin-what", Select).value == "text"
        mode = str(self.query_one("#pin-mode", Select).value)
        # A hard pin has no TTL: whatever the disabled field holds is not checked.
        ttl_s = DEFAULT_TTL_S if mode == "hard" else parse_ttl_s(
            self.query_one("#pin-ttl", Input).value, TUI_FIELDS)
        return pin_args("pin", self.model, tokens=None if text else prefix,
                        text=prefix if text else None,
                        chat_template=text and self.query_one("#pin-chat", Checkbox).value,
                        pin_id=self.query_one("#pin-id", Input).value.strip(), mode=mode,
                        ttl_s=ttl_s, names=TUI_FIELDS, chunk_size=self.chunk_size)


class UnpinScreen(_PinDialog):
    """Drop pin ``pin id`` of ``model`` and remove its values from the pool; as
    ``kvpool-console unpin``.

    Args:
        model: the model's name as its engines report it.
    """

    command: Literal["pin", "unpin"] = "unpin"

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog"):
            yield Label(plain(f"Unpin a prefix of {self.model}"), classes="dialog-title")
            yield Input(placeholder="pin id (n lists the pins)", id="unpin-id")
            yield Static("the pin's id, then Unpin: its values leave the pool",
                         classes="pin-status", id="unpin-status")
            with Horizontal(classes="buttons"):
                yield Button("Unpin", variant="error", classes="pin-go", id="unpin-go")
                yield Button("Close", classes="pin-cancel", id="unpin-cancel")

    @on(Button.Pressed, "#unpin-go")
    @on(Input.Submitted, "#unpin-id")
    def _go(self) -> None:
        self._send(self._args)

    def _args(self) -> PinArgs:
        """The unpin the field means (``PinInputError`` on an empty or bad id)."""
        return pin_args("unpin", self.model,
                        pin_id=self.query_one("#unpin-id", Input).value.strip(),
                        names=TUI_FIELDS)
