"""Fleet benchmark (issue 40): N engines sharing one pool, whole traces, real masters.

Per trace, pool capacity (tokens) and number of engines N (engine processes replaying
concurrently, as fast as they can, requests round-robin in trace order; one shared pool: a real
``mooncake_master`` and a separate store process over TCP on 127.0.0.1; 64 B/token, chunk 512):

* ``service``: ``kvpool-replay --admission service``: the pool-wide policy service
  (``kvpool-policy serve``) beside the master, filling ``--policy-fill`` of the pool (default
  ``ReplayConfig.policy_fill``, 0.8), the master's watermark (0.95) above it;
* ``service-lru``: the same service admitting every chunk (``kvpool-policy serve --admission
  all``): only its pool-wide leaf-first LRU evicts. The live LRU, run under the same
  concurrency, leases and removal lag as ``service`` (the offline LRU below is computed in trace
  order, one request after another, which N concurrent engines cannot reach);
* ``per-engine``: ``--admission adaptive --eviction connector``: each engine its own policy of
  its share of the pool (pool / N), its worker removing what falls out (the policy before the
  service);
* ``master``: ``--admission all``: every chunk saved, the master evicting at 0.9 (Mooncake's
  ``eviction_high_watermark_ratio``);
* offline: an exact LRU of the whole pool and Belady's MIN (``kvpool_replay.lru_hits``,
  ``belady_hits``, trace order), ``x LRU`` = service / LRU and ``gap`` = the share of the
  LRU-to-MIN gap the service closes, ``(service - LRU) / (MIN - LRU)``; ``x live`` = service /
  service-lru;
* per service run: corrupt blocks (all columns are checked, the row says the worst), the
  service's CPU seconds per million chunk accesses (every chunk of every prompt is one access;
  its process's CPU, all threads, its Mooncake client included) and its peak RSS.

Goals (issue 40), on ``service``: >= exact LRU at every capacity for every N; >= 1.5x exact LRU
at conversation 1M and 2M tokens with 8 engines; 15% of the LRU-to-MIN gap closed on the
synthetic trace; 0 corrupt blocks.

One replay at a time (N engines already share the machine's cores), with a progress line; the
JSON (``--json-out``) is written after every replay and ``--resume`` skips the rows it holds, so
a long grid can be run in parts. A slice (a few minutes)::

    .venv/bin/python bench/bench_fleet.py --limit 1000 --traces conversation_trace.jsonl \\
        --capacities 1000000 --engines 8

The whole grid (whole traces, 8 capacities x 4 N x 4 policies: ~5 minutes a replay here)::

    .venv/bin/python bench/bench_fleet.py --limit 0 --json-out /tmp/fleet.json --resume
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _replay_grid import CAPACITIES, CHUNK, SHAPE, positive_ints

from kvpool_agent.cli_parser import number_in
from kvpool_connector.keys import chunk_hashes
from kvpool_console.signals import Stopped, stop_signals
from kvpool_replay import (
    ReplayConfig,
    belady_hits,
    default_trace_path,
    engine_env,
    load_trace,
    lru_hits,
    request_tokens,
    run_replay,
)

POLICIES: dict[str, dict[str, str]] = {
    "service": {"admission": "service"},
    # The service admitting everything: only its pool-wide leaf-first LRU evicts, live.
    "service-lru": {"admission": "service", "policy_admission": "all"},
    "per-engine": {"admission": "adaptive", "eviction": "connector"},
    "master": {"admission": "all"},
}
"""Replay columns: ``ReplayConfig`` fields of each."""


def _policies(text: str) -> list[str]:
    names = text.split(",")
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad)}: not a policy; give some of {', '.join(POLICIES)}")
    return names


def offline(path: str, limit: int | None, caps: list[int]) -> tuple[int, dict[int, dict]]:
    """Chunk accesses of the replayed requests, and exact LRU / Belady's MIN per capacity."""
    reqs = load_trace(path, limit=limit)
    items = [(r.input_length, chunk_hashes(request_tokens(r), CHUNK)) for r in reqs]
    accesses = sum(len(hashes) for _, hashes in items)
    return accesses, {cap: {"lru": lru_hits(items, CHUNK, cap).hit_rate,
                            "min": belady_hits(items, CHUNK, cap).hit_rate} for cap in caps}


def _fill(text: str) -> float | Literal["auto"]:
    """``--policy-fill``: ``auto`` or a share in (0, 0.95]."""
    if text == "auto":
        return "auto"
    try:
        share = float(text)
    except ValueError:
        share = 0.0
    if not 0 < share <= 0.95:
        raise argparse.ArgumentTypeError(f"{text!r}: give auto or a share in (0, 0.95], e.g. 0.8")
    return share


