"""A live fleet for console tests: a real FleetHub (with CURVE operator keys), real agents
started with ``kvpool_agent.start_agent`` and fed through their Reporter, a real Mooncake pool
client (B's ``MooncakeBackend``) on the session ``mooncake_master``."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from kvpool_agent import AGENT_KEYS_ENV, local_fleet_keys, start_agent
from kvpool_agent.agent import AgentHandle
from kvpool_agent.auth import KeyPaths
from kvpool_agent.client import FleetClient
from kvpool_agent.hub import FleetHub
from kvpool_agent.protocol import Source
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_connector.keys import ParallelLayout, PoolKey
from kvpool_connector.operations import BackendOperations
from kvpool_replay import LocalMooncakeMaster, free_port_block

LEASE_TTL_MS = 11_000
DIGEST = "0123456789ab"
"""Layout digest of the keys the stand-in workers write."""


def hub_address() -> str:
    """``tcp://127.0.0.1:P`` with P..P+4 free (the hub's ports and ``/metrics``)."""
    return f"tcp://127.0.0.1:{free_port_block(5)}"


@dataclass
class LiveFleet:
    """Hub + agents; ``engines[engine_id]`` lists that engine's agent handles (scheduler
    first). ``model`` is unique per fleet so tests never touch each other's keys."""

    address: str
    keys: KeyPaths
    hub: FleetHub
    backend: MooncakeBackend
    master: LocalMooncakeMaster
    model: str
    engines: dict[str, list[AgentHandle]] = field(default_factory=dict)

    def add_engine(self, engine_id: str, role: str, kv_role: str, tp: int = 2,
                   model: str | None = None) -> list[AgentHandle]:
        model = model or self.model

        def src(agent: str, prole: str, rank: int = 0) -> Source:
            return Source(agent_id=f"{engine_id}/{agent}", engine_id=engine_id,
                          instance_role=role,  # type: ignore[arg-type]
                          kv_role=kv_role,  # type: ignore[arg-type]
                          process_role=prole,  # type: ignore[arg-type]
                          tp_rank=rank, pid=4242, host="127.0.0.1", backend="mooncake",
                          model=model)

        # The scheduler holds a pool client too (its lookups call batch_exists).
        sched = src("scheduler", "scheduler")
        handles = [start_agent(sched, address=self.address,
                               operations=BackendOperations(self.backend, sched),
                               lease_ttl_ms=LEASE_TTL_MS)]
        for r in range(tp):
            worker = src(f"dp0.tp{r}.pp0", "worker", r)
            handles.append(start_agent(
                worker, address=self.address,
                operations=BackendOperations(
                    self.backend, worker, key_scope=(model, DIGEST, (ParallelLayout(tp_rank=r),))),
                pool_admin_url=self.master.admin_url, lease_ttl_ms=LEASE_TTL_MS))
        self.engines[engine_id] = handles
        return handles

    def put_keys(self, model: str, n: int, tp: int = 2, size: int = 4096) -> list[str]:
        """Write ``n`` chunks per TP rank of ``model`` into the real pool; returns the keys."""
        keys = [str(PoolKey(model, DIGEST, ParallelLayout(tp_rank=r), f"{i:032x}"))
                for r in range(tp) for i in range(n)]
        for k in keys:
            rc = self.backend.store.put(k, b"\x07" * size)
            assert rc == 0, f"put {k} returned {rc}"
        return keys

    def present(self, keys: list[str]) -> list[int]:
        return self.backend.batch_exists(keys)

    def client(self, *, operator: bool) -> FleetClient:
        return FleetClient(self.address, keys_dir=self.keys.root if operator else None)

    def wait_agents(self, n: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.hub.fleet()) >= n:
                return
            time.sleep(0.05)
        raise AssertionError(f"hub saw {len(self.hub.fleet())} agents, wanted {n}")


@contextlib.contextmanager
def keyed_live_fleet(keys_root: Path, master: LocalMooncakeMaster, backend: MooncakeBackend,
                     monkeypatch: pytest.MonkeyPatch, model_prefix: str,
                     **hub_options: Any) -> Iterator[LiveFleet]:
    """A started hub requiring keys on every port (every role's keys under ``keys_root``;
    agents get theirs from ``KVPOOL_AGENT_KEYS``, a console without ``--keys`` the viewer's
    from ``KVPOOL_KEYS_DIR``), snapshots every 1 s and deltas every 0.1 s, plus
    ``hub_options``; every engine started on it and the hub are stopped on exit."""
    keys = local_fleet_keys(keys_root)
    monkeypatch.setenv(AGENT_KEYS_ENV, str(keys["agent"].root))
    monkeypatch.setenv("KVPOOL_KEYS_DIR", str(keys["viewer"].root))
    hub = FleetHub(hub_address(), authorized_keys_dir=keys["hub"].authorized_dir,
                   secret_key_file=keys["hub"].hub_secret, snapshot_interval_s=1.0,
                   delta_interval_s=0.1, **hub_options).start()
    fleet = LiveFleet(address=hub.address, keys=keys["operator"], hub=hub, backend=backend,
                      master=master, model=f"{model_prefix}-{uuid.uuid4().hex[:8]}")
    try:
        yield fleet
    finally:
        for handles in fleet.engines.values():
            for h in handles:
                h.stop()
        hub.stop()


async def until(pilot: Pilot, cond: Callable[[], bool], what: str, timeout_s: float = 10.0
                ) -> None:
    """Let the app run until ``cond()`` holds (checked every 0.1 s); fail naming ``what``
    after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.1)):
        if cond():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out waiting for {what}")
