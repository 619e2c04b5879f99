"""A real vLLM engine replaying trace requests (``DemoCluster(engine_kind="vllm")``).

``vllm.LLM`` with the tiny local model (``_tiny_model``) and
``KVPoolConnector``; vLLM's own scheduler and worker call the connector. The tiny model takes
at most 2048 positions, so each prompt is the trace request's token ids (``tokens``, ids
modulo the model's vocabulary) truncated to ``MAX_PROMPT_TOKENS``; requests keep their shared
prefixes. vLLM's local prefix cache is off, so every reused token comes from the pool;
``num_cached_tokens`` of each output is the request's hit.

vLLM's stat loggers are on, so the connector's counters reach vLLM's Prometheus registry
(``KVPoolPromMetrics``, in this frontend process): ``lookup_errors``, ``save_failed_keys`` and
``max_lookup_s`` of the result are read from there when the engine closes, as of the last
step vLLM ran (a save that fails after it is not counted).

Run as ``python -m kvpool_replay._vllm_engine SPEC.json`` (an ``EngineSpec`` whose
``model`` is the tiny model's directory).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry

from kvpool_replay._engine_proc import run_engine_spec
from kvpool_replay._spec import (
    REPLAY_LOOKUP_TIMEOUT_MS,
    EngineResult,
    EngineSpec,
    read_spec,
    write_result,
)
from kvpool_replay._tiny_model import VOCAB_SIZE
from kvpool_replay._tokens import request_tokens
from kvpool_replay._trace import TraceRequest

__all__ = ["MAX_PROMPT_TOKENS", "VllmEngine", "main", "pool_counters"]

MAX_PROMPT_TOKENS = 2000
"""Prompt tokens kept per request (the tiny model has 2048 positions; a few are left to
generate)."""

_MAX_NEW_TOKENS = 4


def pool_counters(result: EngineResult, registry: CollectorRegistry = REGISTRY) -> None:
    """Fill ``result``'s ``lookup_errors``, ``save_failed_keys``, ``save_skipped_keys`` and
    ``max_lookup_s`` from the connector's series in ``registry``
    (``vllm:kvpool_lookup_errors_total``, ``vllm:kvpool_save_failed_keys_total``,
    ``vllm:kvpool_save_skipped_keys_total``, the ``vllm:kvpool_lookup_seconds`` histogram;
    summed over their labels: one engine per process). A histogram keeps no maximum, so
    ``max_lookup_s`` is the tightest bound it gives: the smallest bucket bound that holds every
    lookup, or the sum of all lookups when that is smaller (0 without a lookup)."""
    totals = {"vllm:kvpool_lookup_errors_total": 0.0, "vllm:kvpool_save_failed_keys_total": 0.0,
              "vllm:kvpool_save_skipped_keys_total": 0.0}
    buckets: dict[float, float] = {}
    count = seconds = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
            elif sample.name == "vllm:kvpool_lookup_seconds_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == "vllm:kvpool_lookup_seconds_count":
                count += sample.value
            elif sample.name == "vllm:kvpool_lookup_seconds_sum":
                seconds += sample.value
    result.lookup_errors = int(totals["vllm:kvpool_lookup_errors_total"])
    result.save_failed_keys = int(totals["vllm:kvpool_save_failed_keys_total"])
    result.save_skipped_keys = int(totals["vllm:kvpool_save_skipped_keys_total"])
    bound = min((le for le, n in buckets.items() if n >= count), default=float("inf"))
    result.max_lookup_s = min(bound, seconds) if count else 0.0


class VllmEngine:
    """One ``vllm.LLM`` with ``KVPoolConnector``; ``run_request`` generates one trace request.

    Raises:
        ImportError: vLLM is not installed (``kvpool[vllm]``).
    """

    def __init__(self, spec: EngineSpec) -> None:
        from vllm import LLM

        self.spec = spec
        self.vocab = VOCAB_SIZE
        extra: dict[str, Any] = {
            "chunk_size": spec.chunk_size, "lookup_rpc_port": spec.lookup_rpc_port,
            "engine_id": spec.engine_id, "consumer_is_to_load": True,
            "lookup_timeout_ms": REPLAY_LOOKUP_TIMEOUT_MS, **spec.extra_config,
        }
        if spec.agent_address:
            extra["agent_address"] = spec.agent_address
        self.llm = LLM(
            model=spec.model, enforce_eager=True, max_model_len=2048,
            block_size=spec.shape.block_size, dtype="float32", enable_prefix_caching=False,
            max_num_seqs=4, max_num_batched_tokens=2048, seed=0, disable_log_stats=False,
            kv_transfer_config={
                "kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool_connector",
                "kv_role": spec.kv_role, "engine_id": spec.engine_id,
                "kv_connector_extra_config": extra,
            },
        )
        self.result = EngineResult(engine_id=spec.engine_id)

    def run_request(self, index: int, treq: TraceRequest) -> int:
        """Generate ``_MAX_NEW_TOKENS`` greedy tokens for the (truncated) request; returns the
        prompt tokens vLLM did not compute (loaded from the pool)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tokens = [t % self.vocab for t in request_tokens(treq)[:MAX_PROMPT_TOKENS]]
        params = SamplingParams(temperature=0.0, max_tokens=_MAX_NEW_TOKENS, ignore_eos=True)
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], params,
                                   use_tqdm=False)
        hit = int(out.num_cached_tokens or 0)
        r = self.result
        r.requests += 1
        r.input_tokens += len(tokens)
        r.hit_tokens += hit
        r.claimed_tokens += hit
        r.per_request.append((index, hit))
        r.loaded_bytes += hit * self.spec.shape.bytes_per_token
        return hit

    def drain(self, timeout_s: float = 60.0) -> None:
        """vLLM frees a request's blocks only after its saves finished: nothing to wait for."""

    def close(self) -> None:
        """Read the connector's counters (``pool_counters``), then shut the engine down (its
        EngineCore process and the connector's agents)."""
        pool_counters(self.result)
        del self.llm


def main(argv: list[str] | None = None) -> int:
    """Run the vLLM engine of the JSON ``EngineSpec`` in ``argv[0]``; result JSON to
    ``spec.result_path``. Exit status 1 when the replay failed."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvpool_replay._vllm_engine SPEC.json", file=sys.stderr)
        return 2
    spec = read_spec(args[0])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.monotonic()
    result = run_engine_spec(spec, lambda s, _reqs: VllmEngine(s))
    result.wall_s = time.monotonic() - t0
    write_result(spec, result)
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
