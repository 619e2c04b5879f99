# Entry points a newcomer uses; README.md opens with the first two.
.PHONY: setup demo test lint bench docs docs-reference screenshots plots

setup:
	@bash scripts/setup.sh

# Extra demo options, e.g. make demo DEMO_ARGS="--trace /data/conversation_trace.jsonl --engines 6"
DEMO_ARGS ?=

demo: setup
	.venv/bin/kvpool-console --demo $(DEMO_ARGS)

test: setup
	bash scripts/test.sh

lint: setup
	.venv/bin/ruff check kvpool_connector kvpool_agent kvpool_console kvpool_config kvpool_replay kvpool_policy tests bench scripts setup.py
	.venv/bin/mypy
	.venv/bin/lint-imports

bench: setup
	bash scripts/bench.sh

# The documentation site (docs/, mkdocs.yml): built strictly into site/ (gitignored).
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

# docs/connector/config-reference.md from kvpool_connector/config.py and
# docs/snippets/console-keys.md from the console's key bindings (tests check both).
docs-reference: setup
	.venv/bin/python scripts/gen_config_reference.py
	.venv/bin/python scripts/gen_console_keys.py

# docs/img/*.svg: the real console's screens over docs/data/demo-fleet.json
# (re-record that fleet with .venv/bin/python scripts/record_demo_fleet.py).
screenshots: setup
	.venv/bin/python scripts/screenshots.py

# docs/img/fig9.svg from docs/data/fig9.json.
plots: setup
	.venv/bin/python scripts/plot_fig9.py
