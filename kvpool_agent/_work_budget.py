"""What each key may make engines do through the hub: a budget of engine work units per key.

Some read-only commands make every agent they reach do real work inside its serving process
(issue 42: a viewer's ``flush --dry-run`` naming every worker, 64 in flight, made each list
every pool key, 153 enumerations a second: engine CPU from 6% to 134%, the master's from 1% to
22%, the scheduler's lookup p99 from 12-13 to 15-18 ms). Commands in flight per key bound the
concurrency, not the rate; this bounds the rate. One unit is one agent doing one such command
(``cost``); each key has ``capacity`` units, refilled evenly over a minute. A command is taken
while the key has units left, and its whole cost is spent (the balance may go below zero: one
command naming thousands of agents is taken once, then the key waits for the refill), so a key
makes engines do at most ``capacity`` units a minute on average, plus one command's burst.
"""

from __future__ import annotations

import time

from kvpool_agent.protocol import CommandRequest

__all__ = ["WORK_UNITS_PER_MIN", "WorkBudget", "cost"]

WORK_UNITS_PER_MIN = 240
"""Default engine work units one key may spend a minute (4 a second on average): a console's
dry run of a pool, ``pins`` or a probe of each engine now and then fits many times over."""


def cost(req: CommandRequest, agents: int) -> int:
    """Units ``req`` costs when it reaches ``agents`` agents: one per agent for a dry-run
    flush (a pool listing and sizing), ``pins`` (a listing of the pool's pin records) and
    ``health --probe`` (a write, read and remove); 0 for the others (a flush itself, ``pin``
    and ``unpin`` are operator commands with their own bounds; ``health`` without a probe,
    ``snapshot`` and ``drain`` read the process's own state)."""
    heavy = (req.command == "pins" or (req.command == "health" and req.probe)
             or (req.command == "flush" and req.flush is not None and req.flush.dry_run))
    return agents if heavy else 0


class WorkBudget:
    """Per key (its name), the engine work units left (``capacity`` a minute).

    Args:
        capacity: units a key holds when full, and refills per 60 s (> 0).
    """

    def __init__(self, capacity: int = WORK_UNITS_PER_MIN) -> None:
        self.capacity = capacity
        # Key -> (units left, when counted: time.monotonic() s). Keys are the hub's authorized
        # key names ("plain" without keys): as many as the authorized_keys directory holds.
        self._left: dict[str, tuple[float, float]] = {}

    def spend(self, key: str, units: int, now: float | None = None) -> float | None:
        """Spend ``units`` of ``key``'s budget; ``None`` when taken, else the seconds until the
        key has units again (nothing spent)."""
        if units <= 0:
            return None
        now = time.monotonic() if now is None else now
        left, then = self._left.get(key, (float(self.capacity), now))
        left = min(float(self.capacity), left + (now - then) * self.capacity / 60.0)
        if left <= 0:
            self._left[key] = (left, now)
            return -left * 60.0 / self.capacity + 1e-3
        self._left[key] = (left - units, now)
        return None
