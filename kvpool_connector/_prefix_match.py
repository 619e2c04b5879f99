"""The scheduler's answer to vLLM's ``get_num_new_matched_tokens`` (``PrefixMatch``): how many
tokens beyond vLLM's own prefix cache the pool can load for a request.

The prompt's whole chunks are hashed and worker rank 0 asked how many leading chunks the pool
holds, on the lookup thread (``_async_lookup``) or on vLLM's; the answer is counted
(``LookupCounters``), reported, kept in the request's record (``_requests``: ``asked``,
``offered``) and cut to whole chunks short of the last prompt token. Lookups not made are
counted as skips with their reason; failed ones feed the lookup breaker; a P/D hand-over the
request's ``kv_transfer_params`` promise is waited for (``handover``). See the module docstring
of ``kvpool_connector.scheduler`` for where this sits among vLLM's calls.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from kvpool_agent.reporter import Reporter
from kvpool_connector._async_lookup import (
    AsyncLookups,
    Breaker,
    LookupAnswer,
    PrefixLookup,
    PromptHasher,
    prompt_hashes,
    run_lookup,
)
from kvpool_connector._context_prefill import NO_CONTEXT_PREFILL
from kvpool_connector._counters import LookupCounters
from kvpool_connector._requests import (
    CachedLookup,
    RequestRecord,
    has_media,
    has_prompt_embeds,
    record_of,
)
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.handover import HandoverWaits, promised_tokens
from kvpool_connector.keys import ChunkHashCache
from kvpool_connector.metadata import LoadSpec

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["PrefixMatch"]

logger = logging.getLogger("kvpool_connector.scheduler")


class PrefixMatch:
    """Answers vLLM's asks for one scheduler.

    Args:
        config: the connector's settings.
        lookup: client of worker rank 0's lookup server (``None``: this engine never loads).
        reporter: agent event buffer (lookups are reported to it).
        counters: the scheduler's running totals (``LookupCounters``), counted here.
        hash_cache: the chunk hashes of recent prompts (``keys.ChunkHashCache``).
        records: the scheduler's request records (``_requests``), filled here.
        unsupported: the engine has a KV-cache group the pool cannot restore: no lookup.
        no_context_prefill: an attention backend that cannot prefill over loaded context.
        lookup_async: hash and look up on a thread of their own (``_async_lookup``).

    Attributes:
        lookups: the lookup thread's queue (``None`` when lookups run on vLLM's thread).
    """

    def __init__(self, config: KVPoolConfig, lookup: PrefixLookup | None, reporter: Reporter,
                 counters: LookupCounters, hash_cache: ChunkHashCache,
                 records: dict[str, RequestRecord], *, unsupported: bool,
                 no_context_prefill: str | None, lookup_async: bool) -> None:
        self.config = config
        self.chunk_size = config.chunk_size
        self.lookup_client = lookup
        self.reporter = reporter
        self.counters = counters
        self._requests = records
        self.unsupported = unsupported
        self.no_context_prefill = no_context_prefill
        self._hasher = PromptHasher(hash_cache, reporter)
        self.lookups = (AsyncLookups(lookup, self._hasher)
                        if lookup_async and lookup is not None and config.should_load else None)
        self._breaker = Breaker(config.lookup_breaker_failures, config.lookup_breaker_open_ms)
        self._handover = HandoverWaits(config.handover_wait_ms)

    def forget(self, rid: str) -> None:
        """``rid`` finished: drop its hand-over wait and its lookup (aborted while it ran: its
        answer is dropped)."""
        self._handover.forget(rid)
        if self.lookups is not None:
            self.lookups.discard(rid)

    def clear(self) -> None:
        """Drop running lookups' answers (the pool was flushed: ask again)."""
        if self.lookups is not None:
            self.lookups.clear()

    def close(self) -> None:
        """Stop the lookup thread. Idempotent."""
        if self.lookups is not None:
            self.lookups.close()

    def hashes_for(self, request: Request) -> list[str]:
        """The prompt's chunk hashes; none for a request with media or prompt embeddings, so
        it neither loads nor saves (its token ids do not say which images or embeddings they
        stand for)."""
        rec = record_of(self._requests, request.request_id)
        if rec.hashes is None:
            rec.hashes = ([] if has_media(request) or has_prompt_embeds(request)
                          else self._hash_prompt(request))
        return rec.hashes

    def _hash_prompt(self, request: Request) -> list[str]:
        """``_hashes_for`` a request without media: ``_async_lookup.prompt_hashes``, a prompt
        that cannot be keyed reported as ``BAD_TOKEN_IDS``."""
        hashes, bad = prompt_hashes(self._hasher, request)
        if bad is not None:
            self._bad_tokens(request.request_id, bad)
        return hashes

    def _bad_tokens(self, rid: str, msg: str) -> None:
        logger.error("kvpool: %s", msg)
        self.reporter.error("lookup", "BAD_TOKEN_IDS", msg, req_id=rid)

    def _skip(self, rid: str, prompt_len: int, local: int, reason: str) -> tuple[int, bool]:
        """Count and report a lookup not made for ``reason``."""
        c = self.counters
        c.lookup_skipped += 1
        c.prompt_tokens += prompt_len
        c.local_tokens += local
        c.skip_reasons[reason] = c.skip_reasons.get(reason, 0) + 1
        self.reporter.lookup(rid, prompt_len, local, 0, 0.0, skipped=reason)
        return 0, False

    def answer(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``KVPoolScheduler.get_num_new_matched_tokens``."""
        rid = request.request_id
        known = self._requests.get(rid)
        if known is not None:
            known.offered = None
        if not self.config.should_load or self.lookup_client is None:
            return 0, False
        # A prompt of embeddings alone has no token ids, and its length all the same.
        prompt_len = (len(request.prompt_token_ids) if request.prompt_token_ids is not None
                      else request.num_prompt_tokens)
        # The last prompt token is always computed by vLLM: it yields the first logits.
        max_chunks = max(0, prompt_len - 1) // self.chunk_size
        cached = known.asked if known is not None else None
        if (cached is not None and cached.num_tokens == request.num_tokens
                and cached.local_tokens == num_computed_tokens
                and (cached.spec is None or cached.spec.lease_expires_ms is None
                     or cached.spec.lease_expires_ms > time.time() * 1e3)):
            # The same request still waiting (e.g. for free blocks): same answer, no lookup.
            self.counters.lookup_cached += 1
            if cached.spec is not None:
                record_of(self._requests, rid).offered = replace(cached.spec)
            return cached.answer
        if max_chunks * self.chunk_size <= num_computed_tokens:
            if self.lookups is not None:  # vLLM's prefix cache grew while it ran: not needed
                self.lookups.discard(rid)
            # Counted all the same: its prompt belongs in the request-level hit rate.
            reason = ("PROMPT_EMBEDS" if has_prompt_embeds(request)
                      else "LOCAL_CACHE" if num_computed_tokens else "SHORT_PROMPT")
            answer = self._skip(rid, prompt_len, num_computed_tokens, reason)
        else:
            found, load_async = self._lookup(request, prompt_len, max_chunks,
                                             num_computed_tokens)
            if found is None:  # a P/D hand-over not all saved yet: never cached
                return None, False
            answer = (found, load_async)
        rec = record_of(self._requests, rid)
        spec = rec.offered
        rec.asked = CachedLookup(request.num_tokens, num_computed_tokens, answer,
                                 replace(spec) if spec is not None else None)
        return answer

    def _lookup(self, request: Request, prompt_len: int, max_chunks: int,
                num_computed_tokens: int) -> tuple[int | None, bool]:
        """One lookup (or a counted skip) for ``get_num_new_matched_tokens``: started on the
        lookup thread and answered "later", or taken once it ended, or run here."""
        assert self.lookup_client is not None
        rid = request.request_id
        reason = ("UNSUPPORTED_KV_GROUP" if self.unsupported
                  else NO_CONTEXT_PREFILL if self.no_context_prefill
                  else "MULTIMODAL" if has_media(request)
                  else "PROMPT_EMBEDS" if has_prompt_embeds(request)
                  else "BREAKER_OPEN" if self._breaker.is_open(time.monotonic()) else None)
        lookups = self.lookups
        if reason is not None:
            if lookups is not None:
                lookups.discard(rid)
            return self._skip(rid, prompt_len, num_computed_tokens, reason)
        # vLLM drops the answer for a request that skips the prefix cache (prompt logprobs):
        # it must be an answer, never "later".
        if getattr(request, "skip_reading_prefix_cache", False):
            lookups = None
        if lookups is not None and lookups.running(rid):
            return None, False
        answer = lookups.take(rid) if lookups is not None else None
        if answer is None:
            if self._handover.ask_later(rid):
                self.counters.handover_waits += 1
                return None, False
            if lookups is not None:
                lookups.start(request, max_chunks)
                return None, False
            answer = run_lookup(self.lookup_client, self._hasher, request, max_chunks)
        return self._settle(request, answer, prompt_len, max_chunks, num_computed_tokens)

    def _settle(self, request: Request, answer: LookupAnswer, prompt_len: int,
                max_chunks: int, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Count, report and keep what a lookup found (on the scheduler thread, wherever the
        lookup ran)."""
        rid = request.request_id
        rec = record_of(self._requests, rid)
        if rec.hashes is None:
            rec.hashes = answer.hashes
        if answer.bad_tokens is not None:
            self._bad_tokens(rid, answer.bad_tokens)
        hashes = answer.hashes  # a copy only when cut: never mutated, shared read-only
        if len(hashes) > max_chunks:
            hashes = hashes[:max_chunks]
        if not hashes:  # max_chunks >= 1 here: the prompt could not be keyed
            return self._skip(rid, prompt_len, num_computed_tokens, "BAD_TOKEN_IDS")
        self.counters.lookups += 1
        self.counters.prompt_tokens += prompt_len
        self.counters.local_tokens += num_computed_tokens
        hit_chunks, asked_ms = answer.hit_chunks, answer.asked_ms
        exc = answer.error
        if exc is not None:
            self.counters.lookup_errors += 1
            logger.error("kvpool: prefix lookup for request %s failed (%s): %s; "
                         "running it without the pool", rid, exc.name, exc)
            self.reporter.lookup(rid, prompt_len, num_computed_tokens, 0, answer.latency_ms,
                                 error=f"{exc.name}: {exc}", chunk_size=self.chunk_size,
                                 chunks=hashes)
            if self._breaker.failed(time.monotonic()):
                cfg = self.config
                msg = (f"{cfg.lookup_breaker_failures} lookups failed in a row (last: "
                       f"{exc.name}); lookups are skipped for {cfg.lookup_breaker_open_ms} ms")
                logger.error("kvpool: %s", msg)
                self.reporter.error("lookup", "LOOKUP_BREAKER_OPEN", msg, req_id=rid)
            return 0, False
        self._breaker.succeeded()
        promised = promised_tokens(getattr(request, "kv_transfer_params", None), prompt_len)
        if promised is not None:
            expected = min(promised, max_chunks * self.chunk_size)
            found = max(hit_chunks * self.chunk_size, num_computed_tokens)
            c = self.counters
            if self._handover.keep_waiting(rid, found, expected):
                # Asked again at a later step: this ask is counted then, once.
                c.lookups -= 1
                c.prompt_tokens -= prompt_len
                c.local_tokens -= num_computed_tokens
                c.handover_waits += 1
                return None, False
            if found < expected:
                c.handover_short += 1
                logger.warning("kvpool: request %s: its prefill engine handed over %d tokens; "
                               "after %d ms the pool holds %d: the rest is recomputed", rid,
                               expected, self.config.handover_wait_ms, found)
        pool_tokens = hit_chunks * self.chunk_size
        new_tokens = max(0, pool_tokens - num_computed_tokens)
        self.reporter.lookup(rid, prompt_len, num_computed_tokens, new_tokens, answer.latency_ms,
                             chunk_size=self.chunk_size, chunks=hashes)
        if new_tokens == 0:
            return 0, False
        ttl = self.config.lease_ttl_ms
        rec.offered = LoadSpec(
            vllm_cached_tokens=num_computed_tokens, kvpool_cached_tokens=pool_tokens,
            # Counted from before the query: the lease never looks longer than it is.
            lease_expires_ms=asked_ms + ttl if ttl else None,
        )
        return new_tokens, self.config.load_async
