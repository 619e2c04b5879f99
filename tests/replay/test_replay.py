"""Replay slices of both Mooncake traces through KVPoolConnector and a real mooncake_master;
the hit rate must equal the independently computed prefix-reuse ceiling exactly (unbounded
pool) and stay at or below it with a bounded pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_connector.admission import AdaptiveAdmission
from kvpool_connector.keys import chunk_hashes
from kvpool_replay import (
    ModelShape,
    ReplayConfig,
    default_trace_path,
    load_trace,
    lru_hits,
    prefix_ceiling,
    reference_for,
    request_tokens,
    run_replay,
)

SHAPE = ModelShape(layers=2, kv_heads=1, head_size=8, block_size=16, dtype="float16")
SMALL_POOL_SHAPE = ModelShape(layers=8, kv_heads=1, head_size=8, block_size=16, dtype="float16")
"""256 B per token: Mooncake's smallest segment (16 MiB) is then 65,536 tokens, so a bounded pool
overflows within 40 conversation requests (at SHAPE's 64 B it cannot be below 262,144 tokens)."""
SMALL_POOL_TOKENS = 66_000
"""128 chunks of 512 tokens (17 MiB at SMALL_POOL_SHAPE), against 1,106 distinct chunks (566,272
tokens) in the first 50 conversation requests."""
BOUNDED_REQUESTS = 50
"""The bounded-pool slice: the pool overflows more than 8 times, and an exact LRU of its size
already misses a hit the ceiling has (24,576 vs 25,088 hit tokens; at 40 requests 19,456 vs
19,968). 150 requests (the earlier slice) cost three times the replay and check nothing more."""
REPO = Path(__file__).resolve().parents[2]


def test_conversation_slice_reaches_ceiling_exactly() -> None:
    # 100 requests: 50,688 hit tokens at the ceiling, per request in trace order (more requests
    # repeat the same check and cost replay time).
    trace = default_trace_path("conversation_trace.jsonl")
    report = run_replay(ReplayConfig(trace_path=str(trace), limit=100, shape=SHAPE))
    assert report.errors == []
    reqs = load_trace(trace, limit=100)
    from kvpool_connector.keys import chunk_hashes

    ceiling = prefix_ceiling(
        [(r.input_length, chunk_hashes(request_tokens(r), 512)) for r in reqs], 512
    )
    assert report.requests == 100
    assert report.input_tokens == ceiling.input_tokens == sum(r.input_length for r in reqs)
    assert ceiling.hit_tokens > 0
    assert report.hit_tokens == ceiling.hit_tokens
    # Per request, in trace order: the same hit as the unbounded reference.
    (engine,) = report.per_engine
    assert [h for _, h in sorted(engine.per_request)] == ceiling.per_request
    assert report.hit_rate == pytest.approx(report.ceiling_hit_rate, abs=0)
    assert report.lru_hit_rate == report.ceiling_hit_rate  # unbounded: LRU never evicts
    assert report.load_errors == 0 and report.corrupt_blocks == 0
    assert report.loaded_bytes == report.hit_tokens * SHAPE.bytes_per_token
    assert report.saved_bytes > report.loaded_bytes > 0
    assert report.pool_evicted_keys == 0
    assert report.peak_rss_engine_bytes > 0 and report.peak_rss_master_bytes > 0


def test_synthetic_slice_via_cli_json_reaches_ceiling_exactly() -> None:
    # Through the console script, with load_async: vLLM parks each hit request in
    # WAITING_FOR_REMOTE_KVS until the worker reports it in finished_recving. 75 requests
    # (48,640 hit tokens at the ceiling) are enough for the exact comparison.
    trace = default_trace_path("synthetic_trace.jsonl")
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    out = subprocess.run(
        [sys.executable, "-m", "kvpool_replay.cli", str(trace), "--limit", "75",
         "--json", "--load-async"],
        capture_output=True, text=True, env=env, timeout=170, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    for field in ("requests", "input_tokens", "hit_tokens", "hit_rate", "ceiling_hit_rate",
                  "lru_hit_rate", "saved_bytes", "loaded_bytes", "load_errors", "wall_s",
                  "peak_rss_engine_bytes", "peak_rss_master_bytes"):
        assert field in report, field
    ceiling, _ = reference_for(load_trace(trace, limit=75), 512, None)
    assert report["requests"] == 75
    assert ceiling.hit_tokens > 0
    assert report["hit_tokens"] == ceiling.hit_tokens
    assert report["hit_rate"] == report["ceiling_hit_rate"] == pytest.approx(ceiling.hit_rate)
    assert report["load_errors"] == 0 and report["corrupt_blocks"] == 0
    # Without a terminal the progress bar becomes log lines; the last one is the final count.
    lines = [ln for ln in out.stderr.splitlines() if "requests," in ln and "ETA" in ln]
    assert lines and lines[-1].startswith("kvpool-replay: 75/75 requests"), out.stderr[-2000:]
    assert f"hit rate {report['hit_rate']:.1%}" in lines[-1]


def test_bounded_pool_stays_at_or_below_ceiling_next_to_lru() -> None:
    trace = default_trace_path("conversation_trace.jsonl")
    pool_tokens = SMALL_POOL_TOKENS  # far below the 566,272 tokens of distinct chunks in the slice
    report = run_replay(ReplayConfig(trace_path=str(trace), limit=BOUNDED_REQUESTS,
                                     shape=SMALL_POOL_SHAPE,
                                     pool_tokens=pool_tokens))
    assert report.errors == []
    assert report.pool_tokens == pool_tokens
    assert 0 < report.hit_rate <= report.ceiling_hit_rate
    assert 0 < report.lru_hit_rate < report.ceiling_hit_rate  # the bound matters for LRU too
    # The pool filled up: Mooncake evicted (or refused puts) instead of growing.
    assert report.pool_evicted_keys > 0
    assert report.corrupt_blocks == 0


def test_cli_rejects_bad_input_with_named_field(tmp_path: Path, capsys: object) -> None:
    from kvpool_replay.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, '
                     '"hash_ids": [1]}\n')
    assert main([str(trace), "--json"]) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert f"{trace}:1:" in err and "hash_ids" in err
    good = default_trace_path("conversation_trace.jsonl")
    assert main([str(good), "--limit", "5", "--pool-tokens", "1000"]) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "--pool-tokens >=" in err


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_cli_rejects_a_trace_without_requests(tmp_path: Path, text: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool_replay.cli import main

    trace = tmp_path / "empty.jsonl"
    trace.write_text(text)
    assert main([str(trace), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"kvpool-replay: {trace}: no requests (the file is empty or holds "
                            "only blank lines)\n")
    assert captured.out == ""


def test_cli_rejects_a_pool_larger_than_available_memory(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool_replay._pool import pool_bytes_for_tokens
    from kvpool_replay.cli import main

    # 64 B/token at the default model shape: 10**15 tokens are 64 PB, more than any machine.
    tokens = 10**15
    need = pool_bytes_for_tokens(tokens, ModelShape())
    good = default_trace_path("conversation_trace.jsonl")
    assert main([str(good), "--limit", "5", "--pool-tokens", str(tokens)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvpool-replay: the pool needs {need:,} bytes of memory but only ")
    assert err.endswith(" bytes are available: use a smaller --pool-tokens\n")
    # One line, before anything started (no "replaying ..." status line, no Mooncake abort).
    assert err.count("\n") == 1, err
    # Unbounded (no --pool-tokens): the whole trace at Llama-3-70B's shape (320 KiB a token)
    # needs terabytes; the line names what to give, not a flag the operator never typed.
    assert main([str(good), "--model-shape", "llama3-70b"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(" bytes are available: without --pool-tokens the pool holds every "
                        "chunk of the replayed requests at this shape: give --pool-tokens (a "
                        "bounded pool that evicts) or a smaller --limit\n"), err
    assert err.count("\n") == 1, err
    # Private mode: every engine's pool counts.
    assert main([str(good), "--limit", "5", "--engines", "4", "--private",
                 "--pool-tokens", str(tokens)]) == 2
    err = capsys.readouterr().err
    assert f"needs {4 * pool_bytes_for_tokens(tokens // 4, ModelShape()):,} bytes" in err


def test_require_memory_compares_with_what_is_available() -> None:
    from kvpool_replay._pool import require_memory

    require_memory(100, available_bytes=100)
    with pytest.raises(ValueError, match=r"needs 101 bytes of memory but only 100 bytes are "):
        require_memory(101, available_bytes=100)


def test_hits_lost_in_outage_counts_only_requests_begun_without_a_leader() -> None:
    from kvpool_replay import EngineResult
    from kvpool_replay._replay import hits_lost_in_outage

    reference = [0, 64, 128, 32, 96]
    a = EngineResult(engine_id="a", per_request=[(0, 0), (1, 64), (3, 0)],
                     request_starts=[100.0, 105.0, 112.0])
    b = EngineResult(engine_id="b", per_request=[(2, 16), (4, 96)],
                     request_starts=[106.0, 120.0])
    # Kill at 104.5, a leader serves at 115: requests 1 (no loss), 2 (112 lost of 128) and
    # 3 (32 lost) began in between; 0 before, 4 after. A hit above the reference is no gain.
    assert hits_lost_in_outage([a, b], reference, 104.5, 115.0) == 112 + 32
    assert hits_lost_in_outage([a, b], [0, 0, 0, 0, 0], 104.5, 115.0) == 0


def test_steered_pool_holds_what_the_policys_model_holds() -> None:
    """450 conversation requests in a 300k-token pool, ``admission: adaptive`` with
    ``eviction: connector``: the shortest slice where the policy's model (``lru_hits`` with
    ``AdaptiveAdmission``, an exact LRU behind the policy) leaves LRU, 3.86% vs 3.54% (250,880
    hit tokens vs 229,888; at 400 requests they are equal; 600 gave 4.48% vs 3.70%). The pool
    evicts nothing itself, so the replay hits exactly what the model hits."""
    trace = default_trace_path("conversation_trace.jsonl")
    # SMALL_POOL_SHAPE's 66,000-token pool leaves LRU within 40 requests, but a run of it had
    # a put refused for want of space and the master evict a key: its 128 KiB chunks leave
    # the 17 MiB segment room for only 8 more than the connector keeps.
    limit, pool_tokens = 450, 300_000
    # The replay's master: watermark 1.0, a CONNECTOR_EVICTION_LEASE_MS lease.
    report = run_replay(ReplayConfig(
        trace_path=str(trace), limit=limit, shape=SHAPE, pool_tokens=pool_tokens,
        admission="adaptive", eviction="connector"))
    assert report.errors == [] and (report.admission, report.eviction) == ("adaptive",
                                                                           "connector")
    # A load slower than the master's 200 ms lease (a host loaded past the CI's own: 283 ms
    # beside two CPU burners) fails as LEASE_EXPIRED and is recomputed, as it must: the bytes
    # may have been reused mid-copy. No other failure, nothing corrupt, and loaded plus
    # recomputed-after-a-lapse is what the model hits.
    assert report.corrupt_blocks == 0
    assert set(report.load_error_reasons) <= {"LEASE_EXPIRED"}, report.load_error_reasons
    items = [(r.input_length, chunk_hashes(request_tokens(r), 512))
             for r in load_trace(str(trace), limit=limit)]
    model = lru_hits(items, 512, pool_tokens, AdaptiveAdmission(pool_tokens // 512))
    assert report.hit_tokens + report.load_errors * SHAPE.block_size == model.hit_tokens
    assert 0 < report.lru_hit_rate < report.hit_rate <= report.ceiling_hit_rate
    assert report.pool_evicted_keys == 0 and report.evicted_keys > 0
    assert report.pool_keys <= pool_tokens // 512


def test_cli_adaptive_admission_needs_a_pool_size(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool_replay.cli import main

    good = default_trace_path("conversation_trace.jsonl")
    assert main([str(good), "--limit", "5", "--admission", "adaptive"]) == 2
    assert capsys.readouterr().err == ("kvpool-replay: --admission adaptive needs --pool-tokens: "
                                       "the policy simulates a pool of that capacity\n")


def test_cli_connector_eviction_needs_a_pool_size(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool_replay.cli import main

    good = default_trace_path("conversation_trace.jsonl")
    assert main([str(good), "--limit", "5", "--eviction", "connector"]) == 2
    assert capsys.readouterr().err == (
        "kvpool-replay: --eviction connector needs --pool-tokens: the connector keeps an LRU "
        "of the pool's capacity, e.g. --pool-tokens 1000000\n")


def test_cli_disk_tier_needs_a_memory_tier_and_an_absolute_dir(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool_replay.cli import main

    good = default_trace_path("conversation_trace.jsonl")
    assert main([str(good), "--limit", "5", "--disk-tier-tokens", "4000000"]) == 2
    assert capsys.readouterr().err == (
        "kvpool-replay: --disk-tier-tokens needs --pool-tokens (a memory tier to overflow) and "
        "a master started here (no --master, no --ha)\n")
    assert main([str(good), "--limit", "5", "--pool-tokens", "1000000", "--disk-tier-tokens",
                 "4000000", "--disk-tier-dir", "disk"]) == 2
    assert capsys.readouterr().err == (
        "kvpool-replay: --disk-tier-dir 'disk' is relative: give an absolute directory\n")
    # Given alone it was silently ignored (new user).
    assert main([str(good), "--limit", "5", "--disk-tier-dir", "/tmp/disk"]) == 2
    assert capsys.readouterr().err == (
        "kvpool-replay: --disk-tier-dir is where a disk tier's files go: give "
        "--disk-tier-tokens N too (or drop --disk-tier-dir)\n")
    assert main([str(good), "--limit", "5", "--block-size", "48", "--chunk-size", "100"]) == 2
    assert capsys.readouterr().err == (
        "kvpool-replay: --chunk-size 100 must be a multiple of --block-size 48, e.g. "
        "--chunk-size 96\n")


def test_cli_master_admin_url_needs_master(capsys: pytest.CaptureFixture[str]) -> None:
    """``--master-admin-url`` names ``--master``'s admin endpoint (an external master's
    ``--metrics_port``: without it the engines assumed :9003 and raised a false "master admin
    unreachable"); alone it names nothing."""
    from kvpool_replay.cli import main

    good = default_trace_path("conversation_trace.jsonl")
    assert main([str(good), "--limit", "5", "--master-admin-url", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err == (
        "kvpool-replay: --master-admin-url names the admin URL of --master's master: give "
        "--master too (without it the replay starts its own)\n")
