"""A module's independent replays run two at a time in the background (test-only helper).

A replay spends most of its time starting its engine process (importing torch and vLLM,
building the connector: one core, about 10 s on an idle machine) while the test process only
waits; two replays at a time keep both cores of the CI machine busy. Each replay still has its
own master, store and engine, and each test asserts on its own replay's result: ``result(name)``
waits for it and re-raises the replay's own exception in the test that asked.

Only the jobs of tests selected in the session are started (``-k`` one test runs one replay).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest

WORKERS = 2
"""Replays at a time: the CI machine has 2 cores."""


class Jobs:
    """Named jobs running on ``WORKERS`` threads, started in the order given."""

    def __init__(self, futures: dict[str, Future[Any]]) -> None:
        self._futures = futures

    def result(self, name: str, timeout_s: float = 540.0) -> Any:
        """The job's return value (waiting up to ``timeout_s``); its exception re-raised."""
        if name not in self._futures:
            raise KeyError(f"no background job {name!r} (its test was not selected?)")
        return self._futures[name].result(timeout=timeout_s)


@contextmanager
def background_jobs(request: pytest.FixtureRequest,
                    jobs: dict[str, Callable[[], Any]]) -> Iterator[Jobs]:
    """Start the ``jobs`` (test name -> callable; a parametrized test's name with its id, as
    ``item.name``) whose tests are selected in this session and belong to the requesting
    module; on exit, wait for those still running (a replay stops everything it started)."""
    module = request.node.path if hasattr(request.node, "path") else None
    selected = {item.name for item in request.session.items
                if module is None or item.path == module}
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="replay-job")
    futures = {name: pool.submit(job) for name, job in jobs.items() if name in selected}
    try:
        yield Jobs(futures)
    finally:
        pool.shutdown(wait=True, cancel_futures=False)
