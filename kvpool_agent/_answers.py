"""What the hub checks of agents' answers to pool-wide commands before the operator sees them,
and what it tells the operator of pools it left out.

A flush answer is a claim of the agent that ran it (an agent key may be an insider's); the hub
holds it against the pool's key count as the pool's agents report it (``Fleet.pool_keys``) and
marks one that cannot be true ``suspect`` with ``ok=False``: the console prints ``flush
SUSPECT, not confirmed`` and exits 1, the audit line says why. Checked both ways since issue 42 (an
impostor's "removed 10 of 10 keys" of a pool of thousands was printed as done), and a real
flush's removal is confirmed by another key's count of the pool after it (``verified_answer``:
"removed N of N" with N the pool's own count passes every check of the answer alone). A
``pin`` or ``unpin`` answer is confirmed the same way, by another key's worker of the same
layout reporting the pin made or dropped (``PoolStats.pins``, ``pinned_bytes``; round 5: a
forged "pinned" was printed as done).
"""

from __future__ import annotations

import logging

import msgspec

from kvpool_agent.audit import AUDIT_IDS_SHOWN
from kvpool_agent.protocol import CommandReply, CommandRequest, PoolStats

__all__ = [
    "PIN_VERIFY_S",
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
                   pool_keys: tuple[int | None, int | None],
                   moved: tuple[str, str] | None = None) -> CommandReply:
    """``rep``, or when it is a flush answer that cannot be true of its pool the same marked
    ``suspect`` with ``ok=False``: more keys matched than the pool holds, or for scope ``all``
    (every kvpool key) fewer, beyond the slack; more removed than matched; a removal on a dry
    run; a real flush that left more than the slack of what it matched.

    Args:
        req: the command as the console sent it.
        rep: the agent's answer.
        pool_keys: the pool's key count when the command was sent and now (``None``: no agent
            reports the pool).
        moved: the pool (``Source.master``) the answering agent reported when the command
            was sent and now: another one now is suspect (helper 73: a target that re-reported
            itself under a pool only it reports, before answering, had its own count cover
            any claim).
    """
    res, args = rep.flush, req.flush
    if req.command != "flush" or res is None or args is None or not rep.ok:
        return rep
    why = None
    known = [n for n in pool_keys if n is not None]
    if moved is not None and moved[0] != moved[1]:
        why = (f"answered from pool {moved[1][:80]!r}, but reported pool {moved[0][:80]!r} "
               "when the flush was sent")
    elif res.dry_run != args.dry_run or (args.dry_run and res.removed_keys):
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
    elif not args.dry_run and res.keys - res.removed_keys > _slack(res.keys):
        # True (leases) or forged, those keys are still in the pool: not done (issue 42).
        why = (f"removed {res.removed_keys} of {res.keys} matched keys ({res.skipped_leased} "
               "said leased): the pool still holds the rest")
    if why is None:
        return rep
    log.warning("kvpool hub: suspect flush answer from %s: %s", rep.agent_id, why)
    return msgspec.structs.replace(rep, ok=False, suspect=why,
                                   error=f"suspect answer, not counted as done: {why}")


VERIFY_S = 5.0
"""Seconds the hub waits after a flush, pin or unpin for another key's report of the pool to
show it done: agents measure their pool every 2 s and report every 0.25 s, so a genuine one
shows within ~2.5 s."""

PIN_VERIFY_S = 14.0
"""Longest wait (s) of the hub for a pin or unpin to show in another worker's report; a pin
seen sooner is done sooner. A worker with registered KV caches polls the pin records every
``kvpool_connector.pins.PIN_POLL_S`` (0.5 s) and measures the pool every 2 s, so a genuine pin
shows within ~2.75 s; a worker whose poll thread is not running yet (or an agent's listing)
reads them at most every ``Pins.refresh_s`` (10 s), so a genuine pin shows within ~12.25 s.
``VERIFY_S`` alone read such a pin as suspect. ``FleetClient`` gives a pin or unpin that long
at least."""


