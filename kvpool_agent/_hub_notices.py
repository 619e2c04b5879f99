"""Telling an agent that the hub drops its reports (``protocol.ReportRefused``): a takeover, a
key bound elsewhere, a full fleet or an oversized state leave the agent reporting into nothing,
and without a word from the hub its own log says only that it reports (a new user found a store
agent with a duplicate id, and a pool-bound key used for another pool, silently absent).

At most one notice a ``REFUSAL_NOTICE_S`` per connection, never blocking (``NOBLOCK``: a notice
that cannot be queued is not sent), and at most ``_REMEMBERED`` connections remembered (the
oldest forgotten first): a flood of refused reports costs the hub one small frame per
connection and interval.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import zmq

from kvpool_agent.protocol import PROTOCOL_VERSION, REFUSAL_NOTICE_S, ReportRefused, clip, encode

if TYPE_CHECKING:
    from kvpool_agent._hub_sockets import HubSockets

__all__ = ["RefusalNotices"]

_REMEMBERED = 4096
_FLEET_REASONS = {
    "takeover": ("takeover: this agent id or engine id is held by another live connection or "
                 "agent key; reports dropped (give each process its own engine_id)"),
    "full": "full: the hub holds no more agents or state for this engine; reports dropped",
    "oversized": "oversized: the report's state is over the hub's limit; reports dropped",
}
_REASON_CHARS = 300


class RefusalNotices:
    """Notices to agents whose reports the hub refused, sent on the agents' ROUTER (read from
    ``sockets`` at each send: the memory guard may have rebuilt it)."""

    def __init__(self, sockets: HubSockets) -> None:
        self._sockets = sockets
        self._told: dict[bytes, float] = {}

    def tell(self, routing_id: bytes, reason: str, *, own: bool) -> None:
        """Tell the connection ``routing_id`` why its report was dropped, unless it was told
        within ``REFUSAL_NOTICE_S``. A reason about its own key's binding (``own``:
        ``auth.bound_elsewhere``'s) goes as it is; one about the fleet (an id or engine another
        live connection or key holds, a full fleet) only as its kind and the fix: the agent key
        that sent it may not learn which ids are live (the reason's text quotes ids the sender
        chose, so only ``own`` decides)."""
        now = time.monotonic()
        last = self._told.pop(routing_id, None)
        if last is not None and now - last < REFUSAL_NOTICE_S:
            self._told[routing_id] = last
            return
        self._told[routing_id] = now
        while len(self._told) > _REMEMBERED:
            del self._told[next(iter(self._told))]
        kind = reason.partition(":")[0]
        told = reason if own else _FLEET_REASONS.get(kind, "refused: reports dropped")
        notice = ReportRefused(v=PROTOCOL_VERSION, reason=clip(told, _REASON_CHARS,
                                                                 one_line=True))
        # Gone, or its queue full: the next refusal after the interval tries again.
        with contextlib.suppress(zmq.ZMQError):
            self._sockets.agents.send_multipart([routing_id, encode(notice)], zmq.NOBLOCK)
