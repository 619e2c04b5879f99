"""The hub's miss-split memory under forged reports (helper 70's attacks B2 and B3), on a real
keyed hub over CURVE with the fleet's agent key: a report past ``REPORT_ACCESS_CHUNKS`` chunk
ids has only its lookups within them split, the rest counted (``unsplit_accesses``); reports
that take every one of the memory's layouts leave later layouts' chunk ids unremembered,
counted (``layouts_full``), and a key's new layouts past its budget too
(``layouts_over_budget``); both on ``/metrics``'s family and in ``status --json``'s
``hub_counters`` (``HubCounters``)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import zmq
from agent_testlib import FakeAgent, make_source, wait_until

from kvpool_agent import FleetHub
from kvpool_agent._saved_chunks import MAX_LAYOUTS_PER_ENGINE_KEY
from kvpool_agent.auth import authorize_key, generate_keys, local_fleet_keys
from kvpool_agent.protocol import (
    MAX_ACCESS_CHUNKS,
    PROTOCOL_VERSION,
    REPORT_ACCESS_CHUNKS,
    Access,
    EngineState,
    Report,
    encode,
)


def _frame(agent: FakeAgent, report: dict[str, object], model: str, role: str,
           digest: str = "", engine: str = "forger") -> bytes:
    agent.seq += 1
    now = time.time() * 1e3
    src = make_source(engine, role=role, model=model, layout_digest=digest)
    return encode(Report(v=PROTOCOL_VERSION, seq=agent.seq, kind="snapshot",
                         state=EngineState(source=src, started_ms=1.0, ts_ms=now),
                         **report))  # type: ignore[arg-type]


def _lookup(chunk: int) -> dict[str, object]:
    """A scheduler report's one lookup of ``chunk`` (16 tokens, none served), 2 s ahead."""
    return {"accesses": [Access(tokens=16, chunk_size=16, chunks=[chunk],
                                ts_ms=time.time() * 1e3 + 2_000, served=0)]}


def _save_then_look_up(hub: FleetHub, agent: FakeAgent, engine: str, model: str, digest: str,
                       chunk: int) -> None:
    """``engine``'s worker saves ``chunk`` under (``model``, ``digest``), then its scheduler
    looks it up; both reports taken by the hub."""
    before = hub.counters.reports
    assert agent._send(_frame(agent, {"saves": [chunk]}, model, "worker", digest,
                              engine=engine))
    wait_until(lambda: hub.counters.reports == before + 1)
    assert agent._send(_frame(agent, _lookup(chunk), model, "scheduler", engine=engine))
    wait_until(lambda: hub.counters.reports == before + 2)


def test_forged_reports_are_split_within_bounds_and_counted(
        hub: FleetHub, hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    worker = FakeAgent(ctx, hub_address)
    sched = FakeAgent(ctx, hub_address)
    assert worker._send(_frame(worker, {}, "m", "worker", "a" * 12))
    wait_until(lambda: hub.counters.reports >= 1)
    assert hub.counters.reports == 1
    n = REPORT_ACCESS_CHUNKS // MAX_ACCESS_CHUNKS + 2
    accesses = [Access(tokens=16 * MAX_ACCESS_CHUNKS, chunk_size=16,
                       chunks=list(range(i * MAX_ACCESS_CHUNKS, (i + 1) * MAX_ACCESS_CHUNKS)),
                       ts_ms=time.time() * 1e3, served=0) for i in range(n)]
    assert sched._send(_frame(sched, {"accesses": accesses}, "m", "scheduler"))
    wait_until(lambda: hub.counters.unsplit_accesses == 2)
    assert hub.counters.unsplit_accesses == 2
    assert hub.reuse.not_in_pool()["forger"] == {"first_use": 16 * REPORT_ACCESS_CHUNKS}


def test_a_borrowed_engine_key_names_only_its_budget_of_layouts(
        tmp_path: Path, hub_address: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A borrowed engine-bound agent key (engine ``atk``) reports saves under one new layout
    a report: past its 64 the hub remembers none of its new layouts, counts their chunk ids
    (``layouts_over_budget``, ``/metrics``) and one refusal a report for the key; a fleet
    key's engine then still gets a layout of its own, its miss read as ``evicted``, and the
    key's last layout's miss reads ``first_use`` (its saves were not remembered, nor its ask)."""
    keys = local_fleet_keys(tmp_path / "keys")
    attacker = generate_keys(tmp_path / "attacker", "agent", force=True)
    shutil.copyfile(keys["hub"].hub_public, attacker.hub_public)
    authorize_key(keys["hub"].root, "agent", attacker.public("agent"), engine="atk")
    with FleetHub(hub_address, authorized_keys_dir=keys["hub"].authorized_dir,
                  secret_key_file=keys["hub"].hub_secret, snapshot_interval_s=1.0) as hub:
        atk = FakeAgent(ctx, hub.address, attacker.client("agent"))
        n = MAX_LAYOUTS_PER_ENGINE_KEY + 2
        for i in range(n):
            assert atk._send(_frame(atk, {"saves": [1, 2, 3]}, f"m{i}", "worker",
                                    f"{i:012x}", engine="atk"))
        wait_until(lambda: hub.counters.reports >= n, timeout_s=60)
        assert hub.counters.reports == n
        assert hub.counters.layouts_over_budget == 2 * 3
        assert hub.counters.metrics()["layouts_over_budget"] == 6
        assert hub.refused_by_key == {"agent/atk.engine": 2}
        assert hub.counters.layouts_full == 0

        victim = FakeAgent(ctx, hub.address, keys["agent"].client("agent"))
        _save_then_look_up(hub, victim, "victim", "llama", "d" * 12, 7)
        assert atk._send(_frame(atk, _lookup(1), f"m{n - 1}", "scheduler", engine="atk"))
        wait_until(lambda: hub.counters.reports == n + 3)
        assert hub.reuse.not_in_pool() == {"victim": {"evicted": 16},
                                           "atk": {"first_use": 16}}
        # The lookup's ask is not remembered either: one more id, one more refusal.
        assert hub.counters.layouts_over_budget == 7
        assert hub.refused_by_key == {"agent/atk.engine": 3}

        # The operator rotates the leaked key (a new key under the same name): the engine's
        # new key has a budget of its own (it was charged by name, and inherited the spent
        # one: helper 73's B2), so its new layout's save is remembered and its miss evicted.
        rotated = generate_keys(tmp_path / "rotated", "agent", force=True)
        shutil.copyfile(keys["hub"].hub_public, rotated.hub_public)
        authorize_key(keys["hub"].root, "agent", rotated.public("agent"), name="atk.engine")
        # The hub drops the old key's agents once it reads the rotation (until then they hold
        # their agent ids against another key's reports).
        wait_until(lambda: not any(a.startswith("atk/") for a in hub.fleet()))
        engine = FakeAgent(ctx, hub.address, rotated.client("agent"))
        _save_then_look_up(hub, engine, "atk", "m-new", "e" * 12, 5)
        assert hub.reuse.not_in_pool()["atk"] == {"first_use": 16, "evicted": 16}
        assert hub.counters.layouts_over_budget == 7
