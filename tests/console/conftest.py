"""Fixtures for console tests: a live fleet (see ``livefleet``) on the session mooncake_master;
for the triage tests a bare hub, something listening as the pool's master, a real sshd and a
stopped process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from livefleet import LiveFleet, hub_address, keyed_live_fleet
from sshd import Sshd, start_sshd

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
    """A keyed hub (``keyed_live_fleet``) writing its audit trail to ``tmp_path``."""
    with keyed_live_fleet(tmp_path / "keys", mooncake_master, pool_backend, monkeypatch,
                          "console", audit_file=tmp_path / "audit.jsonl") as fleet:
        yield fleet


@pytest.fixture
def hub() -> Iterator[str]:
    """A hub without keys (``FleetHub``) on a free port: its address."""
    address = hub_address()
    h = FleetHub(address, snapshot_interval_s=0.5, delta_interval_s=0.1).start()
    try:
        yield address
    finally:
        h.stop()


@pytest.fixture
def master() -> Iterator[str]:
    """Something listening where the agents say the pool's master is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """A real sshd on a free port of 127.0.0.1 for SSH triage (``tests/sshd.py``), one per
    test module."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def stopped() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of this host and pid namespace, SIGSTOPped (what a hung engine is)."""
    proc = subprocess.Popen(["sleep", "300"])
    os.kill(proc.pid, signal.SIGSTOP)
    yield proc
    proc.kill()
    proc.wait()
