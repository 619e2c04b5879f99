"""Fixtures every real-vLLM test module shares.

Module scope: a ``mooncake_master``, the pool (``_harness.Pool`` over it) and a real fleet hub
the engines' agents report to (ports P..P+3), each module its own, so one module's keys,
segments and agents never meet another's. Session scope: the tiny Llama (built once, read
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
def mooncake_master() -> Iterator[LocalMooncakeMaster]:
    """A master of the module's own (overrides the session's). The engines contribute
    segments: a stopped engine's segment stays listed for the master's ``client_ttl`` (Mooncake's
    default 10 s), where puts fail TRANSFER_FAIL (-800) and what it held is gone; and a reset
    flushes every key of its layout. On three test workers a module ran right after another on
    the same master met both (a flush of 30 keys where 8 were this module's)."""
    with LocalMooncakeMaster() as master:
        yield master


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
