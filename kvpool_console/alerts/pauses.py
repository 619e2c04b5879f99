"""Pauses and what they explain: a load that waited on a stopped master, engine or store is
``pause_wait`` with the pause's hint, not ``default_kv_lease_ttl`` advice (:class:`PauseLedger`);
backend errors recorded in a store pause its agent reported (``EngineState.store_pauses``) are
the store's (:func:`store_explained`), and clear with it (:func:`cleared`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import msgspec

from kvpool_agent.protocol import STORE_PAUSE_KINDS, EngineState, PauseWindow, TransferStats
from kvpool_agent.vocabulary import HINTS
from kvpool_console.alerts.alert import AFTER_HIT, Alert, fmt_ms, make_alert, pool_name

__all__ = ["POOL_EMPTY_HINT", "STORE_STALLED_HINT", "PauseLedger", "cleared", "store_explained",
           "store_pause_text", "store_windows"]

_AFTERMATH_MS = 10_000.0
"""After a pause ends, failures for this long (ms) are its aftermath: loads looked up before
the pause fail with LEASE_EXPIRED once it ends."""

_GAP_MS = 2_500.0
"""An engine whose reports stop this long (ms; heartbeats come every second) was paused."""


_NOT_TTL = "; default_kv_lease_ttl is not the cause"


def _master_pause_hint() -> str:
    return HINTS["RPC_FAIL"] + "; the load waited on it (see pool_unhealthy)" + _NOT_TTL


def _engine_pause_hint(engine_id: str) -> str:
    return ("the engine process was stopped or stalled (SIGSTOP, a debugger, swapping) and its "
            f"load waited with it: `kvpool-console triage {engine_id}` if it recurs" + _NOT_TTL)


STORE_STALLED_HINT = (
    "the store process holding the segments (mooncake_client, or the engines contributing "
    "segments) stopped answering: resume a stopped one (state T: `kill -CONT` it) or restart a "
    "dead one on those hosts, and check the network to it; the loads and saves waited on it "
    "or failed and were recomputed" + _NOT_TTL)
"""The fix of what a ``store_stalled`` window explains (``EngineState.store_pauses``)."""

POOL_EMPTY_HINT = (
    "the pool had no store segment mounted (the master drops a store's segment client_ttl "
    "after its last ping, and every value in it: see the Pool tab's loss): saves failed with "
    "NO_AVAILABLE_HANDLE and loads found nothing; start the mooncake_client store, or resume "
    "a stopped one (`kill -CONT`)" + _NOT_TTL)
"""The fix of what a ``pool_no_segments`` window explains."""


def store_pause_text(w: PauseWindow, st: EngineState) -> tuple[str, str]:
    """What a store pause window of ``st``'s agent was (for "... while {what}") and its fix."""
    master = st.source.master or pool_name(st)
    if w.kind == "pool_no_segments":
        was = f" ({w.detail} dropped)" if w.detail else ""
        return f"master {master} held no store segment{was}", POOL_EMPTY_HINT
    return (f"the store did not answer {st.source.agent_id} (its transfers stuck)",
            STORE_STALLED_HINT)


def _overlaps(a: PauseWindow, b: PauseWindow) -> bool:
    return (b.end_ms is None or a.start_ms <= b.end_ms) and \
        (a.end_ms is None or b.start_ms <= a.end_ms)


def store_windows(st: EngineState) -> list[PauseWindow]:
    """``st``'s store pause windows (``EngineState.store_pauses``) that no pause of its own
    overlaps: a master failing its health check, or the process stopped, also leaves its
    transfers stuck, and that pause, not the store, is their cause."""
    return [w for w in st.store_pauses if not any(_overlaps(w, p) for p in st.pauses)]


def store_explained(group: list[EngineState], names: Collection[str]
                    ) -> dict[str, tuple[PauseWindow, EngineState]]:
    """Of the error ``names``, those whose newest record (``EngineState.recent_errors`` of the
    engine's agents) falls in a store pause window its agent reported
    (``store_windows``), from its start to ``_AFTERMATH_MS`` after its end, or, with no
    record left, all of whose count its agents' store windows counted: name ->
    (that window, the agent's state). Their cause is the store; once the window ended more
    than ``_AFTERMATH_MS`` ago (:func:`cleared`) it has cleared."""
    newest: dict[str, tuple[float, EngineState]] = {}
    for st in group:
        for e in st.recent_errors:
            if e.name in names and (e.name not in newest or e.ts_ms > newest[e.name][0]):
                newest[e.name] = (e.ts_ms, st)
    out: dict[str, tuple[PauseWindow, EngineState]] = {}
    for name in names:
        if name not in newest:
            counted = _counted(group, name)
            if counted is not None:
                out[name] = counted
            continue
        ts, st = newest[name]
        # The window it fell in, the latest first; else one whose aftermath it fell in.
        windows = store_windows(st)
        for after in (0.0, _AFTERMATH_MS):
            w = next((w for w in reversed(windows) if w.start_ms <= ts and (
                w.end_ms is None or ts <= w.end_ms + after)), None)
            if w is not None:
                out[name] = (w, st)
                break
    return out


