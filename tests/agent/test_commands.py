"""Operator commands over real sockets against a real pool: flush scopes remove exactly their
keys (checked with the master's /get_all_keys), authorisation by CURVE key, health, drain."""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from agent_testlib import FakeAgent, Spammer, make_source, pool_keys, wait_until

from kvpool_agent import (
    UNAUTHORISED,
    AgentHandle,
    FleetClient,
    FleetHub,
    generate_keys,
    start_agent,
)
from kvpool_agent.hub import OPERATOR_ONLY
from kvpool_agent.operations import CommandError
from kvpool_agent.protocol import (
    CommandReply,
    DrainArgs,
    DrainResult,
    FlushArgs,
    FlushResult,
    HealthCheck,
    PoolStats,
)
from kvpool_connector.keys import PROBE_PREFIX, ParallelLayout, PoolKey
from kvpool_connector.operations import BackendOperations
from kvpool_replay import LocalMooncakeMaster

VALUE = 4096
DIGEST, OTHER_DIGEST = "0123456789ab", "ba9876543210"
"""The worker agent's layout digest, and another layout's of the same model."""


@pytest.fixture
def pool(
    mooncake_backend: Any, pool_buffer: Any, agent_master: LocalMooncakeMaster, model: str
) -> Iterator[dict]:
    """Keys of two shards of ``model``, of its tp0 shard under another layout digest, of
    another model, and a key outside kvpool's namespace, all really stored; removed again
    afterwards."""
    other_model = model + "-other"

    def keys(m: str, digest: str, tp: int, n: int) -> list[str]:
        return [str(PoolKey(m, digest, ParallelLayout(tp_rank=tp), f"{i:032x}")) for i in range(n)]

    groups = {
        "tp0": keys(model, DIGEST, 0, 3),
        "tp1": keys(model, DIGEST, 1, 2),
        "tp0_other_layout": keys(model, OTHER_DIGEST, 0, 2),
        "other_keys": keys(other_model, DIGEST, 0, 2),
        "foreign": [f"tenant-b/{model}/blob"],
    }
    every = [k for ks in groups.values() for k in ks]
    codes = mooncake_backend.batch_put_from(
        every, [[ctypes.addressof(pool_buffer)]] * len(every), [[VALUE]] * len(every)
    )
    assert codes == [0] * len(every)
    assert set(every) <= pool_keys(agent_master)
    yield {"model": model, "other_model": other_model, **groups}
    mooncake_backend.remove_by_scope(f"^(kvpool@)?(tenant-b/)?{model}", dry_run=False, force=True)


@pytest.fixture
def worker_agent(
    hub: FleetHub, hub_address: str, mooncake_backend: Any, agent_master: LocalMooncakeMaster,
    model: str,
) -> Iterator[AgentHandle]:
    src = make_source("eng-f", tp=0, model=model)
    handle = start_agent(
        src,
        address=hub_address,
        operations=BackendOperations(
            mooncake_backend, src, key_scope=(model, DIGEST, (ParallelLayout(tp_rank=0),))
        ),
        pool_admin_url=agent_master.admin_url,
    )
    yield handle
    handle.stop()


def _operator(hub_address: str, keys_dir: Path) -> FleetClient:
    c = FleetClient(hub_address, keys_dir=keys_dir)
    c.wait_for(1, 30)
    return c


