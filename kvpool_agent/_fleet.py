"""The hub's view of the fleet: each agent's latest state, which agents reported since the last
update, which agents a command goes to, and the ``FleetUpdate`` frames consoles receive.

Thread-safe: the hub thread writes, ``FleetHub.fleet()`` reads from any thread. Agents that go
silent stay with their last state and ``last_seen_ms`` (consoles decide when that is stale) until
the hub forgets them (``forget``, ``forget_silent``).

An agent id belongs to the identity (the agent's CURVE public key when the hub has keys, else
``""``) and the ZMQ connection (routing id) that registered it. Reports for the id from another
connection of the same identity are refused until the holder has been silent for
``TAKEOVER_AFTER_S`` (a restarted or reconnected agent gets its id back then); from another
identity, until the holder has been silent for ``LIVE_S`` (a live engine's id cannot be taken by
another key, even a valid one). An engine id is bound the same way: while an agent of the engine
is live, reports naming that engine from another identity are refused, so one engine's key cannot
add an agent to another engine (a forged start failure would mark it FAILED, a forged worker
would receive its ``flush --scope engine``). With one fleet-wide agent key every agent is the
same identity and only the connection binding applies.

An engine holds at most ``MAX_AGENTS_PER_ENGINE`` agent ids and ``MAX_ENGINE_STATE_BYTES`` of state,
so one engine-bound key cannot fill the fleet (by count or by bytes). Who has held each engine id
since when (its *tenure*: the identity and the time it took the id) is kept across hub restarts
(``tenure``/``load_tenure``, the hub's state file): pool-wide flushes go to the worker whose key has
held its engine longest, per pool.

A pool some agent key is bound to (``kvpool-agent authorize --pool``, passed as ``closed``) is
*closed*: only its bound keys' agents receive its pool-wide commands and count in its key counts
and verifiers (``kvpool_agent._pool_members``, whose functions run under the fleet's lock).

Over 600 lines: the choices of who receives what (``targets``, ``pool_listers``, the verifiers)
read the agents' table under its one lock, so they stay beside it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from kvpool_agent._hub_memory import UPDATE_STATES_BYTES
from kvpool_agent._pool_members import PoolCount, counts, largest_counts, left_out
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandRequest,
    EngineState,
    ErrorRecord,
    FleetUpdate,
    FlushRecord,
    PoolStats,
    Report,
    Source,
)

__all__ = [
    "ENGINES_PER_UPDATE",
    "FLUSHES_PER_REPORT",
    "FULL_RATE",
    "LIVE_S",
    "MAX_AGENTS",
    "MAX_AGENTS_PER_ENGINE",
    "MAX_ENGINE_STATE_BYTES",
    "MAX_FLEET_STATE_BYTES",
    "MAX_STATE_BYTES",
    "TAKEOVER_AFTER_S",
    "UPDATE_BUDGET_BYTES",
    "Fleet",
]

FULL_RATE = 0
"""The update stream of every delta (``FleetHub.delta_interval_s``); the other streams are
named by their tier in ms (``kvpool_agent.protocol.UPDATE_TIERS_MS``)."""

ENGINES_PER_UPDATE = 128
"""Engines per ``FleetUpdate`` frame at most; a large fleet's snapshot spans several frames."""

MAX_STATE_BYTES = 256 * 1024
"""Largest encoded ``EngineState`` the hub keeps for one agent (msgpack bytes, after merging
the agent's recent errors); a report over it is refused and counted. A real engine's state is a
few KiB; the bound keeps hub memory per agent small and lets every state fit an update frame."""

UPDATE_BUDGET_BYTES = UPDATE_STATES_BYTES
"""Encoded states per ``FleetUpdate`` frame at most; the rest of ``MAX_UPDATE_FRAME_BYTES``
leaves room for the frame's ``last_seen_ms``/``report_gaps``/``forgotten`` maps
(``kvpool_agent._hub_memory``: what a subscriber's queue holds is frames x that bound)."""

