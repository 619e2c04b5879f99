"""Fixtures for console tests: a live fleet (see ``livefleet``) on the session mooncake_master."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from livefleet import LiveFleet, hub_address

from kvpool_agent.auth import generate_keys
from kvpool_agent.hub import FleetHub
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_replay import LocalMooncakeMaster


@pytest.fixture(scope="session")
def pool_backend(mooncake_master: LocalMooncakeMaster) -> Iterator[MooncakeBackend]:
    backend = MooncakeBackend(MooncakeConfig(
        master_server_address=mooncake_master.address, master_admin_url=mooncake_master.admin_url,
        global_segment_size=64 << 20, local_buffer_size=16 << 20))
    yield backend
    backend.close()


@pytest.fixture
def live_fleet(tmp_path: Path, mooncake_master: LocalMooncakeMaster,
               pool_backend: MooncakeBackend) -> Iterator[LiveFleet]:
    keys = generate_keys(tmp_path / "keys")
    address = hub_address()
    hub = FleetHub(address, authorized_keys_dir=keys.authorized_dir,
                   secret_key_file=keys.server_secret, audit_file=tmp_path / "audit.jsonl",
                   snapshot_interval_s=1.0, delta_interval_s=0.1).start()
    fleet = LiveFleet(address=address, keys=keys, hub=hub, backend=pool_backend,
                      master=mooncake_master, model=f"console-{uuid.uuid4().hex[:8]}")
    try:
        yield fleet
    finally:
        for handles in fleet.engines.values():
            for h in handles:
                h.stop()
        hub.stop()
