# Entry points a newcomer uses; README.md opens with the first two.
.PHONY: setup demo test lint bench

setup:
	@bash scripts/setup.sh

# Extra demo options, e.g. make demo DEMO_ARGS="--trace /data/conversation_trace.jsonl --engines 6"
DEMO_ARGS ?=

demo: setup
	.venv/bin/kvpool-console --demo $(DEMO_ARGS)

test: setup
	bash scripts/test.sh

lint: setup
	.venv/bin/ruff check kvpool_connector kvpool_agent kvpool_console kvpool_config kvpool_replay tests bench setup.py
	.venv/bin/mypy
	.venv/bin/lint-imports

bench: setup
	bash scripts/bench.sh
