"""``kvpool-replay``'s default admission (issue 40 item 2, "the best policy is the default"):
the pool-wide policy service wherever the replay can start it beside a bounded pool, else
``all``; ``ReplayConfig``'s own default stays ``all``. Real runs on a real master and store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpool_policy.cli import _parser as policy_parser
from kvpool_policy.policy import AdmissionKind
from kvpool_replay import ReplayConfig, default_trace_path, run_replay
from kvpool_replay._policy_service import LocalPolicyService
from kvpool_replay._replay import default_admission, service_refusal
from kvpool_replay.cli import main

REPO = Path(__file__).resolve().parents[2]
TRACE = str(default_trace_path("conversation_trace.jsonl"))


def _replay_json(*argv: str) -> dict[str, object]:
    """``kvpool-replay --limit 40 --engines 2 ARGV --json --no-progress``'s report (a child
    process, as an operator runs it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_replay.cli", TRACE, "--limit", "40", "--engines", "2",
         *argv, "--json", "--no-progress"], cwd=REPO, capture_output=True, text=True,
        timeout=600, check=False, env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, object] = json.loads(proc.stdout)
    return report


def test_a_bounded_shared_pool_runs_the_policy_service() -> None:
    """No ``--admission``, ``--pool-tokens`` given: the service ran beside the replay's master,
    applied the engines' records and removed keys for them, nothing read back wrong."""
    r = _replay_json("--pool-tokens", "300000")
    assert r["admission"] == "service", r
    assert r["errors"] == [] and r["corrupt_blocks"] == 0, r
    assert r["requests"] == 40
    # One access record per request of either engine, applied by the service.
    assert 0 < r["policy_records"] <= 40, r  # type: ignore[operator]
    # 506,280 prompt tokens through a pool the service fills to 240,000 tokens: it removed
    # keys (391 in a run here, the master 58 beside it).
    assert r["evicted_keys"] > 0, r  # type: ignore[operator]
    assert isinstance(r["policy_cpu_s"], float) and r["policy_cpu_s"] > 0, r
    assert isinstance(r["peak_rss_policy_bytes"], int) and r["peak_rss_policy_bytes"] > 0, r


def test_an_unbounded_pool_and_an_explicit_all_admit_everything() -> None:
    """Without ``--pool-tokens`` there is nothing for the service to evict: ``all``. An
    explicit ``--admission all`` on a bounded pool is kept: no service, the master evicts."""
    r = _replay_json()
    assert (r["admission"], r["pool_tokens"], r["policy_records"]) == ("all", None, 0), r
    assert r["errors"] == [] and r["corrupt_blocks"] == 0, r
    r = _replay_json("--pool-tokens", "300000", "--admission", "all")
    assert (r["admission"], r["policy_records"], r["evicted_keys"]) == ("all", 0, 0), r
    assert r["errors"] == [] and r["corrupt_blocks"] == 0, r


@pytest.mark.parametrize("settings", [
    {},  # unbounded
    {"pool_tokens": 300_000, "mode": "private", "engines": 2},
    {"pool_tokens": 300_000, "master_address": "127.0.0.1:50051"},
    {"pool_tokens": 300_000, "eviction": "connector"},
    {"pool_tokens": 300_000, "disk_tier_tokens": 1_000_000},
], ids=["unbounded", "private", "master", "connector-eviction", "disk-tier"])
def test_the_default_is_all_where_the_replay_cannot_start_the_service(
        settings: dict[str, object]) -> None:
    cfg = ReplayConfig(trace_path=TRACE, **settings)  # type: ignore[arg-type]
    assert cfg.admission == "all"  # the library's default is unchanged
    assert default_admission(cfg) == "all"


def test_an_ha_pool_runs_the_service_by_default() -> None:
    """The service follows an HA pool's leader (``--ha``): the default is the service there."""
    cfg = ReplayConfig(trace_path=TRACE, pool_tokens=300_000, ha=2)
    assert (service_refusal(cfg), default_admission(cfg)) == (None, "service")


