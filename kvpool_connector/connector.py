"""``KVPoolConnector``: the vLLM V1 KV connector class vLLM instantiates.

vLLM builds one instance per role: ``KVConnectorRole.SCHEDULER`` in the scheduler process
(delegates to ``KVPoolScheduler``) and ``KVConnectorRole.WORKER`` in every worker process
(delegates to ``KVPoolWorker``; worker rank 0 also runs the ``LookupServer`` answering the
scheduler's prefix queries). Each process starts its agent (``kvpool_agent.start_agent``); its
reporter receives the connector's events, and without an agent address it is a
``NullReporter`` and every event costs one empty call. A worker hands its agent a
``BackendOperations`` (``kvpool_connector.operations``) for the operator commands.

With vLLM's ``kv_events_config`` on, the connector's KV events (``BlockStored`` /
``BlockRemoved`` for what the pool holds, ``kvpool_connector._events``) go out with vLLM's own;
``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``) flushes this engine's
layout when ``reset_flush_scope`` says so.

Select it with ``kv_transfer_config={"kv_connector": "KVPoolConnector",
"kv_connector_module_path": "kvpool_connector", "kv_role": ..., "kv_connector_extra_config":
{...}}``; the extra config fields are documented in ``kvpool_connector.config.KVPoolConfig``.

Over 600 lines: not split yet (issue 37: the wiring of the scheduler, worker, agent and
``BackendOperations`` is to move to a wiring module).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

# The agent is a hard dependency: it ships in the same ``kvpool`` distribution as the connector
# (pyproject's packages), so there is no "agent not installed" case to fall back from; without
# an agent address ``start_agent`` returns a handle whose reporter does nothing.
from kvpool_agent import AgentHandle, start_agent
from kvpool_agent.operations import CommandError
from kvpool_agent.process_facts import process_facts
from kvpool_agent.protocol import Source
from kvpool_agent.vocabulary import INSTANCE_ROLE_OF, KV_ROLE_FOR, KV_ROLES
from kvpool_connector._context_prefill import context_prefill_gap
from kvpool_connector._events import (
    ChunkWritten,
    KVPoolKVEvents,
    PoolEventJoiner,
    PoolFlushed,
    kv_events_enabled,
)
from kvpool_connector._groups import KVGroup, kv_groups
from kvpool_connector._heads import HeadShares, plan_shares
from kvpool_connector._layout_digest import ModelFacts
from kvpool_connector._stats import (
    KVPoolConnectorStats,
    KVPoolPromMetrics,
    StatsCollector,
    StatsTap,
)
from kvpool_connector.backends.base import Backend, BackendError, BackendUnavailable
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.eviction import watermark_conflict
from kvpool_connector.fingerprint import engine_identity
from kvpool_connector.keys import ParallelLayout, pins_key
from kvpool_connector.lookup import (
    LookupClient,
    LookupFailed,
    LookupServer,
    PortInUse,
    RuntimeDirError,
    lookup_socket_path,
)
from kvpool_connector.metadata import KVPoolConnectorMetadata, LoadOutcomes
from kvpool_connector.operations import BackendOperations, Tokenize
from kvpool_connector.pins import PinnableBackend, Pins
from kvpool_connector.scheduler import KVPoolScheduler

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

    from kvpool_connector.worker import KVPoolWorker

__all__ = ["KVPoolConnector"]

logger = logging.getLogger(__name__)


RESET_FLUSH_TIMEOUT_MS = 60_000
"""Longest wait of ``reset_cache`` for worker rank 0's flush (ms): its saves (30 s at most),
readers' leases on the keys (15 s at most) and the removal."""


def _serves_lookups(cfg: KVPoolConfig) -> bool:
    """Whether worker rank 0 runs the lookup server: for lookups, and for the reset flush."""
    return cfg.should_load or cfg.reset_flush_scope != "none"


def _group(name: str) -> tuple[int, int]:
    """(rank, size) of this process in vLLM's parallel group ``name`` (``tp``, ``pcp``,
    ``dcp``, ``pp``); (0, 1) when the group is not initialised (single process)."""
    from vllm.distributed import parallel_state

    try:
        group = getattr(parallel_state, f"get_{name}_group")()
    except (AssertionError, AttributeError):
        return 0, 1
    return group.rank_in_group, group.world_size


