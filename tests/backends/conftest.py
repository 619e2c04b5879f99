"""Fixtures for backend tests: a real openYuanrong datasystem worker started with ``dscli``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool_replay import LocalYuanrongWorker


@pytest.fixture(scope="session")
def yuanrong_worker() -> Iterator[LocalYuanrongWorker]:
    """One real yuanrong worker (own metastore, 256 MB shared memory, ``resource.log`` every
    500 ms) for the session. ``dscli start`` takes about 6 s; tests use their own key
    namespace and must not assume an empty pool."""
    with LocalYuanrongWorker(shared_memory_size_mb=256,
                             extra_args=["--log_monitor_interval_ms", "500"]) as worker:
        print(f"\nyuanrong worker {worker.address} started in {worker.start_seconds:.1f}s")
        yield worker


@pytest.fixture
def fresh_yuanrong_worker() -> Iterator[LocalYuanrongWorker]:
    """A small worker of the test's own (64 MB), for tests that fill or kill it."""
    with LocalYuanrongWorker(shared_memory_size_mb=64) as worker:
        yield worker
