"""Fixtures for console tests: a live fleet (see ``livefleet``) on the session mooncake_master."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from livefleet import LiveFleet, hub_address

from kvpool_agent import AGENT_KEYS_ENV, local_fleet_keys
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
               pool_backend: MooncakeBackend, monkeypatch: pytest.MonkeyPatch
               ) -> Iterator[LiveFleet]:
    """The hub requires keys on every port; agents get theirs from ``KVPOOL_AGENT_KEYS`` and a
    console without ``--keys`` the viewer's from ``KVPOOL_KEYS_DIR``."""
    keys = local_fleet_keys(tmp_path / "keys")
    monkeypatch.setenv(AGENT_KEYS_ENV, str(keys["agent"].root))
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(keys["viewer"].root))
    address = hub_address()
    hub = FleetHub(address, authorized_keys_dir=keys["hub"].authorized_dir,
                   secret_key_file=keys["hub"].hub_secret, audit_file=tmp_path / "audit.jsonl",
                   snapshot_interval_s=1.0, delta_interval_s=0.1).start()
    fleet = LiveFleet(address=address, keys=keys["operator"], hub=hub, backend=pool_backend,
                      master=mooncake_master, model=f"console-{uuid.uuid4().hex[:8]}")
    try:
        yield fleet
    finally:
        for handles in fleet.engines.values():
            for h in handles:
                h.stop()
        hub.stop()
