"""Reuse-figures benchmark (issue 41): what the hub's reuse worker costs on a full window.

The hub keeps the fleet's last ``WINDOW_CHUNKS`` looked-up chunk ids
(``kvpool_agent._access_window``) and recomputes, on its own thread, the live ceiling (every
``REUSE_REFRESH_S``) and the what-if curves (LRU and MIN at 6 capacities, every
``WHATIF_REFRESH_S``). This fills a window from a Mooncake trace (chunk ids as the agents send
them) and times each part, median of ``--rounds``, with the window's memory.

Goals: the ceiling well under ``REUSE_REFRESH_S`` (5 s) and the what-if curve well under
``WHATIF_REFRESH_S`` (60 s) of one core on a full window, so the worker's CPU share stays small.

Run (figures belong in docs/benchmarks.md once measured on a quiet machine)::

    .venv/bin/python bench/bench_reuse.py [--chunks 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpool_agent._access_window import WINDOW_CHUNKS, AccessWindow
from kvpool_agent.protocol import chunk_id
from kvpool_connector.keys import chunk_hashes
from kvpool_replay import default_trace_path, load_trace, request_tokens


def _fill(window: AccessWindow, trace: str, chunk_size: int) -> None:
    """Add the trace's requests in order (repeated when short) until the window is full."""
    reqs = load_trace(default_trace_path(trace))
    items: list[tuple[int, list[int]]] = []
    total = 0
    while total < window.max_chunks:
        for i, r in enumerate(reqs):
            if i == len(items):  # hashed once, on first use
                items.append((r.input_length, [chunk_id(h) for h in chunk_hashes(
                    request_tokens(r), chunk_size)]))
            n, ids = items[i]
            window.add("bench", chunk_size, n, ids)
            total += len(ids)
            if total >= window.max_chunks:
                return


def _median_s(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=WINDOW_CHUNKS, help="window size in chunk ids")
    ap.add_argument("--chunk-size", type=int, default=16, help="tokens per chunk (default 16)")
    ap.add_argument("--trace", default="conversation_trace.jsonl")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    window = AccessWindow(args.chunks)
    _fill(window, args.trace, args.chunk_size)
    acc = window.snapshot()
    # What the window holds: each access's record and its array of ids.
    mem = sum(sys.getsizeof(a) + sys.getsizeof(a.chunks) for a in acc)
    ceiling = AccessWindow.ceiling(acc)["bench"]
    cap = max(args.chunk_size, window.chunks // 4 * args.chunk_size)
    print(f"window: {len(acc)} accesses, {window.chunks} chunk ids, {mem / 2**20:.2f} MiB "
          f"(records and arrays); ceiling {ceiling.hit_rate:.1%}")
    print(f"ceiling   median {_median_s(lambda: AccessWindow.ceiling(acc), args.rounds):.3f} s")
    print(f"what-if   median "
          f"{_median_s(lambda: AccessWindow.whatif(acc, 'bench', cap), args.rounds):.3f} s "
          f"(6 capacities around {cap} tokens)")


if __name__ == "__main__":
    main()
