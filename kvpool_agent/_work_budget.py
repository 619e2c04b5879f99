"""What each key may make engines do through the hub: a budget of engine work units per key.

Some commands make every agent they reach do real work inside its serving process (issue 42: a
viewer's ``flush --dry-run`` naming every worker, 64 in flight, made each list every pool key,
153 enumerations a second: engine CPU from 6% to 134%, the master's from 1% to 22%, the
scheduler's lookup p99 from 12-13 to 15-18 ms). Commands in flight per key bound the
concurrency, not the rate; this bounds the rate. Every command a console sends costs (``cost``):
one unit is one agent doing one pool listing's worth of work; each key has ``capacity`` units,
refilled evenly over a minute. A command is taken while the key has units left, and its whole
cost is spent (the balance may go below zero: one command naming thousands of agents is taken
once, then the key waits for the refill), so a key makes engines do at most ``capacity`` units a
minute on average, plus one command's burst.

Costs are per agent connection reached (the ZMQ routing ids the command goes to: an agent
process is one connection, whatever agent ids it reports), by what the agent does (``COSTS``).
Per connection, not per agent id (round 5: a key bound to one engine may report 1,024 agent ids
from one connection, and each ``health`` of every agent then cost the operator 64 units for
them: five and its flush was refused ``hub busy``). A pool listing (a dry-run or
real flush: Mooncake ``/get_all_keys`` then matching and sizing, O(pool keys) under the engine's
GIL), a listing of the pool's pin records (``pins``, ``pin``, ``unpin``) or a write, read and
remove (``health --probe``) cost 1; plain ``health`` (the client's own checks and the master's
``/health``: one HTTP request, no pool keys) 1/16; ``snapshot`` and ``drain`` (the agent's own
state; a drain waits without working) 1/64; ``forget`` (the hub's own table) 1 for the
command. So ``health`` of 2,304 agents (each its own process) costs 144 units: any key may ask
it of the whole fleet about once a minute within the default 240, and a second time at once
(the balance goes below zero), while a viewer's flood of it reaches each agent a few times a
minute at most.
"""

from __future__ import annotations

import time

from kvpool_agent.protocol import CommandRequest

__all__ = ["COSTS", "WORK_UNITS_PER_MIN", "WorkBudget", "cost"]

WORK_UNITS_PER_MIN = 240
"""Default engine work units one key may spend a minute (4 a second on average): a console's
dry run of a pool, ``pins``, a probe of each engine now and then, ``health`` of a fleet of
2,304 agents once a minute fit."""

COSTS: dict[str, float] = {
    "flush": 1.0,
    "pins": 1.0,
    "pin": 1.0,
    "unpin": 1.0,
    "health --probe": 1.0,
    "health": 1 / 16,
    "snapshot": 1 / 64,
    "drain": 1 / 64,
}
"""Units per agent connection reached, by command (``health --probe``: ``health`` with
``probe``)."""
_FORGET_COST = 1.0
"""Units of one ``forget`` or ``refusals`` (the hub's own table, no agent reached)."""


def cost(req: CommandRequest, agents: int) -> float:
    """Units ``req`` costs when it reaches ``agents`` agent connections (``COSTS``;
    ``forget`` and ``refusals``, answered by the hub alone: 1 for the command, so an operator
    key's flood of them is bounded too). An unknown command costs as much as a listing per
    connection."""
    if req.command in ("forget", "refusals"):
        return _FORGET_COST
    name = "health --probe" if req.command == "health" and req.probe else req.command
    return COSTS.get(name, 1.0) * agents


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

    def spend(self, key: str, units: float, now: float | None = None) -> float | None:
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
