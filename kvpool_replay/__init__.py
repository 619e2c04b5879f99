"""Trace replay, the demo fleet and the local pool services (``kvpool-replay``,
``kvpool-console --demo``, tests and benchmarks).

- ``run_replay``/``ReplayConfig``/``ReplayReport``: the replay behind ``kvpool-replay``
  (``kvpool_replay.cli``; ``CONNECTOR_EVICTION_LEASE_MS`` its masters' lease with
  ``--eviction connector``): engine processes replay a Mooncake trace through ``KVPoolConnector``
  and a real pool, set against ``reference_for`` (``prefix_ceiling``, ``lru_hits``); Belady's
  MIN is ``belady_hits``;
- ``DemoCluster``: master + store, fleet hub, operator keys and engine processes replaying a
  trace; ``kvpool-console --demo`` runs it with the console's TUI (``kvpool_replay.demo``);
- ``LocalMooncakeMaster``, ``LocalPoolStore`` (with ``DiskTier``, an SSD tier),
  ``LocalPolicyService`` (``kvpool-policy serve``), ``LocalYuanrongWorker``, ``free_port``,
  ``engine_env``, ``mooncake_extra_config``: real services on 127.0.0.1 and how to reach them;
- ``load_trace``, ``request_tokens``, ``default_trace_path``: trace input;
  ``ModelShape``/``EngineSpec``/``EngineResult``: what engines are told and report;
  ``build_tiny_model``: the tiny local Llama the real-vLLM engines load.

Importing the package loads neither torch nor vLLM: only the engine processes do.
"""

from kvpool_replay._cluster import DEMO_SHAPE, DemoCluster
from kvpool_replay._policy_service import LocalPolicyService
from kvpool_replay._pool import mooncake_extra_config
from kvpool_replay._processes import engine_env, free_port, free_port_block
from kvpool_replay._reference import (
    ReuseResult,
    belady_hits,
    lru_hits,
    prefix_ceiling,
    reference_for,
)
from kvpool_replay._replay import (
    CONNECTOR_EVICTION_LEASE_MS,
    ReplayConfig,
    ReplayReport,
    run_replay,
)
from kvpool_replay._services import (
    DiskTier,
    LocalMooncakeMaster,
    LocalPoolStore,
    LocalYuanrongWorker,
)
from kvpool_replay._spec import EngineResult, EngineSpec, ModelShape
from kvpool_replay._tiny_model import build_tiny_model
from kvpool_replay._tokens import request_tokens
from kvpool_replay._trace import TraceError, TraceRequest, default_trace_path, load_trace

__all__ = [
    "CONNECTOR_EVICTION_LEASE_MS",
    "DEMO_SHAPE",
    "DemoCluster",
    "DiskTier",
    "EngineResult",
    "EngineSpec",
    "LocalMooncakeMaster",
    "LocalPolicyService",
    "LocalPoolStore",
    "LocalYuanrongWorker",
    "ModelShape",
    "ReplayConfig",
    "ReplayReport",
    "ReuseResult",
    "TraceError",
    "TraceRequest",
    "belady_hits",
    "build_tiny_model",
    "default_trace_path",
    "engine_env",
    "free_port",
    "free_port_block",
    "load_trace",
    "lru_hits",
    "mooncake_extra_config",
    "prefix_ceiling",
    "reference_for",
    "request_tokens",
    "run_replay",
]