def _shares(text: str) -> list[float]:
    try:
        shares = [float(x) for x in text.split(",")]
    except ValueError:
        shares = []
    if not shares or not all(0 < f <= 1 for f in shares):
        raise argparse.ArgumentTypeError(f"{text!r}: give shares in (0, 1], e.g. 1,0.95,0.9,0.8")
    return shares


def lru_shares(names: list[str], caps: list[int] | None, limit: int | None,
               shares: list[float]) -> None:
    """Exact LRU (trace order, deterministic) at ``shares`` of each pool: one line per trace
    and capacity (tokens), hit rates in %."""
    print("trace  pool (tokens)  " + "  ".join(f"LRU at {f:g}" for f in shares))
    for name in names:
        reqs = load_trace(str(default_trace_path(name)), limit=limit)
        items = [(r.input_length, chunk_hashes(request_tokens(r), CHUNK)) for r in reqs]
        for cap in caps or CAPACITIES[name.removesuffix(".xz")]:
            rates = [lru_hits(items, CHUNK, int(cap * f)).hit_rate for f in shares]
            print(f"{name}  {cap:,}  " + "  ".join(f"{r:.2%}" for r in rates), flush=True)


def replay(path: str, limit: int | None, cap: int, engines: int, policy: str,
           fill: float | Literal["auto"], speedup: float) -> dict:
    """One real replay: its hit rate, corrupt blocks, load errors and the service's cost."""
    t0 = time.monotonic()
    cfg = ReplayConfig(trace_path=path, limit=limit, pool_tokens=cap, engines=engines,
                       shape=SHAPE, show_progress=True, policy_fill=fill, speedup=speedup,
                       **POLICIES[policy])  # type: ignore[arg-type]
    # SIGTERM or SIGHUP stops the replay's engines, master, store and service on the way out
    # (killed on the spot they would run on); the rows measured so far stay in --json-out.
    with stop_signals() as sig:
        try:
            r = run_replay(cfg)
        except Stopped:
            raise SystemExit(f"stopped by signal {sig.signum}: every process of the replay was "
                             "stopped; --resume goes on from the rows written") from None
    if r.errors:
        raise RuntimeError(f"{Path(path).name} at {cap:,} tokens, {engines} engines, {policy}: "
                           f"{r.errors}")
    return {"hit": r.hit_rate, "corrupt": r.corrupt_blocks, "load_errors": r.load_errors,
            "load_error_reasons": r.load_error_reasons,
            "evicted_by_master": r.pool_evicted_keys, "evicted_by_policy": r.evicted_keys,
            "save_skipped_keys": r.save_skipped_keys,
            "policy_cpu_s": r.policy_cpu_s, "policy_rss": r.peak_rss_policy_bytes,
            "wall_s": round(time.monotonic() - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=1000, help="requests per trace (0 = whole)")
    p.add_argument("--traces", default=",".join(CAPACITIES),
                   help="trace file names in the traces directory, comma-separated (name.jsonl or "
                   "the shipped name.jsonl.xz)")
    p.add_argument("--capacities", type=positive_ints, default=None, metavar="TOKENS",
                   help="pool capacities (tokens, comma-separated) instead of each trace's list")
    p.add_argument("--engines", type=positive_ints, default=[1, 2, 4, 8], metavar="N",
                   help="engine counts, comma-separated (default 1,2,4,8)")
    p.add_argument("--policies", type=_policies, default=list(POLICIES), metavar="NAMES",
                   help="replay columns, comma-separated, of " + ", ".join(POLICIES))
    p.add_argument("--policy-fill", type=_fill, default=ReplayConfig(trace_path="").policy_fill,
                   metavar="F", help="share of the pool the service fills, in (0, 0.95], or "
                   "auto (following the master's used bytes below its 0.95) (default "
                   "%(default)s)")
    p.add_argument("--speedup", type=number_in(0), default=0.0, metavar="S",
                   help="trace time / wall time of every replay (default 0: as fast as the "
                   "engines go, ~10-15x the trace's rate here; leases and the service's "
                   "removal lag then span that many more requests)")
    p.add_argument("--json-out", type=Path, default=None,
                   help="write the rows as JSON after every replay")
    p.add_argument("--resume", action="store_true",
                   help="with --json-out: keep its rows and replay only the missing ones")
    p.add_argument("--lru-shares", type=_shares, default=None, metavar="F",
                   help="print only the offline exact LRU at these shares of each pool, "
                   "comma-separated in (0, 1] (e.g. 1,0.95,0.9,0.8: the best an LRU filling "
                   "that share holds; the service fills --policy-fill, the master evicts at "
                   "0.95), and replay nothing")
    args = p.parse_args()
    if args.resume and args.json_out is None:
        p.error("--resume needs --json-out (the rows to keep)")
    # The traces ship compressed (name.jsonl.xz): either name has the capacity list.
    names = args.traces.split(",")
    unknown = [n for n in names if n.removesuffix(".xz") not in CAPACITIES]
    if unknown and not args.capacities:
        p.error(f"--traces: {', '.join(unknown)} has no capacity list (those with one: "
                f"{', '.join(CAPACITIES)}); give --capacities")
    os.environ.update({k: v for k, v in engine_env().items() if k in ("PATH", "PYTHONPATH")})
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    limit = args.limit or None
    if args.lru_shares:
        lru_shares(names, args.capacities, limit, args.lru_shares)
        return 0
    started = time.monotonic()
    rows: dict[str, dict] = {}
    if args.resume and args.json_out.exists():
        kept = json.loads(args.json_out.read_text())
        if kept.get("limit") != limit:
            p.error(f"--resume: {args.json_out} was measured with --limit {kept.get('limit')}")
        if kept.get("policy_fill", 0.8) != args.policy_fill:
            p.error(f"--resume: {args.json_out} was measured with --policy-fill "
                    f"{kept.get('policy_fill', 0.8)}")
        if kept.get("speedup", 0.0) != args.speedup:
            p.error(f"--resume: {args.json_out} was measured with --speedup "
                    f"{kept.get('speedup', 0.0)}")
        rows = kept["rows"]

    def save() -> None:
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(
                {"limit": limit, "policy_fill": args.policy_fill, "speedup": args.speedup,
                 "rows": rows}, indent=1))

    for name in names:
        path = str(default_trace_path(name))
        caps = args.capacities or CAPACITIES[name.removesuffix(".xz")]
        print(f"{name}: exact LRU and Belady's MIN offline", flush=True)
        accesses, ref = offline(path, limit, caps)
        for cap in caps:
            for n in args.engines:
                for policy in args.policies:
                    key = f"{name} {cap} {n} {policy}"
                    if key in rows:
                        continue
                    print(f"{name} {cap:,} tokens, {n} engines, {policy}", flush=True)
                    rows[key] = {"trace": name, "pool_tokens": cap, "engines": n,
                                 "policy": policy, "accesses": accesses, **ref[cap],
                                 **replay(path, limit, cap, n, policy, args.policy_fill,
                                          args.speedup)}
                    r = rows[key]
                    print(f"  hit {r['hit']:.2%} (LRU {r['lru']:.2%}, MIN {r['min']:.2%}), "
                          f"corrupt {r['corrupt']}, {r['wall_s']:.0f} s", flush=True)
                    save()
    print(f"\nservice fill {args.policy_fill} of the pool; speedup {args.speedup:g} (0: as "
          "fast as the engines go)")
    table(rows)
    print(f"total bench time {time.monotonic() - started:.0f} s")
    return 0


