"""``KVPoolConnector``: the vLLM V1 KV connector class vLLM instantiates.

vLLM builds one instance per role: ``KVConnectorRole.SCHEDULER`` in the scheduler process
(routes to ``KVPoolScheduler``) and ``KVConnectorRole.WORKER`` in every worker process (routes
to ``KVPoolWorker``; worker rank 0 also runs the ``LookupServer`` answering the scheduler's
prefix queries). ``kvpool_connector._wiring`` builds each role's objects (the agent, the
backend and its ``BackendOperations`` for the operator's commands, the scheduler or worker,
vLLM's stats, the KV-event joiner) in the order vLLM's calls allow; this class only routes
vLLM's calls to them.

With vLLM's ``kv_events_config`` on, the connector's KV events (``BlockStored`` /
``BlockRemoved`` for what the pool holds, ``kvpool_connector._events``) go out with vLLM's own;
``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``) flushes this engine's
layout when ``reset_flush_scope`` says so.

Select it with ``kv_transfer_config={"kv_connector": "KVPoolConnector",
"kv_connector_module_path": "kvpool_connector", "kv_role": ..., "kv_connector_extra_config":
{...}}``; the extra config fields are documented in ``kvpool_connector.config.KVPoolConfig``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvpool_connector._events import ChunkWritten, KVPoolKVEvents, PoolFlushed
from kvpool_connector._logs import follow_vllm_logging
from kvpool_connector._policy_link import scheduler_client, worker_handshake
from kvpool_connector._stats import KVPoolConnectorStats, KVPoolPromMetrics
from kvpool_connector._wiring import (
    SchedulerSide,
    StartProgress,
    WorkerSide,
    build_scheduler,
    build_worker,
    connector_config,
    report_start_failure,
)
from kvpool_connector.lookup import PortInUse, RuntimeDirError
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadOutcomes
from kvpool_connector.policy_client import PolicyClient

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvpool_connector.scheduler import KVPoolScheduler
    from kvpool_connector.worker import KVPoolWorker

__all__ = ["KVPoolConnector"]

logger = logging.getLogger(__name__)


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM V1 KV connector backed by a shared pool (Mooncake Store, openYuanrong, MemCache).

    Supports vLLM's hybrid memory allocator (``SupportsHMA``): every KV-cache group is saved
    and loaded (``kvpool_connector._groups``); with several groups loads are asynchronous
    and layer-wise mode is off (vLLM takes a hybrid model's load failures per request only).

    Args:
        vllm_config: the engine's ``VllmConfig``; ``kv_transfer_config`` selects this class.
        role: ``KVConnectorRole.SCHEDULER`` or ``KVConnectorRole.WORKER``.
        kv_cache_config: vLLM's KV-cache layout (block count, groups).

    Raises:
        ValueError: a ``kv_connector_extra_config`` field is invalid (the message names it).
        BackendUnavailable: (worker role) the backend's package or service is missing.
        RuntimeDirError: (an engine that loads) the lookup socket's runtime directory is unsafe
            or its path too long (``kvpool_connector.lookup``).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        follow_vllm_logging()
        self._sched_side: SchedulerSide | None = None
        self._policy: PolicyClient | None = None
        self._worker_side: WorkerSide | None = None
        self._process_role = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._start = StartProgress()
        try:
            cfg, groups, hybrid = connector_config(vllm_config, kv_cache_config)
            self._start.config = self.kv_config = cfg
            if self._process_role == "scheduler":
                self._sched_side = build_scheduler(vllm_config, cfg, groups, kv_cache_config,
                                                   self._start)
            else:
                self._worker_side = build_worker(vllm_config, cfg, groups, hybrid,
                                                 kv_cache_config, self._start)
        except Exception as exc:
            report_start_failure(exc, vllm_config, self._start, self._process_role)
            raise

    @property
    def pool_scheduler(self) -> KVPoolScheduler | None:
        """The scheduler process's ``KVPoolScheduler`` (its counters); ``None`` in a worker."""
        return self._sched_side.scheduler if self._sched_side is not None else None

    @property
    def pool_worker(self) -> KVPoolWorker | None:
        """A worker process's ``KVPoolWorker`` (its counters); ``None`` in the scheduler."""
        return self._worker_side.worker if self._worker_side is not None else None

    # ------------------------------------------------------------ vLLM stats

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This process's stats since the previous call (``kvpool_connector._stats``); vLLM
        calls it every step in the scheduler and in every worker and merges the results."""
        side = self._sched_side or self._worker_side
        assert side is not None
        return side.stats.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild the merged stats from their ``to_dict()`` form, for vLLM's log line."""
        return KVPoolConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVPoolPromMetrics:
        """The ``vllm:kvpool_*`` series of vLLM's Prometheus metrics
        (``kvpool_connector._stats.KVPoolPromMetrics``)."""
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --------------------------------------------------------------- scheduler

    def _side(self) -> SchedulerSide:
        if self._sched_side is None:
            raise RuntimeError("KVPoolConnector: scheduler method called in a worker process")
        return self._sched_side

    def _sched(self) -> KVPoolScheduler:
        return self._side().scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """See ``KVPoolScheduler.get_num_new_matched_tokens``."""
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """See ``KVPoolScheduler.update_state_after_alloc``."""
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """See ``KVPoolScheduler.build_connector_meta``."""
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """See ``KVPoolScheduler.request_finished``."""
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: the request finished in every KV-cache group; ``(True, None)``
        keeps every group's blocks until its saves' ``finished_sending`` (see
        ``KVPoolScheduler.request_finished``)."""
        return self._sched().request_finished(request, list(block_ids[0]) if block_ids else [])

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """vLLM's block pool: a hybrid model's saves hold the sliding-window blocks they read
        in it (``KVPoolScheduler.bind_block_pool``)."""
        self._sched().bind_block_pool(gpu_block_pool)

    def has_pending_push_work(self) -> bool:
        """Scheduler side: saves still hold blocks in vLLM's pool; vLLM keeps stepping so the
        workers can report them ended."""
        return self._sched_side is not None and self._sched_side.scheduler.has_held_blocks

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: count the loads' outcomes (``LoadOutcomes``, the workers'
        ``build_connector_worker_meta``); ``finished_recving`` ends those async loads."""
        side = self._side()
        sched, events = side.scheduler, side.events
        outcomes = connector_output.kv_connector_worker_meta
        recving = connector_output.finished_recving or ()
        sched.loads_outcome(outcomes if isinstance(outcomes, LoadOutcomes) else None, recving)
        sched.loads_finished(recving)
        sched.saves_finished(connector_output.finished_sending or ())
        if events is not None:
            reports = connector_output.kv_cache_events
            if isinstance(reports, KVPoolKVEvents):
                events.add(reports.get_all_events())
            # Every worker finished these requests' saves: their chunks are all reported.
            events.release(connector_output.finished_sending or ())

    def reset_cache(self) -> bool | None:
        """Scheduler side of vLLM's ``reset_prefix_cache(reset_connector=True)``.

        ``reset_flush_scope`` ``none`` (default): the pool is left as it is (True).
        ``engine``: worker rank 0 waits for its saves and removes every key of this
        engine's model and layout digest (``BackendOperations.reset_flush``, audited), before
        this returns, so no later lookup finds them; the chunks announced to routers get a
        ``BlockRemoved``. Returns False (logged; nothing removed, call again) when the flush
        failed or, with more than one worker, finished requests' saves are still running on
        workers rank 0 cannot wait for. Worker side: ``None``.
        """
        return self._sched_side.reset_cache() if self._sched_side is not None else None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler side: ``BlockStored`` for chunks every shard wrote to the pool and
        ``BlockRemoved`` after flushes of this engine's keys, since the last call; vLLM
        publishes them with its KV-event publisher (``kvpool_connector._events``). Nothing
        unless ``kv_events_config.enable_kv_cache_events``."""
        side = self._sched_side
        return side.events.take() if side is not None and side.events is not None else ()

    # ------------------------------------------------------------------ worker

    def _wside(self) -> WorkerSide:
        if self._worker_side is None:
            raise RuntimeError("KVPoolConnector: worker method called in the scheduler process")
        return self._worker_side

    def _work(self) -> KVPoolWorker:
        return self._wside().worker

    def _meta(self) -> KVPoolConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Record each layer's KV tensor and the layout digest of this worker's keys, give the
        operator's commands their key scope and pins and, on TP rank 0 / PP rank 0 of an engine
        that loads, start the lookup server (``WorkerSide.register_kv_caches``).

        Raises:
            PortInUse: another live engine holds ``lookup_rpc_port`` on this host.
            RuntimeDirError: the runtime directory of the lookup socket is unsafe.
        """
        try:
            self._wside().register_kv_caches(kv_caches)
        except (PortInUse, RuntimeDirError) as exc:
            report_start_failure(exc, self._vllm_config, self._start, "worker")
            raise

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Wait for saves/loads of requests preempted this step before vLLM zeroes or hands
        their blocks to other requests (a save must never read a reused block)."""
        assert isinstance(kv_connector_metadata, KVPoolConnectorMetadata)
        self._work().handle_preemptions(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads (``KVPoolWorker.start_load_kv``)."""
        self._work().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise mode: block (bounded by ``layerwise_timeout_ms``) until ``layer_name``'s
        blocks are loaded; a timeout reports the step's load blocks failed, never raises."""
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Layer-wise mode: start saving ``layer_name``'s completed chunks."""
        self._work().save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        """Save this step's completed chunks (or wait for the layer-wise saves)."""
        self._work().wait_for_save(self._meta())

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)`` request ids (see the scheduler contract in
        ``kvpool_connector.scheduler``)."""
        return self._work().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s requests, and (hybrid models) the requests whose load failed:
        vLLM recomputes them whole (``failed_recving``)."""
        sending, recving = self.get_finished(finished_req_ids)
        work = self._work()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()),
            failed_recving=work.take_failed_requests() if work.hybrid else set())

    def build_connector_worker_meta(self) -> LoadOutcomes | None:
        """This step's load outcomes for the scheduler (``KVPoolWorker``'s)."""
        return self._work().build_connector_worker_meta()

    def get_kv_connector_kv_cache_events(self) -> KVPoolKVEvents | None:
        """Worker side: one ``ChunkWritten`` per chunk this worker's saves wrote since the
        last call (and a ``PoolFlushed`` per operator flush of this engine's keys), for the
        scheduler's ``update_connector_output``; ``None`` when there is none or vLLM's KV
        events are off."""
        side = self._worker_side
        if side is None or not side.kv_events:
            return None
        work = side.worker
        own, shards = work.own_shards, work.lookup_shards
        reports: list[KVCacheEvent] = [ChunkWritten(req_id=rid, chunk=c, shard=shard,
                                                    shards=shards, group=g)
                                       for rid, c, g in work.take_written_chunks()
                                       for shard in own]
        reports += [PoolFlushed(scope=scope) for scope in side.operations.take_flushes()]
        return KVPoolKVEvents(reports) if reports else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call; vLLM recomputes them
        (``kv_load_failure_policy="recompute"``)."""
        return self._work().get_block_ids_with_load_errors()

    # ------------------------------------------------------- policy service

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker TP 0 / PP 0 hands its layout to the scheduler for ``admission: service``
        (``kvpool_connector._policy_link``)."""
        side = self._worker_side
        if side is None:
            return None
        return worker_handshake(side.config, side.worker, side.tp_rank, side.layout.pp_rank)

    def set_xfer_handshake_metadata(
            self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """The scheduler's ``PolicyClient`` decides saves from now on (``admission:
        service``)."""
        if self._sched_side is None or self._policy is not None:
            return
        self._policy = scheduler_client(self._sched_side.config, metadata,
                                        self._sched().reporter)
        if self._policy is not None:
            self._sched().admission = self._policy

    def shutdown(self) -> None:
        """Stop the lookup server/client, the worker's transfers, the backend and the agent.
        Idempotent."""
        if self._policy is not None:
            self._policy.close()
            self._policy = None
        side, self._sched_side, self._worker_side = (self._sched_side or self._worker_side,
                                                     None, None)
        if side is not None:
            side.close()
