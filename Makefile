# Entry points a newcomer uses; README.md opens with the first two.
.PHONY: setup demo test lint bench

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/kvpool-console --demo

test: setup
	bash scripts/test.sh

lint: setup
	.venv/bin/ruff check kvpool_connector kvpool_agent kvpool_console tests bench
	.venv/bin/mypy

bench: setup
	bash scripts/bench.sh
