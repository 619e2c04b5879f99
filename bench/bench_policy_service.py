"""Policy service cost (issue 40): CPU time and memory per million chunk accesses.

The service's path for a trace's records, in one process and without sockets: each request as
an engine's ``PolicyRecord``, batched 64 to a ``RecordBatch``, msgpack-encoded and decoded
(what crosses the records socket) and applied by ``kvpool_policy.service.PolicyCore`` (checks,
budget, ``PoolPolicy.record``). Baseline of the same run: ``PoolPolicy.record`` alone over the
same records (the offline model), so the service's own overhead is the difference.

Per repeat: CPU seconds (``time.process_time``) per million chunk accesses; printed as median
and spread (min-max) over ``--repeats``. Memory: ``tracemalloc`` peak of one run of each, per
resident chunk at the end.

Run (a slice to check it works; time the whole trace on an idle machine)::

    .venv/bin/python bench/bench_policy_service.py --limit 300 --repeats 1
    .venv/bin/python bench/bench_policy_service.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpool_connector.keys import ParallelLayout, chunk_hashes, shard_prefix
from kvpool_connector.policy_wire import WIRE_VERSION, PolicyLayout, PolicyRecord, RecordBatch
from kvpool_policy import AccessRecord, PoolPolicy
from kvpool_policy.service import PolicyCore
from kvpool_replay import default_trace_path, load_trace, request_tokens

CHUNK = 512
CHUNK_BYTES = 2 << 20  # a 2 MiB chunk: the capacity below is in tokens of it
DIGEST = "0123456789ab"
LAYOUT = PolicyLayout(DIGEST, [shard_prefix("bench", DIGEST, ParallelLayout(tp_rank=r))
                               for r in range(8)])
BATCH = 64


def _service(records: list[PolicyRecord], capacity: int) -> PolicyCore:
    core = PolicyCore(PoolPolicy(capacity), None, budget=10**9)
    dec = msgspec.msgpack.Decoder(RecordBatch)
    for i in range(0, len(records), BATCH):
        wire = msgspec.msgpack.encode(RecordBatch(WIRE_VERSION, "e0", i // BATCH, 0, [LAYOUT],
                                                  records[i:i + BATCH]))
        core.apply(dec.decode(wire), "bench")
    return core


def _model(records: list[PolicyRecord], capacity: int) -> PoolPolicy:
    policy = PoolPolicy(capacity)
    for r in records:
        policy.record(AccessRecord(r.digest, tuple(r.hashes), r.chunk_bytes, r.wants))
    return policy


def _cpu(run: Callable[[], object]) -> float:
    t0 = time.process_time()
    run()
    return time.process_time() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default="conversation_trace.jsonl")
    p.add_argument("--capacity-tokens", type=int, default=1_000_000)
    p.add_argument("--limit", type=int, default=0, help="requests (0 = the whole trace)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    reqs = load_trace(default_trace_path(args.trace), limit=args.limit or None)
    records = [PolicyRecord(DIGEST, hs, CHUNK_BYTES, len(hs))
               for hs in (chunk_hashes(request_tokens(r), CHUNK) for r in reqs)]
    accesses = sum(len(r.hashes) for r in records)
    capacity = args.capacity_tokens // CHUNK * CHUNK_BYTES
    print(f"{args.trace}: {len(records):,} records, {accesses:,} chunk accesses, capacity "
          f"{args.capacity_tokens:,} tokens; {args.repeats} repeats")
    runs = {"baseline PoolPolicy.record": lambda: _model(records, capacity),
            "service PolicyCore.apply": lambda: _service(records, capacity)}
    for name, run in runs.items():
        per_m = [_cpu(run) / accesses * 1e6 for _ in range(args.repeats)]
        tracemalloc.start()
        kept = run()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        policy = kept.policy if isinstance(kept, PolicyCore) else kept
        assert isinstance(policy, PoolPolicy)
        resident = len(policy)
        print(f"{name:<28} CPU {statistics.median(per_m):7.3f} s per million accesses "
              f"(spread {min(per_m):.3f}-{max(per_m):.3f}); peak {peak / 2**20:6.1f} MiB, "
              f"{peak / max(1, resident):,.0f} bytes per resident chunk ({resident:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
