"""``kvpool-replay``: replay a Mooncake trace through the connector and a real pool, no TUI.

Examples::

    kvpool-replay --limit 300 --json        # the conversation trace (default_trace_path)
    kvpool-replay /data/my_trace.jsonl.xz --limit 300 --json
    kvpool-replay --limit 4000 --engines 8 --pool-tokens 1000000   # the policy service decides
    kvpool-replay --limit 4000 --engines 8 --pool-tokens 1000000 --admission all   # the master
    kvpool-replay --limit 2000 --engines 4 --pool-tokens 2000000 --private
    kvpool-replay --pool-tokens 1000000 --disk-tier-tokens 4000000   # memory + an SSD tier
    kvpool-replay --limit 600 --engines 2 --ha 2 --kill-leader-after 5 --json
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import msgspec
import psutil

from kvpool_agent import hub_ports
from kvpool_agent.cli_parser import EXIT_USAGE, CommandParser, int_at_least, number_in
from kvpool_connector.backends.mooncake_address import parse_master_address
from kvpool_console.signals import Stopped, stop_signals
from kvpool_replay._forkserver import stop_fork_server
from kvpool_replay._replay import (
    CONNECTOR_EVICTION_LEASE_MS,
    ReplayConfig,
    ReplayReport,
    default_admission,
    run_replay,
)
from kvpool_replay._spec import ModelShape
from kvpool_replay._trace import TraceError, default_trace_path

__all__ = ["MODEL_SHAPES", "build_parser", "format_report", "main", "model_shape"]

MODEL_SHAPES: dict[str, dict[str, int | str]] = {
    "llama3-8b": {"layers": 32, "kv_heads": 8, "head_size": 128, "dtype": "bfloat16"},
    "llama3-70b": {"layers": 80, "kv_heads": 8, "head_size": 128, "dtype": "bfloat16"},
    # MLA's 576-element latent per layer as the CPU layout's K and V halves of one head.
    "deepseek-v3-mla": {"layers": 61, "kv_heads": 1, "head_size": 288, "dtype": "bfloat16"},
}
"""``--model-shape`` presets: real models' KV per token (128 KiB, 320 KiB, 68.6 KiB)."""

_TOY_SHAPE: dict[str, int | str] = {"layers": 2, "kv_heads": 1, "head_size": 8,
                                    "dtype": "float16"}
"""Without ``--model-shape``: 2 x 1 x 8 x float16, K and V = 64 B per token (the logic, fast)."""


