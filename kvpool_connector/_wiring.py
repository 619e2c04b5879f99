"""The wiring of one connector process: which objects a role needs, built in the order their
dependencies allow, so that ``KVPoolConnector`` only routes vLLM's calls (issue 37).

The scheduler process (``build_scheduler``): its agent, the lookup client of worker rank 0's
``LookupServer``, the ``KVPoolScheduler``, vLLM's stats collector and, with vLLM's KV events,
the ``PoolEventJoiner``.

A worker process (``build_worker``), in three phases fixed by vLLM's call order:

1. at ``__init__``: the backend, its ``BackendOperations`` and the agent (which serves the
   operator's commands from then on), then the ``KVPoolWorker`` (which reports through the
   agent's reporter); ``BackendOperations.bind`` gives the operations the reporter and the
   worker's saves;
2. at ``register_kv_caches`` (``WorkerSide.register_kv_caches``): the worker learns the
   layers and the layout digest; ``BackendOperations.register`` gives the operations the key
   scope, the layout's pins and vLLM's tokenizer; worker rank 0 starts the ``LookupServer``;
3. at ``shutdown``: the lookup server, the worker's transfers, the backend and the agent stop.

A start failure in either role is reported to the hub (``report_start_failure``) before it
propagates and vLLM exits.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvpool_agent import AgentHandle, start_agent
from kvpool_agent.process_facts import process_facts
from kvpool_agent.protocol import Source
from kvpool_agent.vocabulary import INSTANCE_ROLE_OF, KV_ROLE_FOR, KV_ROLES
from kvpool_connector._context_prefill import context_prefill_gap
from kvpool_connector._events import PoolEventJoiner, kv_events_enabled
from kvpool_connector._groups import KVGroup, kv_groups
from kvpool_connector._heads import HeadShares
from kvpool_connector._stats import StatsCollector, StatsTap
from kvpool_connector._vllm_facts import (
    engine_tokenizer,
    layer_ids,
    model_facts,
    worker_layout,
)
from kvpool_connector.backends.base import Backend, BackendError, BackendUnavailable
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.eviction import watermark_conflict
from kvpool_connector.keys import ParallelLayout, pins_key
from kvpool_connector.lookup import (
    LookupClient,
    LookupFailed,
    LookupServer,
    PortInUse,
    RuntimeDirError,
    lookup_socket_path,
)
from kvpool_connector.operations import BackendOperations
from kvpool_connector.pins import PinnableBackend, Pins, pin_secret
from kvpool_connector.scheduler import KVPoolScheduler

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvpool_connector.worker import KVPoolWorker

__all__ = [
    "RESET_FLUSH_TIMEOUT_MS",
    "SchedulerSide",
    "StartProgress",
    "WorkerSide",
    "build_scheduler",
    "build_worker",
    "connector_config",
    "report_start_failure",
]

logger = logging.getLogger(__name__)

RESET_FLUSH_TIMEOUT_MS = 60_000
"""Longest wait of ``reset_cache`` for worker rank 0's flush (ms): its saves (30 s at most),
readers' leases on the keys (15 s at most) and the removal."""


def _serves_lookups(cfg: KVPoolConfig) -> bool:
    """Whether worker rank 0 runs the lookup server: for lookups, and for the reset flush."""
    return cfg.should_load or cfg.reset_flush_scope != "none"


def connector_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
                     ) -> tuple[KVPoolConfig, list[KVGroup], bool]:
    """The parsed ``kv_connector_extra_config``, vLLM's KV-cache groups and whether the model
    is hybrid (several groups, or one that is not full attention). A hybrid model's loads are
    asynchronous and never layer-wise: vLLM reports its failed loads only per request, and
    only for asynchronous loads (``failed_recving``); a block-level report raises in its
    scheduler.

    Raises:
        ValueError: a field is invalid (the message names it).
    """
    cfg = KVPoolConfig.from_vllm_config(vllm_config)
    groups = kv_groups(kv_cache_config, cfg.block_size)
    hybrid = len(groups) > 1 or groups[0].kind != "full"
    if hybrid and (cfg.use_layerwise or not cfg.load_async):
        if cfg.use_layerwise:
            logger.warning("KVPoolConnector: %d KV-cache groups: use_layerwise is off, "
                           "loads are asynchronous", len(groups))
        cfg = cfg.model_copy(update={"use_layerwise": False, "load_async": True})
    if cfg.declared_role is not None and INSTANCE_ROLE_OF[cfg.kv_role] != cfg.declared_role:
        logger.warning("KVPoolConnector: %s instance (declared by %s) runs kv_role %s; "
                       "set kv_role to %s", cfg.declared_role, cfg.role_source, cfg.kv_role,
                       KV_ROLE_FOR[cfg.declared_role])
    return cfg, groups, hybrid


