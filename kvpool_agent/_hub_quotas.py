"""What each key may cost the hub and the fleet through the command ports: commands in flight
(per connection, per key, in all, with a reserve for the operator), ``pin``/``unpin`` per
minute, and engine work per minute (``kvpool_agent._work_budget``).

Bounded per key (the ZAP User-Id's key name; ``plain`` without keys), not per message or
connection: a key opening more connections gets no more. A command over a quota is answered at
once by the hub, never sent to an agent and never audited (a flood must not fill the audit
file); the refusal is counted for the key (``HubCounters.refused_by_key``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from kvpool_agent._work_budget import WORK_UNITS_PER_MIN, WorkBudget

__all__ = [
    "MAX_PENDING",
    "MAX_PENDING_PER_CONNECTION",
    "MAX_PENDING_PER_KEY",
    "OPERATOR_RESERVE",
    "PIN_COMMANDS_PER_MIN",
    "Quotas",
]

MAX_PENDING = 1024
"""Commands in flight at once; more are answered at once with an error."""
OPERATOR_RESERVE = 256
"""Pending slots only the operator port P+3 may use, so read-only traffic never starves it."""
MAX_PENDING_PER_CONNECTION = 16
"""Commands one connection of the read-only port P+2 may have in flight."""
MAX_PENDING_PER_KEY = 64
"""Commands one key may have in flight on the read-only port P+2, over all its connections
(``plain`` counts as one key)."""
PIN_COMMANDS_PER_MIN = 30
"""``pin`` and ``unpin`` commands one operator key may send per minute (sliding window); more
are refused at once, unaudited, like a full pending quota. Bounds what a flood of pins costs
the workers (each pin reads and upserts up to ``MAX_PIN_TOKENS`` tokens' values) and the
audit file."""


class Quotas:
    """The quotas of every key (hub thread only).

    Args:
        work_units_per_min: engine work units one key may spend a minute.
    """

    def __init__(self, work_units_per_min: int = WORK_UNITS_PER_MIN) -> None:
        self.work = WorkBudget(work_units_per_min)
        # Operator key -> when its last PIN_COMMANDS_PER_MIN pin/unpin commands were taken.
        self._pin_times: dict[str, deque[float]] = {}

    def busy(self, pending: Iterable[tuple[bool, bytes, str]], client: bytes, key: str, *,
             curve: bool, command: str = "") -> str | None:
        """Why a new command of ``key`` from connection ``client`` cannot be taken now (a full
        pending quota, a key's pin commands over ``PIN_COMMANDS_PER_MIN``), else ``None``.
        ``pending``: the commands in flight as (from the read-only port, connection, key)."""
        flight = list(pending)
        if len(flight) >= MAX_PENDING:
            return f"hub busy: {MAX_PENDING} commands in flight, retry later"
        if curve:
            if command not in ("pin", "unpin"):
                return None
            # Each pin makes a worker read and upsert up to MAX_PIN_TOKENS tokens' values.
            now = time.monotonic()
            sent = self._pin_times.setdefault(key, deque(maxlen=PIN_COMMANDS_PER_MIN))
            if len(sent) == PIN_COMMANDS_PER_MIN and now - sent[0] < 60.0:
                return (f"hub busy: {PIN_COMMANDS_PER_MIN} pin/unpin commands of this key in "
                        f"the last minute; retry in {60.0 - (now - sent[0]):.0f} s")
            sent.append(now)
            return None
        plain = [(c, k) for readonly, c, k in flight if readonly]
        if len(plain) >= MAX_PENDING - OPERATOR_RESERVE:
            return "hub busy: the read-only port's commands in flight are at their limit"
        if sum(1 for c, _ in plain if c == client) >= MAX_PENDING_PER_CONNECTION:
            return (
                f"hub busy: {MAX_PENDING_PER_CONNECTION} commands of this connection in "
                "flight, wait for their replies"
            )
        if sum(1 for _, k in plain if k == key) >= MAX_PENDING_PER_KEY:
            return (f"hub busy: {MAX_PENDING_PER_KEY} commands of this key in flight (all "
                    "its connections), wait for their replies")
        return None

    def spend(self, key: str, units: float) -> str | None:
        """Spend ``units`` of ``key``'s engine work budget; ``None`` when taken, else why not
        (nothing spent)."""
        wait_s = self.work.spend(key, units)
        if wait_s is None:
            return None
        return (f"hub busy: this key's engine work budget ({self.work.capacity} units a "
                f"minute: one per agent listing the pool, probing or listing pins, 1/16 per "
                f"agent's health, 1/64 per snapshot or drain) is spent; retry in "
                f"{wait_s:.0f} s")