TAKEOVER_AFTER_S = 2.0
"""Another connection may take over an agent id after the holder has been silent this long
(8 report intervals of ``DELTA_INTERVAL_S`` = 0.25 s)."""

MAX_AGENTS = 16_384
"""Agents the hub keeps; reports from further new agent ids are refused."""

MAX_AGENTS_PER_ENGINE = 1_024
"""Agent ids one engine id holds at most (a real engine has one per rank plus its scheduler:
DP x TP x PP + 1); reports of further new ids of that engine are refused (``full``). An
engine-bound agent key reports for one engine only, so this is also what one such key holds."""

MAX_FLEET_STATE_BYTES = 256 << 20
"""Encoded states the hub keeps over all agents (bytes); a report that would pass it is
refused (``full``). 2,304 real agents hold ~10 MiB; without this bound one agent key could
register thousands of near-``MAX_STATE_BYTES`` agents and grow the hub (and every console's
snapshot) by gigabytes."""

MAX_ENGINE_STATE_BYTES = 16 << 20
"""Encoded states one engine id's agents hold together (bytes); a report that would pass it
is refused (``full``). A real engine's agents hold a few KiB each (65 agents of DP x TP x PP
= 64: < 1 MiB). Without it one engine-bound key's ``MAX_AGENTS_PER_ENGINE`` agents of
``MAX_STATE_BYTES`` each are exactly ``MAX_FLEET_STATE_BYTES``: the fleet full for every
other engine (and 256 MiB in every console's snapshot)."""

LIVE_S = 15.0
"""An agent heard from within this many seconds is live: commands without targets go to it."""

_RECENT_ERRORS = 50
_FORGOTTEN_KEPT = 1024
_state_encoder = msgspec.msgpack.Encoder()


@dataclass
class _Entry:
    state: EngineState
    last_seen_ms: float
    routing_id: bytes
    first_seen_ms: float
    identity: str = ""
    # The identity is a key bound to one engine (``kvpool-agent authorize --engine``): alone,
    # it cannot vouch for a pool (``targets``).
    bound: bool = False
    # The pool (``Source.master``) the identity is bound to (``authorize --pool``), else "".
    pool: str = ""
    size: int = 0
    errors: deque[ErrorRecord] = field(default_factory=lambda: deque(maxlen=_RECENT_ERRORS))
    # request ids of the agent's own flushes (EngineState.flushes) already audited.
    audited: deque[str] = field(default_factory=lambda: deque(maxlen=_AUDITED_FLUSHES))


_AUDITED_FLUSHES = 64
"""Per agent, the request ids of its own flushes remembered as audited (a snapshot repeats
the last 16)."""

FLUSHES_PER_REPORT = 16
"""Own flushes of one report the hub audits at most (the newest; an agent keeps 16): a report
listing thousands cannot flood the audit trail."""


