"""The connector's running totals: the scheduler's ``LookupCounters`` and each worker's
``WorkerCounters`` (shared by its load and save threads, ``_transfers``), read by tests,
benchmarks and vLLM's stats (``_stats``). What each counts, its unit and help are the counter
catalogue's (``kvpool_agent.ledger``): a field it does not list reaches no metric."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LookupCounters", "WorkerCounters"]


@dataclass
class WorkerCounters:
    """Running totals of this worker (bytes, keys, blocks). ``load_failed_tokens`` is this
    rank's own count; vLLM's metric of that name is the scheduler's (once per request)."""

    saved_bytes: int = 0
    saved_keys: int = 0
    save_skipped_keys: int = 0
    save_failed_keys: int = 0
    loaded_bytes: int = 0
    loaded_keys: int = 0
    load_failed_keys: int = 0
    load_failed_blocks: int = 0
    layer_timeouts: int = 0
    load_failed_tokens: int = 0
    checksum_failures: int = 0
    evicted_keys: int = 0
    evict_failed_keys: int = 0


@dataclass
class LookupCounters:
    """Scheduler-side totals since start (tokens unless named otherwise).

    ``prompt_tokens`` and ``local_tokens`` count every request vLLM asks about, once per waiting
    period, whether looked up, skipped or failed (the request-level hit rate's denominator).
    ``loaded_tokens`` counts what loads really brought in, once per load (``loads_outcome``):
    the pool's hits (one fact, one name); ``load_failed_tokens`` what vLLM accepted but a load
    failed to bring (recomputed). ``lookup_skipped`` counts lookups not made (``skip_reasons``:
    by reason, ``MULTIMODAL``, ``PROMPT_EMBEDS`` (a request with prompt embeddings: neither
    loaded nor saved), ``BREAKER_OPEN``, ``UNSUPPORTED_KV_GROUP`` (a KV-cache group the pool
    cannot restore, ``_groups``), ``NO_CONTEXT_PREFILL`` (an attention backend that cannot
    prefill over loaded context, ``_context_prefill``), ``LOCAL_CACHE`` when vLLM's own prefix
    cache already holds every whole chunk, ``SHORT_PROMPT`` when the prompt has no whole chunk
    before its last token); ``lookup_cached`` repeated asks answered from the request's cached
    lookup. ``handover_waits``: asks answered "later" while a P/D hand-over's chunks were not
    all in the pool yet (``handover``; such an ask is counted in ``lookups`` once, when
    answered); ``handover_short``: hand-overs that ran with fewer tokens than their prefill
    engine promised, after ``handover_wait_ms``.
    """

    lookups: int = 0
    lookup_errors: int = 0
    prompt_tokens: int = 0
    local_tokens: int = 0
    loaded_tokens: int = 0
    saves_scheduled_chunks: int = 0
    load_failed_tokens: int = 0
    lookup_skipped: int = 0
    lookup_cached: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    handover_waits: int = 0
    handover_short: int = 0
