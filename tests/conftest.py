"""Shared fixtures: real services on 127.0.0.1, started once per test session where possible."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import mooncake.store  # noqa: F401  # see below
import pytest
import yaml
from _timing import install as install_suite_timing

from kvpool_replay import LocalMooncakeMaster
from kvpool_replay._forkserver import stop_fork_server

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
# mooncake_master, mooncake_client and dscli live next to the interpreter in the venv; tests may
# run without the venv's bin on PATH (python -m pytest from any shell).
# Mooncake's native client is loaded before any test loads openYuanrong's: the other way round,
# the first MooncakeDistributedStore in the process segfaults (a test-process interaction; an
# engine loads one backend).
_BIN = os.path.join(sys.prefix, "bin")
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


def pytest_configure(config: pytest.Config) -> None:
    # Wall time per test directory and the suite's budget (KVPOOL_TEST_BUDGET_S): tests/_timing.py.
    install_suite_timing(config)


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> Iterator[None]:
    """The engines' fork server (``kvpool_replay._forkserver``: replays' simulated engines and
    ``tests/vllm``'s real ones), one per test process, started by the first engine; stopped
    and reaped when the session ends."""
    yield
    stop_fork_server()


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[LocalMooncakeMaster]:
    """One real mooncake_master for the session. Tests must use their own key namespace
    (e.g. a unique model name) and must not assume an empty pool."""
    with LocalMooncakeMaster() as master:
        yield master


@pytest.fixture
def fresh_mooncake_master() -> Iterator[LocalMooncakeMaster]:
    """A mooncake_master of the test's own, for tests that fill, kill or flush the pool."""
    with LocalMooncakeMaster() as master:
        yield master


_SERIES = re.compile(r"(?<![\w:\"'])((?:vllm:)?kvpool_[A-Za-z0-9_:]*)")


@pytest.fixture(scope="session")
def observability_series() -> dict[str, set[str]]:
    """Series named by ``config/prometheus/kvpool-rules.yml`` and
    ``config/grafana/kvpool-dashboard.json``: ``{"rules": names, "dashboard": names}``, each a
    ``kvpool_*`` (hub) or ``vllm:kvpool_*`` (vLLM) sample name as a scrape shows it."""
    root = Path(__file__).resolve().parents[1] / "config"
    rules = yaml.safe_load((root / "prometheus" / "kvpool-rules.yml").read_text())
    dash = json.loads((root / "grafana" / "kvpool-dashboard.json").read_text())
    rule_exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    panel_exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return {"rules": {m for e in rule_exprs for m in _SERIES.findall(e)},
            "dashboard": {m for e in panel_exprs for m in _SERIES.findall(e)}}
