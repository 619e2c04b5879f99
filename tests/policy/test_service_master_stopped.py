"""The policy service while its (non-HA) master does not answer: a real ``mooncake_master``
SIGSTOPped under a running ``kvpool-policy serve``, a store process, an engine's
``PolicyClient`` and a snapshot subscriber (the live harness of ``test_service_live``).

Before (measured, ``kvpool_policy._store_calls``): the service read pins on its loop every
second, and each read waited in the Mooncake client (90 s on a SIGSTOPped master, 8.5-13.3 s
on a SIGKILLed one): the subscriber saw no snapshot for the whole 15 s the master was stopped.
And a pin read on a master that does not answer read as "no pins" (the empty set)."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from test_service_live import (
    CAPACITY_CHUNKS,
    MODEL,
    Pool,
    chunk,
    pinned_under_the_service,
    store_client,
    wait_for,
)
from test_service_live import DIGEST as LIVE_DIGEST

from kvpool_agent.auth import local_fleet_keys
from kvpool_connector.backends.base import BackendError
from kvpool_connector.pins import pinned_chunks
from kvpool_connector.policy_wire import SNAPSHOT_EVERY_S, AdmissionSnapshot
from kvpool_replay import LocalMooncakeMaster, LocalPoolStore

GAP_S = 6 * SNAPSHOT_EVERY_S
"""The longest wait between two snapshots the subscriber may see while the master is stopped
(s): six periods of ``--snapshot-every-ms`` (the default 500 ms; room for a loaded 2-core
machine), the engines' default ``policy_stale_ms`` (3 s): they stay with the service."""

STOPPED_SNAPSHOTS = 10
"""Snapshots the subscriber must see while the master is stopped (5 s at the period)."""


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    """A master of the test's own (it is stopped) with a 200 ms lease, a 32 MiB store."""
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=200) as master, \
            LocalPoolStore(master, 32 << 20):
        p = Pool(master, local_fleet_keys(tmp_path / "keys"), tmp_path)
        try:
            yield p
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)  # stopped, it would not stop on SIGTERM
            p.close()


class Subscriber:
    """A viewer's snapshot subscriber on a thread of its own: each snapshot's arrival
    (``time.monotonic``) and its ``removed`` and ``records`` counts."""

    def __init__(self, pool: Pool) -> None:
        self.got: list[tuple[float, int, int]] = []
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        self._sock.linger = 0
        pool.keys["viewer"].client("viewer").apply(self._sock)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(f"tcp://127.0.0.1:{pool.service.port + 1}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                snap = msgspec.msgpack.decode(self._sock.recv(), type=AdmissionSnapshot)
                self.got.append((time.monotonic(), snap.removed, snap.records))

    def since(self, t: float) -> list[tuple[float, int, int]]:
        return [s for s in list(self.got) if s[0] >= t]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)


def test_snapshots_and_records_flow_while_the_master_is_stopped(pool: Pool) -> None:
    b, held = pinned_under_the_service(pool)
    first = [chunk(f"s{i}") for i in range(CAPACITY_CHUNKS + 1)]
    for h in first:
        pool.save(b, [h])
    # The pool full: the pinned chunk and the newest; two chunks removed, both ranks' keys.
    wait_for(lambda: pool.resident() == {held, *first[-(CAPACITY_CHUNKS - 1):]},
             what="the service's first removals", log=pool.log)
    before = wait_for(lambda: (s := b.snapshot) is not None and s.removed == 2 * 2 and s)
    sub = Subscriber(pool)
    try:
        wait_for(lambda: sub.got, what="the subscriber's first snapshot", log=pool.log)
        stopped = time.monotonic()
        os.kill(pool.master.proc.pid, signal.SIGSTOP)
        # Records while the master is stopped (the engine cannot save them: no put answers):
        # the service applies them and evicts its oldest chunks, their removals wait.
        late = [chunk(f"late{i}") for i in range(3)]
        for h in late:
            assert b.admit([h]) == 1
        n = before.records + len(late)
        wait_for(lambda: len(sub.since(stopped)) >= STOPPED_SNAPSHOTS
                 and sub.got[-1][2] >= n, 60,
                 f"{STOPPED_SNAPSHOTS} snapshots and {n} records while the master is stopped",
                 log=lambda: f"{sub.since(stopped)}\n{pool.log()}")
        during = sub.since(stopped)
        gaps = [b_[0] - a[0] for a, b_ in itertools.pairwise(sub.since(stopped - GAP_S))]
        assert max(gaps) < GAP_S, (gaps, pool.log())
        assert {removed for _, removed, _ in during} == {before.removed}  # nothing removed
        assert b.in_charge == "service"
        os.kill(pool.master.proc.pid, signal.SIGCONT)
        # Removals resume: the three oldest unpinned chunks go (one at a time behind a call
        # the stop held up: up to 90 s for a pin read, measured), the pinned one stays.
        keep = {held, *first[-(CAPACITY_CHUNKS - 1 - len(late)):]}
        wait_for(lambda: pool.resident() == keep, 240, f"the pool holding {keep}",
                 log=lambda: f"{sorted(pool.resident())}\n{pool.log()}")
        wait_for(lambda: sub.got[-1][1] == before.removed + 2 * len(late), 60,
                 "the removals counted", log=pool.log)
    finally:
        sub.close()


def test_a_pin_read_on_a_master_that_does_not_answer_is_an_error(
        fresh_mooncake_master: LocalMooncakeMaster) -> None:
    """The connector's record reader took a killed master's codes for "no record" (the empty
    set, measured): it raises now, so the service's, the engines' and the agents' pin reads
    keep the pins read last. A live master without pin records is no error."""
    master = fresh_mooncake_master
    client = store_client(master.address, master.admin_url)
    try:
        assert pinned_chunks(client, MODEL, LIVE_DIGEST, 1) == frozenset()  # type: ignore[arg-type]
        master.kill()
        with pytest.raises(BackendError, match=r"answered (RPC_FAIL|INTERNAL_ERROR|ERROR_)"):
            pinned_chunks(client, MODEL, LIVE_DIGEST, 1)  # type: ignore[arg-type]
    finally:
        client.close()
