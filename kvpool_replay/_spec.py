"""What the replay's engine processes are told and what they report: the model's KV geometry
(``ModelShape``), one engine's settings (``EngineSpec``, sent to the process as JSON) and its
measurements (``EngineResult``, written back as JSON). No torch or vLLM here: the orchestrators
(``run_replay``, ``DemoCluster``) only build and read these.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Literal

import msgspec

from kvpool_agent.vocabulary import KVRole
from kvpool_replay._tokens import DEFAULT_VOCAB_SIZE

__all__ = [
    "DTYPE_BYTES", "REPLAY_LOOKUP_TIMEOUT_MS", "EngineResult", "EngineSpec", "ModelShape",
    "read_spec", "write_result",
]

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
"""Bytes per element of the KV dtypes the engines support (torch's ``element_size()``)."""

REPLAY_LOOKUP_TIMEOUT_MS = 5_000
"""``lookup_timeout_ms`` of replay and demo engines (an ``extra_config`` entry overrides it).
A replay measures hit rates against an exact ceiling, and several engines, the master and the
store share a few cores: the connector's 50 ms default (sized to protect a production scheduler
thread) would turn lookups slowed by the machine into misses and open the lookup breaker."""


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """KV geometry of the simulated model.

    ``bytes_per_token`` = ``layers * 2 (K and V) * kv_heads * head_size * dtype bytes``. Blocks
    hold ``block_size`` tokens (vLLM's ``--block-size``). The cache layout is vLLM's CPU one:
    ``(num_blocks, kv_heads, block_size, 2 * head_size)`` per layer.
    """

    layers: int = 2
    kv_heads: int = 1
    head_size: int = 8
    block_size: int = 16
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model shape {name} must be >= 1, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers."""
        return self.layers * 2 * self.kv_heads * self.head_size * self.itemsize


class EngineSpec(msgspec.Struct, kw_only=True):
    """Everything an engine process needs (sent as JSON to ``python -m
    kvpool_replay._engine_proc``).

    Attributes:
        engine_id: names the engine in agent reports.
        kv_role: vLLM ``kv_role``; ``kv_consumer`` engines load with ``consumer_is_to_load``.
        master_address: ``mooncake_master`` ``host:port``.
        model: model name in pool keys (one namespace per replay).
        shape: KV geometry.
        chunk_size: tokens per pool key (multiple of ``shape.block_size``).
        trace_path, indices: the trace and the request indices (0-based) this engine replays.
        speedup: trace time / wall time; ``0`` = as fast as possible.
        start_at: wall-clock time (s since epoch) of trace time 0; ``0`` = when ready.
        wait_saves: finish each request's saves before the next lookup (deterministic order).
        agent_address: fleet hub agent address, ``None`` = no agent reports.
        lookup_rpc_port: distinct per engine on a host.
        load_async, use_layerwise: connector modes.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        progress_to: ZMQ address of the orchestrator's ``ProgressReceiver`` ("" = no progress).
        result_path: where the ``EngineResult`` JSON goes.
        go_path: when set, wait for this file (written by the orchestrator once every engine is
            ready); it holds ``start_at``.
        ready_path: touched when the engine is ready.
        extra_config: more ``kv_connector_extra_config`` keys (backend settings).
        forward_to: prefill engine of a P/D pair: ZMQ address to PUSH each request's trace
            index to once its saves finished (its decode engine then replays it).
        feed_from: decode engine of a P/D pair: ZMQ address to PULL trace indices from,
            in place of ``indices`` (which then only size the KV cache); the engine stops
            after ``feed_count`` of them.
        hold_after: once its share is replayed and its result written, keep the engine (and
            its agent, reporting) up, idle, until it is terminated: the demo's engines, so a
            finished trace shows as idle engines, not as gone ones.
    """

    engine_id: str
    kv_role: KVRole = "kv_both"
    master_address: str
    model: str = "kvpool-replay"
    shape: ModelShape = msgspec.field(default_factory=ModelShape)
    chunk_size: int = 512
    trace_path: str
    indices: list[int] = msgspec.field(default_factory=list)
    speedup: float = 0.0
    start_at: float = 0.0
    wait_saves: bool = True
    agent_address: str | None = None
    lookup_rpc_port: int = 0
    load_async: bool = False
    use_layerwise: bool = False
    vocab_size: int = DEFAULT_VOCAB_SIZE
    progress_to: str = ""
    result_path: str = ""
    go_path: str = ""
    ready_path: str = ""
    extra_config: dict[str, Any] = msgspec.field(default_factory=dict)
    forward_to: str = ""
    feed_from: str = ""
    feed_count: int = 0
    hold_after: bool = False


class EngineResult(msgspec.Struct, kw_only=True):
    """What one engine measured. Token counts in tokens, sizes in bytes, times in seconds.

    ``hit_tokens`` are prompt tokens the pool served (claimed by ``get_num_new_matched_tokens``
    and loaded without error); ``claimed_tokens`` what the scheduler claimed before loading.
    ``per_request`` lists ``(trace index, hit tokens)``. ``load_errors`` counts blocks reported
    by ``get_block_ids_with_load_errors`` (recomputed); ``load_error_reasons`` failed loads
    (transfers) by error name, e.g. ``TIMEOUT``, ``LEASE_EXPIRED`` (the connector's
    ``get_kv_connector_stats`` errors, as in ``vllm:kvpool_transfer_errors_total``; the
    simulated engine only); ``corrupt_blocks`` loaded blocks whose
    bytes were wrong (must be 0). ``saved_bytes``/``loaded_bytes`` are KV bytes the connector
    was asked to save / loaded successfully. ``load_s``: wall time of synchronous loads
    (``start_load_kv``) or from submission to ``finished_recving`` for asynchronous ones;
    ``save_s``: from ``wait_for_save`` to ``finished_sending`` (measured only with
    ``wait_saves``). ``lookup_errors``: lookups that failed (the request ran without the
    pool); ``save_failed_keys``: pool values whose save failed; ``save_skipped_keys``: pool
    values not stored and not counted as failed: refused for a full pool (Mooncake -200
    NO_AVAILABLE_HANDLE, the rest of that request's saves skipped with them), skipped while
    the engine's ``save_budget_bytes`` were in flight, or dropped with a preempted request;
    ``evicted_keys``: values the connector removed (``eviction: connector``);
    ``max_lookup_s``: the longest
    ``get_num_new_matched_tokens`` call (bounded by ``lookup_timeout_ms`` while the pool is
    away). These are the connector's own counters; the real-vLLM engine reads them from
    vLLM's Prometheus series, so its ``max_lookup_s`` is a histogram bound
    (``_vllm_engine.pool_counters``).
    ``max_request_s``: the longest request, from the engine taking it (after its trace
    timestamp's wait) until it returned (lookup, loads, compute, saves; any engine).
    ``request_starts``: when each request of ``per_request`` began (epoch seconds, same order).
    """

    engine_id: str
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    claimed_tokens: int = 0
    per_request: list[tuple[int, int]] = msgspec.field(default_factory=list)
    saved_bytes: int = 0
    loaded_bytes: int = 0
    load_errors: int = 0
    load_error_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    corrupt_blocks: int = 0
    lookup_errors: int = 0
    save_failed_keys: int = 0
    save_skipped_keys: int = 0
    evicted_keys: int = 0
    max_lookup_s: float = 0.0
    max_request_s: float = 0.0
    request_starts: list[float] = msgspec.field(default_factory=list)
    save_s: float = 0.0
    load_s: float = 0.0
    wall_s: float = 0.0
    peak_rss_bytes: int = 0
    error: str = ""


def read_spec(path: str) -> EngineSpec:
    """The ``EngineSpec`` JSON file an engine process is started with.

    Raises:
        OSError: unreadable; msgspec.ValidationError / DecodeError: not an ``EngineSpec``.
    """
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=EngineSpec)


def write_result(spec: EngineSpec, result: EngineResult) -> None:
    """Hand ``result`` back as JSON: atomically to ``spec.result_path`` (written aside, then
    renamed, so the orchestrator never reads half a file), or one line on stdout without one."""
    data = msgspec.json.encode(result)
    if not spec.result_path:
        sys.stdout.buffer.write(data + b"\n")
        return
    tmp = spec.result_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, spec.result_path)