def test_flush_scopes_remove_exactly_their_keys(
    worker_agent: AgentHandle, hub_address: str, keys_dir: Path, pool: dict,
    agent_master: LocalMooncakeMaster, tmp_path: Path, mooncake_backend: Any,
) -> None:
    aid = worker_agent.source.agent_id
    with _operator(hub_address, keys_dir) as op:
        # Dry run of this engine's shard: counts its 3 keys and their bytes, removes nothing.
        (r,) = op.command("flush", targets=[aid], flush=FlushArgs(scope="engine", dry_run=True))
        assert r.ok and r.flush is not None
        assert (r.flush.dry_run, r.flush.keys, r.flush.bytes) == (True, 3, 3 * VALUE)
        assert r.flush.removed_keys == 0
        assert set(pool["tp0"]) <= pool_keys(agent_master)
        # A load's read of one key grants it default_kv_lease_ttl: an unforced flush skips it.
        assert mooncake_backend.store.get_size(pool["tp0"][0]) == VALUE
        before = pool_keys(agent_master)
        (r,) = op.command(
            "flush", targets=[aid],
            flush=FlushArgs(scope="engine", engine_id="eng-f", dry_run=False),
        )
        assert r.ok and r.flush is not None
        assert (r.flush.removed_keys, r.flush.skipped_leased) == (2, 1), r
        leased = set(pool["tp0"]) & pool_keys(agent_master)
        assert leased == {pool["tp0"][0]}
        assert pool_keys(agent_master) == before - (set(pool["tp0"]) - leased)

        # Model scope: every key of the other model, nothing else. The dry run before it read
        # only the master's metadata: it leased nothing, the unforced flush skips nothing.
        (r,) = op.command("flush", targets=[aid],
                          flush=FlushArgs(scope="model", model=pool["other_model"]))
        assert r.ok and r.flush is not None
        assert (r.flush.keys, r.flush.bytes, r.flush.removed_keys) == (2, 2 * VALUE, 0)
        before = pool_keys(agent_master)
        (r,) = op.command(
            "flush", targets=[aid],
            flush=FlushArgs(scope="model", model=pool["other_model"], dry_run=False),
        )
        assert r.ok and r.flush is not None
        assert (r.flush.removed_keys, r.flush.skipped_leased, r.flush.bytes) == (2, 0, 2 * VALUE)
        assert pool_keys(agent_master) == before - set(pool["other_keys"])

        # Model scope of this agent's own model (no model given): the tp1 shard and the keys of
        # the model's other layout go (every digest), the leased tp0 key stays.
        before = pool_keys(agent_master)
        (r,) = op.command("flush", targets=[aid], flush=FlushArgs(scope="model", dry_run=False))
        assert r.ok and r.flush is not None
        assert (r.flush.removed_keys, r.flush.skipped_leased) == (4, 1)
        assert pool_keys(agent_master) == before - set(pool["tp1"]) - set(pool["tp0_other_layout"])

        # Forced engine scope removes the leased shard.
        before = pool_keys(agent_master)
        (r,) = op.command(
            "flush", targets=[aid], flush=FlushArgs(scope="engine", dry_run=False, force=True)
        )
        assert r.ok and r.flush is not None and r.flush.removed_keys == 1
        assert pool_keys(agent_master) == before - set(pool["tp0"])

        # Keys outside kvpool's namespace are never touched, not even by scope "all".
        (r,) = op.command("flush", targets=[aid], flush=FlushArgs(scope="all", dry_run=False))
        assert r.ok
        left = pool_keys(agent_master)
        assert not any(k.startswith("kvpool@") for k in left)
        assert set(pool["foreign"]) <= left
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    flushes = [a for a in audit if a["command"] == "flush"]
    assert len(flushes) == 7
    assert all(a["who"].startswith("key:") and not a["refused"] for a in flushes)
    assert flushes[5]["flush"]["force"] and flushes[5]["results"][0]["flush"]["removed_keys"] == 1


