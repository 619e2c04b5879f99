"""Trace replay and the demo fleet (``kvpool-replay``, ``kvpool-console --demo``).

- ``DemoCluster``: master + store, fleet hub, operator keys and engine processes replaying a
  Mooncake trace through ``KVPoolConnector``;
- ``run_replay``/``ReplayConfig``/``ReplayReport``: the replay behind ``kvpool-replay``;
- ``load_trace``, ``request_tokens``, ``prefix_ceiling``, ``lru_hits``: trace input and the
  independent reference figures.
"""

from kvpool_console.demo.cluster import DEMO_SHAPE, DemoCluster
from kvpool_console.demo.engine import EngineResult, EngineSpec, ModelShape, SimEngine
from kvpool_console.demo.reference import ReuseResult, lru_hits, prefix_ceiling
from kvpool_console.demo.replay import ReplayConfig, ReplayReport, reference_for, run_replay
from kvpool_console.demo.tokens import request_tokens
from kvpool_console.demo.trace import TraceError, TraceRequest, default_trace_path, load_trace

__all__ = [
    "DEMO_SHAPE",
    "DemoCluster",
    "EngineResult",
    "EngineSpec",
    "ModelShape",
    "ReplayConfig",
    "ReplayReport",
    "ReuseResult",
    "SimEngine",
    "TraceError",
    "TraceRequest",
    "default_trace_path",
    "load_trace",
    "lru_hits",
    "prefix_ceiling",
    "reference_for",
    "request_tokens",
    "run_replay",
]