def _hub_address(text: str) -> str:
    # The hub's own rule for an address to connect to (kvpool-config's agent_address too).
    try:
        hub_ports(text, connect=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpool-replay`` argument parser."""
    p = CommandParser(
        prog="kvpool-replay",
        description="Replay a Mooncake request trace through KVPoolConnector and a real "
        "Mooncake pool; compare the hit rate with the trace's prefix-reuse ceiling and an "
        "exact LRU cache of the same capacity.",
    )
    p.add_argument("trace", nargs="?", default=None,
                   help=f"JSON-lines trace, plain or .xz (default: {default_trace_path()})")
    p.add_argument("--trace", dest="trace_opt", default=None, help="same as the positional")
    p.add_argument("--limit", type=int_at_least(1), default=None,
                   help="replay only the first N requests")
    p.add_argument("--engines", type=int_at_least(1), default=1, help="engine processes")
    p.add_argument("--pool-tokens", type=int_at_least(1), default=None,
                   help="pool capacity in tokens of KV (default: unbounded = every chunk fits)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--shared", dest="mode", action="store_const", const="shared",
                      help="all engines share one pool (default)")
    mode.add_argument("--private", dest="mode", action="store_const", const="private",
                      help="each engine has its own pool of pool-tokens / engines")
    p.set_defaults(mode="shared")
    p.add_argument("--speedup", default=0.0,
                   type=number_in(0, finite=False, hint=" (0 = as fast as possible)"),
                   help="trace time / wall time (0 = as fast as possible; default 0)")
    p.add_argument("--master", default=None,
                   help="use this mooncake_master host:port instead of starting one")
    p.add_argument("--master-admin-url", default=None, metavar="URL",
                   help="--master's HTTP admin URL (its --metrics_port; default "
                   "http://<host>:9003): the engines' pool stats and flushes read it")
    p.add_argument("--ha", type=int_at_least(1), default=0, metavar="N",
                   help="replay against an HA pool: a local etcd and N mooncake_master "
                   "processes with leader election (etcd-server must be installed)")
    p.add_argument("--kill-leader-after", type=number_in(0, low_open=True, unit="seconds"),
                   default=None, metavar="S",
                   help="with --ha 2 or more: SIGKILL the leader master S seconds into the "
                   "replay (--json then has failover_s, keys_kept and hits_lost)")
    p.add_argument("--agent-address", type=_hub_address, default=None,
                   help="fleet hub agent address (tcp://host:port) the engines report to")
    p.add_argument("--chunk-size", type=int_at_least(1), default=512, help="tokens per pool key")
    p.add_argument("--layers", type=int_at_least(1), default=None,
                   help=f"KV layers (default {_TOY_SHAPE['layers']})")
    p.add_argument("--kv-heads", type=int_at_least(1), default=None,
                   help=f"KV heads (default {_TOY_SHAPE['kv_heads']})")
    p.add_argument("--head-size", type=int_at_least(1), default=None,
                   help=f"head size (default {_TOY_SHAPE['head_size']})")
    p.add_argument("--block-size", type=int_at_least(1), default=16,
                   help="vLLM block size in tokens")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help=f"KV dtype (default {_TOY_SHAPE['dtype']})")
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None,
                   help="a real model's KV shape, not with --layers, --kv-heads, --head-size "
                   "or --dtype (--block-size still applies)")
    p.add_argument("--load-async", action="store_true", help="connector load_async mode")
    p.add_argument("--layerwise", action="store_true", help="connector use_layerwise mode")
    p.add_argument("--no-wait-saves", dest="wait_saves", action="store_false",
                   help="start a request's lookup while the previous one's saves still run")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr (requests done, req/s, hit rate, ETA)")
    p.add_argument("--admission", choices=["all", "adaptive", "service"], default=None,
                   help="the connector's save admission: all saves every chunk (the master "
                   "evicts past its watermark); adaptive skips chunks never asked for before "
                   "when that would hit more (needs --pool-tokens); service: one pool-wide "
                   "policy (kvpool-policy serve, started here beside the master) admits and "
                   "evicts for all engines (needs --pool-tokens; not with --disk-tier-tokens: "
                   "its removals erase the disk tier's copy too). Default: service wherever "
                   "the replay can start it beside a bounded pool (--pool-tokens, --shared, "
                   "the replay's own master, eviction pool, no disk tier), the best measured "
                   "for a pool shared by several engines (docs/benchmarks.md: whole "
                   "conversation trace, 8 engines, 1,000,000 tokens: 1.76x an exact LRU, 1.33x "
                   "the master alone); else all. The report says which ran")
    p.add_argument("--eviction", choices=["pool", "connector"], default="pool",
                   help="who evicts: pool (default) the master, past its watermark; connector "
                   "an exact LRU in the connector (needs --pool-tokens; masters started here "
                   f"run at watermark 1.0 with a {CONNECTOR_EVICTION_LEASE_MS} ms lease)")
    p.add_argument("--policy-admission", choices=["adaptive", "all"], default="adaptive",
                   help="with --admission service, the service's own admission: adaptive "
                   "(default; its pool-wide doorkeeper) or all (engines save every chunk and "
                   "it only evicts: a live pool-wide LRU)")
    p.add_argument("--kill-policy-after", type=int_at_least(1), default=None, metavar="N",
                   help="with --admission service: kill the policy service after N requests "
                   "and start it again N requests and at least 4 s later; needs more than 2N "
                   "requests (--limit above 2N), and requests left once the 4 s passed, or "
                   "nothing runs under the restarted service")
    p.add_argument("--disk-tier-tokens", type=int_at_least(1), default=None, metavar="N",
                   help="a disk tier (Mooncake SSD offload) of N tokens of KV behind the pool's "
                   "memory (needs --pool-tokens; split per engine with --private)")
    p.add_argument("--disk-tier-dir", default=None, metavar="DIR",
                   help="absolute directory for the disk tier's files (default: the run's "
                   "temporary directory, removed at the end)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def format_report(r: ReplayReport) -> str:
    """Human-readable summary of a replay (what ``kvpool-replay`` prints without ``--json``)."""
    mib = 1 << 20
    pool = "unbounded" if r.pool_tokens is None else f"{r.pool_tokens:,} tokens"
    lines = [
        f"requests            {r.requests:,} on {r.engines} engine(s), {r.mode} pool ({pool}, "
        f"{r.pool_bytes / mib:.0f} MiB, {r.bytes_per_token} B/token, chunk {r.chunk_size}), "
        f"admission {r.admission}"
        + (f" (the service's own: {r.policy_admission})" if r.policy_admission else "")
        + f", eviction {r.eviction}",
        f"input tokens        {r.input_tokens:,}",
        f"hit tokens          {r.hit_tokens:,}",
        f"hit rate            {r.hit_rate:.2%}   (ceiling {r.ceiling_hit_rate:.2%}, "
        f"exact LRU {r.lru_hit_rate:.2%})",
        f"saved / loaded      {r.saved_bytes / mib:.1f} MiB / {r.loaded_bytes / mib:.1f} MiB "
        f"({r.save_bytes_per_s / mib:.1f} / {r.load_bytes_per_s / mib:.1f} MiB/s in connector "
        "calls)",
        f"load errors         {r.load_errors} blocks (recomputed"
        + "".join(f"; {n} loads {name}" for name, n in sorted(r.load_error_reasons.items()))
        + f"), corrupt blocks {r.corrupt_blocks}",
        f"pool                {r.pool_keys:,} keys, {r.pool_evicted_keys:,} evicted"
        + (f" by the master, {r.evicted_keys:,} by the connector"
           if r.eviction == "connector" else
           f" by the master, {r.evicted_keys:,} by the policy service"
           + (f" (after its restart {r.policy_restarts}x)" if r.policy_restarts else "")
           if r.admission == "service" else "")
        + ("" if r.disk_tier_tokens is None else
           f"; disk tier {r.disk_tier_tokens:,} tokens, {r.pool_disk_keys:,} values on disk, "
           f"reads served {r.pool_memory_hits:,} from memory / {r.pool_disk_hits:,} from disk"),
        f"failures            {r.lookup_errors} lookups failed, {r.save_failed_keys} values' "
        f"saves failed (longest lookup {r.max_lookup_s * 1e3:.0f} ms); "
        f"{r.save_skipped_keys:,} values' saves skipped (a full pool, the save budget or "
        "preemption)",
        f"peak RSS            engine {r.peak_rss_engine_bytes / mib:.0f} MiB, master "
        f"{r.peak_rss_master_bytes / mib:.0f} MiB, store {r.peak_rss_store_bytes / mib:.0f} "
        f"MiB, replay {r.peak_rss_replay_bytes / mib:.0f} MiB"
        + (f", policy service {r.peak_rss_policy_bytes / mib:.0f} MiB "
           f"({r.policy_cpu_s:.1f} s CPU)" if r.admission == "service" else ""),
        f"wall                {r.wall_s:.1f} s",
    ]
    if r.failover_s is not None:
        lines.append(f"failover            {r.failover_s:.1f} s without a serving leader; "
                     f"{r.keys_kept:,} of {r.keys_at_kill:,} keys kept; "
                     f"{r.hits_lost or 0:,} hit tokens lost")
    lines += [f"error               {e}" for e in r.errors]
    return "\n".join(lines)


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The replay's KV shape: ``--model-shape``'s preset, else ``--layers``, ``--kv-heads``,
    ``--head-size`` and ``--dtype`` (each defaulting to the 64 B/token toy shape);
    ``--block-size`` either way.

    Raises:
        ValueError: one of those four beside ``--model-shape`` (it would be ignored), or a
            dimension below 1 (``ModelShape``).
    """
    given = {name: getattr(args, name) for name in _TOY_SHAPE}
    if args.model_shape:
        beside = [f"--{name.replace('_', '-')}" for name, value in given.items()
                  if value is not None]
        if beside:
            raise ValueError(f"{', '.join(beside)}: --model-shape {args.model_shape} sets the "
                             "whole KV shape; give one or the other")
        dims = MODEL_SHAPES[args.model_shape]
    else:
        dims = {name: _TOY_SHAPE[name] if value is None else value
                for name, value in given.items()}
    return ModelShape(block_size=args.block_size, **dims)  # type: ignore[arg-type]


def _master_problem(text: str) -> str | None:
    """Why ``--master`` is no master address (the message), or ``None``: not ``HOST:PORT`` or
    ``etcd://...`` (whether one answers there: ``run_replay``)."""
    try:
        parse_master_address(text)
    except ValueError as exc:
        return f"--master: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvpool-replay``. Exit status: 0 ok, 1 an engine failed, 2 bad input
    (options, a missing, invalid or empty trace, a pool larger than the memory available), with
    one line on stderr saying why; 130 on Ctrl-C, 128+N on SIGHUP or SIGTERM (129, 143), after
    stopping every process it started (master, store, engines) and removing its work
    directory."""
    parser = build_parser()
    args = parser.parse_args(argv)
    trace = args.trace_opt or args.trace or str(default_trace_path())
    try:
        shape = model_shape(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.master is not None and (problem := _master_problem(args.master)):
        parser.error(problem)
    try:
        cfg = ReplayConfig(
            trace_path=trace, limit=args.limit, engines=args.engines,
            pool_tokens=args.pool_tokens, mode=args.mode, speedup=args.speedup, shape=shape,
            chunk_size=args.chunk_size, master_address=args.master,
            master_admin_url=args.master_admin_url,
            agent_address=args.agent_address, wait_saves=args.wait_saves,
            load_async=args.load_async, use_layerwise=args.layerwise,
            show_progress=args.progress, ha=args.ha,
            kill_leader_after_s=args.kill_leader_after,
            kill_policy_after=args.kill_policy_after,
            policy_admission=args.policy_admission,
            eviction=args.eviction,
            disk_tier_tokens=args.disk_tier_tokens, disk_tier_dir=args.disk_tier_dir,
        )
        cfg.admission = args.admission or default_admission(cfg)
        # Killed on the spot it would leave its master, store and engines running: the signal
        # raises Stopped instead, and run_replay stops what it started on the way out.
        with stop_signals() as sig:
            try:
                report = run_replay(cfg, on_status=lambda m: print(
                    f"kvpool-replay: {m}", file=sys.stderr, flush=True))
            except Stopped:
                pass
            finally:
                sig.cleaning_up = True
                # Its own exit, once this process is gone, is seconds of garbage collection.
                stop_fork_server()
        if sig.signum is not None:
            # Whatever a signal landing mid-start left running (a store whose Popen the
            # signal interrupted was seen alive after the exit once in CI): this process started
            # every child it has, and none may outlive it.
            left = psutil.Process().children(recursive=True)
            for child in left:
                with contextlib.suppress(psutil.Error):
                    child.kill()
            psutil.wait_procs(left, timeout=10)
            print(f"kvpool-replay: stopped by signal {sig.signum}; every process it started "
                  "was stopped", file=sys.stderr)
            return 128 + sig.signum
    except (FileNotFoundError, TraceError, ValueError) as exc:
        print(f"kvpool-replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvpool-replay: interrupted; every process it started was stopped",
              file=sys.stderr)
        return 130
    if args.json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        print(format_report(report))
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