def _counted(group: list[EngineState], name: str) -> tuple[PauseWindow, EngineState] | None:
    """An error ``name`` with no record left (a flood of others pushed it out of
    ``recent_errors``): the latest store window of the agents counting it, when their windows
    counted every one of them (``PauseWindow.errors``), else None."""
    latest: tuple[PauseWindow, EngineState] | None = None
    for st in group:
        n = st.transfers.errors_by_name.get(name, 0)
        if not n:
            continue
        windows = [w for w in store_windows(st) if w.errors.get(name)]
        if sum(w.errors[name] for w in windows) < n:
            return None
        if latest is None or windows[-1].start_ms > latest[0].start_ms:
            latest = (windows[-1], st)
    return latest


def cleared(w: PauseWindow, now_ms: float) -> bool:
    """A pause window that ended, with its aftermath, before ``now_ms``."""
    return w.end_ms is not None and now_ms > w.end_ms + _AFTERMATH_MS


@dataclass
class _Pause:
    """A span (epoch ms) in which a pool's master failed its health check or an engine sent no
    report; ``end_ms`` is None while it lasts."""

    what: str
    hint: str
    start_ms: float
    end_ms: float | None = None

    def remembered(self, now_ms: float) -> bool:
        """Failures and its alert still belong to it (it lasts, or ended < aftermath ago)."""
        return self.end_ms is None or now_ms <= self.end_ms + _AFTERMATH_MS


@dataclass
class _Excuse:
    """What of one agent's counters a pause explains: subtracted before the rules run."""

    pause: _Pause
    failed_after_hit: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    max_load_seen: float | None = None
    """The slowest load that overlapped the pause (``TransferStats.max_load_ms``)..."""
    max_load_before: float = 0.0
    """...and the slowest before it, which the lease TTL rule sees while that is the max."""


@dataclass
class _Seen:
    """One agent's counters at the previous update (``ts_ms``), its hub receive time then
    (``seen_ms``), and its state then with what :meth:`PauseLedger.adjust` made of it."""

    ts_ms: float
    seen_ms: float
    failed_after_hit: int
    errors: dict[str, int]
    max_load_ms: float
    state: EngineState
    adjusted: EngineState


def _agent_excused(tr: TransferStats) -> TransferStats:
    """``tr`` less what its agent's own pause windows explain (``max_unpaused_load_ms`` for
    ``max_load_ms``, ``paused_after_hit`` off ``failed_after_hit`` and ``errors_by_name``):
    ``tr`` itself when they take nothing off (and from an agent before those fields)."""
    if not tr.paused_after_hit and tr.max_unpaused_load_ms in (None, tr.max_load_ms):
        return tr
    paused = tr.paused_after_hit
    return msgspec.structs.replace(
        tr, failed_after_hit=max(0, tr.failed_after_hit - sum(paused.values())),
        errors_by_name={n: c - paused.get(n, 0) for n, c in tr.errors_by_name.items()
                        if c > paused.get(n, 0)},
        max_load_ms=tr.max_load_ms if tr.max_unpaused_load_ms is None
        else tr.max_unpaused_load_ms)


