"""The peer benchmark's workload (``bench/bench_peer.py``, no vLLM here): prompts share leading
tokens exactly where the trace requests share leading ``hash_ids``, within the model's limits."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from kvpool_replay import TraceRequest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_peer.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peer", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_hash_ids_give_shared_token_prefixes() -> None:
    bench = _bench()
    trace = [
        TraceRequest(0, 3000, 4, [7, 8, 9, 10, 11, 12]),
        TraceRequest(1, 1800, 4, [7, 8, 20, 21]),     # shares blocks 7, 8 with the first
        TraceRequest(2, 1500, 4, [30, 31, 32]),       # shares nothing
        TraceRequest(3, 600, 4, [7, 40]),             # shares block 7 only
    ]
    p = bench.build_workload(trace, 1, 3, vocab=1024, max_prompt=2000)
    assert [len(x) for x in p] == [1800, 1500, 600]
    full = bench.build_workload(trace, 0, 1, vocab=1024, max_prompt=2000)[0]
    assert len(full) == 2000  # truncated to the model's prompt budget
    assert all(0 <= t < 1024 for x in [*p, full] for t in x)
    assert _common_prefix(full, p[0]) == 1024
    assert _common_prefix(full, p[2]) == 512
    assert _common_prefix(full, p[1]) < 512
    # Deterministic across calls (and processes: ids come from the hash id's own generator).
    assert bench.build_workload(trace, 1, 1, vocab=1024)[0] == p[0]


def test_empty_slice_is_refused() -> None:
    bench = _bench()
    with pytest.raises(ValueError, match="empty"):
        bench.build_workload([TraceRequest(0, 10, 1, [1])], 5, 3)


def test_the_pd_warmup_prompt_shares_no_chunk_with_the_workload() -> None:
    from kvpool_connector.keys import chunk_hashes
    from kvpool_replay._tokens import request_tokens

    bench = _bench()
    work = [TraceRequest(0, 2000, 8, [5, 9, 700, 3]), TraceRequest(1, 900, 8, [5, 12])]
    (warm,) = bench.pd_warmup(work)
    prompt = request_tokens(warm)
    assert len(prompt) == bench.MAX_PROMPT
    assert min(warm.hash_ids) == 701
    warm_chunks = set(chunk_hashes(prompt, 32))
    for req in work:
        toks = request_tokens(req)
        assert _common_prefix(prompt, toks) < 32
        assert warm_chunks.isdisjoint(chunk_hashes(toks, 32))
