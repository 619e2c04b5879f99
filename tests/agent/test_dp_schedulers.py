"""Data parallel: every DP rank runs its own scheduler, and a configured ``engine_id`` is
shared by every rank, so a scheduler's agent id carries its rank past 0
(``kvpool_connector._wiring._agent_id``). With one id for all, a real hub took each rank's
reports for a takeover of the others' and kept one scheduler of the engine."""

from __future__ import annotations

import os

from agent_testlib import wait_until

from kvpool_agent import FleetHub, start_agent
from kvpool_agent.protocol import Source
from kvpool_connector._wiring import _agent_id
from kvpool_connector.keys import ParallelLayout


def _scheduler(engine: str, dp: int) -> Source:
    return Source(agent_id=_agent_id(engine, "scheduler", dp, ParallelLayout()),
                  engine_id=engine, instance_role="mixed", kv_role="kv_both",
                  process_role="scheduler", dp_rank=dp, pid=os.getpid(), host="localhost",
                  backend="mooncake")


def test_ids_name_the_rank_past_zero() -> None:
    assert _agent_id("e", "scheduler", 0, ParallelLayout()) == "e/scheduler"
    assert _agent_id("e", "scheduler", 3, ParallelLayout()) == "e/dp3.scheduler"
    assert _agent_id("e", "worker", 3, ParallelLayout(tp_rank=1, pp_rank=2)) == "e/dp3.tp1.pp2"


def test_every_dp_ranks_scheduler_of_one_engine_reports(hub: FleetHub, hub_address: str) -> None:
    agents = [start_agent(_scheduler("eng", dp), address=hub_address) for dp in range(3)]
    try:
        wait_until(lambda: len(hub.fleet()) == 3)
        assert sorted(hub.fleet()) == ["eng/dp1.scheduler", "eng/dp2.scheduler",
                                       "eng/scheduler"]
    finally:
        for a in agents:
            a.stop()
