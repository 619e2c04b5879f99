"""One pool listing per pool: what the hub does with dry-run flushes so that a pool is listed once
however many of its agents a command names, and how often a read-only key may have a pool
listed at all.

Why: an agent answers a dry run by listing every key of its pool (Mooncake ``/get_all_keys``),
matching and sizing them, O(pool keys) under the engine's GIL. Issue 42: a viewer's dry runs
naming every worker, 64 in flight, made every serving process list the pool 153 times a second
(engine CPU from 6% to 134% of two cores, the master's from 1% to 22%).

What the hub does (``plan``):

- targets whose answer is the same listing share it: one agent of a group lists, the others get
  a copy of its answer (``share_key``: the pool, the scope and what it resolves with, the
  process role; for an engine-bound key also the key itself, so an insider's bound key never
  answers for another key's agents, while a fleet-wide key's answer is shared fleet-wide, as
  ``Fleet.pool_keys`` trusts its count first);
- an answer stays the group's answer for ``LISTING_SHARED_S`` after it came (to every key: the
  pool's own key count in the agents' reports is as old), so repeated dry runs list nothing; a
  real flush of a pool drops its answers at once;
- a read-only key (``P+2``) is answered from a listing up to ``LISTING_INTERVAL_S`` old, and
  has a pool listed at most once per ``LISTING_INTERVAL_S``; a group that would need another
  listing within it is answered ``hub busy`` without reaching its agents. The operator port is
  bounded by the work budget only (``kvpool_agent._work_budget``).

Where the pool has a store agent that lists it (``Source.lists_pool``, ``kvpool-agent store``
beside the master: ``Fleet.pool_listers``), a dry run of scope ``all`` is listed there, not by
an engine's worker: the engines do no work for it at all (measured: a viewer's flood took an
engine's CPU to 1.59x and its scheduler lookup p99 to 2.17x of idle with the one listing a
pool every 2 s in a worker, 1.04x and 0.78x with none; ``bench/bench_dryrun_engine.py
--split-cores``). The store agent is no target: its answer reaches the console only as the
copies of the targets it listed for. A group bound to one key keeps listing through its own
agents (its answer is its own claim).

A shared answer carries the target's ``agent_id`` and the listing's ``FlushResult``; the
console sums answers as before (a scope ``all`` dry run naming N workers of one pool counted
the pool N times before, and still does), and the hub counts every shared answer
(``HubCounters.shared_listings``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    FlushResult,
    Source,
)

__all__ = [
    "LISTER_BENCHED_S",
    "LISTING_INTERVAL_S",
    "LISTING_SHARED_S",
    "ListingPlan",
    "PoolListings",
    "share_key",
    "shared_answer",
]

LISTING_SHARED_S = 2.0
"""Seconds a dry run's answer answers every dry run of its group (``share_key``): the agents'
pool stats (the pool's key count the console shows) are refreshed every 2 s."""
LISTING_INTERVAL_S = 10.0
"""Seconds between two listings of one pool a read-only key may cause, and how old a listing
that answers a read-only key's dry run may be. Whoever lists, the master serves each listing
(``/get_all_keys``, O(pool keys)): with a store agent listing every 2 s under a viewer's
flood, the engines listed nothing and their CPU stayed at 1.06x of idle, but their scheduler
lookups' p99 (each a master RPC) went to 1.27x, 1.35x in another run
(``bench/bench_dryrun_engine.py --split-cores``, 20,000 keys)."""

LISTER_BENCHED_S = 60.0
"""Seconds a pool lister that failed or did not answer a dry run in time is not asked: the
targets' own agents list meanwhile."""

ShareKey = tuple[str, ...]


def share_key(req: CommandRequest, src: Source, identity: str, bound: bool) -> ShareKey:
    """The group of agents whose answer to the dry run ``req`` is one listing's: the pool
    (``Source.master``), the process role (a scheduler answers with an error, a worker with its
    listing) and what the scope resolves with (``kvpool_connector.operations.flush_pattern``):
    ``all`` nothing more, ``model`` the model named or the agent's own, ``engine`` the engine,
    model, layout digest and the ranks whose shards it writes; for an engine-bound key's agent
    its identity (its answer is its own claim)."""
    fl = req.flush
    scope = fl.scope if fl is not None else ""
    if scope == "all":
        what: tuple[str, ...] = ()
    elif scope == "model":
        what = ((fl.model if fl is not None and fl.model else "") or src.model,)
    else:
        what = (src.engine_id, src.model, src.layout_digest, str(src.tp_rank),
                str(src.pp_rank))
    return (src.master, src.process_role, scope, *what, identity if bound else "")


@dataclass
class ListingPlan:
    """What the hub does with one dry run's targets: ``send`` (agent ids that list),
    ``answered`` (agent id -> an answer already known: a copy of a fresh listing, or a ``hub
    busy`` refusal), ``shared`` (agent id -> the agent in ``send`` whose answer it gets) and
    ``groups`` (agent id in ``send`` -> its share key, to keep its answer) and ``cached``
    (agent id answered from a kept listing -> who listed it: the copy is that agent's claim)."""

    send: list[str] = field(default_factory=list)
    answered: dict[str, CommandReply] = field(default_factory=dict)
    shared: dict[str, str] = field(default_factory=dict)
    groups: dict[str, ShareKey] = field(default_factory=dict)
    cached: dict[str, str] = field(default_factory=dict)
    busy: str = ""


@dataclass
class _Answer:
    result: FlushResult
    lister: str
    at: float  # time.monotonic() s


class PoolListings:
    """The listings the hub shares (``LISTING_SHARED_S``; to read-only keys
    ``LISTING_INTERVAL_S``) and when each read-only key last had each pool listed
    (``LISTING_INTERVAL_S``). Hub thread only."""

    def __init__(self) -> None:
        self._answers: dict[ShareKey, _Answer] = {}
        # (key name, pool) -> when that key last had the pool listed (monotonic s).
        self._listed: dict[tuple[str, str], float] = {}
        # Pool lister -> until when it is not asked (``lister_failed``).
        self._benched: dict[str, float] = {}

    def plan(self, req: CommandRequest, members: dict[str, tuple[Source, str, bool]],
             key: str, *, readonly: bool, now: float | None = None,
             pool_listers: Callable[[], Mapping[str, str]] | None = None) -> ListingPlan:
        """Which of ``members`` (agent id -> its source, identity, bound) list for the dry run
        ``req`` of ``key``, which get a fresh answer now and which share another's.
        ``pool_listers`` (called once, only when a group of scope ``all`` needs a listing:
        master -> agent id, ``Fleet.pool_listers``, a scan of the fleet): a group of scope
        ``all`` whose answer is not one bound key's own claim is listed by its pool's lister,
        a store agent, which then is in ``send`` though not a target (module docstring)."""
        now = time.monotonic() if now is None else now
        scope_all = req.flush is not None and req.flush.scope == "all"
        found: dict[str, str] | None = None

        def lister_of_pool(master: str) -> str | None:
            nonlocal found
            if found is None:
                found = {m: a for m, a in (pool_listers() if pool_listers else {}).items()
                         if now >= self._benched.get(a, -math.inf)}
            return found.get(master)

        window = LISTING_INTERVAL_S if readonly else LISTING_SHARED_S
        plan = ListingPlan()
        lister_of: dict[ShareKey, str] = {}
        for aid, (src, identity, bound) in members.items():
            group = share_key(req, src, identity, bound)
            known = self._answers.get(group)
            if known is not None and now - known.at < window:
                plan.answered[aid] = _copy(req, aid, known.result, known.lister,
                                           (now - known.at) * 1e3)
                plan.cached[aid] = known.lister
                continue
            if group in lister_of:
                plan.shared[aid] = lister_of[group]
                continue
            lister = (lister_of_pool(src.master)
                      if scope_all and not bound and src.process_role == "worker" else None)
            lister = lister or aid
            if lister not in plan.groups:  # else already sent this dry run: no new listing
                if readonly:
                    last = self._listed.get((key, src.master))
                    if last is not None and now - last < LISTING_INTERVAL_S:
                        wait = LISTING_INTERVAL_S - (now - last)
                        pool = f"{src.backend}@{src.master}"[:90]
                        plan.busy = (f"hub busy: this key had pool {pool!r} listed "
                                     f"{now - last:.1f} s ago (one listing per pool every "
                                     f"{LISTING_INTERVAL_S:g} s per read-only key); retry in "
                                     f"{wait:.1f} s")
                        plan.answered[aid] = _refusal(req, aid, plan.busy)
                        continue
                    self._listed[(key, src.master)] = now
                plan.send.append(lister)
                plan.groups[lister] = group
            lister_of[group] = lister
            if lister != aid:
                plan.shared[aid] = lister
        return plan

    def lister_failed(self, agent_id: str, now: float | None = None) -> None:
        """A pool lister (not a target: ``Fleet.pool_listers``) failed or did not answer in
        time: its pool's dry runs go to the targets' own agents for ``LISTER_BENCHED_S``, so a
        lister that never answers cannot keep every console from its pool's count."""
        now = time.monotonic() if now is None else now
        self._benched[agent_id] = now + LISTER_BENCHED_S

    def forget_agents(self, agent_ids: set[str]) -> None:
        """Agents dropped (key revoked, ``forget``): the answers they listed answer no more."""
        for group in [g for g, a in self._answers.items() if a.lister in agent_ids]:
            del self._answers[group]

    def keep(self, group: ShareKey, rep: CommandReply, now: float | None = None) -> None:
        """Keep ``rep`` (a lister's answer) as its group's, if it is a dry run's listing."""
        if rep.ok and rep.flush is not None and rep.flush.dry_run:
            self._answers[group] = _Answer(rep.flush, rep.agent_id,
                                           time.monotonic() if now is None else now)

    def flushed(self, pools: set[str]) -> None:
        """A real flush was sent to ``pools``: their answers are stale now."""
        for group in [g for g in self._answers if g[0] in pools]:
            del self._answers[group]

    def prune(self, now: float | None = None) -> None:
        """Drop answers and listing times past their window (the hub calls it once a second):
        the tables hold what a second of dry runs added, however many keys and models."""
        now = time.monotonic() if now is None else now
        keep_s = max(LISTING_SHARED_S, LISTING_INTERVAL_S)
        for group in [g for g, a in self._answers.items() if now - a.at >= keep_s]:
            del self._answers[group]
        for k in [k for k, t in self._listed.items() if now - t >= LISTING_INTERVAL_S]:
            del self._listed[k]
        for a in [a for a, until in self._benched.items() if now >= until]:
            del self._benched[a]


def shared_answer(req: CommandRequest, aid: str, lister: CommandReply) -> CommandReply:
    """``aid``'s answer from its group's lister's: the listing when it has one, else the
    lister's failure, named."""
    if lister.ok and lister.flush is not None:
        return _copy(req, aid, lister.flush, lister.agent_id)
    return _refusal(req, aid, f"its pool's listing by {lister.agent_id[:80]} failed: "
                    f"{(lister.error or 'no flush result')[:200]}")


def _copy(req: CommandRequest, aid: str, result: FlushResult, lister: str,
          age_ms: float = 0.0) -> CommandReply:
    """``aid``'s answer: ``result`` as ``lister`` listed it ``age_ms`` ago (named in the
    answer unless ``aid`` listed it itself)."""
    return CommandReply(v=PROTOCOL_VERSION, seq=0, request_id=req.request_id, agent_id=aid,
                        ok=True, flush=msgspec.structs.replace(
                            result, listed_by="" if lister == aid else lister,
                            listed_ms_ago=max(0.0, age_ms)))


def _refusal(req: CommandRequest, aid: str, why: str) -> CommandReply:
    return CommandReply(v=PROTOCOL_VERSION, seq=0, request_id=req.request_id, agent_id=aid,
                        ok=False, error=why)
