"""Replays at real models' KV sizes (issue 38): the pool in its own ``mooncake_client`` process,
TCP on 127.0.0.1, one engine. Every save lands (0 failed keys), no block is corrupt, and the hit
tokens equal the slice's prefix-reuse ceiling, which a replay at 64 B per token reaches exactly
(``test_replay.test_conversation_slice_reaches_ceiling_exactly``): the data path moves 128-320
KiB per token as correctly as the toy shape. The ceiling is computed, not replayed at the toy
shape here: a replay costs an engine start, and the computed figure is the exact one.

The trace is shortened, never the shape: the first four requests of the conversation trace with
at most 1,100 input tokens (3,932 tokens, 1,536 of them hits: the shared first chunk).
"""

from __future__ import annotations

import functools
import json
import lzma
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from replay_jobs import Jobs, background_jobs

from kvpool_replay import (
    ModelShape,
    ReplayConfig,
    ReplayReport,
    ReuseResult,
    default_trace_path,
    load_trace,
    reference_for,
    run_replay,
)
from kvpool_replay.cli import MODEL_SHAPES, build_parser, main, model_shape

# DeepSeek-V3 MLA is 61 layers x 576 x bf16 (68.6 KiB/token): the sim engine's cache carries a
# K and a V half per head, 2 x 288 elements are the 576 of the latent, the same bytes per block.
LLAMA3_8B, LLAMA3_70B = MODEL_SHAPES["llama3-8b"], MODEL_SHAPES["llama3-70b"]
DEEPSEEK_V3_MLA = MODEL_SHAPES["deepseek-v3-mla"]

REQUESTS = 4
MAX_INPUT = 1_100
# Room for the slice's 3 distinct chunks with no eviction (the unbounded default adds 64 chunks
# of slack: 10 GiB at 70B's 320 KiB per token).
POOL_TOKENS = 8 * 512


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = default_trace_path("conversation_trace.jsonl")
    out = tmp_path_factory.mktemp("real-shapes") / "short.jsonl"
    rows = []
    with lzma.open(src, "rt") if src.suffix == ".xz" else open(src) as f:
        for line in f:
            row = json.loads(line)
            if row["input_length"] <= MAX_INPUT:
                rows.append(line if line.endswith("\n") else line + "\n")
            if len(rows) == REQUESTS:
                break
    out.write_text("".join(rows))
    return out


@pytest.fixture(scope="module")
def ceiling(short_trace: Path) -> ReuseResult:
    """The slice's prefix-reuse ceiling at 512-token chunks (the unbounded pool's hits)."""
    result, _ = reference_for(load_trace(short_trace), 512, None)
    assert result.hit_tokens == 1_536  # the shared first chunk, three times
    return result


# id -> (dims, block size, bytes per token); the longest replays first (two run at a time).
CASES: dict[str, tuple[dict[str, Any], int, int]] = {
    "llama3-70b-b16": (LLAMA3_70B, 16, 320 << 10),
    "llama3-70b-b128": (LLAMA3_70B, 128, 320 << 10),
    "llama3-8b-b16": (LLAMA3_8B, 16, 128 << 10),
    "llama3-8b-b128": (LLAMA3_8B, 128, 128 << 10),
    "deepseek-v3-mla-b16": (DEEPSEEK_V3_MLA, 16, 61 * 576 * 2),
}
SHORT_LEASE = "test_a_lease_far_below_the_load_time_never_serves_wrong_kv"


@pytest.fixture(scope="module")
def replays(request: pytest.FixtureRequest, short_trace: Path) -> Iterator[Jobs]:
    """The module's replays (each its own master, store and engine), two at a time in the
    background from the first test on: each test asserts on its own."""
    def case(dims: dict[str, Any], block_size: int, **kw: Any) -> Callable[[], ReplayReport]:
        shape = ModelShape(block_size=block_size, **dims)
        return functools.partial(run_replay, ReplayConfig(
            trace_path=str(short_trace), shape=shape, pool_tokens=POOL_TOKENS, **kw))

    # A 60 s lease and a 60 s load budget: these are about moving real sizes, not their speed
    # (bench/); lapsed leases have their own replay below (SHORT_LEASE). Llama-3-70B lost one
    # chunk's load (a 160 MiB value) now and then in whole-suite runs: named since, it was the
    # 10 s inline-load budget (TIMEOUT, 32 blocks at block 16, recomputed) on a loaded
    # 2-core machine.
    jobs = {f"test_real_shape_replay_reaches_the_ceiling[{cid}]":
            case(dims, block_size, default_kv_lease_ttl_ms=60_000, layerwise_timeout_ms=60_000)
            for cid, (dims, block_size, _) in CASES.items()}
    # Issue 39's racing replay: connector eviction and a 5 ms lease at Llama-3-8B's shape.
    jobs[SHORT_LEASE] = case(LLAMA3_8B, 16, eviction="connector", default_kv_lease_ttl_ms=5)
    with background_jobs(request, jobs) as running:
        yield running


