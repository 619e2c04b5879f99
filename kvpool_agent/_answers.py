"""What the hub checks of agents' answers to pool-wide commands before the operator sees them,
and what it tells the operator of pools it left out.

A flush answer is a claim of the agent that ran it (an agent key may be an insider's); the hub
holds it against the pool's key count as the pool's agents report it (``Fleet.pool_keys``) and
marks one that cannot be true ``suspect`` with ``ok=False``: the console prints ``flush
SUSPECT, not done`` and exits 1, the audit line says why. Checked both ways since issue 42 (an
impostor's "removed 10 of 10 keys" of a pool of thousands was printed as done), and a real
flush's removal is confirmed by another key's count of the pool after it (``verified_answer``:
"removed N of N" with N the pool's own count passes every check of the answer alone).
"""

from __future__ import annotations

import logging

import msgspec

from kvpool_agent.audit import AUDIT_IDS_SHOWN
from kvpool_agent.protocol import CommandReply, CommandRequest

__all__ = [
    "SUSPECT_SLACK_KEYS",
    "VERIFY_S",
    "checked_answer",
    "needs_verifying",
    "unvouched_note",
    "verified_answer",
]

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


VERIFY_S = 5.0
"""Seconds the hub waits after a flush for another key's count of the pool to show the keys
gone: agents measure their pool every 2 s and report every 0.25 s, so a genuine flush shows
within ~2.5 s."""


def _slack(count: int) -> int:
    return max(count // 8, SUSPECT_SLACK_KEYS)


def needs_verifying(req: CommandRequest, rep: CommandReply, verifiers: dict[str, int]) -> bool:
    """Whether ``rep``, a flush's answer not suspect so far, claims a removal the pool's other
    keys' counts (``verifiers``: agent id -> count when the flush was sent,
    ``Fleet.pool_verifiers``) can confirm: more keys than the slack of some count."""
    res = rep.flush
    return (req.command == "flush" and req.flush is not None and not req.flush.dry_run
            and rep.ok and res is not None and rep.suspect is None
            and any(res.removed_keys > _slack(n) for n in verifiers.values()))


def verified_answer(rep: CommandReply, verifiers: dict[str, int], now: dict[str, int],
                    done: bool) -> CommandReply | None:
    """``rep`` (``needs_verifying``) once one verifier's count ``now`` shows the keys gone: at
    most its count when the flush was sent (``verifiers``), less the keys removed, plus the
    slack; marked ``suspect`` when ``done`` (``VERIFY_S`` passed) without; ``None``: wait.
    Issue 42: an impostor's "removed 10 of 10 keys" matching the pool's own count was printed
    as done while the pool kept every key."""
    res = rep.flush
    assert res is not None
    removed = res.removed_keys
    for aid, after in now.items():
        before = verifiers[aid]
        if after <= before - removed + _slack(before):
            return rep
    if not done:
        return None
    if now:
        aid, after = next(iter(now.items()))
        why = (f"removed {removed} keys, but {VERIFY_S:g} s later the pool holds {after} of "
               f"its {verifiers[aid]} as {aid[:80]} reports it")
    else:
        why = f"removed {removed} keys, but no other key reports the pool any more"
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