@pytest.mark.parametrize(("flags", "line"), [
    (["--private", "--engines", "2"], "--admission service keeps one policy for one shared "
     "pool: drop --private (or give --admission all)"),
    (["--master", "127.0.0.1:1"], "--admission service starts kvpool-policy beside the "
     "replay's own master or --ha pool: drop --master (or give --admission all)"),
    (["--eviction", "connector"], "--admission service evicts for the whole pool itself: drop "
     "--eviction connector (or give --admission adaptive for per-engine eviction)"),
], ids=["private", "master", "connector-eviction"])
def test_an_explicit_service_names_the_flag_in_its_way(
        flags: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A new user's three conflicting combinations got one generic line; each names its flag."""
    assert main([TRACE, "--limit", "10", "--pool-tokens", "300000", "--admission", "service",
                 *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [f"kvpool-replay: {line}"]


def test_the_default_is_the_service_on_the_replays_own_bounded_shared_pool() -> None:
    for engines in (1, 8):
        cfg = ReplayConfig(trace_path=TRACE, pool_tokens=1_000_000, engines=engines)
        assert (service_refusal(cfg), default_admission(cfg)) == (None, "service")
        assert cfg.admission == "all"


def test_help_says_the_default_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Default: service wherever the replay can start it beside a bounded pool" in text
    assert "the best measured for a pool shared by several engines" in text
    assert "else all" in text


def test_kill_policy_after_without_a_pool_size_names_the_fix(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The drill needs the service, which an unbounded replay does not start by default."""
    assert main([TRACE, "--limit", "30", "--kill-policy-after", "10"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("kvpool-replay: --kill-policy-after needs --admission service (a service "
                    "to kill)")


@pytest.mark.parametrize(("flags", "line"), [
    ([], "--admission service steers a bounded pool: give --pool-tokens, e.g. --pool-tokens "
     "1000000 (or --admission all for an unbounded one)"),
    (["--pool-tokens", "300000", "--disk-tier-tokens", "1000000"],
     "--admission service removes what it evicts from every tier, the disk tier's copy too: "
     "drop --disk-tier-tokens (or give --admission all with --pool-tokens for a disk tier)"),
    # Without --pool-tokens too: the disk tier's line first, whose fix leads out (the
    # unbounded line's "give --pool-tokens" led to the disk-tier refusal, and "--admission
    # all" to "--disk-tier-tokens needs --pool-tokens": a new user went round in circles).
    (["--disk-tier-tokens", "1000000"],
     "--admission service removes what it evicts from every tier, the disk tier's copy too: "
     "drop --disk-tier-tokens (or give --admission all with --pool-tokens for a disk tier)"),
], ids=["unbounded", "disk-tier", "disk-tier-unbounded"])
def test_an_explicit_service_without_a_bounded_memory_only_pool_is_refused(
        flags: list[str], line: str) -> None:
    """``kvpool-replay --admission service`` as an operator runs it (a child process): without
    ``--pool-tokens`` (the replay sized the pool to hold every chunk: the service would steer
    nothing) or with ``--disk-tier-tokens`` (its removals erase the disk tier's copy too) it
    starts nothing and says so in one line, exit 2, before any pool or engine starts."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_replay.cli", TRACE, "--limit", "10", "--admission",
         "service", "--no-progress", *flags], cwd=REPO, capture_output=True, text=True,
        timeout=120, check=False, env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"kvpool-replay: {line}"], proc.stderr[-3000:]


@pytest.mark.parametrize("fill", [0.0, 0.96, float("nan")])
def test_a_service_fill_outside_the_watermark_is_refused_before_anything_starts(
        fill: float, tmp_path: Path) -> None:
    """``ReplayConfig.policy_fill`` (``bench_fleet.py --policy-fill``) must leave the masters'
    watermark (0.95) above it: refused with the range and the default, nothing started."""
    cfg = ReplayConfig(trace_path=TRACE, limit=4, pool_tokens=300_000, admission="service",
                       policy_fill=fill)
    with pytest.raises(ValueError,
                       match=r"policy_fill .*: must be auto or in \(0, 0\.95\] .* e\.g\. 0\.8"):
        run_replay(cfg)


def test_the_services_own_admission_needs_the_service() -> None:
    """``policy_admission`` (bench_fleet's ``service-lru``) is the service's; without it the
    value would be ignored and the row mislabelled."""
    cfg = ReplayConfig(trace_path=TRACE, limit=5, pool_tokens=1_000_000, admission="all",
                       policy_admission="all")
    with pytest.raises(ValueError, match="--policy-admission all is the policy service's own "
                       "admission: it needs --admission service"):
        run_replay(cfg)


@pytest.mark.parametrize("admission", ["adaptive", "all"])
def test_the_replays_service_runs_with_the_admission_asked(admission: AdmissionKind,
                                                             tmp_path: Path) -> None:
    """The argument ``kvpool-policy serve`` parses and hands to ``PoolPolicy``: the command
    line a replay starts the service with (a restart in ``--kill-policy-after`` reuses it)."""
    master = SimpleNamespace(address="127.0.0.1:50051", admin_url="http://127.0.0.1:9003",
                             eviction_high_watermark_ratio=0.95)
    svc = LocalPolicyService(master, tmp_path, admission=admission,  # type: ignore[arg-type]
                             port=5600, log_dir=tmp_path)
    cmd = svc.command()
    args = policy_parser().parse_args(cmd[cmd.index("serve"):])
    assert args.admission == admission
    # The fill follows the master by default, under the watermark the master runs.
    assert (args.fill, args.master_watermark) == ("auto", 0.95)
