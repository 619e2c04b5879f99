"""Messages between the console's widgets, screens and app.

Selection bubbles up from the fleet table (:class:`EngineChosen`). Commands are asked for by the
modal that shows their result (:class:`HealthRequested`, :class:`FlushRequested`,
:class:`PinRequested`, bubbling up to the app, which owns the fleet source) and answered by the
app posting :class:`HealthFinished` / :class:`FlushFinished` / :class:`PinFinished` to that
modal. The app runs the command in a thread worker, so the answer is posted from that thread
(``post_message`` is thread-safe).
"""

from __future__ import annotations

from typing import Literal

from textual.message import Message
from textual.message_pump import MessagePump

from kvpool_agent.protocol import CommandReply, FlushArgs, PinArgs

__all__ = ["EngineChosen", "FleetArrived", "FlushFinished", "FlushRequested", "HealthFinished",
           "HealthRequested", "PinFinished", "PinRequested", "TriageFinished"]


class FleetArrived(Message):
    """The fleet source merged a whole batch of hub updates (posted from its feed thread)."""


class EngineChosen(Message):
    """The operator chose an engine (``enter`` on its row or one of its agents' rows)."""

    def __init__(self, engine_id: str) -> None:
        super().__init__()
        self.engine_id = engine_id


class TriageFinished(Message):
    """A triage panel's run ended (bubbles up to the app, which logs it in the events log):
    ``summary`` is its most severe finding, or why it could not run."""

    def __init__(self, engine_id: str, summary: str) -> None:
        super().__init__()
        self.engine_id, self.summary = engine_id, summary


class HealthRequested(Message):
    """Run the health command on ``targets`` (agent ids; empty: every agent).

    Args:
        requester: where to post the :class:`HealthFinished` answer.
        title: what is checked, for the events log (``"health: engine e1"``).
        targets: agent ids.
    """

    def __init__(self, requester: MessagePump, title: str, targets: list[str]) -> None:
        super().__init__()
        self.requester = requester
        self.title = title
        self.targets = targets


class HealthFinished(Message):
    """Answer to :class:`HealthRequested`: one reply per agent, or the error that stopped the
    command (``"TimeoutError: ..."``) with no replies."""

    bubble = False  # posted to the modal that asked; nothing above it needs it

    def __init__(self, replies: list[CommandReply], error: str | None = None) -> None:
        super().__init__()
        self.replies = replies
        self.error = error


class FlushRequested(Message):
    """Run one flush with ``args`` (a dry run or the removal).

    Args:
        requester: where to post the :class:`FlushFinished` answer.
        args: scope, model/engine, dry run, force.
    """

    def __init__(self, requester: MessagePump, args: FlushArgs) -> None:
        super().__init__()
        self.requester = requester
        self.args = args


class FlushFinished(Message):
    """Answer to :class:`FlushRequested` for ``args``: one reply per agent that ran it, or the
    error that stopped it before any agent did (read-only console, hub unreachable)."""

    bubble = False  # posted to the modal that asked; nothing above it needs it

    def __init__(self, args: FlushArgs, replies: list[CommandReply],
                 error: str | None = None) -> None:
        super().__init__()
        self.args = args
        self.replies = replies
        self.error = error


class PinRequested(Message):
    """Run ``pin`` or ``unpin`` with ``args`` (checked already: ``_pins.pin_args``).

    Args:
        requester: where to post the :class:`PinFinished` answer.
        command: ``pin`` or ``unpin``.
        args: model, pin id and, for a pin, the prefix, mode and TTL.
    """

    def __init__(self, requester: MessagePump, command: Literal["pin", "unpin"],
                 args: PinArgs) -> None:
        super().__init__()
        self.requester = requester
        self.command: Literal["pin", "unpin"] = command
        self.args = args


class PinFinished(Message):
    """Answer to :class:`PinRequested`: one reply per worker that ran it, or the error that
    stopped it before any did (read-only console, hub unreachable)."""

    bubble = False  # posted to the modal that asked; nothing above it needs it

    def __init__(self, replies: list[CommandReply], error: str | None = None) -> None:
        super().__init__()
        self.replies = replies
        self.error = error
