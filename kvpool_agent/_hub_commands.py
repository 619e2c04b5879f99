"""The hub's command routing: a console's command in, the agents it goes to, their replies back,
checked, audited, answered.

Commands and replies are bound to connections: the hub forwards a command under a fresh
unguessable request id (``secrets.token_hex``) to the routing id each target agent last
reported from, and accepts a reply only from that routing id, for that id, once. What a command
may cost is ``kvpool_agent._hub_quotas`` (in flight, pins, engine work); who may send it is the
port it came on (``P+2`` read-only, ``P+3`` operator); a dry-run flush lists each pool once
(``kvpool_agent._hub_listings``); a pool-wide flush's answer is held against the pool's count,
a flush's, pin's or unpin's confirmed by another key's report (``kvpool_agent._answers``);
each command is one audit line (``kvpool_agent._audit``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from kvpool_agent._answers import (
    PIN_VERIFY_S,
    VERIFY_S,
    checked_answer,
    needs_verifying,
    unvouched_note,
    verified_answer,
)
from kvpool_agent._audit import AuditTrail
from kvpool_agent._fleet import Fleet
from kvpool_agent._hub_counters import HubCounters
from kvpool_agent._hub_cross_listing import cross_checked, listers, wants_cross_listing
from kvpool_agent._hub_listings import PoolListings, shared_answer
from kvpool_agent._hub_quotas import Quotas
from kvpool_agent._hub_sockets import HubSockets, user_id
from kvpool_agent._work_budget import cost
from kvpool_agent.audit import AUDIT_IDS_SHOWN
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    DrainArgs,
    PoolStats,
    ProtocolError,
    decode,
    encode,
)

__all__ = [
    "FORGOTTEN_SHOWN",
    "MAX_TARGETS",
    "MAX_TIMEOUT_MS",
    "OPERATOR_ONLY",
    "UNAUTHORISED",
    "CommandRouter",
]

log = logging.getLogger("kvpool.hub")

UNAUTHORISED = "unauthorised: flush needs the operator key (kvpool-agent keygen --role operator)"
OPERATOR_ONLY = (
    "unauthorised: {what} needs the operator key (kvpool-agent keygen --role operator)"
)
_REVOKED = "refused: this key is no longer authorized on the hub (revoked or rotated)"
MAX_TARGETS = 4096
"""Agent ids one command may name (``targets``); a longer list is refused at once."""
FORGOTTEN_SHOWN = 1000
"""Agent ids a ``forget`` reply lists at most (``forgotten_count`` has them all), so the reply
stays far below ``MAX_MESSAGE_BYTES``."""
MAX_TIMEOUT_MS = 600_000
"""Longest a command waits for its agents' replies (ms), whatever the console asked."""
_VERIFY_GRACE_S = 1.5
"""How long past a command's deadline (s) the hub may hold its answer to check a flush
(``kvpool_agent._answers.VERIFY_S``): ``FleetClient`` waits 2 s past it."""


