"""One simulated engine: trace requests through ``KVPoolConnector`` exactly as vLLM calls it.

The engine owns a scheduler-role and a worker-role ``KVPoolConnector`` (in vLLM they live in the
EngineCore and the worker process; here in one process, talking over the connector's own lookup
socket), paged KV caches in torch tensors of a configurable model shape, and a block allocator.
Per request it runs vLLM V1's sequence (``vllm/v1/core/sched/scheduler.py`` and
``vllm/v1/worker/kv_connector_model_runner_mixin.py``):

1. scheduler: ``get_num_new_matched_tokens(request, num_computed_tokens=0)`` (no local prefix
   cache), block allocation, ``update_state_after_alloc``;
2. with an asynchronous load: empty steps (``build_connector_meta`` -> worker
   ``start_load_kv``/``wait_for_save``/``get_finished``) until the worker reports the request in
   ``finished_recving``;
3. the prefill step: ``build_connector_meta``; worker ``bind_connector_metadata``,
   ``start_load_kv``, per layer ``wait_for_layer_load`` -> "attention" (the engine writes the
   computed blocks' KV) -> ``save_kv_layer``, then ``wait_for_save``, ``get_finished``,
   ``get_block_ids_with_load_errors``;
4. the request finishes after its first token: ``request_finished``; blocks are freed when the
   worker reports it in ``finished_sending`` (or at once when no save is pending).

"Attention" writes a value derived from the chunk hash, block position and layer into every
computed block; every loaded block is checked against that value, so wrong KV from the pool is
counted (``corrupt_blocks``) and never passes silently.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from kvpool_connector.keys import chunk_hashes
from kvpool_replay._spec import REPLAY_LOOKUP_TIMEOUT_MS, EngineResult, EngineSpec
from kvpool_replay._tokens import request_tokens
from kvpool_replay._trace import TraceRequest

__all__ = ["SimEngine", "sim_engine_for"]

_IDLE_STEP_S = 0.0005
"""Pause between idle steps while waiting for transfers: leaves the GIL to the connector's
transfer threads (a busy loop would slow them down)."""

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class _Live:
    """One request in the engine."""

    index: int
    req: Any
    hashes: list[str]
    block_ids: list[int] = field(default_factory=list)
    external: int = 0


class _BlockPool:
    """Free list of vLLM block ids; hands out the lowest ids first so a request's blocks are
    mostly consecutive (as vLLM's free queue does on an idle engine)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"engine KV cache has {len(self._free)} free blocks, a request needs {n}: "
                "raise the engine's num_blocks"
            )
        out = [self._free.pop() for _ in range(n)]
        return out

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)
        self._free.sort(reverse=True)


def _vllm_config(spec: EngineSpec) -> Any:
    """A ``VllmConfig``-shaped object with real vLLM sub-configs: the attributes
    ``KVConnectorBase_V1``, ``KVPoolConfig.from_vllm_config`` and the layout digest read
    (``kv_transfer_config``, ``cache_config``, ``model_config``, ``parallel_config``, a
    ``compilation_config`` without attention layers, and ``instance_id``: new per engine, like
    vLLM's ``time.time_ns()``). A full ``VllmConfig`` would need a model
    checkpoint on disk."""
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig

    extra = {
        "backend": "mooncake",
        "chunk_size": spec.chunk_size,
        "lookup_rpc_port": spec.lookup_rpc_port,
        "engine_id": spec.engine_id,
        "load_async": spec.load_async,
        "use_layerwise": spec.use_layerwise,
        "consumer_is_to_load": True,
        "lookup_timeout_ms": REPLAY_LOOKUP_TIMEOUT_MS,
        # No weights to fingerprint: simulated engines of one model share by its name.
        "model_fingerprint": f"simulated:{spec.model}",
        **spec.extra_config,
    }
    if spec.agent_address:
        extra["agent_address"] = spec.agent_address
    ktc = KVTransferConfig(
        kv_connector="KVPoolConnector",
        kv_connector_module_path="kvpool_connector",
        kv_role=spec.kv_role,
        engine_id=spec.engine_id,
        kv_connector_extra_config=extra,
    )
    model_config = SimpleNamespace(
        model=spec.model,
        revision=None,
        quantization=None,
        use_mla=False,
        dtype=_DTYPES[spec.shape.dtype],
        get_num_layers=lambda *_: spec.shape.layers,
        get_num_kv_heads=lambda *_: spec.shape.kv_heads,
        get_total_num_kv_heads=lambda: spec.shape.kv_heads,  # TP=1: every head
        get_head_size=lambda: spec.shape.head_size,
    )
    return SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=CacheConfig(block_size=spec.shape.block_size),
        model_config=model_config,
        parallel_config=ParallelConfig(),
        instance_id=str(time.time_ns()),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


