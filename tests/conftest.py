"""Shared fixtures: real services on 127.0.0.1, started once per test session where possible."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import mooncake.store  # noqa: F401  # see below
import pytest

from kvpool_replay import LocalMooncakeMaster

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
# mooncake_master, mooncake_client and dscli live next to the interpreter in the venv; tests may
# run without the venv's bin on PATH (python -m pytest from any shell).
# Mooncake's native client is loaded before any test loads openYuanrong's: the other way round,
# the first MooncakeDistributedStore in the process segfaults (a test-process interaction; an
# engine loads one backend).
_BIN = os.path.join(sys.prefix, "bin")
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


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
