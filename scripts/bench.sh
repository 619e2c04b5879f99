#!/usr/bin/env bash
# Run every benchmark in bench/; each prints its figures next to its named baseline.
set -euo pipefail
cd "$(dirname "$0")/.."
export MC_TCP_BIND_ADDRESS=127.0.0.1
for b in bench/bench_*.py; do
    printf '\n==> %s\n' "$b"
    .venv/bin/python "$b"
done