class Fleet:
    """Every agent the hub has heard from, by agent id."""

    def __init__(self) -> None:
        self._agents: dict[str, _Entry] = {}
        # Engine id -> (identity, ms since epoch) of its newest accepted report.
        self._engine_owner: dict[str, tuple[str, float]] = {}
        # Per update stream (FULL_RATE, or a tier's ms): agents reported / forgotten since that
        # stream's last update, so a slow stream loses nothing between its ticks.
        self._dirty: dict[int, set[str]] = {FULL_RATE: set()}
        # Engine id -> agent ids it holds (for MAX_AGENTS_PER_ENGINE and dropping owners).
        self._engine_agents: dict[str, int] = {}
        # Engine id -> encoded state bytes of its agents (for MAX_ENGINE_STATE_BYTES).
        self._engine_bytes: dict[str, int] = {}
        # Engine id -> (identity, since ms, last seen ms): who holds it since when.
        self._tenure: dict[str, tuple[str, float, float]] = {}
        self.tenure_changed = False
        # Forgotten agent id -> when (ms since epoch), oldest first (insertion order: trimmed
        # in O(1) per id); told to consoles so they drop it too.
        self._forgotten: dict[str, float] = {}
        self._forgotten_new: dict[int, set[str]] = {FULL_RATE: set()}
        self._state_bytes = 0  # sum of the kept agents' encoded state sizes
        self._lock = threading.Lock()

    def unaudited_flushes(self, agent_id: str, records: list[FlushRecord]) -> list[FlushRecord]:
        """Those of the last ``FLUSHES_PER_REPORT`` of ``records`` (the agent's
        ``EngineState.flushes`` just accepted) not audited yet, now marked audited; ``[]`` for
        an agent the fleet does not hold."""
        with self._lock:
            ag = self._agents.get(agent_id)
            if ag is None:
                return []
            out: list[FlushRecord] = []
            for r in records[-FLUSHES_PER_REPORT:]:
                # Checked one by one: a report repeating one id is audited once.
                if r.request_id not in ag.audited:
                    ag.audited.append(r.request_id)
                    out.append(r)
        return out

    def accept(self, routing_id: bytes, rep: Report, identity: str = "",
               bound: bool = False, pool: str = "") -> str | None:
        """Keep ``rep``'s state as its agent's latest (stamped with the receive time) and
        remember the agent's ZMQ routing id for commands. A delta's errors are added to the
        agent's last ``_RECENT_ERRORS``; a snapshot replaces them.

        Args:
            routing_id: the ZMQ routing id of the connection the report came on.
            rep: the report.
            identity: who the connection authenticated as (z85 CURVE public key), ``""``
                without keys.
            bound: ``identity`` is a key bound to one engine.
            pool: the pool ``identity`` is bound to (``""``: none).

        Returns:
            ``None``, or why the report was refused: ``"takeover: ..."`` (the id is held by
            another live connection or identity, see the module docstring),
            ``"oversized: ..."`` (state over ``MAX_STATE_BYTES``) or ``"full: ..."`` (the fleet
            holds ``MAX_AGENTS`` already, or the state would pass ``MAX_FLEET_STATE_BYTES``).
        """
        st = rep.state
        aid = st.source.agent_id
        now_ms = time.time() * 1e3
        # A report from the future would outrank every honest one wherever readers keep the
        # newest (the console's pool row): an agent's clock says no more than the hub's.
        st.ts_ms = min(st.ts_ms, now_ms)
        with self._lock:
            ag = self._agents.get(aid)
            if ag is not None and ag.routing_id != routing_id:
                hold_s = TAKEOVER_AFTER_S if ag.identity == identity else LIVE_S
                if not ag.routing_id and ag.identity == identity:
                    hold_s = 0.0  # its connection was dropped by the hub (reset_routes)
                if now_ms - ag.last_seen_ms < hold_s * 1e3:
                    return f"takeover: {aid!r} is held by a live connection; report dropped"
            owner = self._engine_owner.get(st.source.engine_id)
            if owner is not None and owner[0] != identity and now_ms - owner[1] < LIVE_S * 1e3:
                return (f"takeover: engine {st.source.engine_id!r} belongs to another agent key "
                        "while it is live; report dropped")
            engine = st.source.engine_id
            if ag is None and len(self._agents) >= MAX_AGENTS:
                return f"full: {MAX_AGENTS} agents; report of {aid!r} dropped"
            moves = ag is None or ag.state.source.engine_id != engine
            if moves and self._engine_agents.get(engine, 0) >= MAX_AGENTS_PER_ENGINE:
                return (f"full: engine {engine[:80]!r} holds {MAX_AGENTS_PER_ENGINE} agent ids; "
                        f"report of {aid[:80]!r} dropped")
            errors = deque(ag.errors if ag is not None else (), maxlen=_RECENT_ERRORS)
            if rep.kind == "snapshot":
                errors.clear()
            errors.extend(st.recent_errors)
            st.recent_errors = list(errors)
            size = len(_state_encoder.encode(st))
            if size > MAX_STATE_BYTES:
                return f"oversized: state of {aid!r} is {size} bytes > {MAX_STATE_BYTES}"
            total = self._state_bytes - (ag.size if ag is not None else 0) + size
            if total > MAX_FLEET_STATE_BYTES:
                return (f"full: fleet state would be {total} bytes > {MAX_FLEET_STATE_BYTES}; "
                        f"report of {aid!r} dropped")
            held_here = ag.size if ag is not None and not moves else 0
            engine_total = self._engine_bytes.get(engine, 0) - held_here + size
            if engine_total > MAX_ENGINE_STATE_BYTES:
                return (f"full: engine {engine[:80]!r}'s state would be {engine_total} bytes > "
                        f"{MAX_ENGINE_STATE_BYTES}; report of {aid[:80]!r} dropped")
            self._state_bytes = total
            if moves:
                if ag is not None:
                    self._leave_engine(ag.state.source.engine_id, ag.size)
                self._engine_agents[engine] = self._engine_agents.get(engine, 0) + 1
            self._engine_bytes[engine] = engine_total
            if ag is None:
                ag = _Entry(state=st, last_seen_ms=now_ms, routing_id=routing_id,
                            first_seen_ms=now_ms)
                self._agents[aid] = ag
                self._forgotten.pop(aid, None)
                for gone in self._forgotten_new.values():
                    gone.discard(aid)
            elif ag.routing_id != routing_id:
                ag.first_seen_ms = now_ms
            held = self._tenure.get(engine)
            if held is None or held[0] != identity:
                self._tenure[engine] = (identity, now_ms, now_ms)
                self.tenure_changed = True
            else:
                self._tenure[engine] = (identity, held[1], now_ms)
            ag.errors = errors
            ag.state = st
            ag.size = size
            ag.last_seen_ms = now_ms
            ag.routing_id = routing_id
            ag.identity = identity
            ag.bound = bound
            ag.pool = pool
            self._engine_owner[engine] = (identity, now_ms)
            for dirty in self._dirty.values():
                dirty.add(aid)
        return None

    def forget(self, names: list[str], identities: frozenset[str] = frozenset()) -> list[str]:
        """Drop the agents whose agent id or engine id is in ``names``, or registered by one of
        ``identities`` (revoked keys; O(agents + names)); returns the agent ids dropped
        (sorted). Consoles are told with the next update's ``forgotten``."""
        with self._lock:
            wanted = set(names)
            ids = sorted(k for k, a in self._agents.items() if k in wanted
                         or a.state.source.engine_id in wanted or a.identity in identities)
            self._drop(ids)
        return ids

    def forget_silent(self, forget_after_s: float) -> list[str]:
        """Drop the agents not heard from for ``forget_after_s`` seconds; returns their ids."""
        cutoff = time.time() * 1e3 - forget_after_s * 1e3
        with self._lock:
            ids = sorted(k for k, a in self._agents.items() if a.last_seen_ms < cutoff)
            self._drop(ids)
        return ids

    def _drop(self, ids: list[str]) -> None:
        """Forget ``ids`` (held agents): O(1) per id, however many are remembered."""
        now_ms = time.time() * 1e3
        for k in ids:
            ag = self._agents.pop(k)
            self._state_bytes -= ag.size
            self._leave_engine(ag.state.source.engine_id, ag.size)
            # Re-inserted at the end: the dict stays oldest first.
            self._forgotten.pop(k, None)
            self._forgotten[k] = now_ms
            for stream, dirty in self._dirty.items():
                dirty.discard(k)
                self._forgotten_new[stream].add(k)
        while len(self._forgotten) > _FORGOTTEN_KEPT:
            oldest = next(iter(self._forgotten))
            del self._forgotten[oldest]
            for gone in self._forgotten_new.values():
                gone.discard(oldest)

    def _leave_engine(self, engine: str, size: int) -> None:
        """One agent id of ``engine`` (holding ``size`` state bytes) is gone (dropped, or it
        moved to another engine); the engine's owner goes with its last agent. Its tenure
        stays (``prune_tenure`` ends it): a forgotten or silent engine that comes back with
        its key keeps its place, so neither ``forget`` nor silence hands pool-wide commands to
        a newcomer (issue 42: the real workers re-registered with fresh tenure and an impostor
        of the pool got the operator's ``flush --scope all``)."""
        left = self._engine_agents.get(engine, 0) - 1
        if left > 0:
            self._engine_agents[engine] = left
            self._engine_bytes[engine] = self._engine_bytes.get(engine, 0) - size
            return
        self._engine_agents.pop(engine, None)
        self._engine_bytes.pop(engine, None)
        self._engine_owner.pop(engine, None)

    def tenure(self) -> dict[str, tuple[str, float, float]]:
        """Engine id -> (identity holding it, since when, last report; ms since epoch), for
        the hub's state file; clears ``tenure_changed``."""
        with self._lock:
            self.tenure_changed = False
            return dict(self._tenure)

    def prune_tenure(self, kept_s: float) -> None:
        """End the tenures of engines no agent holds that were last heard ``kept_s`` seconds
        ago or more, then of the longest unheard beyond ``MAX_AGENTS`` tenures (one key cannot
        grow the table by cycling engine ids). O(tenures); the hub calls it once a second."""
        cutoff = time.time() * 1e3 - kept_s * 1e3
        with self._lock:
            gone = [e for e, t in self._tenure.items()
                    if t[2] < cutoff and e not in self._engine_agents]
            over = len(self._tenure) - len(gone) - MAX_AGENTS
            if over > 0:
                unheld = sorted((t[2], e) for e, t in self._tenure.items()
                                if e not in self._engine_agents and t[2] >= cutoff)
                gone += [e for _, e in unheld[:over]]
            for e in gone:
                del self._tenure[e]
            self.tenure_changed = self.tenure_changed or bool(gone)

    def load_tenure(self, held: dict[str, tuple[str, float, float]]) -> None:
        """Take tenures saved by an earlier hub (``tenure``); an engine's next report from
        the same identity keeps its ``since``, from another identity starts a new one."""
        with self._lock:
            for engine, entry in held.items():
                self._tenure.setdefault(engine, entry)

    def reset_routes(self) -> None:
        """The hub dropped every agent connection (``FleetHub._shed``): each agent takes its
        id back from its next connection at once, with its own key only."""
        with self._lock:
            for ag in self._agents.values():
                ag.routing_id = b""

    def members(self, agent_ids: list[str], closed: frozenset[str] = frozenset(),
                ) -> dict[str, tuple[Source, str, bool]]:
        """Agent id -> (source, identity, its answer is its own claim: its key is engine-bound,
        or it claims a ``closed`` pool its key is not bound to) of those of ``agent_ids``."""
        with self._lock:
            return {k: (a.state.source, a.identity, a.bound or not counts(a, closed))
                    for k in agent_ids if (a := self._agents.get(k)) is not None}

    def pool_listers(self, masters: set[str], closed: frozenset[str] = frozenset(),
                     ) -> dict[str, str]:
        """Master -> the live agent that lists that pool for dry runs of scope ``all`` in place
        of the engines' workers (``Source.lists_pool``: a store agent beside the master), of a
        key not bound to one engine that counts for the pool (``closed``), connected; the
        longest held first, as ``targets`` ranks. Pools without one are absent."""
        now_ms = time.time() * 1e3
        with self._lock:
            return self._first_per_pool(
                ((k, a) for k, a in self._agents.items()
                 if a.state.source.lists_pool and a.state.source.master in masters
                 and not a.bound and counts(a, closed) and a.routing_id
                 and now_ms - a.last_seen_ms < LIVE_S * 1e3), now_ms)

    def _first_per_pool(self, candidates: Iterable[tuple[str, _Entry]], now_ms: float,
                        ) -> dict[str, str]:
        """Master -> the agent id of ``candidates`` a pool-wide command goes to: a worker
        before a store agent, a key not bound to one engine before a bound one, then the
        longest held (``_held_since``). Under the lock."""
        best: dict[str, tuple[bool, bool, float, float, str]] = {}
        for k, a in candidates:
            src = a.state.source
            rank = (src.process_role != "worker", a.bound, *self._held_since(a, now_ms), k)
            if src.master not in best or rank < best[src.master]:
                best[src.master] = rank
        return {m: r[4] for m, r in best.items()}

    def routing_id(self, agent_id: str) -> bytes | None:
        """The ZMQ routing id of ``agent_id``'s last message, ``None`` for an unknown agent."""
        with self._lock:
            ag = self._agents.get(agent_id)
            return ag.routing_id if ag is not None else None

    def states(self) -> dict[str, tuple[EngineState, float]]:
        """Agent id -> (latest state, hub receive time of its last message, ms since epoch)."""
        with self._lock:
            return {k: (a.state, a.last_seen_ms) for k, a in self._agents.items()}

    def changed_for(self, stream: int) -> bool:
        """Some agent reported or was forgotten since ``stream``'s last update (a stream not
        added yet: ``False``)."""
        with self._lock:
            return bool(self._dirty.get(stream) or self._forgotten_new.get(stream))

    def add_stream(self, stream: int) -> None:
        """Track what ``stream`` (a tier's ms, ``kvpool_agent.protocol.UPDATE_TIERS_MS``) has
        not been sent yet, from now on (the hub sends a snapshot on every subscription).
        Idempotent."""
        with self._lock:
            self._dirty.setdefault(stream, set())
            self._forgotten_new.setdefault(stream, set())

    def targets(self, req: CommandRequest, closed: frozenset[str] = frozenset(),
                ) -> tuple[list[str], str | None, list[str]]:
        """The agent ids ``req`` goes to, or why it goes nowhere.

        ``req.targets`` when given; otherwise every live agent, except for ``flush``: scope
        ``engine`` goes to the live worker agents of ``FlushArgs.engine_id``; scopes ``model``
        and ``all`` are pool-wide and go to one live agent with a pool client per pool (agents
        grouped by ``Source.master``): a worker agent (a store agent when the pool has no live
        worker), of a key not bound to one engine when the pool has one (a fleet-wide key is the
        operator's own deployment; an engine-bound key may be an insider's that claims the pool,
        issue 42), whose identity has held its engine id the longest (``tenure``, kept across
        hub restarts), then the longest connected. Tenure, not most recently heard nor first to
        reconnect, so an agent that just appeared, or reconnects fastest after a hub restart,
        cannot draw the flush to itself. The choice is made once, when the command arrives:
        agents appearing later never receive it. Pools ``left_out`` (one engine-bound key's
        alone, a ``closed`` pool without a live member) get no pool-wide command (flush, pin,
        pins); a closed pool's only through its members.

        Returns:
            ``(agent ids, None, pools refused as unvouched)`` or ``([], the reason for the
            operator, pools refused)``.
        """
        with self._lock:
            if req.targets:
                return list(dict.fromkeys(req.targets)), None, []
            now_ms = time.time() * 1e3
            live = {
                k: a for k, a in self._agents.items() if now_ms - a.last_seen_ms < LIVE_S * 1e3
            }
            pooled, refused = left_out(live, closed)
            if req.command in ("pin", "unpin", "pins"):
                ids, problem = self._pin_targets(req, pooled, now_ms, refused)
                return ids, problem, sorted(refused)
            if req.command != "flush":
                return sorted(live), None if live else "no live agent connected to the hub", []
            fl = req.flush
            if fl is not None and fl.scope == "engine":
                if not fl.engine_id:
                    return [], "flush scope 'engine' needs FlushArgs.engine_id or targets", []
                ids = [
                    k
                    for k, a in live.items()
                    if a.state.source.engine_id == fl.engine_id
                    and a.state.source.process_role == "worker"
                ]
                return sorted(ids), None if ids else (
                    f"no live worker agent of engine {fl.engine_id!r}"), []
            # Workers: a store agent holds no pool client (it answered "no pool backend", and a
            # bound pool whose one live member it was got nothing flushed); one that lists its
            # pool (``lists_pool``) answers a dry run of scope ``all`` where no worker is live.
            lists = fl is not None and fl.dry_run and fl.scope == "all"
            best = self._first_per_pool(
                ((k, a) for k, a in pooled.items() if a.state.source.master not in refused
                 and (a.state.source.process_role == "worker"
                      or (lists and a.state.source.lists_pool))), now_ms)
            if not best:
                return [], ("no live worker agent to run the flush (a store agent holds no pool "
                            "client)"), sorted(refused)
            return sorted(best.values()), None, sorted(refused)

    def _held_since(self, a: _Entry, now_ms: float) -> tuple[float, float]:
        """How an agent ranks as a pool-wide command's target: since when its identity has
        held its engine id (``tenure``), then since when it is connected (earliest first)."""
        held = self._tenure.get(a.state.source.engine_id)
        return (held[1] if held is not None and held[0] == a.identity else now_ms,
                a.first_seen_ms)

    def _pin_targets(self, req: CommandRequest, live: dict[str, _Entry], now_ms: float,
                     refused: set[str]) -> tuple[list[str], str | None]:
        """``pin`` / ``unpin`` / ``pins``: one live worker agent per pool and layout digest of
        the model (``PinArgs.model``; ``pins`` without one: of every model), ranked as a
        pool-wide flush's target (fleet-wide keys first, then tenure): one worker computes
        every rank's keys of its layout."""
        model = req.pin.model if req.pin is not None else ""
        if not model and req.command != "pins":
            return [], f"{req.command} needs PinArgs.model (the model's name as engines report it)"
        best: dict[tuple[str, str, str], tuple[bool, float, float, str]] = {}
        for k, a in live.items():
            src = a.state.source
            if src.process_role != "worker" or not src.layout_digest or src.master in refused:
                continue
            if model and src.model != model:
                continue
            group = (src.master, src.model, src.layout_digest)
            rank = (a.bound, *self._held_since(a, now_ms), k)
            if group not in best or rank < best[group]:
                best[group] = rank
        if not best:
            models = sorted({a.state.source.model for a in live.values()
                             if a.state.source.process_role == "worker" and a.state.source.model})
            return [], (f"no live worker agent of model {model!r} (known: "
                        f"{', '.join(models[:8]) or 'none'})" if model
                        else "no live worker agent with a registered KV layout")
        return sorted(r[3] for r in best.values()), None

    def pool_keys(self, agent_ids: list[str],
                  closed: frozenset[str] = frozenset()) -> dict[str, int | None]:
        """Agent id -> the key count of its pool (``Source.master``) as agents report it
        (``PoolStats.keys``: the master's own count, the same from every member), from the
        most trusted reporters, the largest of theirs: keys not bound to one engine before
        engine-bound ones, then other identities, then other agents, before the agent itself.
        An engine-bound key can report any master (issue 42): its ``keys=0`` cannot make a
        genuine flush look suspect, nor its forged count cover a forged answer. Of a ``closed``
        pool only its members' reports count. ``None``: no agent reports that pool. O(agents)
        a call, not per id asked (round 5)."""
        with self._lock:
            want = {k: a for k in agent_ids if (a := self._agents.get(k)) is not None}
            pools: dict[str, list[PoolCount]] = {}
            masters = {a.state.source.master for a in want.values()}
            for k, a in self._agents.items():
                if (a.state.pool is not None and a.state.source.master in masters
                        and counts(a, closed)):
                    pools.setdefault(a.state.source.master, []).append(
                        (a.bound, a.identity, k, a.state.pool.keys))
        return largest_counts(want, pools, agent_ids)

    def pool_verifiers(self, agent_ids: list[str], layout: bool = False,
                       closed: frozenset[str] = frozenset()) -> dict[str, dict[str, PoolStats]]:
        """Agent id -> pool stats of the agents that may confirm what it says it did to its
        pool (and layout when ``layout``: one layout's agents report the same pins): of another
        key; fleet-wide keys when the pool has any, else (for a bound agent) bound ones; of a
        ``closed`` pool its members only, any of them (keys not bound to an engine first). Ids
        of one pool, key and layout share one answer, found once (round 6: per id before)."""
        out: dict[str, dict[str, PoolStats]] = {}
        found: dict[tuple[str, str, bool, str], dict[str, PoolStats]] = {}
        with self._lock:
            for aid in [k for k in agent_ids if k in self._agents]:
                ag, s = self._agents[aid], self._agents[aid].state.source
                cls = (s.master, ag.identity, ag.bound, s.layout_digest if layout else "")
                if cls not in found:
                    others = [(k, a) for k, a in self._agents.items() if a.state.pool is not None
                              and a.identity != ag.identity and a.state.source.master == s.master
                              and (not layout or a.state.source.layout_digest == cls[3])
                              and counts(a, closed)]
                    free = [(k, a) for k, a in others if not a.bound]
                    trusted = ag.bound or s.master in closed
                    found[cls] = {k: a.state.pool for k, a in free or (others if trusted else [])
                                  if a.state.pool is not None}
                out[aid] = found[cls]
        return out

    def pool_stats(self, agent_ids: list[str]) -> dict[str, PoolStats]:
        """Agent id -> its pool stats now, of those of ``agent_ids`` that report them."""
        with self._lock:
            return {k: a.state.pool for k in agent_ids
                    if (a := self._agents.get(k)) is not None and a.state.pool is not None}

    def updates(self, kind: str, first_seq: int, gaps: dict[str, int],
                stream: int = FULL_RATE) -> list[FleetUpdate]:
        """The frames of one ``FleetUpdate``: every agent (``kind="snapshot"``) or those that
        reported since ``stream``'s last update (``"delta"``; ``stream`` is ``FULL_RATE`` or a
        tier added with ``add_stream``), numbered from ``first_seq``. A snapshot counts as an
        update of every stream (each gets it). A frame holds
        at most ``ENGINES_PER_UPDATE`` engines and ``UPDATE_BUDGET_BYTES`` of encoded states.
        ``gaps`` (agent id -> reports lost) goes with each agent's state. The first frame lists
        in ``forgotten`` the agents forgotten since the last update (a snapshot: every one still
        remembered as forgotten). An empty snapshot is one frame without engines: it tells a
        console the hub is alive."""
        with self._lock:
            snapshot = kind == "snapshot"
            ids = sorted(self._agents) if snapshot else sorted(self._dirty[stream])
            entries = [(self._agents[i].state, self._agents[i].size) for i in ids
                       if i in self._agents]
            seen = {i: self._agents[i].last_seen_ms for i in ids if i in self._agents}
            forgotten = sorted(self._forgotten if snapshot else self._forgotten_new[stream])
            for s in self._dirty if snapshot else (stream,):
                self._dirty[s].clear()
                self._forgotten_new[s].clear()
        chunks: list[list[EngineState]] = []
        room = 0
        for st, size in entries:
            if not chunks or len(chunks[-1]) >= ENGINES_PER_UPDATE or size > room:
                chunks.append([])
                room = UPDATE_BUDGET_BYTES
            chunks[-1].append(st)
            room -= size
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
                    forgotten=forgotten if seq == first_seq else [],
                    more=seq < first_seq + len(chunks) - 1,
                )
            )
        return out
