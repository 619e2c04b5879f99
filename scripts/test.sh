#!/usr/bin/env bash
# Run the whole test suite: lint, type check, package import contracts, then pytest. Tests start
# their own services (mooncake_master, yuanrong worker, real vLLM engines) on 127.0.0.1 and stop
# them.
set -euo pipefail
cd "$(dirname "$0")/.."
export MC_TCP_BIND_ADDRESS=127.0.0.1
printf '\n==> ruff\n';  .venv/bin/ruff check kvpool_connector kvpool_agent kvpool_console kvpool_config kvpool_replay tests bench
printf '\n==> mypy\n';  .venv/bin/mypy
printf '\n==> import contracts\n';  .venv/bin/lint-imports
printf '\n==> pytest\n'
exec .venv/bin/python -m pytest -p no:cacheprovider -ra --durations=15 "$@"
