"""Issue 42, attack 3: a viewer's read-only commands made engines work without a rate bound
(a dry-run flush naming every worker, 64 in flight: 153 pool listings a second). Against a real
keyed hub: a key's dry runs past its engine work budget never reach the engine, another key's
still do, and the refused ones are not audited."""

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
from kvpool_agent._work_budget import WorkBudget, cost
from kvpool_agent.auth import Role
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    FlushArgs,
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


def test_a_viewers_dry_run_flood_stops_at_its_engine_work_budget(
    budget_hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """60 dry runs of a viewer naming the worker: the first 20 (the budget) and what refilled
    meanwhile reach it, the rest are answered ``hub busy`` by the hub and never reach it nor
    the audit file; the operator's dry run (its own budget) still does."""
    dry = FlushArgs(scope="engine", engine_id="eng-w", dry_run=True)
    with _Worker(ctx, hub_address, fleet_keys["agent"]) as worker:
        wait_until(lambda: worker.src.agent_id in budget_hub.fleet())
        start = time.monotonic()
        with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
            replies = [viewer.command("flush", targets=[worker.src.agent_id], flush=dry,
                                      timeout_ms=5_000)[0] for _ in range(60)]
        elapsed = time.monotonic() - start
        reached = len(worker.received)
        with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
            (r,) = op.command("flush", targets=[worker.src.agent_id], flush=dry)
        assert r.ok and r.agent_id == worker.src.agent_id, r
        assert len(worker.received) == reached + 1
    refused = [x for x in replies if x.agent_id == "hub"]
    assert all(x.error is not None and "engine work budget" in x.error for x in refused)
    assert _UNITS <= reached <= _UNITS + math.ceil(elapsed * _UNITS / 60), (reached, elapsed)
    assert len(refused) == 60 - reached
    audit = Path(str(tmp_path / "audit.jsonl") + READONLY_SUFFIX).read_text().splitlines()
    assert len([x for x in map(json.loads, audit) if x["command"] == "flush"]) == reached


def test_a_budget_takes_one_large_command_then_waits_for_the_refill() -> None:
    """A key with units left may spend more than it has (one command naming thousands of
    workers is taken once), then waits until the refill covers its debt; only dry runs,
    ``pins`` and probes cost."""
    b = WorkBudget(60)
    assert b.spend("k", 100, now=0.0) is None
    wait = b.spend("k", 1, now=0.0)
    assert wait is not None and 40 <= wait <= 41
    assert b.spend("k", 1, now=39.0) is not None
    assert b.spend("k", 1, now=41.0) is None
    assert b.spend("other", 60, now=0.0) is None
    req = CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="r", command="health")
    assert cost(req, 10) == 0
    assert cost(CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="r", command="health",
                               probe=True), 10) == 10
    assert cost(CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="r", command="pins"),
                3) == 3