@dataclass
class _Pending:
    sock: zmq.Socket[bytes]
    client: bytes
    req: CommandRequest
    who: str
    deadline: float
    expected: list[str]
    plain: bool
    key: str = ""
    # Targets the fleet does not hold: answered together in one reply.
    unknown: list[str] = field(default_factory=list)
    # Pools left out of a pool-wide command: reported by one engine-bound key alone, or bound
    # to keys none of whose agents is live (``Fleet.targets``).
    unvouched: list[str] = field(default_factory=list)
    # The pools some agent key is bound to when the command came (``AllowList.bound_pools``).
    closed: frozenset[str] = frozenset()
    # Agent id -> the routing id the command was sent to: the only one whose reply counts.
    routes: dict[str, bytes] = field(default_factory=dict)
    replies: dict[str, CommandReply] = field(default_factory=dict)
    # Flush: agent id -> its pool's key count when sent (``Fleet.pool_keys``, one scan), and
    # the pool (``Source.master``) it reported then.
    pool_keys: dict[str, int | None] = field(default_factory=dict)
    masters: dict[str, str] = field(default_factory=dict)
    # Dry run: agent id -> the agent whose listing it shares; lister -> its share key.
    shared: dict[str, str] = field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Dry run: agent id answered from a kept listing -> the agent that listed it.
    cached: dict[str, str] = field(default_factory=dict)
    # Flush, pin, unpin: agent id -> the pool stats of the other keys that may confirm its
    # answer, when sent (``Fleet.pool_verifiers``); the answers held for that and until when
    # (monotonic s).
    verifiers: dict[str, dict[str, PoolStats]] = field(default_factory=dict)
    held: dict[str, CommandReply] = field(default_factory=dict)
    verify_until: float = 0.0
    # Real flush: target -> another key's agent listing its pool for the check, their dry-run
    # answers, and until when they are waited for (``kvpool_agent._hub_cross_listing``).
    cross: dict[str, str] = field(default_factory=dict)
    listers: set[str] = field(default_factory=set)
    listings: dict[str, CommandReply] = field(default_factory=dict)
    cross_until: float = 0.0
    # Its key was revoked while it ran (``CommandRouter.revoke``): audited, answered refused.
    withheld: bool = False


