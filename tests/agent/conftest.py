"""Fixtures for the agent tests: a hub on free ports with every role's CURVE keys, a real
Mooncake client.

The ``hub`` fixture's hub requires keys on every port; it points ``KVPOOL_AGENT_KEYS`` at the
agent keys and ``KVPOOL_KEYS_DIR`` at the viewer keys for the test, so agents and consoles
started without explicit keys authenticate as a configured fleet's would."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from agent_testlib import free_port_block

from kvpool_agent import AGENT_KEYS_ENV, FleetHub, KeyPaths, local_fleet_keys
from kvpool_agent.auth import Role
from kvpool_replay import LocalMooncakeMaster

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
# mooncake_master lives next to the interpreter in the venv; tests may run without PATH set.
_BIN = os.path.join(sys.prefix, "bin")
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture(scope="session")
def fleet_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[Role, KeyPaths]:
    """Every role's keys directory (``kvpool_agent.auth.local_fleet_keys``)."""
    return local_fleet_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="session")
def keys_dir(fleet_keys: dict[Role, KeyPaths]) -> Path:
    """The operator's keys directory (``hub.key``, ``operator.key_secret``)."""
    return fleet_keys["operator"].root


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A ZMQ context of the test's own, destroyed without lingering afterwards."""
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def hub_address() -> Iterator[str]:
    """A hub address whose five ports (``free_port_block``) stay held for the whole test.

    Each port has a socket bound with ``SO_REUSEADDR`` and never listening: a connection to
    it is refused as if nobody were there, a hub binds it (libzmq sets ``SO_REUSEADDR`` too)
    whenever the test starts one, and another test worker's ``free_port_block`` probe finds
    it taken. Without the hold, a test that starts its hub late (or restarts it) left the
    ports free for 30 s, and a CI run lost a test to another worker's hub bound there."""
    for _ in range(20):
        port = free_port_block()
        with contextlib.ExitStack() as held:
            try:
                for p in range(port, port + 5):
                    s = held.enter_context(socket.socket())
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", p))
            except OSError:  # taken since the probe: draw again
                continue
            yield f"tcp://127.0.0.1:{port}"
            return
    raise RuntimeError("no hub ports could be held in 20 draws")


@pytest.fixture
def hub(hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetHub]:
    kp = fleet_keys["hub"]
    monkeypatch.setenv(AGENT_KEYS_ENV, str(fleet_keys["agent"].root))
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(fleet_keys["viewer"].root))
    with FleetHub(
        hub_address,
        authorized_keys_dir=kp.authorized_dir,
        secret_key_file=kp.hub_secret,
        audit_file=tmp_path / "audit.jsonl",
        snapshot_interval_s=1.0,
    ) as h:
        yield h


@pytest.fixture
def own_keys(tmp_path: Path) -> dict[Role, KeyPaths]:
    """Every role's keys of this test alone: a key revoked or a pool bound here never touches
    another test's hub (the session's ``fleet_keys`` are shared)."""
    return local_fleet_keys(tmp_path / "keys")


@pytest.fixture
def own_hub(hub_address: str, own_keys: dict[Role, KeyPaths],
            tmp_path: Path) -> Iterator[FleetHub]:
    """A keyed hub over ``own_keys``, auditing to ``tmp_path``, a snapshot a second."""
    kp = own_keys["hub"]
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  snapshot_interval_s=1.0) as h:
        yield h


@pytest.fixture(scope="session")
def agent_master() -> Iterator[LocalMooncakeMaster]:
    """The agent tests' own master (flush tests remove whole scopes; keep others' keys apart)."""
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=10_000) as master:
        yield master


@pytest.fixture(scope="session")
def mooncake_backend(agent_master: LocalMooncakeMaster) -> Iterator[Any]:
    """The connector's real MooncakeBackend on ``agent_master`` (64 MB embedded segment)."""
    from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig

    backend = MooncakeBackend(
        MooncakeConfig(
            master_server_address=agent_master.address,
            master_admin_url=agent_master.admin_url,
            global_segment_size="64MB",
            local_buffer_size="16MB",
            # A key seen leased is tried again this long after (kvpool_connector._removals):
            # short, so a reset flush outlasts a reader's 10 s lease within its 20 s.
            transfer_timeout_ms=2_000,
        )
    )
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def pool_buffer(mooncake_backend: Any) -> ctypes.Array[ctypes.c_char]:
    """1 MiB of host memory registered once with ``mooncake_backend`` (a range may only be
    registered once, and must outlive its registration)."""
    buf = ctypes.create_string_buffer(1 << 20)
    mooncake_backend.register_buffer(ctypes.addressof(buf), 1 << 20)
    return buf


@pytest.fixture
def model() -> str:
    """A model name of the test's own, so its keys never meet another test's."""
    return f"org/model-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test started (appended here): killed if still running when it ends."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(30)