def _agent_id(engine_id: str, process_role: str, dp_rank: int, layout: ParallelLayout) -> str:
    """An agent's id in the fleet: ``ENGINE/scheduler`` (``ENGINE/dpN.scheduler`` for data
    parallel rank N > 0: each DP rank runs its own scheduler, and a configured ``engine_id``
    is shared by every rank, so one id would make the hub take each rank's reports for a
    takeover of the others'), ``ENGINE/dpN.tpT.ppP`` for a worker."""
    if process_role == "scheduler":
        return f"{engine_id}/dp{dp_rank}.scheduler" if dp_rank else f"{engine_id}/scheduler"
    return f"{engine_id}/dp{dp_rank}.tp{layout.tp_rank}.pp{layout.pp_rank}"


def _master(cfg: KVPoolConfig, backend: Backend | None) -> str:
    """The pool's ``master_server_address`` as the engine's Mooncake config writes it (``""``
    for other backends, or a config the worker will refuse): the backend's, else read from
    the same config without connecting (the scheduler holds no backend; with an empty master
    its reports named no pool, and a hub refused every one of a key bound to the pool)."""
    backend_cfg = getattr(backend, "config", None)
    if backend_cfg is not None:
        return str(getattr(backend_cfg, "master_server_address", ""))
    if cfg.backend != "mooncake":
        return ""
    from kvpool_connector.backends.mooncake import MooncakeConfig

    try:
        return MooncakeConfig.load(cfg.extra).master_server_address
    except ValueError:
        return ""


def _source(cfg: KVPoolConfig, process_role: str, layout: ParallelLayout,
            backend: Backend | None) -> Source:
    """Who this process reports as: its agent id names the engine and its ranks; the lookup
    socket it serves or queries and the master are there for SSH triage."""
    agent_id = _agent_id(cfg.engine_id, process_role, cfg.dp_rank, layout)
    return Source(
        agent_id=agent_id, engine_id=cfg.engine_id, instance_role=cfg.instance_role,
        kv_role=cfg.kv_role, process_role=process_role,  # type: ignore[arg-type]
        dp_rank=cfg.dp_rank, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank, pid=os.getpid(),
        host=socket.gethostname(), backend=cfg.backend, model=cfg.model,
        **process_facts(
            sockets=[str(lookup_socket_path(cfg.lookup_rpc_port, cfg.dp_rank,
                                            instance_id=cfg.instance_id))]
            if _serves_lookups(cfg) else [],
            master=_master(cfg, backend)),
        role_source=cfg.role_source,
    )


def _agent(cfg: KVPoolConfig, source: Source, backend: Backend | None,
           operations: BackendOperations | None) -> AgentHandle:
    """Start this process's agent (a handle whose reporter does nothing without
    ``agent_address``)."""
    return start_agent(
        source, address=cfg.agent_address, operations=operations,
        pool_admin_url=getattr(getattr(backend, "config", None), "admin_url", None),
        # A worker knows the master's TTL from its Mooncake config even when the connector's
        # own lease_ttl_ms is unset.
        lease_ttl_ms=cfg.lease_ttl_ms or (backend.lease_ttl_ms() if backend else 0),
        keys_dir=cfg.agent_keys,
    )


@dataclass(slots=True)
class StartProgress:
    """How far a process's start got: what its start failure is reported with."""

    config: KVPoolConfig | None = None
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    agent: AgentHandle | None = None


