"""A real flush's answer checked against another key's listing of the same pool (issue 42): what
the hub holds an under-count against when the pool's key count cannot tell.

Why: the pool's key count (``Fleet.pool_keys``) bounds what a flush of scope ``all`` matches
both ways, but a flush of scope ``model`` matches part of the pool: an
impostor's "matched 10, removed 10" of a model holding 5,000 keys, or "matched 5,000, removed
0, all leased", passed every check and was printed as done.

What the hub does: with a real flush of scope ``model`` or ``all`` it sends the same flush as
a dry run to one agent of another key in each target's pool (``listers``: of the target's
verifiers, ``Fleet.pool_verifiers``: a fleet-wide key's when the pool has one, a worker before a
store agent; for scope ``model`` without a model named, one serving the target's model: an
agent resolves that scope with its own), at the same time. Scope ``engine`` is not
cross-listed: an agent resolves it with its own engine's layout and ranks. That agent lists the
pool's keys the scope matches (one listing per pool and real flush, not charged to the
operator's work budget). An answer that matched fewer keys than the listing, beyond the slack,
is ``suspect`` (``cross_checked``). A listing made after a genuine flush removed the keys
matches fewer keys, never more, so it never makes a genuine answer suspect. The hub waits for
the listing ``VERIFY_S`` at most; without it (no other key in the pool, no answer) the answer is
checked as before. Colluding keys can list the same lie: in a pool without a fleet-wide key
or a store agent the check is as good as the other keys.

A real flush that left more than the slack of what it matched in the pool (``skipped_leased``
or no reason) is suspect too (``kvpool_agent._answers.checked_answer``): true or forged, the
pool still holds those keys and the operator has to flush again.
"""

from __future__ import annotations

import logging

import msgspec

from kvpool_agent._answers import SUSPECT_SLACK_KEYS
from kvpool_agent.protocol import CommandReply, CommandRequest, PoolStats, Source

__all__ = ["cross_checked", "listers", "wants_cross_listing"]

log = logging.getLogger("kvpool.hub")


def wants_cross_listing(req: CommandRequest) -> bool:
    """Whether ``req`` is a real flush of scope ``model`` or ``all`` (its answers are
    cross-checked)."""
    fl = req.flush
    return req.command == "flush" and fl is not None and not fl.dry_run and fl.scope in (
        "model", "all")


def listers(req: CommandRequest, targets: list[str],
            verifiers: dict[str, dict[str, PoolStats]],
            sources: dict[str, Source]) -> dict[str, str]:
    """Target agent id -> the agent that lists its pool for the check of ``req``: one of its
    verifiers (``verifiers``: target -> agent id -> stats) that is a worker (else a store
    agent) with a known source (``sources``, targets' too), not a target itself, and for
    scope ``model`` without a model named one of the target's model. Targets without one are
    left out."""
    out: dict[str, str] = {}
    own = set(targets)
    named = req.flush is not None and (req.flush.scope == "all" or bool(req.flush.model))
    # Targets of one pool, key and model share verifiers: chosen once (4,096 targets).
    chosen: dict[tuple[int, str], str | None] = {}
    for aid in targets:
        if aid not in sources:
            continue
        vs, model = verifiers.get(aid, {}), "" if named else sources[aid].model
        if (id(vs), model) not in chosen:
            ranked = sorted((sources[v].process_role != "worker", v) for v in vs
                            if v in sources and v not in own
                            and sources[v].process_role in ("worker", "store")
                            and (named or sources[v].model == model))
            chosen[(id(vs), model)] = ranked[0][1] if ranked else None
        if (lister := chosen[(id(vs), model)]) is not None:
            out[aid] = lister
    return out


def cross_checked(req: CommandRequest, rep: CommandReply, listing: CommandReply | None,
                  lister: str) -> CommandReply:
    """``rep`` (a real flush's answer), marked ``suspect`` with ``ok=False`` when ``listing``
    (``lister``'s dry-run answer of the same scope, another key's) matched more keys than it
    beyond the slack (``SUSPECT_SLACK_KEYS`` or an eighth of the listing)."""
    res = rep.flush
    got = listing.flush if listing is not None and listing.ok else None
    if res is None or not rep.ok or rep.suspect is not None or got is None or not got.dry_run:
        return rep
    if res.keys + max(got.keys // 8, SUSPECT_SLACK_KEYS) >= got.keys:
        return rep
    why = (f"{res.keys} keys matched, but {lister[:80]} (another key) listed {got.keys} for "
           f"the same scope")
    log.warning("kvpool hub: suspect flush answer from %s: %s", rep.agent_id, why)
    return msgspec.structs.replace(rep, ok=False, suspect=why,
                                   error=f"suspect answer, not counted as done: {why}")
