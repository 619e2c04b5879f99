"""``pool_no_segments`` on a live pool: a real mooncake_master (``--client_ttl=1``), a real
``mooncake_client`` store, a worker's agent reading the master's admin port and a real hub.
The store stopped, the master drops its segment after ``client_ttl`` and stays healthy; the
console's rules raise the alert from what the agent reported (that it clears once memory is
mounted again is tested on fleet states in ``test_pool_no_segments.py``). Polls with a
deadline; about 8 s in all (the agent hands on a pool reading up to two polls, 4 s, after
asking)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from kvpool_agent import FleetClient, FleetHub, start_agent
from kvpool_agent.protocol import Source
from kvpool_console.alerts import Alert, evaluate
from kvpool_console.alerts.segments import NO_SEGMENTS_HINT
from kvpool_replay import LocalMooncakeMaster, LocalPoolStore, free_port_block
from kvpool_replay._processes import use_local_pool_env

SEGMENT = 64 << 20
WAIT_S = 30.0
"""Deadline of each wait: the master's TTL check, the agent's pool poll (every 2 s, a reading
reported at the next poll) and the hub's next delta took 4.0 s on an idle machine."""


def _wait(what: str, fetch: Callable[[], list[Alert]], pred: Callable[[list[Alert]], bool]
          ) -> list[Alert]:
    deadline = time.monotonic() + WAIT_S
    while not pred(alerts := fetch()):
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s; alerts: " + \
            "; ".join(f"{a.key}: {a.message}" for a in alerts)
        time.sleep(0.2)
    return alerts


def test_a_stopped_store_is_pool_no_segments_once_its_segment_is_dropped(tmp_path: Path) -> None:
    use_local_pool_env()
    address = f"tcp://127.0.0.1:{free_port_block()}"
    with FleetHub(address, snapshot_interval_s=0.5), \
            LocalMooncakeMaster(extra_args=["--client_ttl=1"], log_dir=tmp_path) as master, \
            LocalPoolStore(master, SEGMENT, log_dir=tmp_path) as store:
        pool = f"mooncake@{master.address}"
        agent = start_agent(Source(
            agent_id="e/dp0.tp0.pp0", engine_id="e", instance_role="mixed", kv_role="kv_both",
            process_role="worker", backend="mooncake", master=master.address),
            address=address, pool_admin_url=master.admin_url)
        client = FleetClient(address)
        try:
            def alerts() -> list[Alert]:
                entries = client.fleet()
                return evaluate({a: e.state for a, e in entries.items()},
                                {a: e.last_seen_ms for a, e in entries.items()},
                                time.time() * 1e3)

            def read(total: int) -> bool:
                return any(e.state.pool is not None and e.state.pool.healthy is True
                           and e.state.pool.total_bytes == total
                           for e in client.fleet().values())

            _wait("the store's segment read", alerts, lambda _: read(SEGMENT))
            assert [a for a in alerts() if a.subject == pool] == []
            assert store.proc is not None
            os.kill(store.proc.pid, signal.SIGTERM)
            store.proc.wait(timeout=10)
            got = _wait("pool_no_segments", alerts,
                        lambda al: any(a.rule == "pool_no_segments" for a in al))
            (alert,) = [a for a in got if a.subject == pool]
            assert (alert.rule, alert.severity) == ("pool_no_segments", "critical")
            assert alert.message.startswith(
                f"no store segment is mounted on master {master.address} (pool {pool}: 0 B "
                "of memory; engines e): ")
            assert alert.hint == NO_SEGMENTS_HINT
            assert read(0)
        finally:
            client.close()
            agent.stop()