@dataclass(slots=True)
class SchedulerSide:
    """The scheduler process's objects (``build_scheduler``)."""

    config: KVPoolConfig
    scheduler: KVPoolScheduler
    lookup: LookupClient | None
    stats: StatsCollector
    events: PoolEventJoiner | None
    agent: AgentHandle
    world_size: int

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (``KVPoolConnector.reset_cache``
        says what each ``reset_flush_scope`` does); False, logged, when nothing was removed."""
        cfg, sched = self.config, self.scheduler
        if cfg.reset_flush_scope == "none":
            return True
        if self.world_size > 1 and sched.saves_outstanding:
            logger.warning("kvpool reset_cache: %d finished requests' saves are still running; "
                           "the pool is not flushed (reset_prefix_cache again once they "
                           "finished)", sched.saves_outstanding)
            return False
        assert self.lookup is not None  # created whenever reset_flush_scope is set
        try:
            removed = self.lookup.reset_flush(RESET_FLUSH_TIMEOUT_MS)
        except LookupFailed as exc:
            logger.error("kvpool reset_cache: flushing this engine's keys failed (%s): %s",
                         exc.name, exc)
            return False
        sched.forget_lookups()
        if self.events is not None:
            self.events.flushed()
        logger.warning("kvpool reset_cache: removed %d keys of this engine's layout "
                       "(reset_flush_scope engine)", removed)
        return True

    def close(self) -> None:
        self.scheduler.close()
        self.agent.stop()


def build_scheduler(vllm_config: VllmConfig, cfg: KVPoolConfig, groups: list[KVGroup],
                    kv_cache_config: KVCacheConfig | None,
                    progress: StartProgress) -> SchedulerSide:
    """The scheduler process's agent, lookup client, scheduler, stats and KV-event joiner.
    The agent goes to ``progress`` as soon as it runs (a later failure is reported through
    it)."""
    agent = progress.agent = _agent(cfg, _source(cfg, "scheduler", ParallelLayout(), None),
                                    None, None)
    reporter = StatsTap(agent.reporter)
    lookup = (LookupClient(lookup_rpc_port=cfg.lookup_rpc_port, instance_id=cfg.instance_id,
                           dp_rank=cfg.dp_rank, timeout_ms=cfg.lookup_timeout_ms)
              if _serves_lookups(cfg) else None)
    world_size = vllm_config.parallel_config.world_size
    sched = KVPoolScheduler(
        cfg, lookup, reporter, groups=groups, world_size=world_size,
        no_context_prefill=context_prefill_gap(vllm_config) if cfg.should_load else None,
        lookup_async=cfg.lookup_async)
    if sched.no_context_prefill:
        logger.warning("KVPoolConnector: vLLM's %s attention backend cannot prefill over "
                       "loaded context: this engine loads nothing from the pool "
                       "(NO_CONTEXT_PREFILL) and still saves", sched.no_context_prefill)
    events = None
    # getattr: the replay's simulated engine passes a stand-in config without one.
    if kv_events_enabled(getattr(vllm_config, "kv_events_config", None)) and cfg.should_save:
        events = sched.events = PoolEventJoiner(
            medium=cfg.backend, chunk_size=cfg.chunk_size,
            hash_block_size=getattr(kv_cache_config, "hash_block_size", None) or cfg.block_size)
    return SchedulerSide(config=cfg, scheduler=sched, lookup=lookup,
                         stats=StatsCollector(lambda: sched.counters, reporter, worker=False),
                         events=events, agent=agent, world_size=world_size)


@dataclass(slots=True)
class WorkerSide:
    """A worker process's objects (``build_worker``); ``kv_events``: vLLM's KV events are on
    (``kv_events_config``); ``lookup_server`` once ``register_kv_caches`` started it (worker
    rank 0 of an engine that loads)."""

    config: KVPoolConfig
    vllm_config: VllmConfig
    layout: ParallelLayout
    tp_rank: int
    backend: Backend
    operations: BackendOperations
    worker: KVPoolWorker
    stats: StatsCollector
    agent: AgentHandle
    kv_events: bool
    lookup_server: LookupServer | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Phase 2: the worker records each layer's KV tensor and the layout digest; the
        operations get the key scope (every shard the worker writes: with KV-head shares a rank
        writes several), the layout's pins (a backend that can pin, not a hybrid model) and
        vLLM's tokenizer; TP rank 0 / PP rank 0 of an engine that loads starts the lookup
        server.

        Raises:
            PortInUse: another live engine holds ``lookup_rpc_port`` on this host.
            RuntimeDirError: the runtime directory of the lookup socket is unsafe.
        """
        cfg, worker, backend = self.config, self.worker, self.backend
        worker.register_kv_caches(
            kv_caches, model_facts(self.vllm_config, list(kv_caches), cfg.model_fingerprint),
            layer_ids=layer_ids(kv_caches))
        pins = None
        if isinstance(backend, PinnableBackend) and not worker.hybrid:
            pins = Pins(backend, worker.rank_keys, cfg.chunk_size, worker.key_bytes,
                        lambda: backend.stats().total_bytes, hash_algo=cfg.hash_algo,
                        share=cfg.pin_share, record_key=pins_key(cfg.model, worker.layout_digest),
                        secret=pin_secret())
            try:
                # The layout's pins live in the pool: a restarted engine saves them pinned.
                pins.refresh(force=True)
            except BackendError as exc:
                logger.warning("KVPoolConnector: pin records not read (%s): read again with "
                               "the next poll", exc)
            # Agent or not, every rank learns a new pin within a poll (issue 40).
            pins.start()
            worker.pinned_keys = pins.pinned_keys
        self.operations.register(
            (cfg.model, worker.layout_digest, tuple(worker.shard_layouts)), pins,
            engine_tokenizer(self.vllm_config) if pins is not None else None)
        if worker.evicts:
            self._check_watermark(worker.chunk_pool_bytes)
        if _serves_lookups(cfg) and self.tp_rank == 0 and self.layout.pp_rank == 0:
            ops = self.operations
            self.lookup_server = LookupServer(
                worker.lookup_chunks, lookup_rpc_port=cfg.lookup_rpc_port,
                instance_id=cfg.instance_id, dp_rank=cfg.dp_rank, engine_id=cfg.engine_id,
                reset_flush=(lambda: ops.reset_flush().removed_keys)
                if cfg.reset_flush_scope == "engine" else None,
            )

    def _check_watermark(self, chunk_bytes: int) -> None:
        """``eviction: connector``: warn when the master's watermark (as the Mooncake config
        states it) would evict before this engine's LRU is full."""
        cfg = self.config
        watermark = getattr(getattr(self.backend, "config", None),
                            "eviction_high_watermark_ratio", None)
        if watermark is None or cfg.admission_pool_tokens is None or not chunk_bytes:
            return
        why = watermark_conflict(cfg.admission_pool_tokens, cfg.chunk_size, chunk_bytes,
                                 self.backend.stats().total_bytes, watermark)
        if why:
            logger.warning("KVPoolConnector: %s", why)

    def close(self) -> None:
        """Phase 3: the lookup server, the worker's transfers, the pins' poll thread, the
        backend, the agent."""
        if self.lookup_server is not None:
            self.lookup_server.close()
            self.lookup_server = None
        self.worker.shutdown()
        if self.operations.pins is not None:
            self.operations.pins.close()
        self.backend.close()
        self.agent.stop()