@pytest.mark.parametrize("cid", list(CASES))
def test_real_shape_replay_reaches_the_ceiling(cid: str, replays: Jobs, ceiling: ReuseResult,
                                               request: pytest.FixtureRequest) -> None:
    dims, block_size, per_token = CASES[cid]
    shape = ModelShape(block_size=block_size, **dims)
    assert shape.bytes_per_token == per_token
    report = replays.result(request.node.name)
    assert report.bytes_per_token == per_token
    assert report.errors == []
    assert report.save_failed_keys == 0
    assert (report.load_errors, report.load_error_reasons) == (0, {})
    assert report.corrupt_blocks == 0
    assert report.requests == REQUESTS
    assert report.hit_tokens == ceiling.hit_tokens
    assert report.hit_rate == report.ceiling_hit_rate == ceiling.hit_rate
    assert report.loaded_bytes == report.hit_tokens * per_token
    assert report.saved_bytes >= report.loaded_bytes > 0
    assert report.pool_evicted_keys == 0


def test_model_shape_presets_of_the_cli() -> None:
    args = build_parser().parse_args(["t.jsonl", "--model-shape", "llama3-70b",
                                      "--block-size", "128"])
    assert model_shape(args) == ModelShape(layers=80, kv_heads=8, head_size=128,
                                           block_size=128, dtype="bfloat16")
    assert model_shape(args).bytes_per_token == 320 << 10
    args = build_parser().parse_args(["t.jsonl", "--layers", "3"])
    assert model_shape(args) == ModelShape(layers=3, kv_heads=1, head_size=8)
    assert model_shape(build_parser().parse_args(["t.jsonl"])).bytes_per_token == 64


def test_a_shape_flag_beside_model_shape_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--layers`` beside ``--model-shape`` was ignored without a word."""
    with pytest.raises(SystemExit) as exited:
        main(["t.jsonl", "--model-shape", "llama3-8b", "--layers", "3", "--dtype", "float16"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == ("kvpool-replay: error: --layers, --dtype: --model-shape llama3-8b sets the "
                   "whole KV shape; give one or the other (see kvpool-replay --help)\n")


def test_a_malformed_agent_address_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--agent-address foo`` was taken, and the engines then logged a hint about a config key
    the user never wrote."""
    with pytest.raises(SystemExit) as exited:
        main(["t.jsonl", "--agent-address", "foo"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool-replay: error: argument --agent-address: hub address 'foo': "
                          "expected tcp://HOST:PORT (e.g. tcp://127.0.0.1:7600)"), err
    assert err.count("\n") == 1


def test_a_lease_far_below_the_load_time_never_serves_wrong_kv(replays: Jobs,
                                                               ceiling: ReuseResult) -> None:
    """Issue 39: a read holds a lease, not a reference. With ``eviction: connector`` (keys
    removed as soon as no lease holds them) and a 5 ms lease, far below the load time of a
    Llama-3-8B chunk (64 MiB over TCP), every load outlives its lease and fails (Mooncake's
    own check or the worker's, ``test_a_load_that_outlives_its_lease_is_recomputed``): each
    is recomputed, no hit is served and no loaded block is corrupt."""
    report = replays.result(SHORT_LEASE)
    assert report.bytes_per_token == 128 << 10 and report.eviction == "connector"
    assert report.errors == [] and report.corrupt_blocks == 0
    assert ceiling.hit_tokens > 0 and report.load_errors > 0
    # Every failed load failed on its lease (the Mooncake name, -707), none otherwise.
    assert set(report.load_error_reasons) == {"LEASE_EXPIRED"}
    assert report.hit_tokens == 0
