"""``admission: service``: how an engine's scheduler gets its ``PolicyClient`` (issue 40).

The scheduler process knows neither the layout digest nor the pool keys (the workers compute
them from their KV caches), so worker TP rank 0 / PP rank 0 hands them over through vLLM's
handshake metadata (``get_handshake_metadata``, gathered after KV-cache registration and given
to the scheduler's ``set_xfer_handshake_metadata``). Layer-wise keys and models with several
KV-cache groups are not steered by the service (no handshake: the engine saves every chunk).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvpool_agent.auth import KeyPaths
from kvpool_agent.reporter import Reporter
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.policy_client import PolicyClient
from kvpool_connector.policy_wire import PolicyLayout
from kvpool_connector.worker import KVPoolWorker

logger = logging.getLogger(__name__)

_PROBE = "0" * 32


@dataclass(frozen=True)
class PolicyHandshake(KVConnectorHandshakeMetadata):
    """What the scheduler needs of the layout: its digest, every shard's key prefix and the
    bytes one chunk takes in the pool (every rank's keys)."""

    digest: str
    prefixes: tuple[str, ...]
    chunk_bytes: int


def worker_handshake(cfg: KVPoolConfig, worker: KVPoolWorker, tp_rank: int,
                     pp_rank: int) -> PolicyHandshake | None:
    """Worker TP rank 0 / PP rank 0's handshake with ``admission: service``; ``None`` on every
    other rank, for another admission, and where the service cannot steer (logged)."""
    if cfg.admission != "service" or tp_rank != 0 or pp_rank != 0 or not cfg.should_save:
        return None
    if cfg.use_layerwise or worker.hybrid:
        logger.warning("KVPoolConnector: admission 'service' steers whole-chunk keys of one "
                       "KV-cache group only; this engine saves every chunk")
        return None
    keys = worker.rank_keys([_PROBE])
    return PolicyHandshake(worker.layout_digest, tuple(k[:-len(_PROBE)] for k in keys),
                           worker.chunk_pool_bytes)


def scheduler_client(cfg: KVPoolConfig,
                     metadata: Mapping[int, KVConnectorHandshakeMetadata],
                     reporter: Reporter | None = None) -> PolicyClient | None:
    """The scheduler's ``PolicyClient`` from the workers' handshake (``None``: none came, or the
    agent keys cannot be read: logged, every chunk is saved); it tells ``reporter`` (the
    scheduler's agent) who is in charge (``PolicyClient``). A ``kv_producer``'s client saves
    every chunk (its decode engine loads them) and sends its records: the service counts the
    bytes and removes them once cold. A ``kv_consumer`` saves nothing and gets none (no
    handshake: ``worker_handshake``)."""
    shake = next((m for m in metadata.values() if isinstance(m, PolicyHandshake)), None)
    if shake is None or cfg.policy_service is None:
        return None
    try:
        keys = KeyPaths.of(cfg.agent_keys or "").client("agent")
    except ValueError as exc:
        logger.error("KVPoolConnector: admission 'service' off, every chunk is saved: %s", exc)
        return None
    logger.info("KVPoolConnector: admission by the policy service at %s (layout %s)",
                cfg.policy_service, shake.digest)
    return PolicyClient(cfg.policy_service, keys, cfg.engine_id,
                        PolicyLayout(shake.digest, list(shake.prefixes)), shake.chunk_bytes,
                        stale_s=cfg.policy_stale_ms / 1e3, reporter=reporter,
                        admit_all=cfg.kv_role == "kv_producer")