class CommandRouter:
    """Commands in flight and what happens to each (hub thread only).

    Args:
        sockets: the hub's sockets (commands go out on ``sockets.agents``).
        fleet: who the agents are and where they are.
        audit: the audit trail.
        counters: the hub's counters.
        quotas: the keys' quotas.
    """

    def __init__(self, sockets: HubSockets, fleet: Fleet, audit: AuditTrail,
                 counters: HubCounters, quotas: Quotas) -> None:
        self.sockets = sockets
        self.fleet = fleet
        self.audit = audit
        self.counters = counters
        self.quotas = quotas
        self.listings = PoolListings()
        self.pending: dict[str, _Pending] = {}
        # Flushes answered by their agents, held until other keys' counts confirm them.
        self.verifying: list[_Pending] = []
        # Per agent, so each agent sees its own gap-free command sequence.
        self._agent_seq: dict[str, int] = {}

    def recv(self, sock: zmq.Socket[bytes], *, curve: bool, limit: int, until: float,
             between: Callable[[], None] | None = None) -> None:
        """Take up to ``limit`` commands from ``sock`` (the operator port when ``curve``), until
        ``time.monotonic()`` passes ``until``; ``between`` (a callable) runs before each
        read-only command (the operator's turn)."""
        where = "curve" if curve else "commands"
        for _ in range(limit):
            if not curve:
                if between is not None:
                    between()
                if time.monotonic() >= until:
                    return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self.sockets.connections is not None:  # read: no connection's weight any more
                self.sockets.connections.took(where, frames)
            if not self.sockets.admit(where, frames[-1]):
                continue  # a connection past its key's cap: shut down, its command dropped
            if len(frames) != 2:
                self.counters.bad(where, f"{len(frames) - 1} frames, expected 1")
                continue
            client, frame = frames[0].bytes, frames[1]
            try:
                msg = decode(frame.bytes)
            except ProtocolError as e:
                self.counters.bad(where, str(e))
                continue
            if not isinstance(msg, CommandRequest):
                self.counters.bad(where, f"unexpected {type(msg).__name__} from a console")
                continue
            if self.sockets.allow is not None:
                named = self.sockets.listed_key(where, user_id(frame))
                if named is None:  # revoked, on a connection opened before: counted, unaudited
                    self.send_client(sock, client, [agent_error(msg, "hub", _REVOKED)])
                    continue
                key, who = named, f"key:{named}" + (f" ({msg.sender})" if msg.sender else "")
            else:
                key = "plain"
                who = f"plain:{msg.sender or 'anonymous'}"
            self.on_command(sock, client, msg, who, key, curve=curve)

    def _record(self, who: str, key: str, req: CommandRequest, targets: list[str],
                replies: list[CommandReply], *, curve: bool, refused: bool = False) -> None:
        """Audit one command: the operator port's lines in full, the read-only port's within
        ``key``'s budget (a line over it is counted as a refusal of ``key``, unless the command
        was refused and counted already: one command, one refusal)."""
        if not self.audit.record(who, req, targets, replies, refused=refused,
                                 channel="operator" if curve else "readonly",
                                 budget_key=None if curve else key) and not refused:
            self.counters.refuse(key, "audit budget spent: line suppressed")

    def _refuse_busy(self, sock: zmq.Socket[bytes], client: bytes, req: CommandRequest,
                     key: str, why: str) -> None:
        """Answer ``why`` at once, unaudited (a flood must not fill the audit file)."""
        self.counters.busy += 1
        self.counters.refuse(key, why)
        self.send_client(sock, client, [agent_error(req, "hub", why)])

    def on_command(
        self, sock: zmq.Socket[bytes], client: bytes, req: CommandRequest, who: str, key: str,
        *, curve: bool,
    ) -> None:
        """One console command: refused, answered by the hub, or sent to its agents."""
        self.counters.commands += 1
        needs_key = None
        if req.command == "flush" and (req.flush is None or not req.flush.dry_run):
            needs_key = UNAUTHORISED
        elif req.command == "health" and req.probe:
            needs_key = OPERATOR_ONLY.format(what="health --probe")
        elif req.command in ("forget", "pin", "unpin", "refusals"):
            needs_key = OPERATOR_ONLY.format(what=req.command)
        refusal = needs_key if not curve else None
        if len(req.targets) > MAX_TARGETS:
            refusal = f"refused: {len(req.targets)} targets, at most {MAX_TARGETS} per command"
        elif refusal is not None:
            self.counters.refused += 1
        if refusal is not None:
            self.counters.refuse(key, refusal)
            reply = agent_error(req, "hub", refusal)
            # What was tried: the targets it named (the line shows the first few). Audited
            # before the answer leaves, so whoever holds the answer finds the line.
            self._record(who, key, req, list(req.targets), [reply], curve=curve, refused=True)
            self.send_client(sock, client, [reply])
            return
        if req.command in ("forget", "refusals"):
            # Answered at once by the hub: no slot in flight, only its cost.
            busy = self.quotas.spend(key, cost(req, 0))
            if busy is not None:
                self._refuse_busy(sock, client, req, key, busy)
            elif req.command == "forget":
                self._forget(sock, client, req, who)
            else:
                self._refusals(sock, client, req, who)
            return
        busy = self.quotas.busy(((p.plain, p.client, p.key) for p in self.pending.values()),
                                client, key, curve=curve, command=req.command)
        if busy is not None:
            self._refuse_busy(sock, client, req, key, busy)
            return
        # Pools whose members are the keys bound to them (``kvpool-agent authorize --pool``).
        allow = self.sockets.allow
        closed = allow.bound_pools() if allow is not None else frozenset()
        targets, problem, unvouched = self.fleet.targets(req, closed)
        if problem is not None:
            reply = agent_error(req, "hub", problem + unvouched_note(unvouched))
            self._record(who, key, req, targets, [reply], curve=curve)
            self.send_client(sock, client, [reply])
            return
        routes = {aid: self.fleet.routing_id(aid) for aid in targets}
        # Unknown ids get one answer for them all: a request naming thousands costs one reply
        # and one short audit line, not one of each per id.
        unknown = [aid for aid, r in routes.items() if r is None]
        known = {aid: r for aid, r in routes.items() if r is not None}
        pend = _Pending(
            sock=sock, client=client, req=req, who=who,
            deadline=time.monotonic() + min(max(req.timeout_ms, 1), MAX_TIMEOUT_MS) / 1e3,
            expected=list(known), plain=not curve, key=key, unknown=unknown,
            unvouched=unvouched, closed=closed,
        )
        send = list(known)
        dry_run = req.command == "flush" and req.flush is not None and req.flush.dry_run
        if dry_run:
            members = self.fleet.members(list(known), closed)
            pools = {src.master for src, _, _ in members.values()}
            plan = self.listings.plan(req, members, key, readonly=not curve,
                                      pool_listers=lambda: self.fleet.pool_listers(pools, closed))
            if plan.busy and not plan.send and not plan.shared and all(
                    not r.ok for r in plan.answered.values()):
                self._refuse_busy(sock, client, req, key, plan.busy)
                return
            if plan.busy:
                self.counters.refuse(key, plan.busy)
            send = plan.send
            for lister in send:  # a pool's store agent listing for targets (``pool_listers``)
                if lister not in known and (rid := self.fleet.routing_id(lister)) is not None:
                    known[lister] = rid
            pend.replies.update(plan.answered)
            pend.shared, pend.groups, pend.cached = plan.shared, plan.groups, plan.cached
            self.counters.shared_listings += len(plan.shared) + sum(
                1 for r in plan.answered.values() if r.ok)
        # Charged per connection reached, not per agent id: one key's 1,024 ids on one
        # connection spent the operator's budget on every health of the fleet (round 5).
        why = self.quotas.spend(key, cost(req, len({known[aid] for aid in send})))
        if why is not None:
            self._refuse_busy(sock, client, req, key, why)
            return
        if req.command == "flush" and not dry_run:
            self.listings.flushed({src.master for src, _, _ in
                                   self.fleet.members(send).values()})
        if not send:
            self._maybe_finish_pending(pend)
            return
        internal = secrets.token_hex(16)
        self.pending[internal] = pend
        # Without the targets: agents do not read them, and a request naming MAX_TARGETS ids
        # (~1.1 MB) would be queued once per target agent (AGENT_SNDHWM deep each).
        fwd = msgspec.structs.replace(req, request_id=internal, targets=[])
        if req.drain is not None:
            # No agent waits longer than the hub waits for its reply.
            fwd.drain = DrainArgs(timeout_ms=min(max(req.drain.timeout_ms, 0), req.timeout_ms,
                                                 MAX_TIMEOUT_MS))
        if req.command == "flush":
            pend.pool_keys = self.fleet.pool_keys(send, closed)
            pend.masters = {a: m[0].master for a, m in self.fleet.members(send).items()}
        if (req.command == "flush" and not dry_run) or req.command in ("pin", "unpin"):
            # One pass for all targets (a flush naming an engine's 1,024 ids scanned per id).
            pend.verifiers = self.fleet.pool_verifiers(send, layout=req.command != "flush",
                                                       closed=closed)
        if wants_cross_listing(req):
            ids = list({v: None for vs in pend.verifiers.values() for v in vs}
                       | dict.fromkeys(send))
            pend.cross = listers(req, send, pend.verifiers,
                                 {k: m[0] for k, m in self.fleet.members(ids).items()})
            pend.listers = set(pend.cross.values())  # never a target (``listers``)
            pend.cross_until = min(time.monotonic() + VERIFY_S, pend.deadline)
        for aid in send:
            self._forward(pend, aid, known[aid], fwd)
        if pend.cross and fwd.flush is not None:
            dry = msgspec.structs.replace(
                fwd, flush=msgspec.structs.replace(fwd.flush, dry_run=True))
            for lister in sorted(pend.listers):
                if (rid := self.fleet.routing_id(lister)) is None:
                    pend.listings[lister] = agent_error(req, lister, "agent gone")
                else:
                    self._forward(pend, lister, rid, dry, listing=True)
        self.maybe_finish(internal)

    def _forward(self, pend: _Pending, aid: str, routing_id: bytes, fwd: CommandRequest,
                 listing: bool = False) -> None:
        """Send ``fwd`` to agent ``aid`` at ``routing_id`` (its reply counts only from there);
        ``listing``: a cross-check listing, whose answer goes to ``pend.listings``."""
        fwd.seq = self._agent_seq[aid] = self._agent_seq.get(aid, 0) + 1
        try:
            self.sockets.agents.send_multipart([routing_id, encode(fwd)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            why = ("agent not connected: its connection to the hub is gone (the process "
                   "exited, or its network dropped)" if e.errno == zmq.EHOSTUNREACH
                   else f"agent unreachable: {e}")  # libzmq's "Host unreachable" misled
            (pend.listings if listing else pend.replies)[aid] = agent_error(pend.req, aid, why)
            return
        pend.routes[aid] = routing_id

    def _forget(
        self, sock: zmq.Socket[bytes], client: bytes, req: CommandRequest, who: str
    ) -> None:
        if not req.targets:
            reply = agent_error(req, "hub", "forget needs targets (engine or agent ids)")
        else:
            ids = self.fleet.forget(req.targets)
            self.note_forgotten(ids, f"forget by {who}")
            named = ", ".join(req.targets[:AUDIT_IDS_SHOWN])
            more = len(req.targets) - AUDIT_IDS_SHOWN
            reply = CommandReply(
                v=PROTOCOL_VERSION,
                seq=0,
                request_id=req.request_id,
                agent_id="hub",
                ok=bool(ids),
                error=None if ids else f"no agent or engine named {named}"
                + (f" (and {more} more)" if more > 0 else ""),
                forgotten=ids[:FORGOTTEN_SHOWN],
                forgotten_count=len(ids),
            )
        self.audit.record(who, req, list(req.targets), [reply])
        self.send_client(sock, client, [reply])

    def _refusals(self, sock: zmq.Socket[bytes], client: bytes, req: CommandRequest,
                  who: str) -> None:
        """An operator's ``refusals`` (``P+3`` only): the names of the keys the hub refused,
        which the console port's broadcast leaves out (``FleetUpdate.refused_total``)."""
        reply = CommandReply(v=PROTOCOL_VERSION, seq=0, request_id=req.request_id,
                             agent_id="hub", ok=True,
                             refused_by_key=self.counters.most_refused())
        self.audit.record(who, req, [], [reply])
        self.send_client(sock, client, [reply])

    def revoke(self, agent_ids: list[str], keys: set[str]) -> None:
        """Agents ``agent_ids`` were dropped and console keys ``keys`` (names) revoked: the
        commands in flight from those keys run to their end and are audited in full (agents
        may have acted), but their console is answered refused, and every answer awaited or
        held (for its check) from those agents is theirs no more: an error."""
        gone = set(agent_ids)
        self.listings.forget_agents(gone)
        for pend in [*self.pending.values(), *self.verifying]:
            pend.withheld = pend.withheld or pend.key in keys
        for internal, pend in list(self.pending.items()):
            for aid in gone & (set(pend.expected) | pend.listers | set(pend.shared.values())):
                into = pend.listings if aid in pend.listers else pend.replies
                into[aid] = agent_error(pend.req, aid, "agent's key revoked: answer dropped")
            self.maybe_finish(internal)
        for pend in list(self.verifying):
            for aid in gone & set(pend.held):
                del pend.held[aid]
                pend.replies[aid] = agent_error(pend.req, aid, "agent's key revoked: answer "
                                                "dropped before its check")
            if not pend.held:
                self.verifying.remove(pend)
                self._answer(pend)

    def note_forgotten(self, ids: list[str], why: str) -> None:
        """Count and log agents the hub dropped; the dry-run answers they listed answer no
        more."""
        self.listings.forget_agents(set(ids))
        if ids:
            self.counters.forgotten += len(ids)
            log.warning("kvpool hub: forgot %d agent(s) (%s): %s", len(ids), why,
                        ", ".join(ids[:20]))

    def on_reply(self, rid: bytes, rep: CommandReply) -> None:
        """An agent's reply from connection ``rid``: counted only when the command went there."""
        pend = self.pending.get(rep.request_id)
        listing = pend is not None and rep.agent_id in pend.listers
        if (
            pend is None
            or pend.routes.get(rep.agent_id) != rid
            or rep.agent_id in (pend.listings if listing else pend.replies)
        ):
            self.counters.rejected_replies += 1
            self.counters.bad("agents", f"reply {rep.request_id[:40]!r} of "
                              f"{rep.agent_id[:80]!r} not expected from this connection")
            return
        reply = msgspec.structs.replace(rep, request_id=pend.req.request_id)
        if reply.flush is not None and (reply.flush.listed_by or reply.flush.listed_ms_ago):
            # Only the hub says whose listing an answer is (``_hub_listings._copy``).
            reply.flush = msgspec.structs.replace(reply.flush, listed_by="", listed_ms_ago=0.0)
        if listing:
            pend.listings[rep.agent_id] = reply
            self.maybe_finish(rep.request_id)
            return
        pend.replies[rep.agent_id] = reply
        self.maybe_finish(rep.request_id)

    def expire(self, now: float, why: str | None = None) -> None:
        """Answer the commands past their deadline (``why``: every command, for that reason)
        with an error for each agent that has not replied, and the flushes whose check is
        done."""
        self._verify(now)
        for internal in [k for k, p in self.pending.items() if why or now >= p.deadline
                         or (p.listers and now >= p.cross_until)]:
            pend = self.pending[internal]
            for lister in pend.listers:
                if lister not in pend.listings:
                    pend.listings[lister] = agent_error(pend.req, lister, "no listing in time")
            if not (why or now >= pend.deadline):
                self.maybe_finish(internal)
                continue
            for aid in [*pend.expected, *pend.shared.values()]:
                if aid not in pend.replies and aid not in pend.shared:
                    pend.replies[aid] = agent_error(
                        pend.req, aid, why or f"timeout after {pend.req.timeout_ms} ms")
            self.maybe_finish(internal)

    def maybe_finish(self, internal: str) -> None:
        """Answer command ``internal`` once every agent it waits for has replied."""
        pend = self.pending.get(internal)
        if pend is None or not self._complete(pend):
            return
        del self.pending[internal]
        self._finish(pend)

    def _maybe_finish_pending(self, pend: _Pending) -> None:
        if self._complete(pend):
            self._finish(pend)

    @staticmethod
    def _complete(pend: _Pending) -> bool:
        return all(a in pend.replies or a in pend.shared for a in pend.expected) and all(
            lister in pend.listings for lister in pend.listers) and all(
            lister in pend.replies for lister in pend.shared.values())

    def _finish(self, pend: _Pending) -> None:
        """Every agent has answered: shared listings copied, flush answers checked against
        the pool's count, a real flush's, pin's or unpin's answer held until other keys'
        reports confirm it (``_verify``), then audited and sent (``_answer``)."""
        for lister, group in pend.groups.items():  # as listed, to answer later dry runs
            self.listings.keep(group, pend.replies[lister])
        for aid, lister in pend.shared.items():
            pend.replies[aid] = shared_answer(pend.req, aid, pend.replies[lister])
        for lister in set(pend.shared.values()) - set(pend.expected):
            if not pend.replies[lister].ok:  # a pool lister: not asked for a while
                self.listings.lister_failed(lister)
        # Only a flush's answer is held against its pool's count (``checked_answer``), and the
        # counts of every target come from one scan of the fleet: a snapshot of 8,192 agent ids
        # cost the hub thread seconds when each target's count was a scan (round 5). A copy is
        # its lister's claim, held against the counts the lister's key does not report.
        claimant = {a: pend.shared.get(a) or pend.cached.get(a) or a for a in pend.expected}
        now_keys = (self.fleet.pool_keys(list(set(claimant.values())), pend.closed)
                    if pend.req.command == "flush"
                    else {})
        now_at = ({a: m[0].master for a, m in self.fleet.members(list(pend.masters)).items()}
                  if pend.masters else {})
        for a in pend.expected:
            c = claimant[a]
            pend.replies[a] = checked_answer(pend.req, pend.replies[a], (
                pend.pool_keys.get(c), now_keys.get(c)), moved=(
                    pend.masters[c], now_at[c]) if c in pend.masters and c in now_at else None)
            if a in pend.cross:
                pend.replies[a] = cross_checked(pend.req, pend.replies[a],
                                                pend.listings.get(pend.cross[a]), pend.cross[a])
        pend.held = {a: r for a, r in pend.replies.items()
                     if needs_verifying(pend.req, r, pend.verifiers.get(a, {}))}
        if pend.held:
            now = time.monotonic()
            wait = PIN_VERIFY_S if pend.req.command in ("pin", "unpin") else VERIFY_S
            pend.verify_until = min(now + wait, pend.deadline + _VERIFY_GRACE_S)
            self.verifying.append(pend)
            self._verify(now)
            return
        self._answer(pend)

    def _verify(self, now: float) -> None:
        """Answer the held flushes, pins and unpins that other keys' pool reports confirm
        now, or whose check is over (unconfirmed: suspect)."""
        for pend in list(self.verifying):
            done = now >= pend.verify_until
            # Held answers of one pool, key and layout share one verifiers dict: their stats
            # are read, and one claim checked, once per dict (an engine's 1,024 held ids).
            classes = {id(pend.verifiers[aid]): pend.verifiers[aid] for aid in pend.held}
            stats = self.fleet.pool_stats(list({v: None for vs in classes.values() for v in vs}))
            now_of = {k: {v: stats[v] for v in vs if v in stats} for k, vs in classes.items()}
            verdicts: dict[tuple[int, int], bool] = {}  # claim -> confirmed (else: waits)
            for aid, rep in list(pend.held.items()):
                verifiers = pend.verifiers[aid]
                claim = (id(verifiers), rep.flush.removed_keys if rep.flush is not None else 0)
                if claim in verdicts:
                    checked = rep if verdicts[claim] else None
                else:
                    checked = verified_answer(pend.req, rep, verifiers, now_of[id(verifiers)],
                                              done)
                    if checked is rep or checked is None:  # a suspect one names its own agent
                        verdicts[claim] = checked is rep
                if checked is not None:
                    pend.replies[aid] = checked
                    del pend.held[aid]
            if not pend.held:
                self.verifying.remove(pend)
                self._answer(pend)

    def _answer(self, pend: _Pending) -> None:
        """Audit the command's answers and send them to the console."""
        replies = [pend.replies[a] for a in pend.expected]
        if len(pend.unknown) == 1:
            (aid,) = pend.unknown
            replies.append(agent_error(pend.req, aid, f"unknown agent {aid!r}"))
        elif pend.unknown:
            first = ", ".join(pend.unknown[:AUDIT_IDS_SHOWN])
            replies.append(agent_error(
                pend.req, "hub", f"unknown agents: {len(pend.unknown)} ({first}"
                + (", ..." if len(pend.unknown) > AUDIT_IDS_SHOWN else "") + ")"))
        if pend.unvouched:
            replies.append(agent_error(pend.req, "hub", "not sent"
                                       + unvouched_note(pend.unvouched)))
        self._record(pend.who, pend.key, pend.req, [*pend.expected, *pend.unknown], replies,
                     curve=not pend.plain)
        self.send_client(pend.sock, pend.client, [agent_error(pend.req, "hub", _REVOKED)]
                         if pend.withheld else replies)

    def send_client(
        self, sock: zmq.Socket[bytes], client: bytes, replies: list[CommandReply]
    ) -> None:
        """Send ``replies`` to console connection ``client``; a reply that cannot go is lost
        and counted (a console that disconnects with replies pending is no log flood)."""
        try:
            sock.send_multipart([client, *(encode(r) for r in replies)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.counters.lose_reply(e)


def agent_error(req: CommandRequest, agent_id: str, error: str) -> CommandReply:
    """A failed answer to ``req`` in ``agent_id``'s name (``"hub"`` for the hub's own)."""
    return CommandReply(
        v=PROTOCOL_VERSION,
        seq=0,
        request_id=req.request_id,
        agent_id=agent_id,
        ok=False,
        error=error,
    )