def _worker_layout(vllm_config: VllmConfig, store_tp_size: int | None = None
                   ) -> tuple[ParallelLayout, dict[str, int], tuple[int, int],
                              HeadShares | str]:
    """This worker's shard, the layout sizes ``KVPoolWorker`` needs for lookups, its save
    stripe ``(rank, size)`` and its KV-head shares (or why it has none).

    MLA caches are identical on every TP rank, so all TP ranks share the ``tp0`` keys (the
    keys and the layout digest do not depend on the TP size) and each rank saves every
    TP-size-th chunk (vLLM's ``MooncakeStoreConnector`` stripes the same way). GQA/MHA values
    are per KV-head share (``_heads.plan_shares``); TP ranks that hold the same head (TP larger
    than the heads) stripe their saves the same way.
    """
    (tp, tp_size), (pcp, pcp_size) = _group("tp"), _group("pcp")
    (dcp, dcp_size), (pp, pp_size) = _group("dcp"), _group("pp")
    stripe = (0, 1)
    shares: HeadShares | str = ""
    if vllm_config.model_config.use_mla:
        stripe = (tp, tp_size)
        tp, tp_size = 0, 1
    else:
        shares = plan_shares(vllm_config.model_config.get_total_num_kv_heads(), tp, tp_size,
                             store_tp_size=store_tp_size, pcp_size=pcp_size, dcp_size=dcp_size)
        if isinstance(shares, HeadShares) and shares.replicas > 1:
            stripe = (shares.replica, shares.replicas)
    layout = ParallelLayout(tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp, pp_rank=pp)
    return layout, {"tp_size": tp_size, "pcp_size": pcp_size, "dcp_size": dcp_size,
                    "pp_size": pp_size}, stripe, shares


