"""Fixtures every real-vLLM test module shares, each module its own (module scope): the pool
(``_harness.Pool`` over the session's ``mooncake_master``) and a real fleet hub the engines'
agents report to (ports P..P+3)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool_agent.hub import FleetHub
from kvpool_replay import LocalMooncakeMaster, free_port_block

from _harness import Pool  # isort: skip


@pytest.fixture(scope="module")
def pool(mooncake_master: LocalMooncakeMaster, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Pool]:
    p = Pool(mooncake_master, tmp_path_factory.mktemp("vllm-pool"))
    yield p
    p.store.close()


@pytest.fixture(scope="module")
def hub() -> Iterator[FleetHub]:
    with FleetHub(f"tcp://127.0.0.1:{free_port_block()}") as h:
        yield h
