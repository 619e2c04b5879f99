"""Fold the Reporter's engine-side events into one ``EngineState`` (agent thread only).

Windows are bucketed per second so memory stays bounded whatever the event rate: the hit rate
over the last minute keeps at most 61 buckets, throughput over the last 10 s at most 11. The
in-flight table and the per-request lookup times are capped too (oldest dropped first), so a
connector that never reports the end of a transfer cannot grow the agent.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import msgspec

from kvpool_agent.protocol import (
    EngineState,
    ErrorRecord,
    LookupStats,
    PoolStats,
    ProcessStats,
    Source,
    Transfer,
    TransferStats,
)
from kvpool_agent.reporter import Event

__all__ = ["MAX_IN_FLIGHT", "RECENT_ERRORS", "Aggregator"]

RECENT_ERRORS = 50
"""Errors kept in a snapshot (``EngineState.recent_errors``)."""

MAX_IN_FLIGHT = 4096
"""In-flight transfers tracked; beyond this the oldest entry is forgotten."""

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
    """

    def __init__(self, source: Source, lease_ttl_ms: int = 0, now_ms: float = 0.0) -> None:
        self.source = source
        self.lease_ttl_ms = lease_ttl_ms
        self.started_ms = now_ms
        self.lookup = LookupStats()
        self.transfers = TransferStats()
        self.pool: PoolStats | None = None
        self.process = ProcessStats()
        self.in_flight: OrderedDict[tuple[str, str], Transfer] = OrderedDict()
        self.recent_errors: deque[ErrorRecord] = deque(maxlen=RECENT_ERRORS)
        self.new_errors: list[ErrorRecord] = []
        self.changed = True
        self._latencies: deque[float] = deque(maxlen=_LATENCY_SAMPLES)
        self._hits = _Buckets(_HIT_WINDOW_S, 2)
        self._rates = _Buckets(_RATE_WINDOW_S, 2)
        self._lookup_ms: OrderedDict[str, float] = OrderedDict()

    def _record_error(self, err: ErrorRecord) -> None:
        self.recent_errors.append(err)
        self.new_errors.append(err)
        if len(self.new_errors) > RECENT_ERRORS:
            del self.new_errors[0]

    def apply(self, events: list[Event]) -> int:
        """Fold ``events`` (``Reporter.drain()`` output) in; returns how many were unknown."""
        bad = 0
        for ev in events:
            handler = _HANDLERS.get(ev[0])
            if handler is None:
                bad += 1
                continue
            handler(self, *ev[1:])
        if events:
            self.changed = True
        return bad

    def _on_lookup(
        self,
        ts: float,
        req_id: str,
        prompt: int,
        local: int,
        pool: int,
        latency_ms: float,
        error: str | None,
    ) -> None:
        lk = self.lookup
        lk.lookups += 1
        self._latencies.append(latency_ms)
        if error is not None:
            lk.lookup_errors += 1
            self._record_error(
                ErrorRecord(ts_ms=ts, where="lookup", name="LOOKUP", message=error, req_id=req_id)
            )
            return
        lk.prompt_tokens += prompt
        lk.local_tokens += local
        lk.pool_hit_tokens += pool
        self._hits.add(ts, prompt, pool)
        self._lookup_ms[req_id] = ts
        self._lookup_ms.move_to_end(req_id)
        if len(self._lookup_ms) > _LOOKUP_TIMES:
            self._lookup_ms.popitem(last=False)

    def _on_loaded(self, ts: float, req_id: str, tokens: int) -> None:
        self.lookup.loaded_tokens += tokens

    def _on_started(
        self,
        ts: float,
        req_id: str,
        kind: str,
        blocks: int,
        nbytes: int,
        layers_total: int,
        lease_expires_ms: float | None,
    ) -> None:
        if lease_expires_ms is None and kind == "load" and self.lease_ttl_ms > 0:
            looked_up = self._lookup_ms.get(req_id)
            if looked_up is not None:
                lease_expires_ms = looked_up + self.lease_ttl_ms
        key = (req_id, kind)
        self.in_flight[key] = Transfer(
            req_id=req_id,
            kind="load" if kind == "load" else "save",
            blocks=blocks,
            bytes=nbytes,
            started_ms=ts,
            layers_total=layers_total,
            lease_expires_ms=lease_expires_ms,
        )
        self.in_flight.move_to_end(key)
        if len(self.in_flight) > MAX_IN_FLIGHT:
            self.in_flight.popitem(last=False)

    def _on_progress(self, ts: float, req_id: str, kind: str, layers_done: int) -> None:
        t = self.in_flight.get((req_id, kind))
        if t is not None:
            t.layers_done = max(t.layers_done, layers_done)

    def _on_finished(
        self,
        ts: float,
        req_id: str,
        kind: str,
        ok: bool,
        nbytes: int,
        error_name: str | None,
        failed_blocks: int,
        after_hit: bool,
        timed_out: bool,
    ) -> None:
        tr = self.transfers
        t = self.in_flight.pop((req_id, kind), None)
        if kind == "load":
            tr.loaded_bytes += nbytes
            self._rates.add(ts, nbytes, 0)
            if t is not None:
                tr.max_load_ms = max(tr.max_load_ms, ts - t.started_ms)
            if ok:
                tr.loads_finished += 1
            else:
                tr.loads_failed += 1
                if timed_out:
                    tr.loads_timed_out += 1
        else:
            tr.saved_bytes += nbytes
            self._rates.add(ts, 0, nbytes)
            if ok:
                tr.saves_finished += 1
            else:
                tr.saves_failed += 1
        if ok:
            return
        name = error_name or ("TIMEOUT" if timed_out else "UNKNOWN")
        tr.errors_by_name[name] = tr.errors_by_name.get(name, 0) + 1
        if kind == "load" and after_hit and name in _AFTER_HIT_NAMES:
            tr.failed_after_hit += 1
        self._record_error(
            ErrorRecord(
                ts_ms=ts,
                where=kind,
                name=name,
                message=f"{kind} of {failed_blocks} block(s) failed"
                + (" after a positive lookup" if after_hit else ""),
                req_id=req_id,
            )
        )

    def _on_skipped(self, ts: float, req_id: str, blocks: int, reason: str) -> None:
        tr = self.transfers
        tr.saves_skipped += blocks
        tr.errors_by_name[reason] = tr.errors_by_name.get(reason, 0) + 1

    def _on_error(
        self,
        ts: float,
        where: str,
        name: str,
        message: str,
        code: int | None,
        req_id: str | None,
    ) -> None:
        self._record_error(
            ErrorRecord(ts_ms=ts, where=where, name=name, message=message, code=code, req_id=req_id)
        )

    def state(self, now_ms: float, *, all_errors: bool = True) -> EngineState:
        """A detached copy of the current state.

        ``all_errors``: the last ``RECENT_ERRORS`` errors (snapshot) or only those recorded
        since the previous ``state(all_errors=False)`` call (delta; clears that list).
        """
        lk = msgspec.structs.replace(self.lookup)
        if lk.prompt_tokens:
            lk.hit_rate = lk.pool_hit_tokens / lk.prompt_tokens
        prompt_1m, hit_1m = self._hits.sums(now_ms)
        lk.hit_rate_1m = hit_1m / prompt_1m if prompt_1m else 0.0
        lat = sorted(self._latencies)
        lk.latency_ms_p50 = _percentile(lat, 0.50)
        lk.latency_ms_p99 = _percentile(lat, 0.99)
        tr = msgspec.structs.replace(
            self.transfers, errors_by_name=dict(self.transfers.errors_by_name)
        )
        load_b, save_b = self._rates.sums(now_ms)
        tr.load_bytes_per_s = load_b / _RATE_WINDOW_S
        tr.save_bytes_per_s = save_b / _RATE_WINDOW_S
        if all_errors:
            errors = list(self.recent_errors)
        else:
            errors = self.new_errors
            self.new_errors = []
        return EngineState(
            source=self.source,
            started_ms=self.started_ms,
            ts_ms=now_ms,
            lookup=lk,
            transfers=tr,
            in_flight=[msgspec.structs.replace(t) for t in self.in_flight.values()],
            pool=self.pool,
            process=msgspec.structs.replace(self.process),
            recent_errors=errors,
        )


_HANDLERS: dict[str, Any] = {
    "lookup": Aggregator._on_lookup,
    "loaded": Aggregator._on_loaded,
    "started": Aggregator._on_started,
    "progress": Aggregator._on_progress,
    "finished": Aggregator._on_finished,
    "skipped": Aggregator._on_skipped,
    "error": Aggregator._on_error,
}
