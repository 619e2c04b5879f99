"""A ``PolicyService`` serving on its own thread in the test process, with the session's real
``mooncake_master`` and the fleet's CURVE keys: what the per-key cap tests (snapshot and
records ports) and the first-snapshot test run against, so they can read its counters and
caps directly."""

from __future__ import annotations

import threading
from typing import Any

from kvpool_agent.auth import KeyPaths, Role
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.policy_wire import policy_ports
from kvpool_policy.service import PolicyService
from kvpool_replay import LocalMooncakeMaster, free_port_block

CAPACITY_BYTES = 64 << 20
"""The service's capacity (bytes): these tests count connections and snapshots, not chunks."""


class RunningService:
    """``PolicyService(address, keys["hub"], ...)`` on a fresh port block, serving until
    ``close``. ``capacity_bytes``: the policy's; ``service_kwargs`` go to ``PolicyService``
    (caps, ``snapshot_every_s``).

    Attributes:
        records_at, snapshots_at: the records port P and the snapshots port P+1
            (``tcp://127.0.0.1:...``).
    """

    def __init__(self, master: LocalMooncakeMaster, keys: dict[Role, KeyPaths],
                 capacity_bytes: int = CAPACITY_BYTES, **service_kwargs: Any) -> None:
        self.keys = keys
        self.backend = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            "master_server_address": master.address, "master_admin_url": master.admin_url,
            "global_segment_size": 0, "local_buffer_size": "16MB"}}))
        self.address = f"tcp://127.0.0.1:{free_port_block()}"
        self.records_at, self.snapshots_at = policy_ports(self.address)
        self.service = PolicyService(self.address, keys["hub"], self.backend, capacity_bytes,
                                     **service_kwargs)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.service.serve, args=(self.stop,),
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.service.close()
        self.backend.close()
