"""Fixtures every real-vLLM test module shares.

Module scope: the pool (``_harness.Pool`` over the session's ``mooncake_master``) and a real
fleet hub the engines' agents report to (ports P..P+3), each module its own, so one module's
keys and agents never meet another's counts. Session scope: the tiny Llama (built once, read
only: a test that changes weights copies it first)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_agent.hub import FleetHub
from kvpool_replay import LocalMooncakeMaster, free_port_block

from _harness import REPO, Pool  # isort: skip


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama every Llama module runs (``build_tiny_model``: cached under ``.cache``)."""
    from kvpool_replay import build_tiny_model

    return build_tiny_model(REPO / ".cache" / "tiny-llama").resolve()


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