def _kv_cache_config(spec: EngineSpec, num_blocks: int, layer_names: list[str]) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    s = spec.shape
    attn = FullAttentionSpec(
        block_size=s.block_size, num_kv_heads=s.kv_heads, head_size=s.head_size,
        dtype=_DTYPES[s.dtype],
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layer_names, kv_cache_spec=attn)],
    )


class SimEngine:
    """A vLLM-shaped engine around ``KVPoolConnector`` (see the module docstring).

    Args:
        spec: the engine's settings.
        num_blocks: KV blocks per layer; must hold the longest prompt plus the blocks of
            requests whose saves are still in flight.

    Raises:
        ImportError: ``kvpool_connector.KVPoolConnector`` is not available.
        ValueError: from the connector's configuration (field named).
    """

    def __init__(self, spec: EngineSpec, num_blocks: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvpool_connector import KVPoolConnector

        self.spec = spec
        s = spec.shape
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(s.layers)]
        self.kv_caches = {
            name: torch.zeros(
                (num_blocks, s.kv_heads, s.block_size, 2 * s.head_size), dtype=_DTYPES[s.dtype]
            )
            for name in self.layer_names
        }
        # int16 views address the same bytes; used to write and check block values exactly.
        self._views = [t.view(torch.int16) for t in self.kv_caches.values()]
        self.blocks = _BlockPool(num_blocks)
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        # vLLM's block objects, one per block id, reused like vLLM's BlockPool does.
        self._kv_blocks = [KVCacheBlock(b) for b in range(num_blocks)]
        vcfg = _vllm_config(spec)
        kcfg = _kv_cache_config(spec, num_blocks, self.layer_names)
        self.worker = KVPoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
        self.worker.register_kv_caches(self.kv_caches)
        self.scheduler = KVPoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)
        # vLLM hands the workers' handshake metadata to the scheduler after KV-cache
        # registration (vllm/v1/engine/core.py): admission 'service' learns its layout there.
        shake = self.worker.get_handshake_metadata()
        if shake is not None:
            self.scheduler.set_xfer_handshake_metadata({0: shake})
        # The counters vLLM's KV connector stats carry (kvpool_connector._stats), read
        # directly: this engine owns both roles in one process.
        sched, work = self.scheduler.pool_scheduler, self.worker.pool_worker
        assert sched is not None and work is not None
        self._work = work
        self._lookup_counters, self._save_counters = sched.counters, work.counters
        self._forward_context = SimpleNamespace(
            no_compile_layers={}, attn_metadata={}, virtual_engine=0
        )
        self._pending_free: dict[str, _Live] = {}
        self._finished_ids: set[str] = set()
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._save_started = 0.0
        self.result = EngineResult(engine_id=spec.engine_id)

    # -- vLLM-shaped steps -----------------------------------------------------------------

    def _step(self, scheduled: list[_Live], on_layer: Callable[[int], None] | None) -> None:
        """One scheduler step and the worker's forward pass around it."""
        from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

        so = SchedulerOutput.make_empty()
        so.finished_req_ids = self._finished_ids
        self._finished_ids = set()
        for live in scheduled:
            nrd = NewRequestData.from_request(live.req, (list(live.block_ids),))
            so.scheduled_new_reqs.append(nrd)
            n = live.req.num_tokens - live.req.num_computed_tokens
            so.num_scheduled_tokens[live.req.request_id] = n
            so.total_num_scheduled_tokens += n
        meta = self.scheduler.build_connector_meta(so)
        t0 = time.perf_counter()
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(self._forward_context)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        for i, name in enumerate(self.layer_names):
            self.worker.wait_for_layer_load(name)
            if on_layer is not None:
                on_layer(i)
            self.worker.save_kv_layer(name, self.kv_caches[name], None)  # type: ignore[arg-type]
        t2 = time.perf_counter()
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(so.finished_req_ids)
        self._load_errors |= self.worker.get_block_ids_with_load_errors()
        self._count_load_errors()
        self.worker.clear_connector_metadata()
        self.result.load_s += t1 - t0
        self._save_started = t2
        self._on_finished(sending or set(), recving or set())

    def _count_load_errors(self) -> None:
        """Failed loads by error name from the worker's stats (vLLM takes them every step)."""
        stats = self.worker.get_kv_connector_stats()
        if stats is None:
            return
        reasons = self.result.load_error_reasons
        for name, n in stats.data.get("errors", {}).items():
            kind, _, error = name.partition(":")
            if kind == "load":
                reasons[error] = reasons.get(error, 0) + n

    def _on_finished(self, sending: set[str], recving: set[str]) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        self.scheduler.update_connector_output(
            KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                              invalid_block_ids=set(self._load_errors),
                              kv_connector_worker_meta=self.worker.build_connector_worker_meta())
        )
        self._recving |= recving
        for rid in sending:
            live = self._pending_free.pop(rid, None)
            if live is not None:
                self.blocks.free(live.block_ids)

    # -- KV "attention" ----------------------------------------------------------------------

    def _block_values(self, live: _Live, first: int, last: int) -> torch.Tensor:
        """int16 value per block in ``[first, last)``: from the hash of the chunk holding it
        (a function of the whole prefix, like real KV) and the block's position; blocks past
        the last whole chunk get a value from the request index (never loaded)."""
        bpc = self.spec.chunk_size // self.spec.shape.block_size
        vals = []
        for b in range(first, last):
            c = b // bpc
            base = int(live.hashes[c][:4], 16) if c < len(live.hashes) else live.index
            vals.append(((base + 7 * (b % bpc)) % 30000) + 1)
        return torch.tensor(vals, dtype=torch.int16)

    def _write_layer(self, layer: int, live: _Live, first: int, last: int) -> None:
        if last <= first:
            return
        ids = torch.tensor(live.block_ids[first:last])
        vals = self._block_values(live, first, last) + layer
        view = self._views[layer]
        view[ids] = vals.view(-1, 1, 1, 1).expand(-1, *view.shape[1:])

    def _check_loaded(self, live: _Live, nblocks: int) -> int:
        """Blocks among the first ``nblocks`` whose bytes differ from what attention wrote."""
        if nblocks <= 0:
            return 0
        ids = torch.tensor(live.block_ids[:nblocks])
        want = self._block_values(live, 0, nblocks)
        bad = torch.zeros(nblocks, dtype=torch.bool)
        for layer, view in enumerate(self._views):
            got = view[ids].reshape(nblocks, -1)
            bad |= (got != (want + layer).view(-1, 1)).any(dim=1)
        return int(bad.sum())

    # -- one request ---------------------------------------------------------------------

    def run_request(self, index: int, treq: TraceRequest) -> int:
        """Replay one trace request; returns its hit tokens (served by the pool)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.request import Request, RequestStatus

        spec, s = self.spec, self.spec.shape
        tokens = request_tokens(treq, spec.vocab_size)
        rid = f"{spec.engine_id}-r{index}"
        req = Request(rid, tokens, SamplingParams(max_tokens=1), None)
        live = _Live(index, req, chunk_hashes(tokens, spec.chunk_size))
        n = len(tokens)

        asked = time.perf_counter()
        matched, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        while matched is None:
            # "needs more time": vLLM asks again on a later step.
            self._step([], None)
            matched, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        # Until the answer, not the first ask: an async lookup's first ask returns at once.
        self.result.max_lookup_s = max(self.result.max_lookup_s, time.perf_counter() - asked)
        live.external = matched
        live.block_ids = self.blocks.allocate(math.ceil(n / s.block_size))
        # Loaded blocks start as garbage, so a load that writes nothing is caught.
        for view in self._views:
            view[torch.tensor(live.block_ids)] = -1
        kv_blocks = KVCacheBlocks((tuple(self._kv_blocks[b] for b in live.block_ids),))
        self.scheduler.update_state_after_alloc(req, kv_blocks, matched)
        self.result.claimed_tokens += matched

        computed = 0
        if matched and is_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            req.num_computed_tokens = matched
            load_started = time.perf_counter()
            deadline = time.monotonic() + 120
            while rid not in self._recving:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"asynchronous load of {rid} did not finish in 120 s")
                self._step([], None)
                time.sleep(_IDLE_STEP_S)
            self._recving.discard(rid)
            self.result.load_s += time.perf_counter() - load_started
            computed = self._valid_prefix(live, matched)
            req.num_computed_tokens = computed
            req.status = RequestStatus.WAITING
            # vLLM schedules the resumed request without a new lookup (num_computed_tokens > 0)
            # and tells the connector about its blocks again with no external tokens.
            self.scheduler.update_state_after_alloc(req, kv_blocks, 0)
            req.status = RequestStatus.RUNNING
            self._step([live], lambda layer: self._write_layer(
                layer, live, computed // s.block_size, len(live.block_ids)))
            save_started = self._save_started
        else:
            req.num_computed_tokens = matched
            req.status = RequestStatus.RUNNING
            first = matched // s.block_size
            self._step([live], lambda layer: self._write_layer(
                layer, live, first, len(live.block_ids)))
            save_started = self._save_started
            computed = self._valid_prefix(live, matched)
            if computed < matched:
                # vLLM reschedules the failed blocks for recompute.
                for layer in range(s.layers):
                    self._write_layer(layer, live, computed // s.block_size, first)

        good = computed // s.block_size
        self.result.corrupt_blocks += self._check_loaded(live, good)
        self.result.loaded_bytes += computed * s.bytes_per_token
        self.result.hit_tokens += computed
        self.result.input_tokens += n
        self.result.requests += 1
        self.result.per_request.append((index, computed))
        self.result.saved_bytes += self._saved_tokens(live, computed) * s.bytes_per_token

        req.num_computed_tokens = n
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, _ = self.scheduler.request_finished(req, list(live.block_ids))
        self._finished_ids.add(rid)
        if delay:
            self._pending_free[rid] = live
        else:
            self.blocks.free(live.block_ids)
        if spec.wait_saves:
            deadline = time.monotonic() + 120
            while rid in self._pending_free:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"saves of {rid} did not finish in 120 s")
                self._step([], None)
                time.sleep(_IDLE_STEP_S)
            # finished_sending frees the blocks once the values are staged
            # (kvpool_connector.staging); the puts themselves may still run.
            if not self._work.drain_saves(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"saves of {rid} did not finish in 120 s")
            # From the save's submission to the worker reporting it finished.
            self.result.save_s += time.perf_counter() - save_started
        return computed

    def _valid_prefix(self, live: _Live, matched: int) -> int:
        """Tokens of the claimed prefix left after dropping blocks that failed to load (vLLM's
        ``_update_requests_with_invalid_blocks``: everything from the first failed block on is
        recomputed)."""
        bs = self.spec.shape.block_size
        claimed = live.block_ids[: matched // bs]
        failed = [i for i, b in enumerate(claimed) if b in self._load_errors]
        if not failed:
            return matched
        self.result.load_errors += matched // bs - failed[0]
        self._load_errors -= set(live.block_ids)
        return failed[0] * bs

    def _saved_tokens(self, live: _Live, computed: int) -> int:
        """Tokens of whole chunks this request hands to the pool (chunks past the loaded
        prefix), when this engine saves at all."""
        if self.spec.kv_role == "kv_consumer":
            return 0
        whole = len(live.hashes) * self.spec.chunk_size
        return max(0, whole - (computed // self.spec.chunk_size) * self.spec.chunk_size)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Step until every pending save finished (or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while self._pending_free and time.monotonic() < deadline:
            self._step([], None)
            time.sleep(_IDLE_STEP_S)

    def close(self) -> None:
        """Copy the connector's failure counters into the result; shut both roles down."""
        self._count_load_errors()
        self.result.lookup_errors = self._lookup_counters.lookup_errors
        self.result.save_failed_keys = self._save_counters.save_failed_keys
        self.result.save_skipped_keys = self._save_counters.save_skipped_keys
        self.result.evicted_keys = self._save_counters.evicted_keys
        for conn in (self.scheduler, self.worker):
            try:
                conn.shutdown()
            except Exception as exc:  # shutdown must not mask the replay's own result
                print(f"[{self.spec.engine_id}] connector shutdown failed: {exc}", file=sys.stderr)


def sim_engine_for(spec: EngineSpec, requests: list[TraceRequest]) -> SimEngine:
    """A ``SimEngine`` whose KV cache holds the longest of ``requests`` (the engine factory
    ``_engine_proc`` hands to ``run_engine_spec``)."""
    longest = max((r.input_length for r in requests), default=1)
    per = math.ceil(longest / spec.shape.block_size)
    # Room for the running request, plus a few whose saves are still in flight when requests
    # do not wait for their saves.
    return SimEngine(spec, per * (1 if spec.wait_saves else 4) + 16)