def build_worker(vllm_config: VllmConfig, cfg: KVPoolConfig, groups: list[KVGroup],
                 hybrid: bool, kv_cache_config: KVCacheConfig | None,
                 progress: StartProgress) -> WorkerSide:
    """Phase 1 of a worker: its shard of the keys, the backend, the operations, the agent
    (in ``progress`` as soon as it runs) and the ``KVPoolWorker``.

    Raises:
        BackendUnavailable: the backend's package or service is missing.
        ValueError: a backend setting is invalid.
    """
    from kvpool_connector._cpus import call_pinned, transfer_cpus
    from kvpool_connector.backends import create_backend
    from kvpool_connector.worker import KVPoolWorker

    layout, sizes, stripe, shares = worker_layout(vllm_config, cfg.store_tp_size)
    progress.layout = layout
    # Read with getattr: kvpool-replay's simulated engines pass a config without them (no
    # vLLM binding there: nothing moves).
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    par = getattr(vllm_config, "parallel_config", None)
    ranks: int = getattr(par, "local_world_size", 0) or getattr(par, "world_size", 1)
    cpus = transfer_cpus(cfg.transfer_cpus, cpu_engine=device == "cpu", local_ranks=ranks)
    # The store client's own threads (its transport's) start in its setup: there too.
    backend = call_pinned(cpus, lambda: create_backend(cfg.backend, cfg.extra))
    # MLA: every rank uses the tp0 keys, but each is its own agent (its real rank), and only
    # the real rank 0 serves lookups.
    tp_rank = stripe[0] if vllm_config.model_config.use_mla else layout.tp_rank
    source = _source(cfg, "worker", replace(layout, tp_rank=tp_rank), backend)
    # The key scope is known once register_kv_caches computed the layout digest.
    operations = BackendOperations(backend, source)
    agent = progress.agent = _agent(cfg, source, backend, operations)
    reporter = StatsTap(agent.reporter)
    worker = KVPoolWorker(
        cfg, layout, cfg.model, backend, reporter,
        num_blocks=kv_cache_config.num_blocks if kv_cache_config else None,
        groups=groups if hybrid else None, stripe=stripe,
        shares=shares if isinstance(shares, HeadShares) else None,
        kv_share=shares if isinstance(shares, str) else "",
        pp_partition=cfg.store_pp_layer_partition,
        total_layers=(vllm_config.model_config.get_total_num_hidden_layers()
                      if cfg.store_pp_layer_partition else None),
        # The scheduler's LRU names chunks; TP rank 0 / PP rank 0 (where lookups are served)
        # removes every rank's keys of them.
        evicts=cfg.eviction == "connector" and cfg.should_save and tp_rank == 0
        and layout.pp_rank == 0, cpus=cpus, **sizes,
    )
    operations.bind(agent.reporter, worker)
    kv_events = kv_events_enabled(getattr(vllm_config, "kv_events_config", None))
    if kv_events and cfg.should_save:
        worker.enable_kv_events()
    return WorkerSide(config=cfg, vllm_config=vllm_config, layout=layout, tp_rank=tp_rank,
                      backend=backend, operations=operations, worker=worker,
                      stats=StatsCollector(lambda: worker.counters, reporter, worker=True),
                      agent=agent, kv_events=kv_events)


