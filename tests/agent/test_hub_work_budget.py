"""Issue 42, attack 3: a viewer's read-only commands made engines work without a rate bound
(a dry-run flush naming every worker, 64 in flight: 153 pool listings a second). Against a real
keyed hub: a key's commands past its engine work budget never reach the engine, another key's
still do, and the refused ones are not audited; every command costs, plain ``health`` too.
Dry runs list each pool once: ``test_hub_listings``."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from agent_testlib import FakeAgent, make_source, wait_until

from kvpool_agent import FleetClient, FleetHub, KeyPaths
from kvpool_agent._audit import READONLY_SUFFIX
from kvpool_agent._work_budget import WORK_UNITS_PER_MIN, WorkBudget, cost
from kvpool_agent.auth import Role
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    FlushResult,
    decode,
    encode,
)

_UNITS = 20


@pytest.fixture
def budget_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths],
               tmp_path: Path) -> Iterator[FleetHub]:
    """A keyed hub whose keys may each make engines do 20 units of work a minute."""
    kp = fleet_keys["hub"]
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  work_units_per_min=_UNITS) as h:
        yield h


class _Worker:
    """A worker agent that answers every command it receives (a dry run that matched nothing)
    and counts them."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str,
                 keys: KeyPaths) -> None:
        self.fake = FakeAgent(ctx, address, keys=keys.client("agent"))
        self.src = make_source("eng-w")
        self.received: list[CommandRequest] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        assert self.fake.report(self.src)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.fake.sock.poll(20):
                continue
            req = decode(self.fake.sock.recv())
            assert isinstance(req, CommandRequest)
            self.received.append(req)
            self.fake.seq += 1
            self.fake.sock.send(encode(CommandReply(
                v=PROTOCOL_VERSION, seq=self.fake.seq, request_id=req.request_id,
                agent_id=self.src.agent_id, ok=True,
                flush=FlushResult(dry_run=True, keys=0, bytes=0))))

    def __enter__(self) -> _Worker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_viewers_pins_flood_stops_at_its_engine_work_budget(
    budget_hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """60 ``pins`` of a viewer naming the worker (a listing of the pool's pin records each,
    never shared): the first 20 (the budget) and what refilled meanwhile reach it, the rest
    are answered ``hub busy`` by the hub and never reach it nor the audit file; the
    operator's (its own budget) still does."""
    with _Worker(ctx, hub_address, fleet_keys["agent"]) as worker:
        wait_until(lambda: worker.src.agent_id in budget_hub.fleet())
        start = time.monotonic()
        with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
            replies = [viewer.command("pins", targets=[worker.src.agent_id],
                                      timeout_ms=5_000)[0] for _ in range(60)]
        elapsed = time.monotonic() - start
        reached = len(worker.received)
        with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
            (r,) = op.command("pins", targets=[worker.src.agent_id])
        assert r.ok and r.agent_id == worker.src.agent_id, r
        assert len(worker.received) == reached + 1
    refused = [x for x in replies if x.agent_id == "hub"]
    assert all(x.error is not None and "engine work budget" in x.error for x in refused)
    assert _UNITS <= reached <= _UNITS + math.ceil(elapsed * _UNITS / 60), (reached, elapsed)
    assert len(refused) == 60 - reached
    audit = Path(str(tmp_path / "audit.jsonl") + READONLY_SUFFIX).read_text().splitlines()
    assert len([x for x in map(json.loads, audit) if x["command"] == "pins"]) == reached


def test_plain_health_is_budgeted_too(
    budget_hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Plain ``health`` cost nothing before: a viewer could make every agent call the master's
    ``/health`` as fast as it sent. Now each agent reached costs 1/16 unit: with 20 units a
    minute, 400 healths of one worker reach it 320 times (plus the refill), the rest are
    ``hub busy``."""
    with _Worker(ctx, hub_address, fleet_keys["agent"]) as worker:
        wait_until(lambda: worker.src.agent_id in budget_hub.fleet())
        start = time.monotonic()
        with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
            replies = [viewer.command("health", targets=[worker.src.agent_id],
                                      timeout_ms=5_000)[0] for _ in range(400)]
        elapsed = time.monotonic() - start
        wait_until(lambda: len(worker.received) == sum(x.agent_id != "hub" for x in replies))
    reached = len(worker.received)
    refill = math.ceil(elapsed * _UNITS * 16 / 60)
    assert 16 * _UNITS <= reached <= 16 * _UNITS + refill, (reached, elapsed)
    refused = [x for x in replies if x.agent_id == "hub"]
    assert len(refused) == 400 - reached
    assert all(x.error is not None and "engine work budget" in x.error for x in refused)


def test_a_budget_takes_one_large_command_then_waits_for_the_refill() -> None:
    """A key with units left may spend more than it has (one command naming thousands of
    workers is taken once), then waits until the refill covers its debt; every command
    costs by what it makes agents do, so ``health`` of a 2,304-agent fleet fits the default
    budget once a minute and again at once, not a third time."""
    b = WorkBudget(60)
    assert b.spend("k", 100, now=0.0) is None
    wait = b.spend("k", 1, now=0.0)
    assert wait is not None and 40 <= wait <= 41
    assert b.spend("k", 1, now=39.0) is not None
    assert b.spend("k", 1, now=41.0) is None
    assert b.spend("other", 60, now=0.0) is None

    def req(command: str, probe: bool = False) -> CommandRequest:
        return CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="r", command=command,
                              probe=probe)

    assert cost(req("health"), 16) == 1
    assert cost(req("health", probe=True), 10) == 10
    assert cost(req("pins"), 3) == 3
    assert cost(req("snapshot"), 64) == cost(req("drain"), 64) == 1
    assert cost(req("forget"), 0) == 1
    fleet_health = cost(req("health"), 2304)
    assert fleet_health == 144
    op = WorkBudget(WORK_UNITS_PER_MIN)
    assert op.spend("operator", fleet_health, now=0.0) is None
    assert op.spend("operator", fleet_health, now=0.0) is None
    assert op.spend("operator", fleet_health, now=0.0) is not None
    assert op.spend("operator", fleet_health, now=60.0) is None