def _agent_pauses(st: EngineState, now_ms: float) -> list[tuple[_Pause, int, float]]:
    """``st``'s own remembered pause windows that explain TTL advice (a failed-after-hit load,
    or a load that waited in one for >= 80% of the lease TTL: what ``lease_ttl`` would have
    said): ``(pause, failed after hit, slowest load ms)``."""
    if not st.pauses and not st.store_pauses:
        return []
    ttl = st.pool.lease_ttl_ms if st.pool is not None else 0
    eid = st.source.engine_id
    out = []
    for w in (*st.pauses, *store_windows(st)):
        if not (w.failed_after_hit or (ttl and w.max_load_ms >= 0.8 * ttl)):
            continue
        if w.kind == "pool_unhealthy":
            pause = _Pause(f"master {st.source.master or pool_name(st)} failed its health check "
                           f"({w.detail or 'unhealthy'})", _master_pause_hint(), w.start_ms,
                           w.end_ms)
        elif w.kind in STORE_PAUSE_KINDS:
            pause = _Pause(*store_pause_text(w, st), w.start_ms, w.end_ms)
        else:
            pause = _Pause(f"process {st.source.agent_id} was stopped or stalled",
                           _engine_pause_hint(eid), w.start_ms, w.end_ms)
        if pause.remembered(now_ms):
            out.append((pause, w.failed_after_hit, w.max_load_ms))
    return out