def _slack(count: int) -> int:
    return max(count // 8, SUSPECT_SLACK_KEYS)


def _claims_change(req: CommandRequest, rep: CommandReply) -> bool:
    """Whether ``rep`` says ``req`` (a ``pin`` or ``unpin``) made or dropped a pin."""
    out = rep.pins
    return out is not None and (out.pin is not None or out.pinned_now > 0
                                or (req.command == "unpin" and out.removed_keys > 0))


def needs_verifying(req: CommandRequest, rep: CommandReply,
                    verifiers: dict[str, PoolStats]) -> bool:
    """Whether ``rep``, an answer not suspect so far, claims a change the other keys' pool
    stats (``verifiers``: agent id -> stats when the command was sent, ``Fleet.pool_verifiers``)
    can confirm: a flush's removal of more keys than the slack of some count; a ``pin`` or
    ``unpin`` made or dropped (agents of one layout report the same pins,
    ``PoolStats.pins``)."""
    if not rep.ok or rep.suspect is not None or not verifiers:
        return False
    if req.command in ("pin", "unpin"):
        return _claims_change(req, rep)
    res = rep.flush
    return (req.command == "flush" and req.flush is not None and not req.flush.dry_run
            and res is not None
            and any(res.removed_keys > _slack(n.keys) for n in verifiers.values()))


def _pin_seen(req: CommandRequest, before: PoolStats, after: PoolStats) -> bool:
    """Whether a verifier's stats show a pin made (``pin``: more pins, or pinned bytes
    changed while it holds any) or dropped (``unpin``: fewer pins or pinned bytes)."""
    if req.command == "pin":
        return after.pins > before.pins or (
            after.pins > 0 and after.pinned_bytes != before.pinned_bytes)
    return after.pins < before.pins or after.pinned_bytes < before.pinned_bytes


def verified_answer(req: CommandRequest, rep: CommandReply, verifiers: dict[str, PoolStats],
                    now: dict[str, PoolStats], done: bool) -> CommandReply | None:
    """``rep`` (``needs_verifying``) once one verifier's stats ``now`` show it done: a flush's
    keys gone (at most its count when the flush was sent, ``verifiers``, less the keys
    removed, plus the slack), a pin made or dropped (``_pin_seen``); marked ``suspect`` when
    ``done`` (``VERIFY_S`` passed) without; ``None``: wait. Issue 42: an impostor's "removed
    10 of 10 keys" matching the pool's own count was printed as done while the pool kept
    every key; round 5: an engine-bound key first in its pool answered the operator's ``pin``
    "pinned" and was printed as done, though the pool's other worker never held the pin. A
    pin already held (a second ``pin`` of one pin id, its chunks unchanged) shows no change
    and is suspect too: ``pins`` lists what the pool holds."""
    pin = req.command in ("pin", "unpin")
    removed = rep.flush.removed_keys if rep.flush is not None else 0
    for aid, after in now.items():
        before = verifiers[aid]
        if _pin_seen(req, before, after) if pin else (
                after.keys <= before.keys - removed + _slack(before.keys)):
            return rep
    if not done:
        return None
    waited = PIN_VERIFY_S if pin else VERIFY_S
    if not now:
        why = (f"{req.command} answered as done, but no other key reports the pool any more")
    elif pin:
        aid, after = next(iter(now.items()))
        why = (f"{req.command} answered as done, but {waited:g} s later {aid[:80]} (another "
               f"key, the same layout) reports {after.pins} pin(s) of "
               f"{after.pinned_bytes} bytes ({verifiers[aid].pins} when sent)")
    else:
        aid, after = next(iter(now.items()))
        why = (f"removed {removed} keys, but {waited:g} s later the pool holds "
               f"{after.keys} of its {verifiers[aid].keys} as {aid[:80]} reports it")
    log.warning("kvpool hub: suspect %s answer from %s: %s", req.command, rep.agent_id, why)
    return msgspec.structs.replace(rep, ok=False, suspect=why,
                                   error=f"suspect answer, not counted as done: {why}")


def unvouched_note(pools: list[str]) -> str:
    """What the operator is told of pools a pool-wide command left out
    (``kvpool_agent._fleet.Fleet.targets``: reported by one engine-bound key alone, or bound
    to keys with no live agent while other keys claim it); ``""`` for none."""
    if not pools:
        return ""
    named = ", ".join(repr(p[:80]) for p in pools[:AUDIT_IDS_SHOWN])
    return (f"; {len(pools)} pool(s) reported by one engine-bound agent key alone, or by no "
            f"live agent of a key bound to it (authorize --pool), were left out ({named}): a "
            "second key or a store agent vouches for an unbound pool; name its agents as "
            "targets to reach it")