def test_reset_flush_removes_every_shard_of_the_layout_and_is_audited(
    pool: dict, agent_master: LocalMooncakeMaster, mooncake_backend: Any, model: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``reset_flush_scope: engine`` (vLLM's ``reset_prefix_cache`` on worker rank 0): every key
    of the model's layout digest goes, whatever the shard; the model's other layout, other
    models and foreign keys stay; one audit line like a console flush's. Console flushes that
    covered this process's keys are kept for the KV events' ``BlockRemoved``; dry runs and
    flushes of other keys are not."""
    src = make_source("eng-r", tp=0, model=model)
    ops = BackendOperations(mooncake_backend, src, key_scope=(model, DIGEST, (ParallelLayout(),)))
    before = pool_keys(agent_master)
    with caplog.at_level(logging.INFO, logger="kvpool.hub"):
        res = ops.reset_flush()
    assert (res.dry_run, res.keys, res.removed_keys, res.skipped_leased) == (False, 5, 5, 0)
    assert pool_keys(agent_master) == before - set(pool["tp0"]) - set(pool["tp1"])
    (line,) = [json.loads(r.getMessage().split("kvpool audit: ", 1)[1])
               for r in caplog.records if "kvpool audit: " in r.getMessage()]
    assert (line["who"], line["command"], line["targets"]) == (
        "engine:eng-r (reset_prefix_cache)", "flush", [src.agent_id])
    assert line["flush"] == {"scope": "engine", "model": model, "engine_id": "eng-r",
                             "dry_run": False, "force": False}
    assert line["results"] == [{"agent": src.agent_id, "ok": True, "flush": {
        "dry_run": False, "keys": 5, "bytes": 5 * VALUE, "removed_keys": 5,
        "skipped_leased": 0}}]
    assert ops.take_flushes() == []  # the scheduler announces its own reset
    ops.flush(FlushArgs(scope="model", model=pool["other_model"], dry_run=False))
    ops.flush(FlushArgs(scope="engine", dry_run=True))
    assert ops.take_flushes() == []
    ops.flush(FlushArgs(scope="model", dry_run=False))
    assert ops.take_flushes() == ["model"]
    assert ops.take_flushes() == []
    # Without a key scope (KV caches not registered): refused, nothing removed, audited.
    caplog.clear()
    before = pool_keys(agent_master)
    with caplog.at_level(logging.INFO, logger="kvpool.hub"), pytest.raises(
            CommandError, match="not registered"):
        BackendOperations(mooncake_backend, src).reset_flush()
    assert pool_keys(agent_master) == before
    (failed,) = [json.loads(r.getMessage().split("kvpool audit: ", 1)[1])
                 for r in caplog.records if "kvpool audit: " in r.getMessage()]
    assert not failed["results"][0]["ok"] and "not registered" in failed["results"][0]["error"]


def test_reset_flush_never_forces_a_key_another_engine_is_reading(
    pool: dict, agent_master: LocalMooncakeMaster, mooncake_backend: Any, model: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reader's lease (``default_kv_lease_ttl``, 10 s on this master) protects the memory
    its transfer reads: a forced removal could hand it to a new value under that transfer. The
    reset removes the rest, waits for the lease to end and then removes the key; if the lease
    outlives the wait, the reset fails (audited) and the leased key is still there."""
    ops = BackendOperations(mooncake_backend, make_source("eng-l", model=model),
                            key_scope=(model, DIGEST, (ParallelLayout(),)))
    leased = pool["tp0"][0]
    assert mooncake_backend.store.get_size(leased) == VALUE  # a read: leased for 10 s
    with pytest.raises(CommandError, match=r"1 of 5 keys still leased by readers after 1 s"):
        ops.reset_flush(leases_timeout_s=1.0)
    layout = set(pool["tp0"]) | set(pool["tp1"])
    assert layout & pool_keys(agent_master) == {leased}
    res = ops.reset_flush(leases_timeout_s=20.0)  # outlasts the lease
    assert (res.keys, res.removed_keys, res.skipped_leased) == (1, 1, 0)
    assert not layout & pool_keys(agent_master)


def test_reset_flush_drops_the_unreported_chunks_it_removed(
    pool: dict, agent_master: LocalMooncakeMaster, mooncake_backend: Any, model: str,
) -> None:
    """Saves finished just before vLLM's ``reset_prefix_cache`` leave ``ChunkWritten`` reports
    the scheduler would get at the next step, after the reset's ``BlockRemoved``: routers would
    be told the pool holds chunks the reset removed. The reset drops them with the keys."""

    class Saves:  # the two calls reset_flush makes of KVPoolWorker, and its written chunks
        inflight_saves = 0
        written = [("r", 0), ("r", 1)]

        def drain_saves(self, timeout_s: float | None = None) -> bool:
            return True

        def take_written_chunks(self) -> list[tuple[str, int, int]]:
            out, self.written = self.written, []
            return out

    ops = BackendOperations(mooncake_backend, make_source("eng-w", model=model),
                            key_scope=(model, DIGEST, (ParallelLayout(),)))
    ops.saves = saves = Saves()
    assert ops.reset_flush().removed_keys == 5
    assert not set(pool["tp0"]) & pool_keys(agent_master)
    assert saves.written == []  # nothing left for the next step's KV events


def test_reset_flush_reaches_the_hubs_audit_trail_once(
    hub: FleetHub, hub_address: str, pool: dict, mooncake_backend: Any, model: str,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reset flush's record goes through the worker's agent to the hub, which writes it to
    its agents' audit file once (later snapshots repeat it), attributed to the agent it came
    from; the operator's file gets none."""
    monkeypatch.setattr("kvpool_agent.agent.SNAPSHOT_INTERVAL_S", 0.3)
    src = make_source("eng-h", tp=0, model=model)
    ops = BackendOperations(mooncake_backend, src, key_scope=(model, DIGEST, (ParallelLayout(),)))
    handle = start_agent(src, address=hub_address, operations=ops)
    try:
        ops.reporter = handle.reporter
        res = ops.reset_flush()
        audit_file = tmp_path / "audit.jsonl.agents"

        def lines() -> list[dict]:
            text = audit_file.read_text() if audit_file.exists() else ""
            return [json.loads(x) for x in text.splitlines()]

        wait_until(lambda: lines())
        # Snapshots (every 0.3 s here) repeat the record: still one line.
        seen = hub.reports
        wait_until(lambda: hub.reports >= seen + 4)
        (line,) = lines()
        assert line["who"] == f"agent:{src.agent_id} (engine:eng-h (reset_prefix_cache))"
        assert (line["command"], line["targets"], line["refused"]) == (
            "flush", [src.agent_id], False)
        assert line["flush"]["scope"] == "engine" and not line["flush"]["force"]
        assert line["results"] == [{"agent": src.agent_id, "ok": True, "flush": {
            "dry_run": False, "keys": res.keys, "bytes": res.bytes, "removed_keys": 5,
            "skipped_leased": 0}}]
        assert not (tmp_path / "audit.jsonl").exists()
    finally:
        handle.stop()


def test_a_fast_new_store_agent_does_not_draw_the_pool_wide_flush(
    worker_agent: AgentHandle, hub: FleetHub, hub_address: str, keys_dir: Path, pool: dict,
    agent_master: LocalMooncakeMaster,
) -> None:
    """Issue 10, observation 1: a process reporting every 10 ms as a new store agent does not
    receive the operator's model flush; the long-connected worker runs it for real."""
    with zmq.Context() as ctx, _operator(hub_address, keys_dir) as op:
        fake = FakeAgent(ctx, hub_address)
        with Spammer(fake, make_source("evil-store", role="store")):
            deadline = time.monotonic() + 30
            while len(hub.fleet()) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            before = pool_keys(agent_master)
            (r,) = op.command(
                "flush", flush=FlushArgs(scope="model", model=pool["other_model"], dry_run=False)
            )
        assert fake.drain(200) == []
        fake.sock.close(linger=0)
    assert r.agent_id == worker_agent.source.agent_id and r.ok and r.flush is not None
    assert r.flush.removed_keys == 2
    assert pool_keys(agent_master) == before - set(pool["other_keys"])


def test_leased_keys_are_skipped_unless_forced(
    worker_agent: AgentHandle, hub_address: str, keys_dir: Path, pool: dict,
    mooncake_backend: Any, agent_master: LocalMooncakeMaster,
) -> None:
    aid = worker_agent.source.agent_id
    # A lookup takes a lease (default_kv_lease_ttl, 10 s here) on the keys it finds.
    assert mooncake_backend.batch_exists(pool["tp0"][:1]) == [1]
    with _operator(hub_address, keys_dir) as op:
        (r,) = op.command("flush", targets=[aid], flush=FlushArgs(scope="engine", dry_run=False))
        assert r.ok and r.flush is not None
        assert (r.flush.removed_keys, r.flush.skipped_leased) == (2, 1)
        assert pool["tp0"][0] in pool_keys(agent_master)
        (r,) = op.command(
            "flush", targets=[aid], flush=FlushArgs(scope="engine", dry_run=False, force=True)
        )
        assert r.ok and r.flush is not None and r.flush.removed_keys == 1
    assert not set(pool["tp0"]) & pool_keys(agent_master)


def test_unauthorised_flush_is_refused_and_removes_nothing(
    worker_agent: AgentHandle, hub: FleetHub, hub_address: str, pool: dict,
    agent_master: LocalMooncakeMaster, tmp_path: Path,
) -> None:
    before = pool_keys(agent_master)
    with FleetClient(hub_address) as viewer:
        assert not viewer.authorised
        viewer.wait_for(1, 30)
        for scope in ("engine", "model", "all"):
            replies = viewer.command(
                "flush", flush=FlushArgs(scope=scope, engine_id="eng-f", dry_run=False)  # type: ignore[arg-type]
            )
            assert [(r.agent_id, r.ok, r.error) for r in replies] == [("hub", False, UNAUTHORISED)]
        # A dry run is read-only and allowed without a key.
        (r,) = viewer.command("flush", flush=FlushArgs(scope="engine", engine_id="eng-f"))
        assert r.ok and r.flush is not None and r.flush.keys == 3 and r.flush.removed_keys == 0
    assert pool_keys(agent_master) == before
    assert hub.refused == 3
    # Read-only port lines go to the read-only file; the operator's file has none of them.
    audit = [json.loads(line) for line in
             (tmp_path / "audit.jsonl.readonly").read_text().splitlines()]
    assert [a["refused"] for a in audit if a["command"] == "flush"] == [True, True, True, False]
    assert all(a["who"] == "key:viewer/viewer" for a in audit)
    assert not (tmp_path / "audit.jsonl").exists()


def test_unknown_operator_key_gets_no_access(
    worker_agent: AgentHandle, hub_address: str, keys_dir: Path, tmp_path: Path, pool: dict,
    agent_master: LocalMooncakeMaster,
) -> None:
    # Same hub public key, but an operator key the hub never authorised.
    rogue = tmp_path / "rogue"
    generate_keys(rogue, "operator")
    (rogue / "hub.key").write_bytes((keys_dir / "hub.key").read_bytes())
    before = pool_keys(agent_master)
    with FleetClient(hub_address, keys_dir=rogue) as c:
        (r,) = c.command("flush", flush=FlushArgs(scope="all", dry_run=False), timeout_ms=300)
    assert not r.ok and r.agent_id == "hub" and "no answer from the hub" in (r.error or "")
    assert pool_keys(agent_master) == before


def test_health_checks_client_master_and_probe(
    worker_agent: AgentHandle, hub: FleetHub, hub_address: str, keys_dir: Path,
    agent_master: LocalMooncakeMaster, tmp_path: Path,
) -> None:
    sched = start_agent(make_source("eng-f", role="scheduler"), address=hub_address)
    try:
        with FleetClient(hub_address) as c:
            c.wait_for(2, 30)
            keys_before = pool_keys(agent_master)
            replies = {r.agent_id: r for r in c.command("health")}  # every live agent
            # Read-only health touches no pool key; the probe needs the operator key.
            assert pool_keys(agent_master) == keys_before
            (refused,) = c.command("health", probe=True)
            assert not refused.ok and refused.agent_id == "hub"
            assert refused.error == OPERATOR_ONLY.format(what="health --probe")
        with FleetClient(hub_address, keys_dir=keys_dir) as op:
            op.wait_for(2, 30)
            (probed,) = op.command("health", probe=True,
                                   targets=[worker_agent.source.agent_id])
    finally:
        sched.stop()
    # The scheduler has no pool client: its agent answers for itself only.
    s = replies["eng-f/scheduler"]
    assert s.ok and s.health is not None and [x.name for x in s.health.checks] == ["agent"]
    r = replies[worker_agent.source.agent_id]
    assert r.ok and r.health is not None, r
    checks = {ch.name: ch for ch in r.health.checks}
    assert set(checks) == {"client", "master"}
    assert checks["client"].code == 0 and checks["client"].detail == "HEALTHY"
    assert all(ch.ok and ch.latency_ms > 0 for ch in checks.values())
    assert probed.ok and probed.health is not None, probed
    checks = {ch.name: ch for ch in probed.health.checks}
    assert set(checks) == {"client", "master", "probe_put", "probe_get", "probe_remove"}
    assert all(ch.ok and ch.latency_ms > 0 for ch in checks.values())
    # The probe cleaned up after itself.
    assert not any(k.startswith(PROBE_PREFIX) for k in pool_keys(agent_master))
    assert hub.refused == 1
    def lines(name: str) -> list[tuple[str, bool]]:
        text = (tmp_path / name).read_text()
        return [(a["who"], a["refused"]) for a in map(json.loads, text.splitlines())]

    assert lines("audit.jsonl.readonly") == [("key:viewer/viewer", False),
                                             ("key:viewer/viewer", True)]
    assert lines("audit.jsonl") == [("key:operator/operator", False)]


def test_health_names_an_unreachable_master(hub: FleetHub, hub_address: str) -> None:
    from agent_testlib import free_port_block

    dead = f"http://127.0.0.1:{free_port_block(1)}"
    handle = start_agent(make_source("store-x", role="store"), address=hub_address,
                         pool_admin_url=dead)
    try:
        with FleetClient(hub_address) as c:
            c.wait_for(1, 30)
            (r,) = c.command("health", timeout_ms=3000)
        assert not r.ok and r.health is not None
        (check,) = r.health.checks
        assert check.name == "master" and not check.ok and "unreachable" in check.detail
    finally:
        handle.stop()


class _DrainOnly:
    """A ``PoolOperations`` without a pool: its saves are always drained; records each wait."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def health(self) -> list[HealthCheck]:
        return []

    def flush(self, args: FlushArgs) -> FlushResult:
        raise CommandError("no pool here")

    def wait_for_saves(self, timeout_ms: int) -> DrainResult:
        self.calls.append(timeout_ms)
        return DrainResult(drained=True, waited_ms=1.0, remaining_saves=0)

    def stats(self) -> PoolStats:
        return PoolStats(backend="none")


def test_drain_snapshot_and_timeout(hub: FleetHub, hub_address: str) -> None:
    ops = _DrainOnly()
    calls = ops.calls
    with_drain = start_agent(make_source("eng-d", tp=0), address=hub_address, operations=ops)
    plain = start_agent(make_source("eng-d", tp=1), address=hub_address)
    plain.reporter.transfer_started("s1", "save", 2, 8192)
    try:
        with FleetClient(hub_address) as c:
            c.wait_for(2, 30)
            replies = {
                r.agent_id: r
                for r in c.command("drain", drain=DrainArgs(timeout_ms=400), timeout_ms=3000)
            }
            assert calls == [400]
            ok = replies[with_drain.source.agent_id]
            assert ok.ok and ok.drain == DrainResult(drained=True, waited_ms=1.0, remaining_saves=0)
            # Without a connector drain the agent waits on the save it saw start.
            busy = replies[plain.source.agent_id]
            assert not busy.ok and busy.drain is not None
            assert busy.drain.remaining_saves == 1 and busy.drain.waited_ms >= 400
            plain.reporter.transfer_finished("s1", "save", ok=True, nbytes=8192)
            (done,) = c.command("drain", targets=[plain.source.agent_id])
            assert done.ok and done.drain is not None and done.drain.remaining_saves == 0

            (snap,) = c.command("snapshot", targets=[plain.source.agent_id])
            assert snap.ok and snap.snapshot is not None
            assert snap.snapshot.transfers.saved_bytes == 8192

            # Commands to several agents: each agent still sees a gap-free sequence.
            assert plain.counters["gaps"] == 0 and plain.counters["bad_messages"] == 0
            # An agent whose process is gone: the hub says so at once, once libzmq has dropped
            # the closed connection's route (asynchronously: until then a command waits its
            # timeout; CI's loaded machine sent one there).
            plain.stop()
            deadline = time.monotonic() + 30
            while True:
                (gone,) = c.command("snapshot", targets=[plain.source.agent_id], timeout_ms=300)
                assert not gone.ok, gone
                if "agent not connected" in (gone.error or "") or time.monotonic() > deadline:
                    break
            assert "agent not connected: its connection to the hub is gone" in (
                gone.error or ""), gone.error
            # An agent connected but mute: the hub answers for it after the timeout.
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            try:
                mute = FakeAgent(ctx, hub_address)  # the agent key, from KVPOOL_AGENT_KEYS
                mute.report(make_source("eng-mute"))
                c.wait_for(3, 30)
                t0 = time.monotonic()
                (late,) = c.command("snapshot", targets=["eng-mute/dp0.tp0.pp0"], timeout_ms=300)
                assert not late.ok and late.error == "timeout after 300 ms"
                assert time.monotonic() - t0 >= 0.3  # waited its timeout; CI sets no upper bound
            finally:
                ctx.destroy(linger=0)
            (unknown,) = c.command("snapshot", targets=["nobody"], timeout_ms=300)
            assert not unknown.ok and "unknown agent" in (unknown.error or "")
    finally:
        with_drain.stop()
        plain.stop()


def test_the_health_probe_removes_only_its_own_exact_key(
    mooncake_backend: Any, pool_buffer: Any, agent_master: LocalMooncakeMaster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``health --probe`` against the real master: keys that extend, prefix or sit next to the
    probe key in the probe namespace (another probe of the same agent) all survive."""
    import kvpool_connector.operations as ops_mod

    src = make_source("eng-probe")
    mine = f"{PROBE_PREFIX}{src.agent_id}@00000000000a"
    others = [mine + "0", mine[:-1], f"{PROBE_PREFIX}{src.agent_id}@00000000000b",
              mine.replace(".", "x"), f"x{mine}"]
    codes = mooncake_backend.batch_put_from(
        others, [[ctypes.addressof(pool_buffer)]] * len(others), [[VALUE]] * len(others))
    assert codes == [0] * len(others)
    monkeypatch.setattr(ops_mod, "probe_key", lambda owner="": mine)
    try:
        checks = {c.name: c for c in BackendOperations(mooncake_backend, src).health(probe=True)}
        assert all(checks[n].ok for n in ("probe_put", "probe_get", "probe_remove")), checks
        assert checks["probe_remove"].detail == f"{mine}: removed 1"
        left = pool_keys(agent_master)
        assert mine not in left and set(others) <= left
    finally:
        for k in others:
            mooncake_backend.remove_by_scope(f"^{re.escape(k)}$", dry_run=False, force=True)


class _SlowHealth(_DrainOnly):
    """Health checks that hang until released (a pool client stuck on a dead master); flush
    answers at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.flushes: list[FlushArgs] = []

    def health(self) -> list[HealthCheck]:
        self.release.wait(30)
        return [HealthCheck(name="client", ok=True, latency_ms=1.0, detail="released")]

    def flush(self, args: FlushArgs) -> FlushResult:
        self.flushes.append(args)
        return FlushResult(dry_run=args.dry_run, keys=0, bytes=0)


def test_viewers_filling_an_agent_never_starve_an_operator_flush(
    hub: FleetHub, hub_address: str, keys_dir: Path,
) -> None:
    ops = _SlowHealth()
    agent = start_agent(make_source("eng-q"), address=hub_address, operations=ops)
    target = [agent.source.agent_id]

    def viewer_health() -> CommandReply:
        with FleetClient(hub_address) as viewer:
            (r,) = viewer.command("health", targets=target, timeout_ms=20_000)
            return r

    try:
        with FleetClient(hub_address, keys_dir=keys_dir) as op, \
                cf.ThreadPoolExecutor(8) as pool:
            op.wait_for(1, 30)
            hung = [pool.submit(viewer_health) for _ in range(8)]
            # 6 of the agent's 8 slots take read-only commands; the rest are refused at once.
            first = cf.as_completed(hung, timeout=15)
            busy = [next(first).result() for _ in range(2)]
            assert [(r.ok, r.error) for r in busy] == [
                (False, "agent busy: too many commands")] * 2
            assert sum(f.done() for f in hung) == 2
            # The operator's flush runs now, on its own slot and thread, while health hangs.
            (r,) = op.command("flush", targets=target, timeout_ms=5_000,
                              flush=FlushArgs(scope="engine", engine_id="eng-q", dry_run=False))
            assert r.ok and r.flush == FlushResult(dry_run=False, keys=0, bytes=0)
            assert [f.scope for f in ops.flushes] == ["engine"]
            assert sum(f.done() for f in hung) == 2
            ops.release.set()
            done = [f.result(timeout=30) for f in hung]
            assert sorted((r.ok, r.error) for r in done) == [
                (False, "agent busy: too many commands")] * 2 + [(True, None)] * 6
    finally:
        ops.release.set()
        agent.stop()


def test_a_finished_reply_wakes_the_agent_loop(
    hub: FleetHub, hub_address: str, keys_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command thread's reply is sent at once, not at the agent loop's next poll timeout:
    with that timeout at 60 s, ten ``health`` commands each answer within their 20 s timeout.
    Before the wake-up every reply through a keyed hub waited out the loop's 50 ms poll."""
    monkeypatch.setattr("kvpool_agent.agent._LOOP_S", 60.0)
    handle = start_agent(make_source("eng-w", role="scheduler"), address=hub_address)
    try:
        with _operator(hub_address, keys_dir) as op:
            for _ in range(10):
                (r,) = op.command("health", targets=[handle.source.agent_id],
                                  timeout_ms=20_000)
                assert r.ok and r.agent_id == handle.source.agent_id, r
    finally:
        handle.stop()