def table(rows: dict[str, dict]) -> None:
    """The issue's table from the rows measured (a missing replay prints ``-``)."""
    grid: dict[tuple[str, int, int], dict[str, dict]] = {}
    for r in rows.values():
        grid.setdefault((r["trace"], r["pool_tokens"], r["engines"]), {})[r["policy"]] = r
    head = ["trace", "capacity", "N", *POLICIES, "LRU", "MIN", "x LRU", "gap", "x live",
            "corrupt", "CPU s/M", "RSS MiB"]
    widths = [24, 11, 3, 10, 11, 10, 10, 8, 8, 6, 5, 6, 7, 8, 7]
    print("\n" + "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    below, missed = [], []
    for (trace, cap, n), got in sorted(grid.items()):
        ref = next(iter(got.values()))
        lru, best = ref["lru"], ref["min"]
        svc, live = got.get("service"), got.get("service-lru")
        cols = [trace, f"{cap:,}", str(n),
                *[f"{got[p]['hit']:.2%}" if p in got else "-" for p in POLICIES],
                f"{lru:.2%}", f"{best:.2%}"]
        if svc is None:
            cols += ["-", "-", "-"]
        else:
            gap = (svc["hit"] - lru) / (best - lru) if best > lru else 0.0
            cols += [f"{svc['hit'] / lru:.2f}" if lru else "-", f"{gap:.0%}",
                     f"{svc['hit'] / live['hit']:.2f}" if live and live["hit"] else "-"]
            if svc["hit"] < lru:
                below.append(f"{trace} {cap:,} N={n}")
            if (trace == "conversation_trace.jsonl" and cap in (1_000_000, 2_000_000) and n == 8
                    and svc["hit"] < 1.5 * lru):
                missed.append(f"1.5x LRU at conversation {cap:,}, 8 engines")
        cols.append(str(max(r["corrupt"] for r in got.values())))
        cols += (["-", "-"] if svc is None else
                 [f"{svc['policy_cpu_s'] / svc['accesses'] * 1e6:.1f}",
                  f"{svc['policy_rss'] / (1 << 20):.0f}"])
        print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    print("\ngoal service >= exact LRU everywhere: " + ("met" if not below else
                                                          f"missed at {', '.join(below)}"))
    if missed:
        print("goal missed: " + "; ".join(missed))


if __name__ == "__main__":
    sys.exit(main())
