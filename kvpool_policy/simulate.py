"""The offline multi-engine model (issue 40): N engines sharing one pool, a trace in order.

Accesses are ``(prompt tokens, chained chunk hashes of its whole chunks)`` per request, in trace
order, as ``kvpool_agent.reuse`` takes them (``bench/bench_policy.py`` builds them exactly as
``kvpool-replay`` does: ``kvpool_replay.request_tokens`` and ``kvpool_connector.keys.
chunk_hashes``). Requests go to engines round-robin in trace order, as ``kvpool-replay`` sends
them (the traces carry no session). Counting is ``kvpool-replay``'s and ``kvpool_agent.reuse``'s:
a request hits the leading chunks the pool holds, at most ``claimable_chunks`` of them (whole
chunks, never the last token), each worth ``chunk_size`` tokens; the rate is hit tokens over all
prompt tokens.

The models (each returns a ``kvpool_agent.reuse.ReuseResult``):

* ``per_engine_hits``: today's ``admission: adaptive`` with ``eviction: connector``, N engines.
  Each engine has its own ``AdaptiveAdmission`` and ``ConnectorEviction`` of ``capacity / N``
  (``admission_pool_tokens`` as ``kvpool-replay`` sets it); the pool is one set of chunks: a
  request hits what any engine saved, its engine saves the chunks its admission admits and
  removes from the pool whatever falls out of its own LRU, whoever else uses it. The pool never
  holds more than the sum of the engines' LRUs, so the master (watermark 1.0) never evicts.
  With one engine it is ``lru_hits(..., admission=AdaptiveAdmission)``, the *model* column of
  docs/benchmarks.md that the real replay matched.
* ``lru_hits`` / ``belady_hits`` (``kvpool_agent.reuse``): an exact LRU and Belady's MIN of the
  whole pool; they do not depend on N.
* ``policy_hits``: ``PoolPolicy`` over the whole pool, fed every engine's record in trace order:
  at once (the same for every N), or with admission decided by the engines from snapshots that
  show other engines' records ``delay_ms`` late (``delay_ms``, by the trace's timestamps).

What the model leaves out: engines replay concurrently (a prefix another engine is still
computing is a miss in a real replay, a hit here); records dropped when the service is slow;
removals wait for leases. Chunk bytes are equal (one layout).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvpool_agent.reuse import ReuseResult, belady_hits, claimable_chunks, lru_hits
from kvpool_connector.admission import AdaptiveAdmission
from kvpool_connector.eviction import ConnectorEviction
from kvpool_policy.policy import AccessRecord, EvictionKind, PoolPolicy

__all__ = ["Access", "SimRow", "per_engine_hits", "policy_hits", "simulate_row"]

Access = tuple[int, Sequence[str]]
"""One request: ``(prompt tokens, chained chunk hashes)`` (module docstring)."""

_DIGEST = "000000000000"
"""The one layout of a modelled trace (``keys.DIGEST_LEN`` hex digits)."""


def _check(chunk_size: int, capacity_tokens: int, engines: int) -> None:
    if chunk_size < 1 or engines < 1 or capacity_tokens < chunk_size * engines:
        raise ValueError(
            f"need chunk_size >= 1, engines >= 1 and a chunk per engine, got chunk_size "
            f"{chunk_size}, capacity {capacity_tokens} tokens, {engines} engines")


def per_engine_hits(accesses: Sequence[Access], chunk_size: int, capacity_tokens: int,
                    engines: int) -> ReuseResult:
    """Today's per-engine policy, ``engines`` engines round-robin (module docstring).

    ``evicted_chunks`` counts the chunks the engines removed from the pool.

    Raises:
        ValueError: ``chunk_size`` or ``engines`` < 1, or less than a chunk per engine.
    """
    _check(chunk_size, capacity_tokens, engines)
    share = capacity_tokens // engines // chunk_size  # admission_pool_tokens // chunk_size
    admissions = [AdaptiveAdmission(share) for _ in range(engines)]
    lrus = [ConnectorEviction(share) for _ in range(engines)]
    pool: set[str] = set()
    total = hits = removed = 0
    per: list[int] = []
    for i, (n, hashes) in enumerate(accesses):
        lead = 0
        for h in hashes[:claimable_chunks(n, chunk_size)]:
            if h not in pool:
                break
            lead += 1
        per.append(lead * chunk_size)
        hits += lead * chunk_size
        total += n
        e = i % engines
        admitted = admissions[e].admit(hashes)
        lrus[e].record(hashes, admitted)
        # The engine's worker removes before the step's saves (kvpool_connector.eviction).
        evict, _keep = lrus[e].take()
        removed += sum(1 for h in evict if h in pool)
        pool.difference_update(evict)
        pool.update(hashes[:admitted])
    return ReuseResult(total, hits, per, removed)


def policy_hits(accesses: Sequence[Access], chunk_size: int, capacity_tokens: int,
                engines: int = 1, eviction: EvictionKind = "lru",
                admission: Literal["adaptive", "all"] = "adaptive",
                chunk_bytes: int = 1, timestamps_ms: Sequence[int] | None = None,
                delay_ms: int = 0) -> ReuseResult:
    """``PoolPolicy`` of ``capacity_tokens`` (``chunk_bytes`` per chunk) fed every engine's
    records in trace order.

    With ``delay_ms`` = 0 every record reaches the policy at once and ``engines`` only labels
    them. With ``delay_ms`` > 0 (and ``timestamps_ms``, each request's arrival) admission is
    decided the way engines would decide from snapshots: each engine runs a replica of the
    pool-wide ``AdaptiveAdmission`` that takes its own records at once and every other
    engine's ``delay_ms`` after they arrived (the snapshot interval); the policy, admitting
    what the engines save, keeps the one eviction order.

    Raises:
        ValueError: ``chunk_size`` or ``engines`` < 1, less than a chunk per engine, or a
            ``delay_ms`` > 0 without one timestamp per access.
    """
    _check(chunk_size, capacity_tokens, engines)
    delayed = delay_ms > 0 and engines > 1 and admission == "adaptive"
    if delayed and (timestamps_ms is None or len(timestamps_ms) != len(accesses)):
        raise ValueError("delay_ms needs timestamps_ms, one per access")
    capacity_chunks = capacity_tokens // chunk_size
    policy = PoolPolicy(capacity_chunks * chunk_bytes, eviction=eviction,
                        admission="all" if delayed else admission)
    replicas = [AdaptiveAdmission(capacity_chunks) for _ in range(engines if delayed else 0)]
    pending: deque[tuple[int, int]] = deque()  # (when the others see it, access index)
    total = hits = removed = 0
    per: list[int] = []
    for i, (n, hashes) in enumerate(accesses):
        e = i % engines
        wants = len(hashes)
        if delayed:
            now = timestamps_ms[i]  # type: ignore[index]
            while pending and pending[0][0] <= now:
                j = pending.popleft()[1]
                for f, replica in enumerate(replicas):
                    if f != j % engines:
                        replica.admit(accesses[j][1])
            wants = replicas[e].admit(hashes)
            pending.append((now + delay_ms, i))
        d = policy.record(AccessRecord(_DIGEST, tuple(hashes), chunk_bytes, wants,
                                       engine=str(e)))
        hit = min(d.hits, claimable_chunks(n, chunk_size)) * chunk_size
        per.append(hit)
        hits += hit
        total += n
        removed += len(d.removals)
    return ReuseResult(total, hits, per, removed)


@dataclass(frozen=True)
class SimRow:
    """One row of the table: hit rates (0..1 of all prompt tokens) at one capacity and N.

    ``gap_closed`` = ``(policy - lru) / (min - lru)`` (0.0 when MIN is not above LRU).
    """

    engines: int
    capacity_tokens: int
    per_engine: float
    lru: float
    belady: float
    policy: float

    @property
    def x_lru(self) -> float:
        return self.policy / self.lru if self.lru else 0.0

    @property
    def per_engine_x_lru(self) -> float:
        return self.per_engine / self.lru if self.lru else 0.0

    @property
    def gap_closed(self) -> float:
        gap = self.belady - self.lru
        return (self.policy - self.lru) / gap if gap > 0 else 0.0


def simulate_row(accesses: Sequence[Access], chunk_size: int, capacity_tokens: int,
                 engines: int, eviction: EvictionKind = "lru",
                 pool_wide: tuple[float, float, float] | None = None) -> SimRow:
    """Every model at one capacity and N.

    Args:
        pool_wide: ``(lru, belady, policy)`` hit rates already computed at this capacity (they
            do not depend on N); computed here when ``None``.
    """
    if pool_wide is None:
        pool_wide = (lru_hits(accesses, chunk_size, capacity_tokens).hit_rate,
                     belady_hits(accesses, chunk_size, capacity_tokens).hit_rate,
                     policy_hits(accesses, chunk_size, capacity_tokens, engines,
                                 eviction).hit_rate)
    lru, belady, policy = pool_wide
    return SimRow(engines, capacity_tokens,
                  per_engine_hits(accesses, chunk_size, capacity_tokens, engines).hit_rate,
                  lru, belady, policy)

