"""What the hub checks of agents' answers to pool-wide commands before the operator sees them,
and what it tells the operator of pools it left out.

A flush answer is a claim of the agent that ran it (an agent key may be an insider's); the hub
holds it against the pool's key count as the pool's agents report it (``Fleet.pool_keys``) and
marks one that cannot be true ``suspect`` with ``ok=False``: the console prints ``flush
SUSPECT, not done`` and exits 1, the audit line says why. Checked both ways since issue 42 (an
impostor's "removed 10 of 10 keys" of a pool of thousands was printed as done).
"""

from __future__ import annotations

import logging

import msgspec

from kvpool_agent.audit import AUDIT_IDS_SHOWN
from kvpool_agent.protocol import CommandReply, CommandRequest

__all__ = ["SUSPECT_SLACK_KEYS", "checked_answer", "unvouched_note"]

log = logging.getLogger("kvpool.hub")

SUSPECT_SLACK_KEYS = 64
"""Keys a flush may match beyond its pool's last reported count (the pool grows between
reports, every 2 s), or for scope ``all`` short of it (it shrinks by eviction), before its
answer is suspect; also an eighth of the count. Small, so a forged answer for a small pool
cannot claim much more or less than the pool holds; a genuine flush of a fast-changing small
pool may be shown as suspect, and a second dry run clears it."""


def checked_answer(req: CommandRequest, rep: CommandReply,
                   pool_keys: tuple[int | None, int | None]) -> CommandReply:
    """``rep``, or when it is a flush answer that cannot be true of its pool the same marked
    ``suspect`` with ``ok=False``: more keys matched than the pool holds, or for scope ``all``
    (every kvpool key) fewer, beyond the slack; more removed than matched; a removal on a dry
    run.

    Args:
        req: the command as the console sent it.
        rep: the agent's answer.
        pool_keys: the pool's key count when the command was sent and now (``None``: no agent
            reports the pool).
    """
    res, args = rep.flush, req.flush
    if req.command != "flush" or res is None or args is None or not rep.ok:
        return rep
    why = None
    known = [n for n in pool_keys if n is not None]
    if res.dry_run != args.dry_run or (args.dry_run and res.removed_keys):
        why = f"a {'dry run' if args.dry_run else 'flush'} answered as " + (
            "a dry run" if res.dry_run else f"removing {res.removed_keys} keys")
    elif res.removed_keys + res.skipped_leased > res.keys:
        why = (f"removed {res.removed_keys} and skipped {res.skipped_leased} of "
               f"{res.keys} matched keys")
    elif known and res.keys > max(known) + max(max(known) // 8, SUSPECT_SLACK_KEYS):
        why = f"{res.keys} keys matched, but the pool holds {max(known)} as its agents report it"
    elif known and args.scope == "all" and (
            res.keys + max(min(known) // 8, SUSPECT_SLACK_KEYS) < min(known)):
        why = (f"only {res.keys} keys matched, but the pool holds {min(known)} as its agents "
               "report it")
    if why is None:
        return rep
    log.warning("kvpool hub: suspect flush answer from %s: %s", rep.agent_id, why)
    return msgspec.structs.replace(rep, ok=False, suspect=why,
                                   error=f"suspect answer, not counted as done: {why}")


def unvouched_note(pools: list[str]) -> str:
    """What the operator is told of pools a pool-wide command left out
    (``kvpool_agent._fleet.Fleet.targets``: reported by one engine-bound key alone); ``""``
    for none."""
    if not pools:
        return ""
    named = ", ".join(repr(p[:80]) for p in pools[:AUDIT_IDS_SHOWN])
    return (f"; {len(pools)} pool(s) reported by one engine-bound agent key alone were left "
            f"out ({named}): a second key or a store agent vouches for a pool; name its "
            "agents as targets to reach it")
