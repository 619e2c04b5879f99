"""The hub's view of the fleet: each agent's latest state, which agents reported since the last
update, which agents a command goes to, and the ``FleetUpdate`` frames consoles receive.

Thread-safe: the hub thread writes, ``FleetHub.fleet()`` reads from any thread. Agents that go
silent stay with their last state and ``last_seen_ms``; consoles decide when that is stale.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandRequest,
    EngineState,
    ErrorRecord,
    FleetUpdate,
    Report,
)

__all__ = ["ENGINES_PER_UPDATE", "LIVE_S", "MAX_AGENTS", "Fleet"]

ENGINES_PER_UPDATE = 128
"""Engines per ``FleetUpdate`` frame; a large fleet's snapshot spans several frames so each
stays far below ``MAX_MESSAGE_BYTES``."""

MAX_AGENTS = 16_384
"""Agents the hub keeps; reports from further new agent ids are refused."""

LIVE_S = 15.0
"""An agent heard from within this many seconds is live: commands without targets go to it."""

_RECENT_ERRORS = 50


@dataclass
class _Entry:
    state: EngineState
    last_seen_ms: float
    routing_id: bytes
    errors: deque[ErrorRecord] = field(default_factory=lambda: deque(maxlen=_RECENT_ERRORS))


class Fleet:
    """Every agent the hub has heard from, by agent id."""

    def __init__(self) -> None:
        self._agents: dict[str, _Entry] = {}
        self._dirty: set[str] = set()
        self._lock = threading.Lock()

    def accept(self, routing_id: bytes, rep: Report) -> str | None:
        """Keep ``rep``'s state as its agent's latest (stamped with the receive time) and
        remember the agent's ZMQ routing id for commands. A delta's errors are added to the
        agent's last ``_RECENT_ERRORS``; a snapshot replaces them.

        Returns:
            ``None``, or why the report was refused (the fleet holds ``MAX_AGENTS`` already).
        """
        st = rep.state
        aid = st.source.agent_id
        now_ms = time.time() * 1e3
        with self._lock:
            ag = self._agents.get(aid)
            if ag is None:
                if len(self._agents) >= MAX_AGENTS:
                    return f"fleet full ({MAX_AGENTS} agents): report of {aid!r} dropped"
                ag = _Entry(state=st, last_seen_ms=now_ms, routing_id=routing_id)
                self._agents[aid] = ag
            if rep.kind == "snapshot":
                ag.errors.clear()
            ag.errors.extend(st.recent_errors)
            st.recent_errors = list(ag.errors)
            ag.state = st
            ag.last_seen_ms = now_ms
            ag.routing_id = routing_id
            self._dirty.add(aid)
        return None

    def routing_id(self, agent_id: str) -> bytes | None:
        """The ZMQ routing id of ``agent_id``'s last message, ``None`` for an unknown agent."""
        with self._lock:
            ag = self._agents.get(agent_id)
            return ag.routing_id if ag is not None else None

    def states(self) -> dict[str, tuple[EngineState, float]]:
        """Agent id -> (latest state, hub receive time of its last message, ms since epoch)."""
        with self._lock:
            return {k: (a.state, a.last_seen_ms) for k, a in self._agents.items()}

    @property
    def changed(self) -> bool:
        """Some agent reported since the last ``updates``."""
        return bool(self._dirty)

    def targets(self, req: CommandRequest) -> tuple[list[str], str | None]:
        """The agent ids ``req`` goes to, or why it goes nowhere.

        ``req.targets`` when given; otherwise every live agent, except for ``flush``: scope
        ``engine`` goes to the live worker agents of ``FlushArgs.engine_id``, scopes ``model``
        and ``all`` are pool-wide and go to the one most recently heard worker or store agent.

        Returns:
            ``(agent ids, None)`` or ``([], the reason for the operator)``.
        """
        with self._lock:
            if req.targets:
                return list(dict.fromkeys(req.targets)), None
            now_ms = time.time() * 1e3
            live = {
                k: a for k, a in self._agents.items() if now_ms - a.last_seen_ms < LIVE_S * 1e3
            }
            if req.command != "flush":
                return sorted(live), None if live else "no live agent connected to the hub"
            fl = req.flush
            if fl is not None and fl.scope == "engine":
                if not fl.engine_id:
                    return [], "flush scope 'engine' needs FlushArgs.engine_id or targets"
                ids = [
                    k
                    for k, a in live.items()
                    if a.state.source.engine_id == fl.engine_id
                    and a.state.source.process_role == "worker"
                ]
                return sorted(
                    ids
                ), None if ids else f"no live worker agent of engine {fl.engine_id!r}"
            # model/all scopes are pool-wide: one agent with a pool client does it once.
            holders = [
                (a.last_seen_ms, k)
                for k, a in live.items()
                if a.state.source.process_role in ("worker", "store")
            ]
            if not holders:
                return [], "no live worker or store agent to run the flush"
            return [max(holders)[1]], None

    def updates(self, kind: str, first_seq: int, gaps: dict[str, int]) -> list[FleetUpdate]:
        """The frames of one ``FleetUpdate``: every agent (``kind="snapshot"``) or those that
        reported since the last call (``"delta"``), ``ENGINES_PER_UPDATE`` per frame, numbered
        from ``first_seq``; ``gaps`` (agent id -> reports lost) goes with each agent's state.
        An empty snapshot is one frame without engines: it tells a console the hub is alive."""
        with self._lock:
            ids = sorted(self._agents) if kind == "snapshot" else sorted(self._dirty)
            states = [self._agents[i].state for i in ids if i in self._agents]
            seen = {i: self._agents[i].last_seen_ms for i in ids if i in self._agents}
            self._dirty.clear()
        chunks = [
            states[i : i + ENGINES_PER_UPDATE] for i in range(0, len(states), ENGINES_PER_UPDATE)
        ]
        out = []
        for seq, chunk in enumerate(chunks or [[]], start=first_seq):
            ids_in = {s.source.agent_id for s in chunk}
            out.append(
                FleetUpdate(
                    v=PROTOCOL_VERSION,
                    seq=seq,
                    kind="snapshot" if kind == "snapshot" else "delta",
                    ts_ms=time.time() * 1e3,
                    engines=chunk,
                    last_seen_ms={k: v for k, v in seen.items() if k in ids_in},
                    report_gaps={k: v for k, v in gaps.items() if k in ids_in},
                )
            )
        return out
