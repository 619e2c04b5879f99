"""Closing a Mooncake backend while saves, lookups and health probes are inside the store client
never crashes the process (issue 38: a SIGSEGV inside ``RealClient`` was seen). 20 clients, each
closed while two threads put fragmented values, one looks keys up and one probes health, in a
child process against a real ``mooncake_master`` and a separate ``mooncake_client`` store."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvpool_replay import LocalMooncakeMaster, LocalPoolStore, engine_env

ROUNDS = 20

_CHILD = r'''
import sys, threading, uuid
import torch
from kvpool_connector.backends.base import BackendError
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig

master, admin, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = {"master_server_address": master, "global_segment_size": 0, "master_admin_url": admin,
       "local_buffer_size": "16MB"}
SLICE, PER_KEY, KEYS = 16 << 10, 64, 8
kept = []  # registered memory is never freed: a client keeps its registration
failed = []  # the put codes that were not 0, every round
for r in range(rounds):
    backend = MooncakeBackend(MooncakeConfig.load({"mooncake": cfg}))
    src = torch.ones(SLICE * PER_KEY * KEYS, dtype=torch.uint8)
    kept.append(src)
    backend.register_buffer(src.data_ptr(), src.numel())
    stop = threading.Event()
    done = {"put": threading.Event(), "exists": threading.Event(), "health": threading.Event()}
    refused = []

    def put():
        addrs = [[src.data_ptr() + (k * PER_KEY + j) * SLICE for j in range(PER_KEY)]
                 for k in range(KEYS)]
        while not stop.is_set():
            try:
                codes = backend.batch_put_from([f"close/{uuid.uuid4().hex}" for _ in range(KEYS)],
                                               addrs, [[SLICE] * PER_KEY] * KEYS)
            except BackendError as exc:
                refused.append(exc.code)
                return
            # A put the store or close fails (a full pool's NO_AVAILABLE_HANDLE, a transfer
            # cut by close) is a failed save, not a crash: its codes are Mooncake's errors.
            failed.extend(c for c in codes if c != 0)
            done["put"].set()

    def exists():
        while not stop.is_set():
            try:
                backend.batch_exists([f"close/{uuid.uuid4().hex}" for _ in range(64)])
            except BackendError as exc:
                refused.append(exc.code)
                return
            done["exists"].set()

    def health():
        while not stop.is_set():
            checks = backend.health()  # never raises, closed or not
            assert checks[0].name == "client"
            done["health"].set()

    threads = [threading.Thread(target=f) for f in (put, put, exists, health)]
    for t in threads:
        t.start()
    for e in done.values():
        assert e.wait(60), "no call completed before close"
    backend.close()
    stop.set()
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    # Calls after close are refused: UNAVAILABLE_IN_CURRENT_STATUS.
    assert set(refused) <= {-1010}, refused
    assert backend.health()[0].code == 1
assert all(isinstance(c, int) and c < 0 for c in failed), failed
print("failed put codes", sorted(set(failed)))
print("closed", rounds)
'''


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalMooncakeMaster]:
    with LocalMooncakeMaster() as master, LocalPoolStore(master, 128 << 20):
        yield master


def test_close_with_calls_in_flight_never_crashes(pool: LocalMooncakeMaster) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, pool.address, pool.admin_url, str(ROUNDS)],
        env=engine_env(), capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert out.stdout.strip().endswith(f"closed {ROUNDS}")
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
