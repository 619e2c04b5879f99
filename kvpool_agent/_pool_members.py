"""Which agents count for the pool (``Source.master``) they claim, for the hub's pool-wide
commands and the counts their answers are held against (issue 42).

A pool some agent key is bound to (``kvpool-agent authorize --pool``; the hub passes those pools
as ``closed``, ``kvpool_agent.auth.AllowList.bound_pools``) is *closed*: its members are the
agents of keys bound to it, proven by the operator's authorization, not by agents' agreement.
Only they receive its pool-wide commands and count in its key counts and verifiers; other
agents' claims of it stay in the fleet's state (consoles show them) and are never routed nor
counted: two colluding engine-bound keys confirmed each other's forged flush of a pool no
fleet-wide key reported. A pool bound to no key is proven by agreement (``left_out``: one
engine-bound key alone proves nothing). Pure functions over ``kvpool_agent._fleet``'s entries,
called under its lock (docs/security.md, pool membership).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool_agent._fleet import _Entry

__all__ = ["PoolCount", "counts", "largest_counts", "left_out"]

PoolCount = tuple[bool, str, str, int]
"""One agent's report of its pool's key count: (its key is engine-bound, its identity, its
agent id, ``PoolStats.keys``)."""


def counts(a: _Entry, closed: frozenset[str]) -> bool:
    """Whether ``a`` counts for the pool it claims: no key is bound to that pool (``closed``),
    or ``a``'s key is (a pool-bound key's claim of another pool is refused at its report,
    ``kvpool_agent.auth.bound_elsewhere``)."""
    return a.pool == a.state.source.master or a.state.source.master not in closed


def left_out(live: Mapping[str, _Entry],
             closed: frozenset[str]) -> tuple[dict[str, _Entry], set[str]]:
    """``(the agents of live that count for their pool, the pools a pool-wide command leaves
    out)``. Left out: a closed pool none of whose live agents is a member, and a pool bound to
    no key that one engine-bound key alone reports: a key bound to one engine may claim any
    master, so alone it proves no pool (a phantom pool got its share of a fleet-wide flush and
    its forged 4,242 keys were added to the total). A second key, or one not bound to an engine
    (a fleet-wide agent key, a store agent's, none without keys), vouches for an unbound pool;
    a closed pool's members need no voucher (the operator bound their keys to it)."""
    pooled = {k: a for k, a in live.items() if counts(a, closed)}
    keys: dict[str, set[str]] = {}
    free: set[str] = set()
    for a in pooled.values():
        keys.setdefault(a.state.source.master, set()).add(a.identity)
        if not a.bound:
            free.add(a.state.source.master)
    unvouched = {m for m, ids in keys.items() if m not in free and len(ids) < 2
                 and m not in closed}
    claimed = {a.state.source.master for a in live.values()}
    return pooled, unvouched | (claimed - set(keys))


def largest_counts(want: Mapping[str, _Entry], pools: Mapping[str, list[PoolCount]],
                   agent_ids: list[str]) -> dict[str, int | None]:
    """Agent id -> the key count of its pool from the most trusted of ``pools``' reporters
    (master -> the counts that count, ``counts``), the largest of theirs: keys not bound to one
    engine before engine-bound ones, then other identities, then other agents, before the agent
    itself (``want``: the entries of ``agent_ids`` the fleet holds). ``None``: no count.
    O(reporters) per pool and identity asked, not per id (round 5)."""
    top: dict[tuple[str, str], list[tuple[int, str]]] = {}  # the best class's 2 largest
    out: dict[str, int | None] = dict.fromkeys(agent_ids)
    for k, ag in want.items():
        group = (ag.state.source.master, ag.identity)
        if group not in top:
            ranked = [((b, i == ag.identity), (n, a)) for b, i, a, n in pools.get(group[0], [])]
            best = min((r for r, _ in ranked), default=None)
            top[group] = sorted((c for r, c in ranked if r == best), reverse=True)[:2]
        out[k] = max([n for n, a in top[group] if a != k] or [n for n, _ in top[group]],
                     default=None)
    return out