def start_hint(exc: Exception) -> str:
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


def _failure_source(vllm_config: VllmConfig, progress: StartProgress,
                    process_role: str) -> Source:
    """Who reports a start failure: from the parsed config when it parsed, else from the raw
    ``kv_transfer_config`` (the failure may be that it does not parse)."""
    layout, cfg = progress.layout, progress.config
    if cfg is not None:
        engine_id, kv_role, dp = cfg.engine_id, cfg.kv_role, cfg.dp_rank
        role, role_source = cfg.instance_role, cfg.role_source
        backend, model = cfg.backend, cfg.model
    else:
        ktc = vllm_config.kv_transfer_config
        extra = (ktc.kv_connector_extra_config if ktc is not None else None) or {}
        engine_id = str(extra.get("engine_id") or (ktc.engine_id if ktc else "") or "engine")
        raw_role = ktc.kv_role if ktc is not None else None
        kv_role = raw_role if raw_role in KV_ROLES else "kv_both"
        dp = vllm_config.parallel_config.data_parallel_rank
        role, role_source = INSTANCE_ROLE_OF[kv_role], ""
        backend, model = str(extra.get("backend", "")), ""
    agent_id = _agent_id(engine_id, process_role, dp, layout)
    return Source(agent_id=agent_id, engine_id=engine_id, instance_role=role,
                  kv_role=kv_role, process_role=process_role,  # type: ignore[arg-type]
                  dp_rank=dp, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank,
                  pid=os.getpid(), host=socket.gethostname(), backend=backend, model=model,
                  role_source=role_source, **process_facts())


def _failure_address(vllm_config: VllmConfig, cfg: KVPoolConfig | None) -> str | None:
    if cfg is not None:
        return cfg.agent_address
    ktc = vllm_config.kv_transfer_config
    extra = (ktc.kv_connector_extra_config if ktc is not None else None) or {}
    address = extra.get("agent_address")
    return address if isinstance(address, str) else None


def report_start_failure(exc: Exception, vllm_config: VllmConfig, progress: StartProgress,
                         process_role: str) -> None:
    """Report ``exc`` to the hub as this process's start failure (``kvpool_agent``
    ``StartFailure``: error name, message, fix) before it propagates and the engine exits;
    the agent it goes through (the process's own once it runs, else one started for this) then
    stops. Without a hub address nothing is sent; a failure here is logged, never raised."""
    try:
        agent, progress.agent = progress.agent, None
        if agent is None:
            agent = start_agent(_failure_source(vllm_config, progress, process_role),
                                address=_failure_address(vllm_config, progress.config))
        agent.report_start_failure(type(exc).__name__, str(exc), start_hint(exc))
    except Exception:
        logger.exception("KVPoolConnector: could not report the start failure")
