"""Scheduler side of the connector (``KVPoolScheduler``): what to load and what to save.

Per request, vLLM's scheduler calls, in this order (vLLM V1 ``KVConnectorBase_V1``):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: the prompt's whole chunks are
   hashed (``keys.chunk_hashes`` over ``request.prompt_token_ids``, the LoRA adapter's
   content fingerprint and ``cache_salt`` mixed in as ``extra``; a prefix shared with a
   recent prompt is not hashed again, ``keys.ChunkHashCache``); worker rank 0 is asked how
   many leading chunks the pool holds (``LookupClient``). Both run on the lookup thread
   (``_async_lookup``): vLLM gets ``(None, False)`` until the answer is in, then the answer
   (issue 38; ``lookup_async=False``: on vLLM's thread). The answer is truncated to whole
   chunks and never covers the last prompt token (vLLM must compute at least one token to
   produce logits). The result is kept as a ``LoadSpec`` and cached for the request until
   vLLM allocates it (``update_state_after_alloc``) or its token count changes: a request
   waiting for free blocks is looked up once, not on every scheduler step. A request with
   media (``mm_features``) or prompt embeddings (``prompt_embeds``) skips the pool (its
   tokens do not identify its KV); after ``lookup_breaker_failures`` failed lookups in a row,
   lookups are skipped for ``lookup_breaker_open_ms``; a prompt with a token id no key can
   hold (not an int in [0, 2**32), which vLLM lets through without a tokenizer) skips the
   pool, load and saves (all counted as ``lookup_skipped`` with a reason).
2. ``update_state_after_alloc(request, blocks, num_external_tokens)``: vLLM allocated blocks;
   the load is confirmed (``LoadSpec.can_load``) for the ``num_external_tokens`` vLLM accepted
   (fewer than offered: the worker loads up to the cut, even inside a chunk).
3. ``build_connector_meta(scheduler_output)``: one ``ReqMeta`` per request with work this step:
   its load (once) and the chunks whose prompt tokens are complete after this step (saves).
4. ``request_finished(request, block_ids)``: returns ``True`` (vLLM keeps the blocks) when a
   save was ever scheduled for the request.

Contract with the worker (``KVPoolWorker.get_finished``): the worker reports a request in
``finished_sending`` exactly when it is in (this or an earlier) ``finished_req_ids`` *and* some
``ReqMeta`` for it had a non-empty save range *and* all its saves are done. The worker reports
an asynchronous load (``load_async``) in ``finished_recving`` once it completed or failed, with
failed blocks in ``get_block_ids_with_load_errors``. Every ended load's outcome (tokens accepted,
tokens really loaded) comes back as ``LoadOutcomes`` (``loads_outcome``): the only place hit
tokens are counted, once per load; what failed is counted apart as ``load_failed_tokens``.

Hybrid models (several KV-cache groups, vLLM's hybrid allocator; ``_groups``): the block
tables of every group go to the workers, taken from vLLM's current tables
(``SchedulerOutput.kv_connector_block_state``); loads are asynchronous (a failure is reported
per request, ``failed_recving``); the blocks a sliding-window group's save reads are held in
vLLM's block pool until every worker reported the save job ended (``_save_holds``). A Mamba
group (vLLM's align mode) saves only the states vLLM hands over by block id
(``KVConnectorBlockState.boundary_state_offloads``), at chunk ends, held the same way
(``ReqMeta.boundary_states``). An engine with a group the pool cannot restore
(``KVGroup.kind`` ``unsupported``) neither loads nor saves (``UNSUPPORTED_KV_GROUP``); one
whose attention backend cannot prefill over loaded context (``_context_prefill``, vLLM's
``CPU_MLA``) loads nothing and saves (``NO_CONTEXT_PREFILL``).

``kv_role`` (vllm-ascend's ``AscendStoreConnector`` semantics): ``kv_producer`` and ``kv_both``
load and save; ``kv_consumer`` loads only with ``consumer_is_to_load`` and saves only with
``consumer_is_to_put``.

What the scheduler keeps of a request is one ``_requests.RequestRecord`` with an explicit
``Phase``, dropped in one place (``_forget``); loads awaiting their outcome are
``_load_outcomes``', blocks held for saves ``_save_holds``'; the answer to step 1 is
``_prefix_match``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from kvpool_agent.reporter import NullReporter, Reporter
from kvpool_connector._async_lookup import PrefixLookup, request_extra
from kvpool_connector._counters import LookupCounters
from kvpool_connector._groups import NULL_BLOCK_ID, KVGroup
from kvpool_connector._load_outcomes import AwaitedLoads
from kvpool_connector._prefix_match import PrefixMatch
from kvpool_connector._requests import (
    PendingLoad,
    Phase,
    RequestRecord,
    Running,
    record_of,
)
from kvpool_connector._save_holds import SaveHolds
from kvpool_connector.admission import admission_for
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.eviction import ConnectorEviction
from kvpool_connector.handover import handover_params, wants_handover
from kvpool_connector.keys import ChunkHashCache
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadOutcomes, ReqMeta

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KVPoolScheduler", "PrefixLookup", "request_extra"]

logger = logging.getLogger(__name__)


class RequestEvents(Protocol):
    """What the scheduler tells the KV-event joiner (``_events.PoolEventJoiner``) about
    request lifetimes."""

    def track(self, request: Request) -> None: ...

    def release(self, req_ids: Iterable[str]) -> None: ...


class KVPoolScheduler:
    """Decides per request which chunks to load from and save to the pool.

    Args:
        config: parsed connector settings (``chunk_size``, ``kv_role``, ``load_async``...).
        lookup: client of worker rank 0's lookup server; ``None`` when this engine never loads
            (``config.should_load`` false).
        reporter: agent event buffer (lookups and loaded tokens are reported to it).
        groups: vLLM's KV-cache groups (``_groups.kv_groups``); ``None``: one full group.
        world_size: workers that each report a save job's end (vLLM's world size).
        no_context_prefill: the engine's attention backend when it cannot prefill over loaded
            context (``_context_prefill.context_prefill_gap``): nothing is looked up or loaded
            (``NO_CONTEXT_PREFILL``), saves go on.
        lookup_async: hash and look up on a thread of their own (``_async_lookup``), answering
            vLLM "later" while they run; ``False``: on vLLM's scheduler thread, as before
            issue 38 (for comparison: same answers and counters).

    Attributes:
        hash_cache: the chunk hashes of recent prompts (``keys.ChunkHashCache``, at most 2**20
            prompt tokens), so a prompt sharing a prefix with one hashes only its new chunks.
    """

    def __init__(
        self, config: KVPoolConfig, lookup: PrefixLookup | None, reporter: Reporter | None = None,
        *, groups: list[KVGroup] | None = None, world_size: int = 1,
        no_context_prefill: str | None = None, lookup_async: bool = True,
    ) -> None:
        self.config = config
        self.no_context_prefill = no_context_prefill
        self.groups = groups or []
        self.hybrid = len(self.groups) > 1 or any(g.kind != "full" for g in self.groups)
        self.unsupported = [g for g in self.groups
                            if g.kind == "unsupported" or g.block_size != config.block_size]
        window_groups = [g for g in self.groups if g.kind == "sliding_window"]
        self._mamba_groups = {g.index for g in self.groups if g.kind == "mamba"}
        self._hold_blocks = bool(window_groups or self._mamba_groups)
        self.holds = SaveHolds(window_groups, config.blocks_per_chunk, world_size)
        self.chunk_size = config.chunk_size
        self.lookup_client = lookup
        self.reporter = reporter or NullReporter()
        self.counters = LookupCounters()
        # One record per request vLLM still knows (``_requests``), dropped by ``_forget``.
        self._requests: dict[str, RequestRecord] = {}
        # Requests that were given a load to confirm (a superset of those whose record still
        # holds one): the step's async-load pass looks at these, not at every record.
        self._confirmed: dict[str, None] = {}
        # Repeats, later turns of a conversation, a common system prompt: hashed once.
        self.hash_cache = ChunkHashCache(config.chunk_size, config.hash_algo)
        self.match = PrefixMatch(config, lookup, self.reporter, self.counters, self.hash_cache,
                                 self._requests, unsupported=bool(self.unsupported),
                                 no_context_prefill=no_context_prefill,
                                 lookup_async=lookup_async)
        # Which leading chunks of a new request are saved (admission: all | adaptive).
        self.admission = admission_for(config.admission, config.kv_role,
                                       config.admission_pool_tokens, config.chunk_size)
        # eviction: connector: this engine's exact LRU of the pool (kvpool_connector.eviction).
        self.eviction = (
            ConnectorEviction((config.admission_pool_tokens or 0) // config.chunk_size)
            if config.eviction == "connector" and config.should_save else None)
        self._awaited = AwaitedLoads()
        # Set by the connector when vLLM publishes KV events: keeps each request whose saves
        # may still be reported (released at request_finished or finished_sending).
        self.events: RequestEvents | None = None
        # Finished requests whose blocks vLLM keeps until their saves' finished_sending.
        self._held_for_saves: set[str] = set()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from the pool.

        Args:
            request: the vLLM request (``prompt_token_ids``, ``request_id``).
            num_computed_tokens: tokens vLLM's local prefix cache already holds (block aligned).

        Returns:
            ``(tokens, load_async)``: ``tokens`` is a whole number of chunks minus
            ``num_computed_tokens``, 0 when the pool holds nothing beyond the local hit or the
            lookup failed (the failure is counted, logged as an error and reported to the
            agent with its name); ``load_async`` is ``config.load_async`` when ``tokens > 0``.
            ``(None, False)`` (vLLM's "ask again later") while the request's lookup runs on
            the lookup thread (``_async_lookup``), or while a P/D hand-over the request's
            ``kv_transfer_params`` promise is not all in the pool yet
            (``kvpool_connector.handover``, at most ``handover_wait_ms``).
        """
        return self.match.answer(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Confirm (or drop) the request's pending load once vLLM allocated its blocks.

        ``num_external_tokens`` is what vLLM accepted; 0 means load nothing (for example a
        ``MultiConnector`` chose another connector, or an async load's second call).
        """
        rid = request.request_id
        rec = record_of(self._requests, rid)
        # The request leaves its waiting period: a later ask (after a preemption) looks up.
        rec.asked = None
        # Hash here, where the full Request (with cache_salt) is at hand, for saves too.
        hashes = self.match.hashes_for(request)
        if rec.phase is Phase.ASKED:
            rec.phase = Phase.ALLOCATED
        if self.events is not None and self.config.should_save and hashes:
            self.events.track(request)
        spec, rec.offered = rec.offered, None
        if spec is None:
            return
        if num_external_tokens == 0:
            return
        if num_external_tokens != spec.num_tokens_to_load:
            # vLLM trimmed the hit (e.g. to keep a local sub-block tail): load what it kept,
            # even when the cut is inside a chunk (the planner writes up to the cut).
            spec.kvpool_cached_tokens = spec.vllm_cached_tokens + min(
                num_external_tokens, spec.num_tokens_to_load)
        spec.can_load = True
        tables = blocks.get_block_ids()
        block_ids = list(tables[0])
        rec.confirmed = PendingLoad(
            spec, hashes, block_ids,
            tuple(list(t) for t in tables) if self.hybrid else ())
        self._confirmed[rid] = None
        if rec.phase is not Phase.RUNNING:
            rec.phase = Phase.LOAD_CONFIRMED
        self._awaited.expect(rid, spec.num_tokens_to_load)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPoolConnectorMetadata:
        """This step's loads and saves for the workers (see the module docstring)."""
        meta = KVPoolConnectorMetadata()
        save = self.config.should_save and not self.unsupported
        num_sched = scheduler_output.num_scheduled_tokens
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            rec = self._requests.get(rid)
            if rec is None or rec.phase is Phase.ASKED:
                # update_state_after_alloc always runs first; without it there is no salt.
                logger.warning("kvpool: request %s scheduled without allocation state", rid)
                continue
            hashes = rec.hashes or []
            pending, rec.confirmed = rec.confirmed, None
            load = pending.spec if pending is not None else None
            # The one place a save is decided: once per request, when it is first scheduled.
            tracker = Running(hashes, list(new.block_ids[0]),
                              save_limit=self.admission.admit(hashes) if save else 0)
            if save and self.eviction is not None:
                self.eviction.record(hashes, tracker.save_limit)
            # Chunks the pool already holds need no save.
            pool_tokens, rec.sent_tokens = rec.sent_tokens, 0
            if load is not None:
                pool_tokens = load.kvpool_cached_tokens
            tracker.saved_chunks = pool_tokens // self.chunk_size
            rec.running, rec.phase = tracker, Phase.RUNNING
            self._current_tables(rid, tracker, block_state)
            req = self._step_meta(rid, rec, new.num_computed_tokens + num_sched.get(rid, 0),
                                  save)
            if load is not None:
                req = req or self._empty_meta(rid, tracker)
                req.load = load
            if req is not None:
                meta.requests.append(req)

        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            rec = self._requests.get(rid)
            if rec is None or rec.running is None:
                continue
            tracker = rec.running
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                # A resumed (preempted) request gets its whole block table anew.
                tracker.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracker.block_ids.extend(new_ids[0])
            self._current_tables(rid, tracker, block_state)
            done = cached.num_computed_tokens[i] + num_sched.get(rid, 0)
            req = self._step_meta(rid, rec, done, save)
            pending, rec.confirmed = rec.confirmed, None
            if pending is not None:
                req = req or self._empty_meta(rid, tracker)
                req.load = pending.spec
            if req is not None:
                meta.requests.append(req)

        # Asynchronous loads: the request is not scheduled while its blocks fill.
        for rid in list(self._confirmed):
            rec = self._requests.get(rid)
            if rec is None or rec.confirmed is None:  # finished, or sent with its step
                del self._confirmed[rid]
                continue
            if rid in num_sched:
                continue
            pending, rec.confirmed = rec.confirmed, None
            del self._confirmed[rid]
            rec.sent_tokens = pending.spec.kvpool_cached_tokens
            rec.loading = True
            if rec.running is None:
                rec.phase = Phase.LOAD_SENT
            meta.requests.append(ReqMeta(req_id=rid, block_ids=pending.block_ids,
                                         chunk_hashes=pending.hashes, load=pending.spec,
                                         group_block_ids=pending.group_block_ids))

        meta.preempted = set(scheduler_output.preempted_req_ids or ())
        if self.eviction is not None:
            meta.evict, meta.keep = self.eviction.take()
        if self._mamba_groups and save and block_state is not None:
            self._attach_states(meta, block_state.boundary_state_offloads)
        if self._hold_blocks:
            self.holds.hold(meta)
        return meta

    def _attach_states(self, meta: KVPoolConnectorMetadata,
                       offloads: dict[str, list[tuple[int, int, int]]]) -> None:
        """Mamba groups (vLLM's align mode): the states vLLM handed over this step
        (``KVConnectorBlockState.boundary_state_offloads``: request -> ``(group, block id,
        boundary tokens)``) that a later hit can use go to the workers as
        ``ReqMeta.boundary_states``: a state at a chunk end, of a chunk the request saves (its
        admission limit, a prompt chunk), not sent before. Other boundaries (inside a chunk,
        past the prompt) are never a pool hit's end, and the null block holds no state."""
        by_req = {req.req_id: req for req in meta.requests}
        for rid, entries in offloads.items():
            rec = self._requests.get(rid)
            tracker = rec.running if rec is not None else None
            if rec is None or tracker is None:
                continue
            limit = min(tracker.save_limit, len(tracker.hashes))
            states = []
            for group, block, boundary in entries:
                chunk = boundary // self.chunk_size - 1
                if (group not in self._mamba_groups or block == NULL_BLOCK_ID
                        or boundary % self.chunk_size or not 0 <= chunk < limit
                        or (group, chunk) in tracker.saved_states):
                    continue
                tracker.saved_states.add((group, chunk))
                states.append((group, chunk, block))
            if not states:
                continue
            req = by_req.get(rid)
            if req is None:
                req = by_req[rid] = self._empty_meta(rid, tracker)
                meta.requests.append(req)
            req.boundary_states = states
            rec.saving = True

    def _current_tables(self, rid: str, tracker: Running, block_state: Any) -> None:
        """Hybrid models: every group's current block table (vLLM's, with null blocks where
        a window was freed), instead of the append-only copy of group 0."""
        if not self.hybrid:
            return
        tables = block_state.get_block_ids(rid) if block_state is not None else None
        if tables is None:
            return
        tracker.group_block_ids = tuple(list(t) for t in tables)
        # Whole chunks are counted on the full-attention group, which frees nothing.
        ref = next((g.index for g in self.groups if g.kind == "full"), 0)
        tracker.block_ids = list(tables[ref])

    def saves_finished_jobs(self, done: dict[int, int]) -> None:
        """Workers reported these save jobs ended (``LoadOutcomes.saves_done``: job ->
        workers): ``_save_holds.SaveHolds.ended``."""
        self.holds.ended(done)

    def bind_block_pool(self, pool: BlockPool) -> None:
        """vLLM's block pool (``bind_gpu_block_pool``), to hold blocks saves read."""
        self.holds.bind(pool)

    @property
    def has_held_blocks(self) -> bool:
        """Save jobs still holding blocks (vLLM's ``has_pending_push_work``)."""
        return self.holds.busy

    def _empty_meta(self, rid: str, tracker: Running) -> ReqMeta:
        return ReqMeta(req_id=rid, block_ids=list(tracker.block_ids),
                       chunk_hashes=tracker.hashes,
                       group_block_ids=tracker.group_block_ids)

    def _step_meta(self, rid: str, rec: RequestRecord, tokens_done: int, save: bool
                   ) -> ReqMeta | None:
        """A ``ReqMeta`` saving the chunks completed by ``tokens_done`` tokens, if any."""
        tracker = rec.running
        if not save or tracker is None:
            return None
        complete = min(tracker.save_limit, tokens_done // self.chunk_size,
                       len(tracker.block_ids) // self.config.blocks_per_chunk)
        if complete <= tracker.saved_chunks:
            return None
        req = self._empty_meta(rid, tracker)
        req.save_from_chunk, req.save_to_chunk = tracker.saved_chunks, complete
        req.is_last_save = complete == tracker.save_limit
        self.counters.saves_scheduled_chunks += complete - tracker.saved_chunks
        tracker.saved_chunks = complete
        rec.saving = True
        return req

    def loads_finished(self, req_ids: Iterable[str]) -> None:
        """Workers reported these async loads ended (vLLM's ``finished_recving``)."""
        for rid in req_ids:
            rec = self._requests.get(rid)
            if rec is not None:
                rec.loading = False

    def loads_outcome(self, outcomes: LoadOutcomes | None, finished_recving: Iterable[str]
                      ) -> None:
        """Count what each ended load really brought in, once (``LoadOutcomes`` from the
        workers, merged by vLLM over the ranks of one step; ``_load_outcomes``). Call before
        ``loads_finished``. Reports ``Reporter.loaded(req_id, loaded, failed_tokens)``.
        """
        if outcomes is not None and outcomes.saves_done:
            self.saves_finished_jobs(outcomes.saves_done)
        c = self.counters
        for rid, accepted, loaded in self._awaited.settle(
                outcomes.outcomes if outcomes else {}, finished_recving, self._loading):
            c.loaded_tokens += loaded
            c.load_failed_tokens += accepted - loaded
            self.reporter.loaded(rid, loaded, accepted - loaded)

    def _loading(self, rid: str) -> bool:
        rec = self._requests.get(rid)
        return rec is not None and rec.loading

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; ``(True, params)`` keeps its blocks until the worker reports its
        saves finished (``finished_sending``) or, for a request aborted while its async load
        was in flight, until the load's ``finished_recving`` (vLLM frees the blocks of a
        finished request then); ``(False, params)`` frees them now.

        ``params`` (vLLM's ``kv_transfer_params`` of the request's output) is
        ``handover.handover_params`` for a request a P/D proxy marked ``do_remote_decode``
        when this engine saves and the pool will hold some of its chunks, else ``None``.
        """
        rid = request.request_id
        self.match.forget(rid)
        params = self._handover_params(request)
        rec = self._forget(rid)
        if rec.loading:
            # Freeing now would let vLLM hand the blocks to another request while the worker
            # still writes this request's KV into them.
            if self.events is not None and not rec.saving:
                self.events.release([rid])
            return True, params
        never_sent = rec.confirmed is not None
        if never_sent:
            # No outcome will be counted for a load this request never ran.
            self._awaited.drop(rid)
        # A load sent this step is counted when the step's outcome arrives: vLLM finishes a
        # request (a P/D prefill's one token) before it hands over the connector's output.
        if rec.saving:
            # Its saves' chunks may still be reported: released at its finished_sending.
            self._held_for_saves.add(rid)
            return True, params
        if self.events is not None:
            self.events.release([rid])
        return False, params

    def _handover_params(self, request: Request) -> dict[str, Any] | None:
        """``kv_transfer_params`` for a decode engine (``handover``): the leading tokens whose
        chunks the pool held or this engine's saves write (call before ``_forget``)."""
        rec = self._requests.get(request.request_id)
        tracker = rec.running if rec is not None else None
        if (tracker is None or not self.config.should_save
                or not wants_handover(getattr(request, "kv_transfer_params", None))):
            return None
        tokens = tracker.saved_chunks * self.chunk_size
        return handover_params(tokens) if tokens else None

    def saves_finished(self, req_ids: Iterable[str]) -> None:
        """Every worker finished these requests' saves (vLLM's ``finished_sending``)."""
        self._held_for_saves.difference_update(req_ids)

    @property
    def saves_outstanding(self) -> int:
        """Finished requests whose saves some worker may still be running."""
        return len(self._held_for_saves)

    def forget_lookups(self) -> None:
        """Drop every kept lookup answer, and running lookups' (the pool was flushed: ask
        again)."""
        for rec in self._requests.values():
            rec.asked = rec.offered = None
        self.match.clear()

    def _forget(self, rid: str) -> RequestRecord:
        """Drop ``rid``'s record (the one place it is dropped); returns it (an empty one for a
        request never seen)."""
        return self._requests.pop(rid, None) or RequestRecord()

    def close(self) -> None:
        """Stop the lookup thread, close the lookup client. Idempotent."""
        self.match.close()
        if self.lookup_client is not None:
            self.lookup_client.close()

