"""Fold the Reporter's engine-side events into one ``EngineState`` (agent thread only).

Windows are bucketed per second so memory stays bounded whatever the event rate: the hit rate
over the last minute keeps at most 61 buckets, throughput over the last 10 s at most 11. The
in-flight table and the per-request lookup times are capped too (oldest dropped first), so a
connector that never reports the end of a transfer cannot grow the agent.

Over 600 lines: one fold per event kind of ``kvpool_agent.reporter``, all writing the one
``EngineState`` they build; split, each would reach into the others' windows.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import msgspec

from kvpool_agent._misses import MissCounter
from kvpool_agent._names import count_name, keep_name
from kvpool_agent._store_watch import StoreWatch
from kvpool_agent.protocol import (
    MAX_ACCESS_CHUNKS,
    MAX_BIG_COUNT,
    MAX_COUNT,
    MAX_CPU_PERCENT,
    MAX_ID_CHARS,
    MAX_IN_FLIGHT,
    MAX_MASTERS,
    MAX_MS,
    MAX_REPORT_ACCESSES,
    MAX_REPORT_SAVES,
    RECENT_PAUSES,
    REPORT_ACCESS_CHUNKS,
    Access,
    EngineState,
    ErrorRecord,
    FlushRecord,
    LookupStats,
    PauseWindow,
    PolicySteering,
    PoolStats,
    ProcessStats,
    SegmentUsage,
    Source,
    StartFailure,
    Transfer,
    TransferStats,
    chunk_id,
    clip,
    paused_ms,
)
from kvpool_agent.reporter import (
    AdapterServed,
    Event,
    FlushAudited,
    LayoutKnown,
    Loaded,
    Lookup,
    PolicyReported,
    ReportedError,
    SaveCopied,
    Saved,
    SaveSkipped,
    StartFailed,
    TransferFinished,
    TransferProgress,
    TransferStarted,
)

__all__ = [
    "ACCESS_QUEUE_CHUNKS",
    "RECENT_ERRORS",
    "RECENT_FLUSHES",
    "SAVE_QUEUE_CHUNKS",
    "STALL_MS",
    "Aggregator",
]

RECENT_ERRORS = 50
"""Errors kept in a snapshot (``EngineState.recent_errors``)."""

# MAX_IN_FLIGHT (protocol): in-flight transfers tracked; beyond it the oldest is forgotten.


RECENT_FLUSHES = 16
"""Flushes a process ran on its own kept in a snapshot (``EngineState.flushes``)."""

STALL_MS = 2_000.0
"""Two passes of the agent loop (every 50 ms) further apart than this (ms, monotonic) bound a
``process_stalled`` pause window: the whole process was stopped or starved, its loads too."""

ACCESS_QUEUE_CHUNKS = 4 * REPORT_ACCESS_CHUNKS
"""Chunk ids of lookups waiting for a report (four reports' worth, ~0.5 MiB of ints); a lookup
that would pass it is dropped and counted in ``LookupStats.accesses_dropped``."""

SAVE_QUEUE_CHUNKS = 4 * MAX_REPORT_SAVES
"""Saved chunk ids waiting for a report (four reports' worth, ~0.5 MiB of ints); a save that
would pass it is dropped and counted in ``TransferStats.saves_unreported``."""

_LATENCY_SAMPLES = 1024
_LOOKUP_TIMES = 16_384
_HIT_WINDOW_S = 60
_RATE_WINDOW_S = 10
_AFTER_HIT_NAMES = frozenset({"LEASE_EXPIRED", "OBJECT_NOT_FOUND"})


class _Buckets:
    """Per-second sums over a sliding window of ``span_s`` seconds; ``width`` sums per bucket."""

    def __init__(self, span_s: int, width: int) -> None:
        self._span_s = span_s
        self._width = width
        self._b: deque[list[float]] = deque()

    def add(self, ts_ms: float, *values: float) -> None:
        sec = int(ts_ms // 1000)
        if self._b and self._b[-1][0] == sec:
            row = self._b[-1]
        else:
            row = [float(sec)] + [0.0] * self._width
            self._b.append(row)
            while len(self._b) > self._span_s + 1:
                self._b.popleft()
        for i, v in enumerate(values):
            row[i + 1] += v

    def sums(self, now_ms: float) -> list[float]:
        oldest = int(now_ms // 1000) - self._span_s
        while self._b and self._b[0][0] < oldest:
            self._b.popleft()
        out = [0.0] * self._width
        for row in self._b:
            for i in range(self._width):
                out[i] += row[i + 1]
        return out


def _bounded(value: float, high: float) -> float:
    """``value`` within [0, ``high``], NaN as 0: what the wire schema accepts, so a clock step,
    a psutil glitch or a ratio over events the full buffer dropped never gets a report
    refused."""
    return min(value, high) if value > 0.0 else 0.0


def _count(value: int, limit: int) -> int:
    """``value`` within [0, ``limit``)."""
    return min(max(value, 0), limit - 1)


def _steering(ev: PolicyReported) -> PolicySteering:
    """``ev`` within the wire's bounds (``PolicySteering``): a reading out of range must
    never get the whole report refused."""
    return PolicySteering(
        ts_ms=_bounded(ev.ts_ms, MAX_MS),
        in_charge="service" if ev.in_charge == "service" else "master",
        service=clip(ev.service, MAX_ID_CHARS, one_line=True),
        silent_ms=_bounded(ev.silent_ms, MAX_MS), stale_ms=_bounded(ev.stale_ms, MAX_MS),
        records_connected=bool(ev.records_connected),
        records_sent=_count(ev.records_sent, MAX_COUNT),
        records_dropped=_count(ev.records_dropped, MAX_COUNT),
        service_removed_keys=_count(ev.service_removed, MAX_COUNT))


def _sane_pool(p: PoolStats) -> PoolStats:
    """``p`` (parsed from the master's HTTP text, or from the backend) within the schema's
    bounds: names and detail clipped, numbers clamped."""
    return msgspec.structs.replace(
        p, backend=clip(p.backend, MAX_ID_CHARS), keys=_count(p.keys, MAX_COUNT),
        used_bytes=_count(p.used_bytes, MAX_BIG_COUNT),
        total_bytes=_count(p.total_bytes, MAX_BIG_COUNT),
        evicted_keys=_count(p.evicted_keys, MAX_COUNT),
        evicted_bytes=_count(p.evicted_bytes, MAX_BIG_COUNT),
        high_watermark=_bounded(p.high_watermark, 1.0),
        lease_ttl_ms=_count(p.lease_ttl_ms, MAX_COUNT), health_detail=clip(p.health_detail),
        disk_keys=_count(p.disk_keys, MAX_COUNT),
        disk_used_bytes=_count(p.disk_used_bytes, MAX_BIG_COUNT),
        disk_total_bytes=_count(p.disk_total_bytes, MAX_BIG_COUNT),
        memory_hits=_count(p.memory_hits, MAX_COUNT), disk_hits=_count(p.disk_hits, MAX_COUNT),
        memory_hit_bytes=_count(p.memory_hit_bytes, MAX_BIG_COUNT),
        disk_hit_bytes=_count(p.disk_hit_bytes, MAX_BIG_COUNT),
        segments=[SegmentUsage(name=clip(s.name, MAX_ID_CHARS),
                               used_bytes=_count(s.used_bytes, MAX_BIG_COUNT),
                               total_bytes=_count(s.total_bytes, MAX_BIG_COUNT))
                  for s in p.segments],
        masters=[msgspec.structs.replace(
            m, admin_url=clip(m.admin_url, MAX_ID_CHARS), role=clip(m.role, MAX_ID_CHARS),
            ha_state=clip(m.ha_state, MAX_ID_CHARS),
            leader_address=clip(m.leader_address, MAX_ID_CHARS),
            view_version=_count(m.view_version, MAX_COUNT)) for m in p.masters[:MAX_MASTERS]])


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


class Aggregator:
    """The running state of one agent.

    Args:
        source: who this agent is.
        lease_ttl_ms: ``default_kv_lease_ttl`` in force (ms); when > 0 a load whose start event
            has no ``lease_expires_ms`` gets ``lookup time + lease_ttl_ms``.

    Counting rules (units: tokens, bytes, ms): a timed-out load counts in ``loads_failed`` and
    in ``loads_timed_out``; ``saves_skipped`` counts skipped blocks; ``errors_by_name`` counts
    failed transfers and skipped saves by backend error name (``TIMEOUT`` for a timed-out load
    without a name, ``UNKNOWN`` for a failure without one).

    Pause windows (``pauses``, :meth:`tick` and :meth:`set_pool` record them, and the store's,
    ``store.windows``: ``_store_watch``) are matched against each load when it ends: the time
    it spent in them is taken off its duration for ``max_unpaused_load_ms``, and a
    failed-after-hit load whose lease (from its lookup) would not have run out without that
    time counts in ``paused_after_hit``. A window recorded after a
    load ended explains nothing of it.
    """

    def __init__(self, source: Source, lease_ttl_ms: int = 0, now_ms: float = 0.0) -> None:
        self.source = source
        self.lease_ttl_ms = lease_ttl_ms
        self.started_ms = now_ms
        self.lookup = LookupStats()
        self.transfers = TransferStats(max_unpaused_load_ms=0.0)
        self.pool: PoolStats | None = None
        self.pauses: deque[PauseWindow] = deque(maxlen=RECENT_PAUSES)
        self.recent_errors: deque[ErrorRecord] = deque(maxlen=RECENT_ERRORS)
        self.store = StoreWatch(self.recent_errors)
        """The pool store's pause windows and segment losses (``_store_watch``)."""
        self._tick_ms: float | None = None
        self._pool_pause: PauseWindow | None = None
        self._pool_ok_ms: float | None = None
        self.process = ProcessStats()
        self.in_flight: OrderedDict[tuple[str, str], Transfer] = OrderedDict()
        self.new_errors: list[ErrorRecord] = []
        self.changed = True
        self._latencies: deque[float] = deque(maxlen=_LATENCY_SAMPLES)
        self._hits = _Buckets(_HIT_WINDOW_S, 2)
        self._rates = _Buckets(_RATE_WINDOW_S, 2)
        self._lookup_ms: OrderedDict[str, float] = OrderedDict()
        self.start_failure: StartFailure | None = None
        self.policy: PolicySteering | None = None
        """The latest ``PolicyReported`` (an ``admission: service`` scheduler), wire-bounded."""
        self.recent_flushes: deque[FlushRecord] = deque(maxlen=RECENT_FLUSHES)
        self.new_flushes: deque[FlushRecord] = deque(maxlen=RECENT_FLUSHES)
        self._accesses: deque[Access] = deque()
        self.misses = MissCounter()
        self._access_chunks = 0
        self._saves: deque[int] = deque()

    def tick(self, mono_ms: float, now_ms: float) -> None:
        """The agent loop runs at ``mono_ms`` (monotonic ms) = ``now_ms`` (epoch ms): after a
        gap longer than ``STALL_MS`` since the previous call, a ``process_stalled`` window of
        the gap's length ending at ``now_ms`` (monotonic, so a wall-clock step is no stall)."""
        last, self._tick_ms = self._tick_ms, mono_ms
        if last is not None and mono_ms - last > STALL_MS:
            self._add_pause(PauseWindow(kind="process_stalled",
                                        start_ms=now_ms - (mono_ms - last), end_ms=now_ms))
        if self.store.due(mono_ms):
            self._check_store(now_ms)

    def _check_store(self, now_ms: float) -> None:
        """Open or close the store's ``store_stalled`` window (``_store_watch``) as of
        ``now_ms``: every ``CHECK_MS`` of the loop, and for every report (a report listing a
        stuck transfer carries its window: its loads are then no lease TTL advice)."""
        load_b, save_b = self._rates.sums(now_ms)
        if self.store.check(now_ms, self.in_flight.values(), load_b / _RATE_WINDOW_S,
                            save_b / _RATE_WINDOW_S, self.pauses):
            self.changed = True

    def _add_pause(self, pause: PauseWindow) -> None:
        self.pauses.append(pause)
        self.changed = True

    def set_pool(self, stats: PoolStats, checked_ms: float | None = None) -> None:
        """The pool's latest stats, clamped to what a report may carry (``_sane_pool``).

        ``checked_ms``: when the health check in ``stats`` ended (epoch ms). A failing one
        opens a ``pool_unhealthy`` window from the end of the last passing one (the last time
        the pool was known to answer; the failing check's end if none passed yet), the next
        passing one closes it at its end."""
        self.pool = _sane_pool(stats)
        self.changed = True
        if checked_ms is not None:
            self.store.reading(self.pool, checked_ms, idle=not self.in_flight)
        self.store.pool(self.pool)
        if checked_ms is None or stats.healthy is None:
            return
        if stats.healthy:
            self._pool_ok_ms = checked_ms
            if self._pool_pause is not None:
                self._pool_pause.end_ms = checked_ms
                self._pool_pause = None
        elif self._pool_pause is None:
            self._pool_pause = PauseWindow(
                kind="pool_unhealthy",
                start_ms=checked_ms if self._pool_ok_ms is None else self._pool_ok_ms,
                detail=clip(stats.health_detail, MAX_ID_CHARS))
            self._add_pause(self._pool_pause)

    def _paused(self, start_ms: float, end_ms: float) -> tuple[float, list[PauseWindow]]:
        """How long (ms) of ``[start_ms, end_ms]`` lies in pause windows (overlapping windows
        counted once), and the windows that overlap it."""
        hit = [w for w in (*self.pauses, *self.store.windows)
               if w.start_ms < end_ms and (w.end_ms is None or w.end_ms > start_ms)]
        return paused_ms(hit, start_ms, end_ms), hit

    def _record_error(self, err: ErrorRecord) -> None:
        # Messages quote exceptions and request ids come from API clients: clipped to what a
        # receiver accepts, so one odd error never gets the whole report refused.
        err.where, err.name = clip(err.where, MAX_ID_CHARS), clip(err.name, MAX_ID_CHARS)
        err.message = clip(err.message)
        if err.req_id is not None:
            err.req_id = clip(err.req_id, MAX_ID_CHARS)
        self.recent_errors.append(err)
        self.new_errors.append(err)
        if len(self.new_errors) > RECENT_ERRORS:
            del self.new_errors[0]

    def apply(self, events: list[Event]) -> None:
        """Fold ``events`` (``Reporter.drain()`` output) in, oldest first."""
        for ev in events:
            match ev:
                case Lookup():
                    self._on_lookup(ev)
                case Loaded():
                    lk = self.lookup
                    lk.loaded_tokens += ev.tokens
                    lk.load_failed_tokens += ev.failed_tokens
                    self._hits.add(ev.ts_ms, 0, ev.tokens)
                case TransferStarted():
                    self._on_started(ev)
                case TransferProgress():
                    t = self.in_flight.get((ev.req_id, ev.kind))
                    if t is not None:
                        t.layers_done = max(t.layers_done, ev.layers_done)
                case TransferFinished():
                    self._on_finished(ev)
                case SaveSkipped():
                    tr = self.transfers
                    tr.saves_skipped += ev.blocks
                    count_name(tr.errors_by_name, ev.reason)
                    self.store.failed(ev.reason, ev.ts_ms)
                case SaveCopied():
                    t = self.in_flight.get((ev.req_id, "save"))
                    if t is not None and t.copied_ms is None:
                        t.copied_ms = ev.ts_ms
                case Saved():
                    self._queue_saves(ev)
                case LayoutKnown():
                    # A cache signature of a model with many kinds of layers may run long.
                    self.source = msgspec.structs.replace(
                        self.source, layout_digest=ev.digest,
                        layout={clip(k, MAX_ID_CHARS): clip(v, one_line=True)
                                if isinstance(v, str) else v for k, v in ev.facts.items()})
                case StartFailed():
                    self.start_failure = StartFailure(
                        ts_ms=ev.ts_ms, name=clip(ev.name, MAX_ID_CHARS),
                        message=clip(ev.message), hint=clip(ev.hint))
                case AdapterServed():
                    keep_name(self.lookup.adapters, ev.name, ev.identity)
                case PolicyReported():
                    self.policy = _steering(ev)
                case FlushAudited():
                    self.recent_flushes.append(ev.record)
                    self.new_flushes.append(ev.record)
                case ReportedError():
                    self._record_error(
                        ErrorRecord(ts_ms=ev.ts_ms, where=ev.where, name=ev.name,
                                    message=ev.message, code=ev.code, req_id=ev.req_id)
                    )
        if events:
            self.changed = True

    def _on_lookup(self, ev: Lookup) -> None:
        lk = self.lookup
        # Every request asked about counts its prompt, looked up or not (one hit-rate
        # denominator); hits are counted when a load's outcome is known (Loaded).
        lk.prompt_tokens += ev.prompt_tokens
        lk.local_tokens += ev.local_tokens
        self._hits.add(ev.ts_ms, ev.prompt_tokens, 0)
        self.misses.lookup(ev.prompt_tokens, ev.local_tokens, ev.pool_tokens,
                           skipped=ev.skipped, error=ev.error is not None,
                           chunks=None if ev.chunks is None else len(ev.chunks),
                           chunk_size=ev.chunk_size)
        if ev.skipped is not None:
            lk.lookup_skipped += 1
            count_name(lk.skipped_by_reason, ev.skipped)
            return
        lk.lookups += 1
        self._latencies.append(ev.latency_ms)
        if ev.chunks:
            self._queue_access(ev)
        if ev.error is not None:
            lk.lookup_errors += 1
            self._record_error(
                ErrorRecord(ts_ms=ev.ts_ms, where="lookup", name="LOOKUP", message=ev.error,
                            req_id=ev.req_id)
            )
            return
        self._lookup_ms[ev.req_id] = ev.ts_ms
        self._lookup_ms.move_to_end(ev.req_id)
        if len(self._lookup_ms) > _LOOKUP_TIMES:
            self._lookup_ms.popitem(last=False)

    def _queue_access(self, ev: Lookup) -> None:
        """Keep the lookup's leading chunk ids for ``take_accesses`` (``ACCESS_QUEUE_CHUNKS``
        bound: past it the lookup is dropped and counted)."""
        hashes = ev.chunks or []
        n = min(len(hashes), MAX_ACCESS_CHUNKS)
        if self._access_chunks + n > ACCESS_QUEUE_CHUNKS or ev.chunk_size < 1:
            self.lookup.accesses_dropped += 1
            return
        try:
            ids = [chunk_id(h) for h in hashes[:n]]
        except ValueError:  # not a chunk hash: nothing the hub could match
            self.lookup.accesses_dropped += 1
            return
        # The leading tokens held (vLLM's cache) or found, as MissCounter counts them: the
        # hub splits the not_in_pool chunks past them; a failed lookup has none to split.
        served = (ev.prompt_tokens if ev.error is not None else ev.local_tokens
                  + min(max(0, ev.pool_tokens), max(0, ev.prompt_tokens - ev.local_tokens)))
        self._accesses.append(Access(tokens=ev.prompt_tokens, chunk_size=ev.chunk_size,
                                     chunks=ids, ts_ms=_bounded(ev.ts_ms, MAX_MS),
                                     served=_count(served, MAX_COUNT)))
        self._access_chunks += n

    def take_accesses(self) -> list[Access]:
        """The oldest queued lookups for one report: at most ``MAX_REPORT_ACCESSES`` records
        and ``REPORT_ACCESS_CHUNKS`` chunk ids (one record always, whatever its size)."""
        out: list[Access] = []
        chunks = 0
        q = self._accesses
        while q and len(out) < MAX_REPORT_ACCESSES:
            n = len(q[0].chunks)
            if out and chunks + n > REPORT_ACCESS_CHUNKS:
                break
            out.append(q.popleft())
            chunks += n
        self._access_chunks -= chunks
        return out

    def _queue_saves(self, ev: Saved) -> None:
        """Keep a save's chunk ids for ``take_saves`` (``SAVE_QUEUE_CHUNKS`` bound: past it
        the save's chunks are dropped and counted)."""
        if len(self._saves) + len(ev.chunks) > SAVE_QUEUE_CHUNKS:
            self.transfers.saves_unreported += len(ev.chunks)
            return
        try:
            ids = [chunk_id(h) for h in ev.chunks]
        except ValueError:  # not a chunk hash: nothing the hub could match
            self.transfers.saves_unreported += len(ev.chunks)
            return
        self._saves.extend(ids)

    def take_saves(self) -> list[int]:
        """The oldest queued saved chunk ids for one report (at most ``MAX_REPORT_SAVES``)."""
        q = self._saves
        return [q.popleft() for _ in range(min(len(q), MAX_REPORT_SAVES))]

    def _on_started(self, ev: TransferStarted) -> None:
        lease_expires_ms = ev.lease_expires_ms
        if lease_expires_ms is None and ev.kind == "load" and self.lease_ttl_ms > 0:
            looked_up = self._lookup_ms.get(ev.req_id)
            if looked_up is not None:
                lease_expires_ms = looked_up + self.lease_ttl_ms
        key = (ev.req_id, ev.kind)
        self.in_flight[key] = Transfer(
            req_id=clip(ev.req_id, MAX_ID_CHARS),
            kind=ev.kind,
            blocks=ev.blocks,
            bytes=ev.nbytes,
            started_ms=ev.ts_ms,
            layers_total=ev.layers_total,
            lease_expires_ms=lease_expires_ms,
        )
        self.in_flight.move_to_end(key)
        if len(self.in_flight) > MAX_IN_FLIGHT:
            self.in_flight.popitem(last=False)

    def _on_finished(self, ev: TransferFinished) -> None:
        tr = self.transfers
        t = self.in_flight.pop((ev.req_id, ev.kind), None)
        self.store.finished(ev.ok, ev.ts_ms)
        if ev.bytes_by_group:
            per = tr.loaded_bytes_by_group if ev.kind == "load" else tr.saved_bytes_by_group
            for g, n in ev.bytes_by_group.items():
                per[f"g{g}"] = per.get(f"g{g}", 0) + n
        if ev.kind == "load":
            tr.loaded_bytes += ev.nbytes
            self._rates.add(ev.ts_ms, ev.nbytes, 0)
            if t is not None:
                took = ev.ts_ms - t.started_ms
                paused, waited = self._paused(t.started_ms, ev.ts_ms)
                for w in waited:
                    w.loads += 1
                # A timed-out load ran as long as the timeout, not as long as the pool took:
                # it must not feed the "slowest load vs lease TTL" rule (its own alert names
                # it).
                if not ev.timed_out:
                    tr.max_load_ms = max(tr.max_load_ms, took)
                    tr.max_unpaused_load_ms = max(tr.max_unpaused_load_ms or 0.0, took - paused)
                    for w in waited:
                        w.max_load_ms = max(w.max_load_ms, took)
            if ev.ok:
                tr.loads_finished += 1
            else:
                tr.loads_failed += 1
                if ev.timed_out:
                    tr.loads_timed_out += 1
        else:
            tr.saved_bytes += ev.nbytes
            self._rates.add(ev.ts_ms, 0, ev.nbytes)
            if ev.ok:
                tr.saves_finished += 1
            else:
                tr.saves_failed += 1
        if ev.ok:
            return
        name = ev.error_name or ("TIMEOUT" if ev.timed_out else "UNKNOWN")
        count_name(tr.errors_by_name, name)
        self.store.failed(name, ev.ts_ms)
        if ev.kind == "load" and ev.after_hit and name in _AFTER_HIT_NAMES:
            tr.failed_after_hit += 1
            if t is not None:
                self._explain_after_hit(t, ev.ts_ms, name)
        self._record_error(
            ErrorRecord(
                ts_ms=ev.ts_ms,
                where=ev.kind,
                name=name,
                message=f"{ev.kind} of {ev.failed_blocks} block(s) failed"
                + (" after a positive lookup" if ev.after_hit else ""),
                req_id=ev.req_id,
            )
        )

    def _explain_after_hit(self, t: Transfer, end_ms: float, name: str) -> None:
        """Count a load that failed after its hit in ``paused_after_hit`` (and in the windows
        it overlapped) when a pause explains it: time in pause windows from its lookup (the
        lease's start; the load's start when unknown) to ``end_ms``, and without that time it
        would have ended before its lease expired (when the expiry is known)."""
        expires = t.lease_expires_ms
        start = (expires - self.lease_ttl_ms if expires is not None and self.lease_ttl_ms > 0
                 else t.started_ms)
        paused, waited = self._paused(start, end_ms)
        if not paused or (expires is not None and end_ms - paused >= expires):
            return
        count_name(self.transfers.paused_after_hit, name)
        for w in waited:
            w.failed_after_hit += 1

    def _saves_in_flight(self, tr: TransferStats, now_ms: float) -> None:
        """The saves in flight as of ``now_ms`` (issue 38 item 4): the oldest one's age (ms),
        the engine blocks they still read, the bytes they hold in staging buffers (a layer-wise
        save's copied layers not yet reported done)."""
        oldest, held, staged = now_ms, 0, 0
        for t in self.in_flight.values():
            if t.kind != "save":
                continue
            oldest = min(oldest, t.started_ms)
            if t.copied_ms is None:
                held += t.blocks
            elif t.layers_total:  # layer-wise: the layers not finished are in staging
                staged += t.bytes * (t.layers_total - min(t.layers_done, t.layers_total)) \
                    // t.layers_total
            else:
                staged += t.bytes
        tr.oldest_save_age_ms = _bounded(now_ms - oldest, MAX_MS)
        tr.save_blocks_held = _count(held, MAX_COUNT)
        tr.save_bytes_staged = _count(staged, MAX_BIG_COUNT)

    def state(self, now_ms: float, *, all_errors: bool = True) -> EngineState:
        """A detached copy of the current state.

        ``all_errors``: the last ``RECENT_ERRORS`` errors and ``RECENT_FLUSHES`` flushes
        (snapshot) or only those recorded since the previous ``state(all_errors=False)`` call
        (delta; clears those lists).
        """
        lk = msgspec.structs.replace(
            self.lookup, skipped_by_reason=dict(self.lookup.skipped_by_reason),
            adapters=dict(self.lookup.adapters),
            miss_tokens={k: _count(v, MAX_COUNT) for k, v in self.misses.snapshot(
                self.lookup.loaded_tokens, self.lookup.load_failed_tokens).items()})
        # Hits can outnumber the prompt tokens counted: a Lookup event the full buffer dropped,
        # a load counted in the window after its lookup's. A rate is at most 1.
        if lk.prompt_tokens:
            lk.hit_rate = min(1.0, lk.loaded_tokens / lk.prompt_tokens)
        prompt_1m, hit_1m = self._hits.sums(now_ms)
        lk.hit_rate_1m = min(1.0, hit_1m / prompt_1m) if prompt_1m else 0.0
        lat = sorted(self._latencies)
        lk.latency_ms_p50 = _bounded(_percentile(lat, 0.50), MAX_MS)
        lk.latency_ms_p99 = _bounded(_percentile(lat, 0.99), MAX_MS)
        tr = msgspec.structs.replace(
            self.transfers, errors_by_name=dict(self.transfers.errors_by_name),
            loaded_bytes_by_group=dict(self.transfers.loaded_bytes_by_group),
            saved_bytes_by_group=dict(self.transfers.saved_bytes_by_group),
            paused_after_hit=dict(self.transfers.paused_after_hit))
        load_b, save_b = self._rates.sums(now_ms)
        tr.load_bytes_per_s = _bounded(load_b / _RATE_WINDOW_S, MAX_BIG_COUNT)
        tr.save_bytes_per_s = _bounded(save_b / _RATE_WINDOW_S, MAX_BIG_COUNT)
        tr.max_load_ms = _bounded(tr.max_load_ms, MAX_MS)
        tr.max_unpaused_load_ms = _bounded(tr.max_unpaused_load_ms or 0.0, MAX_MS)
        self._saves_in_flight(tr, now_ms)
        self._check_store(now_ms)
        if all_errors:
            errors = list(self.recent_errors)
            flushes = list(self.recent_flushes)
        else:
            errors = self.new_errors
            self.new_errors = []
            flushes = list(self.new_flushes)
            self.new_flushes.clear()
        return EngineState(
            source=self.source,
            started_ms=self.started_ms,
            ts_ms=now_ms,
            lookup=lk,
            transfers=tr,
            in_flight=[msgspec.structs.replace(t) for t in self.in_flight.values()],
            pool=self.pool,
            process=msgspec.structs.replace(
                self.process, cpu_percent=_bounded(self.process.cpu_percent, MAX_CPU_PERCENT)),
            recent_errors=errors,
            start_failure=self.start_failure,
            flushes=flushes,
            pauses=[msgspec.structs.replace(
                w, start_ms=_bounded(w.start_ms, MAX_MS),
                max_load_ms=_bounded(w.max_load_ms, MAX_MS)) for w in self.pauses],
            store_pauses=[msgspec.structs.replace(
                w, start_ms=_bounded(w.start_ms, MAX_MS), errors=dict(w.errors),
                max_load_ms=_bounded(w.max_load_ms, MAX_MS)) for w in self.store.windows],
            policy=self.policy,
        )

