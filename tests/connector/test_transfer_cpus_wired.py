"""``transfer_cpus`` through the whole connector (issue 38): a simulated engine's real
``KVPoolConnector`` worker (``_wiring.build_worker``) on a real ``mooncake_master`` and a separate
store process runs its save and load threads and the threads its store client's setup started
on the configured CPU, and leaves the engine's own thread where it was. The rules and the
placing alone: ``tests/connector/test_transfer_cpus.py``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvpool_replay import (
    EngineSpec,
    LocalMooncakeMaster,
    LocalPoolStore,
    ModelShape,
    TraceRequest,
    free_port,
    mooncake_extra_config,
)

ALL = frozenset(os.sched_getaffinity(0))
SHAPE = ModelShape(layers=2, kv_heads=2, head_size=64, block_size=16)
CHUNK = 64


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _affinity(tid: int) -> frozenset[int] | None:
    """The CPUs of thread ``tid`` of this process; ``None`` once it ended."""
    try:
        return frozenset(os.sched_getaffinity(tid))
    except OSError:
        return None


def _comm(tid: int) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.mark.skipif(len(ALL) < 2, reason="needs 2 CPUs to move a thread")
def test_the_connectors_transfer_threads_run_on_transfer_cpus() -> None:
    from kvpool_replay._sim_engine import SimEngine

    cpu = max(ALL)
    with LocalMooncakeMaster() as m, LocalPoolStore(m, 32 << 20):
        extra = mooncake_extra_config(m.address, m.admin_url)
        extra["transfer_cpus"] = str(cpu)
        before = _tasks()
        engine = SimEngine(EngineSpec(
            engine_id="cpus", master_address=m.address, model="org/transfer-cpus", shape=SHAPE,
            chunk_size=CHUNK, trace_path="unused", wait_saves=True,
            lookup_rpc_port=free_port(), extra_config=extra), num_blocks=64)
        try:
            # A save, then a load of the same prompt: both threads have run.
            req = TraceRequest(0, 4 * CHUNK + 1, 1, [11, 12, 13, 14, 15])
            assert engine.run_request(0, req) == 0
            assert engine.run_request(1, req) == 4 * CHUNK
            named = {t.name.split("_")[0]: t.native_id for t in threading.enumerate()
                     if t.name.startswith(("kvpool-save", "kvpool-load"))}
            assert named.keys() == {"kvpool-save", "kvpool-load"}
            assert {n: _affinity(tid) for n, tid in named.items() if tid is not None} == {
                "kvpool-save": {cpu}, "kvpool-load": {cpu}}
            # Threads the connector started that Python does not know: the store client's
            # (its transport's), started in its setup on a thread pinned to the CPU.
            python = {t.native_id for t in threading.enumerate()}
            native = {tid: _comm(tid) for tid in _tasks() - before - python
                      if _affinity(tid) == {cpu}}
            assert native, "no thread of the store client runs on transfer_cpus"
            # The engine's own thread (vLLM's forward pass) is not moved.
            assert frozenset(os.sched_getaffinity(0)) == ALL
        finally:
            engine.close()
