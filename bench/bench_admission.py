"""Admission benchmark (issue 24): the connector with ``admission: all`` and ``adaptive``, with the
pool's eviction and with its own (``eviction: connector``), against exact LRU, Belady's MIN and
the prefix-reuse ceiling, on the paper's Figure 9 axis.

Per trace and capacity (tokens):

* ``all`` / ``adaptive``: real replays through ``KVPoolConnector`` and a real ``mooncake_master``
  (one engine, 64 B/token, chunk 512), two at a time, the master evicting (watermark 0.9,
  lease 10 s);
* ``steered``: ``admission: adaptive`` with ``eviction: connector``, the master at watermark 1.0
  (it evicts only when a put finds no room) and a 200 ms lease (``CONNECTOR_EVICTION_LEASE_MS``);
* exact LRU, Belady's MIN, the ceiling: computed offline from the trace (``kvpool_replay``'s
  ``lru_hits``, ``belady_hits``, ``prefix_ceiling``), and ``model``: the exact LRU behind the
  adaptive policy itself (``lru_hits(..., admission=AdaptiveAdmission)``);
* ``x LRU`` and ``gap closed``: ``steered / LRU`` and ``(steered - LRU) / (MIN - LRU)``, the
  share of what future knowledge would add over LRU that the steered connector reaches.

Goals (issue 24), on ``steered``: >= exact LRU at every capacity of both traces; >= 1.5x exact LRU
on the conversation trace at 1M and 2M tokens. ``--policies steered`` replays that column alone.

Run (a slice, ~3 minutes here)::

    .venv/bin/python bench/bench_admission.py --limit 600

Whole traces (the docs' table; about an hour on 2 shared cores)::

    .venv/bin/python bench/bench_admission.py --limit 0 --json-out /tmp/admission.json

The SSD tier (``--disk-tier-tokens``): instead of the grid, per trace two real replays
(``admission: all``) at ``--memory-tokens`` of memory, one alone and one with a disk tier of
``--disk-tier-tokens`` behind it (Mooncake SSD offload into a temporary directory), next to an
exact LRU of the memory alone and of memory + disk::

    .venv/bin/python bench/bench_admission.py --traces conversation_trace.jsonl \
        --limit 300 --memory-tokens 1000000 --disk-tier-tokens 4000000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _replay_grid import CAPACITIES, CHUNK, SHAPE, positive_ints

from kvpool_connector.admission import AdaptiveAdmission
from kvpool_connector.keys import chunk_hashes
from kvpool_replay import (
    ReplayConfig,
    belady_hits,
    default_trace_path,
    engine_env,
    load_trace,
    lru_hits,
    prefix_ceiling,
    request_tokens,
    run_replay,
)


def offline(trace: str, limit: int | None, caps: list[int]) -> dict[int, dict[str, float]]:
    """Exact LRU, Belady's MIN, the adaptive policy's model and the ceiling per capacity."""
    reqs = load_trace(trace, limit=limit)
    items = [(r.input_length, chunk_hashes(request_tokens(r), CHUNK)) for r in reqs]
    ceiling = prefix_ceiling(items, CHUNK).hit_rate
    out = {}
    for cap in caps:
        out[cap] = {
            "lru": lru_hits(items, CHUNK, cap).hit_rate,
            "belady": belady_hits(items, CHUNK, cap).hit_rate,
            "model": lru_hits(items, CHUNK, cap, AdaptiveAdmission(cap // CHUNK)).hit_rate,
            "ceiling": ceiling,
        }
    return out


POLICIES: dict[str, dict[str, object]] = {
    "all": {"admission": "all"},
    "adaptive": {"admission": "adaptive"},
    # The replay starts its master at watermark 1.0 with a CONNECTOR_EVICTION_LEASE_MS lease.
    "steered": {"admission": "adaptive", "eviction": "connector"},
}
"""Replay columns: ``ReplayConfig`` fields of each."""

Job = tuple[str, int, str]
"""A replay: trace path, capacity in tokens, policy (``POLICIES``)."""


def replays(jobs: list[Job], limit: int | None) -> dict[Job, float]:
    """Hit rate of each ``(trace, capacity, policy)`` replay, two at a time."""

    def one(job: Job) -> float:
        trace, cap, policy = job
        t0 = time.monotonic()
        r = run_replay(ReplayConfig(trace_path=trace, limit=limit, pool_tokens=cap, shape=SHAPE,
                                    **POLICIES[policy]))  # type: ignore[arg-type]
        if r.errors:
            raise RuntimeError(f"{Path(trace).name} at {cap:,} tokens, {policy}: {r.errors}")
        # Two replays run at once: these lines are the progress.
        print(f"  {Path(trace).name} {cap:>10,} tokens {policy:<8}: hit {r.hit_rate:.2%} "
              f"(LRU {r.lru_hit_rate:.2%}; evicted by the connector {r.evicted_keys:,}, by the "
              f"master {r.pool_evicted_keys:,}; {time.monotonic() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        return r.hit_rate

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(jobs, pool.map(one, jobs), strict=True))


def disk_tier(paths: dict[str, str], limit: int | None, memory: int, disk: int) -> int:
    """Memory alone vs memory + disk tier, per trace (``--disk-tier-tokens``)."""
    jobs = [(n, d) for n in paths for d in (None, disk)]

    def one(job: tuple[str, int | None]) -> tuple[float, int, int]:
        name, d = job
        t0 = time.monotonic()
        r = run_replay(ReplayConfig(trace_path=paths[name], limit=limit, pool_tokens=memory,
                                    shape=SHAPE, disk_tier_tokens=d))
        if r.errors:
            raise RuntimeError(f"{name} at {memory:,} tokens, disk {d}: {r.errors}")
        print(f"  {name} memory {memory:,} disk {d or 0:,}: hit {r.hit_rate:.2%} "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        return r.hit_rate, r.pool_disk_hits, r.pool_memory_hits

    print(f"replaying {len(jobs)} runs (two at a time)", flush=True)
    with ThreadPoolExecutor(2) as pool:
        got = dict(zip(jobs, pool.map(one, jobs), strict=True))
    widths = [24, 11, 11, 9, 9, 9, 9, 13]
    head = ["trace", "memory", "disk", "memory", "mem+disk", "LRU mem", "LRU m+d",
            "reads m/disk"]
    print("\n" + "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for name, path in paths.items():
        reqs = load_trace(path, limit=limit)
        items = [(r.input_length, chunk_hashes(request_tokens(r), CHUNK)) for r in reqs]
        alone, both = got[name, None][0], got[name, disk]
        cols = [name, f"{memory:,}", f"{disk:,}", f"{alone:.2%}", f"{both[0]:.2%}",
                f"{lru_hits(items, CHUNK, memory).hit_rate:.2%}",
                f"{lru_hits(items, CHUNK, memory + disk).hit_rate:.2%}",
                f"{both[2]}/{both[1]}"]
        print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    return 0


def _policies(text: str) -> list[str]:
    """``--policies steered,all`` -> ``["steered", "all"]`` (names of ``POLICIES``)."""
    names = text.split(",")
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad)}: not a policy; give some of {', '.join(POLICIES)}")
    return names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=600, help="requests per trace (0 = whole)")
    p.add_argument("--traces", default=",".join(CAPACITIES),
                   help="trace file names in the shared traces directory")
    p.add_argument("--capacities", type=positive_ints, default=None, metavar="TOKENS",
                   help="pool capacities (tokens, comma-separated) instead of each trace's "
                        "Figure-9 list, e.g. 20000000 to measure one row")
    p.add_argument("--policies", type=_policies, default=list(POLICIES), metavar="NAMES",
                   help="replay columns, comma-separated, of " + ", ".join(POLICIES)
                   + " (default: all three)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--disk-tier-tokens", type=int, default=None, metavar="N",
                   help="compare memory alone with memory + a disk tier of N tokens instead")
    p.add_argument("--memory-tokens", type=int, default=1_000_000, metavar="M",
                   help="memory tier of the --disk-tier-tokens comparison, tokens")
    args = p.parse_args()
    os.environ.update({k: v for k, v in engine_env().items() if k in ("PATH", "PYTHONPATH")})
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    limit = args.limit or None
    started = time.monotonic()
    names = args.traces.split(",")
    unknown = [n for n in names if n not in CAPACITIES]
    if unknown and not args.capacities:
        p.error(f"--traces: {', '.join(unknown)} has no Figure-9 capacities; give --capacities")
    capacities = {n: args.capacities or CAPACITIES[n] for n in names}
    paths = {n: str(default_trace_path(n)) for n in names}
    if args.disk_tier_tokens:
        status = disk_tier(paths, limit, args.memory_tokens, args.disk_tier_tokens)
        print(f"total bench time {time.monotonic() - started:.0f} s")
        return status
    print("offline: exact LRU, Belady's MIN, the adaptive policy's model, ceiling", flush=True)
    ref = {n: offline(paths[n], limit, capacities[n]) for n in names}
    jobs = [(paths[n], cap, pol) for n in names for cap in capacities[n]
            for pol in args.policies]
    print(f"replaying {len(jobs)} runs (two at a time)", flush=True)
    hit = replays(jobs, limit)
    rows = []
    pols = args.policies
    widths = [24, 11, *[9] * len(pols), 9, 9, 9, 9, 8, 7]
    head = ["trace", "capacity", *pols, "LRU", "MIN", "model", "ceiling", "x LRU", "gap"]
    print("\n" + "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for n in names:
        for cap in capacities[n]:
            r = ref[n][cap]
            got = {pol: hit[paths[n], cap, pol] for pol in pols}
            # The goals are the steered connector's (the recommended setting), when replayed.
            d = got.get("steered", got[pols[-1]])
            gap = (d - r["lru"]) / (r["belady"] - r["lru"]) if r["belady"] > r["lru"] else 0.0
            rows.append({"trace": n, "pool_tokens": cap, **got, **r,
                         "x_lru": d / r["lru"] if r["lru"] else 0.0, "gap_closed": gap})
            cols = [n, f"{cap:,}", *[f"{got[p]:.2%}" for p in pols], f"{r['lru']:.2%}",
                    f"{r['belady']:.2%}", f"{r['model']:.2%}", f"{r['ceiling']:.2%}",
                    f"{rows[-1]['x_lru']:.2f}", f"{gap:.0%}"]
            print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    judged = "steered" if "steered" in pols else pols[-1]
    below = [f"{r['trace']} at {r['pool_tokens']:,}" for r in rows if r[judged] < r["lru"]]
    print(f"\ngoal {judged} >= exact LRU everywhere: "
          + ("met" if not below else f"missed at {', '.join(below)}"))
    conv = [r for r in rows if r["trace"] == "conversation_trace.jsonl"
            and r["pool_tokens"] in (1_000_000, 2_000_000)]
    for r in conv:
        print(f"goal >= 1.5x LRU, conversation at {r['pool_tokens']:,}: {r['x_lru']:.2f}x "
              f"({'met' if r['x_lru'] >= 1.5 else 'missed'})")
    if args.json_out:
        args.json_out.write_text(json.dumps({"limit": limit, "rows": rows}, indent=1))
        print(f"wrote {args.json_out}")
    print(f"total bench time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