class PauseLedger:
    """Pauses the console observed, and the slow loads and failed-after-hit loads they explain.

    A pause of a pool: from the first update that sees an agent report its health check failing
    to the first that sees none. Of an engine: from its last report before a silence longer than
    ``_GAP_MS`` to the first after. A load whose span (its ``max_load_ms`` ending by this update)
    overlaps a pause of its pool or engine, and a ``failed_after_hit`` that grew during one or in
    its aftermath, are taken off the counters the rules see (so no TTL advice) and reported as
    ``pause_wait`` with the pause's hint until the pause is no longer remembered.
    """

    def __init__(self) -> None:
        self._pools: dict[str, _Pause] = {}
        self._engines: dict[str, _Pause] = {}
        self._past: list[tuple[str, _Pause]] = []
        self._seen: dict[str, _Seen] = {}
        self._excused: dict[str, _Excuse] = {}
        self._updated_ms: float | None = None

    def _open_close(self, states: Mapping[str, EngineState], last_seen_ms: Mapping[str, float],
                    now_ms: float) -> None:
        sick: dict[str, str] = {}
        masters: dict[str, str] = {}
        for st in states.values():
            if st.pool is not None:
                name = pool_name(st)
                masters[name] = st.source.master or name
                if st.pool.healthy is False:
                    sick[name] = st.pool.health_detail or "unhealthy"
        for name in set(self._pools) | set(sick):
            p = self._pools.get(name)
            if name in sick and p is None:
                self._pools[name] = _Pause(
                    f"master {masters[name]} failed its health check ({sick[name]})",
                    _master_pause_hint(), now_ms)
            elif name not in sick and p is not None:
                p.end_ms = now_ms
                self._past.append((name, self._pools.pop(name)))
        # One pass over the agents (this runs on every refresh of a 2,304-agent fleet):
        # each engine's newest receive time now and at the previous update.
        last: dict[str, float] = {}
        before: dict[str, float] = {}
        for a, st in states.items():
            eid = st.source.engine_id
            last[eid] = max(last.get(eid, 0.0), last_seen_ms.get(a, st.ts_ms))
            old = self._seen.get(a)
            if old is not None:
                before[eid] = max(before.get(eid, 0.0), old.seen_ms)
        # A jump of the receive time is a pause only if this model looked in between: else
        # it is the model's own gap (a slow refresh), not the engine's.
        looked = self._updated_ms is not None and now_ms - self._updated_ms <= _GAP_MS
        self._updated_ms = now_ms
        for eid, seen in last.items():
            p = self._engines.get(eid)
            prev = before.get(eid)
            jumped = looked and prev is not None and seen - prev > _GAP_MS
            if p is None and (now_ms - seen > _GAP_MS or jumped):
                p = self._engines[eid] = _Pause(
                    f"engine {eid} sent no report (stopped or stalled)",
                    _engine_pause_hint(eid), prev if jumped and prev is not None else seen)
            if p is not None and now_ms - seen <= _GAP_MS:
                p.end_ms = seen
                self._past.append((eid, self._engines.pop(eid)))
        self._past = [(k, p) for k, p in self._past if p.remembered(now_ms)]

    def _pause_of(self, st: EngineState, start_ms: float, end_ms: float) -> _Pause | None:
        """A pause of ``st``'s pool or engine overlapping ``[start_ms, end_ms]``, aftermath
        included."""
        keys = {st.source.engine_id, pool_name(st) if st.pool is not None else ""}
        spans = [p for k, p in [*self._pools.items(), *self._engines.items(), *self._past]
                 if k in keys]
        return next((p for p in spans if p.start_ms <= end_ms and (
            p.end_ms is None or start_ms <= p.end_ms + _AFTERMATH_MS)), None)

    def adjust(self, states: Mapping[str, EngineState], last_seen_ms: Mapping[str, float],
               now_ms: float) -> dict[str, EngineState]:
        """Record this update's pauses and what they explain; returns ``states`` with the
        explained counts taken off, first what the agents' own pause windows explain
        (``_agent_excused``), then what this ledger's pauses explain of the rest (the same
        objects for agents with nothing explained)."""
        self._open_close(states, last_seen_ms, now_ms)
        out = dict(states)
        for a, st in states.items():
            prev = self._seen.get(a)
            if prev is not None and prev.state is st:
                # No report since (FleetClient replaces a state per report): same counters.
                prev.ts_ms, prev.seen_ms = now_ms, last_seen_ms.get(a, st.ts_ms)
                out[a] = prev.adjusted
                continue
            tr = _agent_excused(st.transfers)
            base = st if tr is st.transfers else msgspec.structs.replace(st, transfers=tr)
            out[a] = base
            ex = self._excused.get(a)
            if prev is not None and (tr.failed_after_hit < prev.failed_after_hit
                                     or tr.max_load_ms < prev.max_load_ms):
                prev = ex = None  # the agent restarted: its counters began again
                self._excused.pop(a, None)
            if prev is not None:
                grew = tr.failed_after_hit - prev.failed_after_hit
                pause = self._pause_of(st, now_ms, now_ms) if grew > 0 else None
                if pause is not None:
                    ex = self._excused.setdefault(a, _Excuse(pause))
                    ex.pause = pause
                    ex.failed_after_hit += grew
                    for n in AFTER_HIT:
                        ex.errors[n] += max(0, tr.errors_by_name.get(n, 0) - prev.errors.get(n, 0))
                if tr.max_load_ms > prev.max_load_ms:
                    pause = self._pause_of(st, prev.ts_ms - tr.max_load_ms, now_ms)
                    if pause is not None:
                        ex = self._excused.setdefault(a, _Excuse(pause))
                        ex.pause = pause
                        if ex.max_load_seen is None:
                            ex.max_load_before = prev.max_load_ms
                        ex.max_load_seen = tr.max_load_ms
            if ex is not None:
                errors = {n: c - ex.errors[n] for n, c in tr.errors_by_name.items()
                          if c - ex.errors[n] > 0}
                max_load = (ex.max_load_before if ex.max_load_seen == tr.max_load_ms
                            else tr.max_load_ms)
                out[a] = msgspec.structs.replace(base, transfers=msgspec.structs.replace(
                    tr, failed_after_hit=tr.failed_after_hit - ex.failed_after_hit,
                    errors_by_name=errors, max_load_ms=max_load))
            self._seen[a] = _Seen(now_ms, last_seen_ms.get(a, st.ts_ms), tr.failed_after_hit,
                                  dict(tr.errors_by_name), tr.max_load_ms, st, out[a])
        for a in set(self._seen) - set(states):
            del self._seen[a]
            self._excused.pop(a, None)
        return out

    def alerts(self, states: Mapping[str, EngineState], now_ms: float) -> list[Alert]:
        """One ``pause_wait`` per engine with explained loads whose pause is remembered: the
        pauses this ledger saw and those the engine's agents reported (``_agent_pauses``),
        named by the latest."""
        by_engine: dict[str, list[tuple[_Pause, int, float]]] = {}
        for a, ex in self._excused.items():
            st = states.get(a)
            if st is not None and ex.pause.remembered(now_ms):
                by_engine.setdefault(st.source.engine_id, []).append(
                    (ex.pause, ex.failed_after_hit, ex.max_load_seen or 0.0))
        for st in states.values():
            if st.pauses:
                by_engine.setdefault(st.source.engine_id, []).extend(_agent_pauses(st, now_ms))
        out = []
        for eid, exs in sorted(by_engine.items()):
            if not exs:
                continue
            pause = max((x[0] for x in exs), key=lambda p: p.start_ms)
            failed = sum(x[1] for x in exs)
            slowest = max(x[2] for x in exs)
            parts = ([f"{failed} loads failed after a positive lookup"] if failed else []) + (
                [f"slowest load {fmt_ms(slowest)}"] if slowest else [])
            span = (f"{fmt_ms(pause.end_ms - pause.start_ms)}" if pause.end_ms is not None
                    else "ongoing")
            out.append(make_alert("pause_wait", "warning", eid,
                                  f"{', '.join(parts)} while {pause.what} ({span})",
                                  pause.hint, now_ms))
        return out