def _layer_ids(kv_caches: Mapping[str, object]) -> list[int]:
    """The model's index of each registered layer, read from its name as vLLM reads it
    (``extract_layer_index``: ``model.layers.12.self_attn.attn`` is 12); empty when a name
    holds no single index (``_stages.plan_ranges`` then keeps per-stage values)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return [extract_layer_index(name) for name in kv_caches]
    except (AssertionError, ValueError):
        return []


def _model_facts(vllm_config: VllmConfig, layer_names: list[str],
                 model_fingerprint: str | None = None) -> ModelFacts:
    """What vLLM's configuration and the weights' content say decides the KV bytes
    (``_layout_digest.ModelFacts``; the model's identity from ``fingerprint.engine_identity``
    with the operator's ``model_fingerprint``, logged with what it cost).

    Read when vLLM registers the caches: the attention layers (and their backends) exist only
    once the model is loaded, and the weights are local by then. A layer name that is not an
    attention layer adds no backend.
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    mc = vllm_config.model_config
    layers = get_layers_from_vllm_config(
        vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
    backends = sorted({layer.get_attn_backend().get_name() for layer in layers.values()})
    ident = engine_identity(vllm_config, model_fingerprint)
    w = ident.weights
    logger.info("KVPoolConnector: model fingerprint %s (%s) in %.1f ms", ident.fingerprint,
                f"{w.files} files, {w.tensors} tensors, {w.bytes_read} bytes read"
                if w is not None else ident.why or "model_fingerprint", ident.elapsed_ms)
    return ModelFacts(
        revision=mc.revision or "", quantization=str(mc.quantization or ""),
        dtype=str(mc.dtype).removeprefix("torch."),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        attn_backend=",".join(backends),
        kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(), fingerprint=ident.fingerprint,
    )


def _engine_tokenizer(vllm_config: VllmConfig) -> Tokenize | None:
    """vLLM's own tokenizer of the model, for text pins (``kvpool-console pin --text``),
    loaded at the first text pin (``cached_tokenizer_from_config``, the one vLLM's input
    processor uses); ``None`` when the engine has none (``skip_tokenizer_init``, or a stand-in
    config without ``model_config.tokenizer``, as the replay's simulated engines pass)."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or getattr(mc, "tokenizer", None) is None or mc.skip_tokenizer_init:
        return None

    def tokenize(text: str, chat_template: bool) -> list[int]:
        from vllm.tokenizers import cached_tokenizer_from_config

        tok = cached_tokenizer_from_config(mc)
        if chat_template and not getattr(tok, "chat_template", None):
            raise CommandError(f"the tokenizer of {mc.model} has no chat template: pin the "
                               "text without --chat-template, or as the engine's token ids")
        if chat_template:
            # The prefix as the engine sees a chat that starts with this system prompt.
            ids = tok.apply_chat_template([{"role": "system", "content": text}],
                                          tokenize=True, add_generation_prompt=False)
        else:
            # As vLLM encodes a text prompt: with the tokenizer's special tokens (BOS).
            ids = tok.encode(text)
        return [int(t) for t in ids]

    return tokenize


def _start_hint(exc: Exception) -> str:
    """What fixes a start failure, by its kind (shown by the console next to the error)."""
    if isinstance(exc, PortInUse):
        return ("another live engine holds this lookup socket on the host: give each engine "
                "its own kv_connector_extra_config.lookup_rpc_port, or leave it unset (the "
                "socket is then named from vLLM's instance_id)")
    if isinstance(exc, RuntimeDirError):
        return ("fix the lookup socket's runtime directory named in the message: remove it, "
                "or set KVPOOL_RUNTIME_DIR to a directory only the engine's user can access")
    if isinstance(exc, (BackendUnavailable, ImportError)):
        return ("install the backend's package on this host (mooncake: pip install "
                "mooncake-transfer-engine) and start its service, or set "
                "kv_connector_extra_config.backend to one that is installed")
    if isinstance(exc, (ValueError, KeyError)):
        return ("fix the field the message names in kv_transfer_config; `kvpool-config "
                "validate` checks a configuration before the engine starts")
    return "see the engine's log for the traceback"


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
        self._scheduler: KVPoolScheduler | None = None
        self._worker: KVPoolWorker | None = None
        self._lookup_server: LookupServer | None = None
        self._agent: AgentHandle | None = None
        self._operations: BackendOperations | None = None
        self._layout = ParallelLayout()
        self._tp_rank = 0
        self._events: PoolEventJoiner | None = None
        self._lookup_client: LookupClient | None = None
        # getattr: the demo's simulated engine passes a stand-in config without one.
        self._kv_events = kv_events_enabled(getattr(vllm_config, "kv_events_config", None))
        is_scheduler = role == KVConnectorRole.SCHEDULER
        try:
            self._setup(vllm_config, is_scheduler, kv_cache_config)
        except Exception as exc:
            self._report_start_failure(exc, "scheduler" if is_scheduler else "worker")
            raise

    def _setup(self, vllm_config: VllmConfig, is_scheduler: bool,
               kv_cache_config: KVCacheConfig | None) -> None:
        cfg = KVPoolConfig.from_vllm_config(vllm_config)
        self._groups: list[KVGroup] = kv_groups(kv_cache_config, cfg.block_size)
        self._hybrid = len(self._groups) > 1 or self._groups[0].kind != "full"
        if self._hybrid and (cfg.use_layerwise or not cfg.load_async):
            # vLLM reports a hybrid model's failed loads only per request and only for
            # asynchronous loads (failed_recving): a block-level report raises in its scheduler.
            if cfg.use_layerwise:
                logger.warning("KVPoolConnector: %d KV-cache groups: use_layerwise is off, "
                               "loads are asynchronous", len(self._groups))
            cfg = cfg.model_copy(update={"use_layerwise": False, "load_async": True})
        self.kv_config = cfg
        if cfg.declared_role is not None and INSTANCE_ROLE_OF[cfg.kv_role] != cfg.declared_role:
            logger.warning("KVPoolConnector: %s instance (declared by %s) runs kv_role %s; "
                           "set kv_role to %s", cfg.declared_role, cfg.role_source, cfg.kv_role,
                           KV_ROLE_FOR[cfg.declared_role])
        if is_scheduler:
            reporter = self._start_agent("scheduler", ParallelLayout(), backend=None)
            lookup = (
                LookupClient(lookup_rpc_port=cfg.lookup_rpc_port, instance_id=cfg.instance_id,
                             dp_rank=cfg.dp_rank, timeout_ms=cfg.lookup_timeout_ms)
                if _serves_lookups(cfg) else None
            )
            self._lookup_client = lookup
            self._world_size = vllm_config.parallel_config.world_size
            sched = self._scheduler = KVPoolScheduler(
                cfg, lookup, reporter, groups=self._groups, world_size=self._world_size,
                no_context_prefill=context_prefill_gap(vllm_config) if cfg.should_load else None)
            if sched.no_context_prefill:
                logger.warning("KVPoolConnector: vLLM's %s attention backend cannot prefill over "
                               "loaded context: this engine loads nothing from the pool "
                               "(NO_CONTEXT_PREFILL) and still saves", sched.no_context_prefill)
            self._stats = StatsCollector(lambda: sched.counters, reporter, worker=False)
            if self._kv_events and cfg.should_save:
                self._events = PoolEventJoiner(
                    medium=cfg.backend, chunk_size=cfg.chunk_size,
                    hash_block_size=getattr(kv_cache_config, "hash_block_size", None)
                    or cfg.block_size)
                sched.events = self._events
        else:
            from kvpool_connector.backends import create_backend
            from kvpool_connector.worker import KVPoolWorker

            self._layout, sizes, stripe, shares = _worker_layout(vllm_config, cfg.store_tp_size)
            self._backend = create_backend(cfg.backend, cfg.extra)
            # MLA: every rank uses the tp0 keys, but each is its own agent (its real rank),
            # and only the real rank 0 serves lookups.
            self._tp_rank = stripe[0] if vllm_config.model_config.use_mla else self._layout.tp_rank
            reporter = self._start_agent("worker", replace(self._layout, tp_rank=self._tp_rank),
                                         backend=self._backend)
            self._worker = KVPoolWorker(
                cfg, self._layout, cfg.model, self._backend, reporter,
                num_blocks=kv_cache_config.num_blocks if kv_cache_config else None,
                groups=self._groups if self._hybrid else None, stripe=stripe,
                shares=shares if isinstance(shares, HeadShares) else None,
                kv_share=shares if isinstance(shares, str) else "",
                pp_partition=cfg.store_pp_layer_partition,
                total_layers=(vllm_config.model_config.get_total_num_hidden_layers()
                              if cfg.store_pp_layer_partition else None),
                # The scheduler's LRU names chunks; TP rank 0 / PP rank 0 (where lookups are
                # served) removes every rank's keys of them.
                evicts=cfg.eviction == "connector" and cfg.should_save and self._tp_rank == 0
                and self._layout.pp_rank == 0, **sizes,
            )
            if self._operations is not None:
                self._operations.saves = self._worker
            work = self._worker
            self._stats = StatsCollector(lambda: work.counters, reporter, worker=True)
            if self._kv_events and cfg.should_save:
                work.enable_kv_events()

    # ------------------------------------------------------------------ agent

    def _start_agent(self, process_role: str, layout: ParallelLayout, backend: Backend | None
                     ) -> StatsTap:
        """Start this process's agent; return its reporter, tapped for vLLM's stats."""
        cfg = self.kv_config
        agent_id = (f"{cfg.engine_id}/scheduler" if process_role == "scheduler"
                    else f"{cfg.engine_id}/dp{cfg.dp_rank}.tp{layout.tp_rank}.pp{layout.pp_rank}")
        backend_cfg = getattr(backend, "config", None)
        source = Source(
            agent_id=agent_id, engine_id=cfg.engine_id, instance_role=cfg.instance_role,
            kv_role=cfg.kv_role, process_role=process_role,  # type: ignore[arg-type]
            dp_rank=cfg.dp_rank, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank, pid=os.getpid(),
            host=socket.gethostname(), backend=cfg.backend, model=cfg.model,
            # For SSH triage: the lookup socket this engine serves or queries, the master.
            **process_facts(
                sockets=[str(lookup_socket_path(cfg.lookup_rpc_port, cfg.dp_rank,
                                                instance_id=cfg.instance_id))]
                if _serves_lookups(cfg) else [],
                master=getattr(backend_cfg, "master_server_address", "")),
            role_source=cfg.role_source,
        )
        if backend is not None:
            # The key scope is known once register_kv_caches computed the layout digest.
            self._operations = BackendOperations(backend, source)
        self._agent = start_agent(
            source, address=cfg.agent_address, operations=self._operations,
            pool_admin_url=getattr(backend_cfg, "admin_url", None),
            # A worker knows the master's TTL from its Mooncake config even when the
            # connector's own lease_ttl_ms is unset.
            lease_ttl_ms=cfg.lease_ttl_ms or (backend.lease_ttl_ms() if backend else 0),
            keys_dir=cfg.agent_keys,
        )
        if self._operations is not None:
            self._operations.reporter = self._agent.reporter
        return StatsTap(self._agent.reporter)

    # ------------------------------------------------------------ vLLM stats

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This process's stats since the previous call (``kvpool_connector._stats``); vLLM
        calls it every step in the scheduler and in every worker and merges the results."""
        return self._stats.take()

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

    def _report_start_failure(self, exc: Exception, process_role: str) -> None:
        """Report ``exc`` to the hub as this process's start failure (``kvpool_agent``
        ``StartFailure``: error name, message, fix) before it propagates and the engine exits.
        Without a hub address nothing is sent; a failure here is logged, never raised."""
        try:
            agent = self._agent
            if agent is None:
                agent = start_agent(self._failure_source(process_role),
                                    address=self._failure_address())
            self._agent = None
            agent.report_start_failure(type(exc).__name__, str(exc), _start_hint(exc))
        except Exception:
            logger.exception("KVPoolConnector: could not report the start failure")

    def _failure_address(self) -> str | None:
        cfg = getattr(self, "kv_config", None)
        if cfg is not None:
            return cfg.agent_address
        ktc = self._vllm_config.kv_transfer_config
        extra = (ktc.kv_connector_extra_config if ktc is not None else None) or {}
        address = extra.get("agent_address")
        return address if isinstance(address, str) else None

    def _failure_source(self, process_role: str) -> Source:
        """Who reports a start failure: from the parsed config when it parsed, else from the
        raw ``kv_transfer_config`` (the failure may be that it does not parse)."""
        layout = self._layout
        cfg = getattr(self, "kv_config", None)
        if cfg is not None:
            engine_id, kv_role, dp = cfg.engine_id, cfg.kv_role, cfg.dp_rank
            role, role_source = cfg.instance_role, cfg.role_source
            backend, model = cfg.backend, cfg.model
        else:
            ktc = self._vllm_config.kv_transfer_config
            extra = (ktc.kv_connector_extra_config if ktc is not None else None) or {}
            engine_id = str(extra.get("engine_id") or (ktc.engine_id if ktc else "") or "engine")
            raw_role = ktc.kv_role if ktc is not None else None
            kv_role = raw_role if raw_role in KV_ROLES else "kv_both"
            dp = self._vllm_config.parallel_config.data_parallel_rank
            role, role_source = INSTANCE_ROLE_OF[kv_role], ""
            backend, model = str(extra.get("backend", "")), ""
        agent_id = (f"{engine_id}/scheduler" if process_role == "scheduler"
                    else f"{engine_id}/dp{dp}.tp{layout.tp_rank}.pp{layout.pp_rank}")
        return Source(agent_id=agent_id, engine_id=engine_id, instance_role=role,
                      kv_role=kv_role, process_role=process_role,  # type: ignore[arg-type]
                      dp_rank=dp, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank,
                      pid=os.getpid(), host=socket.gethostname(), backend=backend, model=model,
                      role_source=role_source, **process_facts())

    # --------------------------------------------------------------- scheduler

    def _sched(self) -> KVPoolScheduler:
        if self._scheduler is None:
            raise RuntimeError("KVPoolConnector: scheduler method called in a worker process")
        return self._scheduler

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
        return self._scheduler is not None and self._scheduler.has_held_blocks

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: count the loads' outcomes (``LoadOutcomes``, the workers'
        ``build_connector_worker_meta``); ``finished_recving`` ends those async loads."""
        sched = self._sched()
        outcomes = connector_output.kv_connector_worker_meta
        recving = connector_output.finished_recving or ()
        sched.loads_outcome(outcomes if isinstance(outcomes, LoadOutcomes) else None, recving)
        sched.loads_finished(recving)
        sched.saves_finished(connector_output.finished_sending or ())
        if self._events is not None:
            reports = connector_output.kv_cache_events
            if isinstance(reports, KVPoolKVEvents):
                self._events.add(reports.get_all_events())
            # Every worker finished these requests' saves: their chunks are all reported.
            self._events.release(connector_output.finished_sending or ())

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
        sched = self._scheduler
        if sched is None:
            return None
        cfg = self.kv_config
        if cfg.reset_flush_scope == "none":
            return True
        if self._world_size > 1 and sched.saves_outstanding:
            logger.warning("kvpool reset_cache: %d finished requests' saves are still running; "
                           "the pool is not flushed (reset_prefix_cache again once they "
                           "finished)", sched.saves_outstanding)
            return False
        assert self._lookup_client is not None  # created whenever reset_flush_scope is set
        try:
            removed = self._lookup_client.reset_flush(RESET_FLUSH_TIMEOUT_MS)
        except LookupFailed as exc:
            logger.error("kvpool reset_cache: flushing this engine's keys failed (%s): %s",
                         exc.name, exc)
            return False
        sched.forget_lookups()
        if self._events is not None:
            self._events.flushed()
        logger.warning("kvpool reset_cache: removed %d keys of this engine's layout "
                       "(reset_flush_scope engine)", removed)
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler side: ``BlockStored`` for chunks every shard wrote to the pool and
        ``BlockRemoved`` after flushes of this engine's keys, since the last call; vLLM
        publishes them with its KV-event publisher (``kvpool_connector._events``). Nothing
        unless ``kv_events_config.enable_kv_cache_events``."""
        return self._events.take() if self._events is not None else ()

    # ------------------------------------------------------------------ worker

    def _work(self) -> KVPoolWorker:
        if self._worker is None:
            raise RuntimeError("KVPoolConnector: worker method called in the scheduler process")
        return self._worker

    def _meta(self) -> KVPoolConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Record each layer's KV tensor and the layout digest of this worker's keys
        (``KVPoolWorker.register_kv_caches``), give the agent's flush its key scope and, on
        TP rank 0 / PP rank 0 of an engine that loads, start the lookup server.

        Raises:
            PortInUse: another live engine holds ``lookup_rpc_port`` on this host.
            RuntimeDirError: the runtime directory of the lookup socket is unsafe.
        """
        worker = self._work()
        worker.register_kv_caches(
            kv_caches, _model_facts(self._vllm_config, list(kv_caches),
                                    self.kv_config.model_fingerprint),
            layer_ids=_layer_ids(kv_caches))
        cfg = self.kv_config
        if self._operations is not None:
            # Every shard the worker writes: with KV-head shares a rank writes several.
            self._operations.key_scope = (cfg.model, worker.layout_digest,
                                          tuple(worker.shard_layouts))
            backend = self._backend
            if isinstance(backend, PinnableBackend) and not worker.hybrid:
                pins = Pins(backend, worker.rank_keys, cfg.chunk_size, worker.key_bytes,
                            lambda: backend.stats().total_bytes, hash_algo=cfg.hash_algo,
                            share=cfg.pin_share,
                            record_key=pins_key(cfg.model, worker.layout_digest))
                try:
                    # The layout's pins live in the pool: a restarted engine saves them pinned.
                    pins.refresh(force=True)
                except BackendError as exc:
                    logger.warning("KVPoolConnector: pin records not read (%s): read again "
                                   "with the next pool stats", exc)
                self._operations.pins = pins
                worker.pinned_keys = pins.pinned_keys
                self._operations.tokenize = _engine_tokenizer(self._vllm_config)
            chunk_bytes = worker.chunk_pool_bytes if worker.evicts else 0
            if chunk_bytes:
                self._check_watermark(backend, chunk_bytes)
        if _serves_lookups(cfg) and self._tp_rank == 0 and self._layout.pp_rank == 0:
            ops = self._operations
            try:
                self._lookup_server = LookupServer(
                    worker.lookup_chunks, lookup_rpc_port=cfg.lookup_rpc_port,
                    instance_id=cfg.instance_id, dp_rank=cfg.dp_rank, engine_id=cfg.engine_id,
                    reset_flush=(lambda: ops.reset_flush().removed_keys)
                    if ops is not None and cfg.reset_flush_scope == "engine" else None,
                )
            except (PortInUse, RuntimeDirError) as exc:
                self._report_start_failure(exc, "worker")
                raise

    def _check_watermark(self, backend: Backend, chunk_bytes: int) -> None:
        """``eviction: connector``: warn when the master's watermark (as the Mooncake config
        states it) would evict before this engine's LRU is full."""
        cfg = self.kv_config
        watermark = getattr(getattr(backend, "config", None), "eviction_high_watermark_ratio",
                            None)
        if watermark is None or cfg.admission_pool_tokens is None:
            return
        why = watermark_conflict(cfg.admission_pool_tokens, cfg.chunk_size, chunk_bytes,
                                 backend.stats().total_bytes, watermark)
        if why:
            logger.warning("KVPoolConnector: %s", why)

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
        if not self._kv_events or self._worker is None:
            return None
        work = self._worker
        own, shards = work.own_shards, work.lookup_shards
        reports: list[KVCacheEvent] = [ChunkWritten(req_id=rid, chunk=c, shard=shard,
                                                    shards=shards, group=g)
                                       for rid, c, g in work.take_written_chunks()
                                       for shard in own]
        if self._operations is not None:
            reports += [PoolFlushed(scope=scope) for scope in self._operations.take_flushes()]
        return KVPoolKVEvents(reports) if reports else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call; vLLM recomputes them
        (``kv_load_failure_policy="recompute"``)."""
        return self._work().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Stop the lookup server/client, the worker's transfers and the agent. Idempotent."""
        if self._lookup_server is not None:
            self._lookup_server.close()
            self._lookup_server = None
        if self._worker is not None:
            self._worker.shutdown()
            self._backend.close()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._agent is not None:
            self._agent.stop()
            self._agent = None
