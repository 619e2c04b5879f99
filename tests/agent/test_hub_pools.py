"""Issue 42's attacks on pool-wide commands by an insider's engine-bound agent key, against a
keyed hub with real CURVE keys (and a real Mooncake pool where keys must really go): after the
operator's ``forget`` an impostor of the pool receives nothing pool-wide and the real flush
removes the keys; an answer that matches fewer keys than the pool holds is suspect; a pool only
the attacker reports gets no share of a fleet-wide flush; silence keeps tenure too (the fleet's
own state, no sockets needed)."""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from agent_testlib import FakeAgent, make_source, pool_keys, wait_until

from kvpool_agent import FleetClient, FleetHub, KeyPaths, start_agent
from kvpool_agent._fleet import MAX_AGENTS_PER_ENGINE, Fleet
from kvpool_agent.auth import Role, authorize_key, generate_keys
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    EngineState,
    FlushArgs,
    FlushResult,
    PoolStats,
    Report,
    encode,
)
from kvpool_connector.keys import ParallelLayout, PoolKey
from kvpool_connector.operations import BackendOperations
from kvpool_console.cli import main as console_main
from kvpool_replay import LocalMooncakeMaster

DIGEST = "0123456789ab"
_VALUE = 4096


def _bound_agent(tmp_path: Path, hub_keys: KeyPaths, engine: str) -> KeyPaths:
    """A fresh agent key bound to ``engine`` (``kvpool-agent authorize --engine``)."""
    d = generate_keys(tmp_path / engine, "agent")
    (d.root / "hub.key").write_bytes(hub_keys.hub_public.read_bytes())
    authorize_key(hub_keys.root, "agent", d.public("agent"), None, engine)
    return d


def _answer(agent: FakeAgent, aid: str, keys: int, *, dry_run: bool) -> list[str]:
    """Answer every flush ``agent`` receives within 2 s with a forged ``keys`` matched (and
    removed unless a dry run); returns the commands it received."""
    seen: list[str] = []
    done = len(agent.received)
    for req in agent.drain(2_000)[done:]:
        seen.append(req.command)
        agent.seq += 1
        agent.sock.send(encode(CommandReply(
            v=PROTOCOL_VERSION, seq=agent.seq, request_id=req.request_id, agent_id=aid, ok=True,
            flush=FlushResult(dry_run=dry_run, keys=keys, bytes=keys,
                              removed_keys=0 if dry_run else keys))))
    return seen


@pytest.fixture
def real_keys(mooncake_backend: Any, pool_buffer: ctypes.Array[ctypes.c_char],
              agent_master: LocalMooncakeMaster, model: str) -> Iterator[list[str]]:
    """Six keys of ``model`` really stored in the agent tests' pool."""
    keys = [str(PoolKey(model, DIGEST, ParallelLayout(), f"{i:032x}")) for i in range(6)]
    codes = mooncake_backend.batch_put_from(
        keys, [[ctypes.addressof(pool_buffer)]] * len(keys), [[_VALUE]] * len(keys))
    assert codes == [0] * len(keys)
    yield keys
    mooncake_backend.remove_by_scope(f"^kvpool@{model}", dry_run=False, force=True)


def test_after_forget_an_impostor_of_the_pool_receives_nothing_pool_wide(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]], mooncake_backend: Any,
    agent_master: LocalMooncakeMaster, model: str, real_keys: list[str],
) -> None:
    """Issue 42, attack 2: a key bound to ``imp-0`` copies the real worker's master, model and
    digest and waits. The operator forgets the real engine (its agent re-registers at its next
    report): before the fix that gave the real worker a fresh tenure, and the impostor, now
    the oldest, alone received ``flush --scope all``, ``pins`` and ``pin``. Now tenure
    outlives ``forget``: both go to the real worker, the impostor receives nothing, and the
    real flush removes the pool's keys."""
    src = make_source("eng-r", model=model, master=agent_master.address, layout_digest=DIGEST)
    handle = start_agent(src, address=hub_address, pool_admin_url=agent_master.admin_url,
                         operations=BackendOperations(
                             mooncake_backend, src, key_scope=(model, DIGEST, (ParallelLayout(),))))
    try:
        wait_until(lambda: src.agent_id in hub.fleet())
        imp_keys = _bound_agent(tmp_path, fleet_keys["hub"], "imp-0")
        impostor = FakeAgent(ctx, hub_address, keys=imp_keys.client("agent"))
        isrc = make_source("imp-0", model=model, master=agent_master.address,
                           layout_digest=DIGEST)
        assert impostor.report(isrc)
        wait_until(lambda: isrc.agent_id in hub.fleet())
        with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
            (r,) = op.command("forget", targets=["eng-r"])
            assert r.ok and r.forgotten == [src.agent_id], r
            wait_until(lambda: src.agent_id in hub.fleet())
            assert src.agent_id in hub.fleet()
            flushed = op.command("flush", flush=FlushArgs(scope="all", dry_run=False),
                                 timeout_ms=10_000)
            listed = op.command("pins", timeout_ms=10_000)
        assert impostor.drain(200) == []
    finally:
        handle.stop()
    assert [r.agent_id for r in flushed] == [src.agent_id], flushed
    (r,) = flushed
    assert r.ok and r.flush is not None and r.flush.removed_keys >= len(real_keys), r
    assert not set(real_keys) & pool_keys(agent_master)
    assert [r.agent_id for r in listed] == [src.agent_id], listed


def test_an_under_counted_flush_answer_is_suspect(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Issue 42, attack 2: the pool's own agents report 5,000 keys; the flush went to an impostor
    that answered "removed 10 of 10 keys", which the console printed with exit 0 and the audit
    called ok (only an over-claim was suspect). Now an answer of scope ``all`` that matches
    fewer keys than the pool holds, beyond the slack, is suspect both ways. Every key of the
    pool is bound to its engine, so the impostor's older tenure still draws the flush (with a
    fleet-wide key in the pool, that key's worker would: test_hub_review)."""
    master = "10.0.0.9:50051"
    impostor = FakeAgent(ctx, hub_address,
                         keys=_bound_agent(tmp_path, fleet_keys["hub"], "imp-1").client("agent"))
    isrc = make_source("imp-1", master=master)
    assert impostor.report(isrc)
    wait_until(lambda: isrc.agent_id in hub.fleet())
    honest = FakeAgent(ctx, hub_address,
                       keys=_bound_agent(tmp_path, fleet_keys["hub"], "real-1").client("agent"))
    assert honest.report(make_source("real-1", master=master),
                         pool=PoolStats(backend="mooncake", keys=5000))
    wait_until(lambda: "real-1/dp0.tp0.pp0" in hub.fleet())
    with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
        got: list[CommandReply] = []
        t = threading.Thread(target=lambda: got.extend(op.command(
            "flush", flush=FlushArgs(scope="all", dry_run=False), timeout_ms=5_000)))
        t.start()
        assert _answer(impostor, isrc.agent_id, 10, dry_run=False) == ["flush"]
        t.join()
    (r,) = got
    assert r.agent_id == isrc.agent_id and not r.ok, r
    assert r.suspect is not None and "only 10 keys matched" in r.suspect, r
    audit = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    (line,) = [x for x in audit if x["command"] == "flush"]
    assert "suspect" in line["results"][0] and not line["results"][0]["ok"]


def test_a_pool_only_one_bound_key_reports_gets_no_share_of_a_fleet_wide_flush(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Issue 42, attack 2: a bound key claims a master nobody else reports; before the fix it
    got its share of a fleet-wide flush and its forged 4,242 keys were added to the total. Now
    the phantom pool receives nothing (dry run or not), the real pool's worker does, and the
    operator is told which pool was left out and why."""
    phantom = FakeAgent(ctx, hub_address,
                        keys=_bound_agent(tmp_path, fleet_keys["hub"], "ph-0").client("agent"))
    psrc = make_source("ph-0", master="10.6.6.6:50051")
    assert phantom.report(psrc, pool=PoolStats(backend="mooncake", keys=4242))
    real = FakeAgent(ctx, hub_address)
    rsrc = make_source("real-2", master="10.0.0.2:50051")
    assert real.report(rsrc, pool=PoolStats(backend="mooncake", keys=7))
    wait_until(lambda: {psrc.agent_id, rsrc.agent_id} <= set(hub.fleet()))
    with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
        for dry_run in (True, False):
            got: list[CommandReply] = []
            t = threading.Thread(target=lambda d=dry_run, out=got: out.extend(op.command(
                "flush", flush=FlushArgs(scope="all", dry_run=d), timeout_ms=5_000)))
            t.start()
            assert _answer(real, rsrc.agent_id, 7, dry_run=dry_run) == ["flush"]
            t.join()
            assert [r.agent_id for r in got] == [rsrc.agent_id, "hub"], got
            assert got[0].ok and got[0].flush is not None and got[0].flush.keys == 7
            assert not got[1].ok and got[1].error is not None and "10.6.6.6" in got[1].error
    assert phantom.drain(200) == []


def _worker_report(engine: str, master: str) -> Report:
    src = make_source(engine, master=master)
    return Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot",
                  state=EngineState(source=src, started_ms=1.0, ts_ms=1.0))


def test_silence_keeps_tenure_and_only_unheld_tenures_are_pruned() -> None:
    """Issue 42, attack 2, the silent case: the real workers go silent past ``forget_after``
    (dropped) and come back after an impostor of their pool joined: the real one's tenure is
    kept, so the pool-wide flush still goes to it. Tenures are pruned only for engines no agent
    holds, once unheard for the kept time."""
    fleet = Fleet()
    pool = "10.0.0.5:50051"
    flush_all = CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="r", command="flush",
                               flush=FlushArgs(scope="all", dry_run=True))
    assert fleet.accept(b"r1", _worker_report("eng-real", pool), "real-key") is None
    assert fleet.forget_silent(-1.0) == ["eng-real/dp0.tp0.pp0"]  # silent past the limit
    assert fleet.accept(b"i1", _worker_report("eng-imp", pool), "imp-key", bound=True) is None
    assert fleet.accept(b"r2", _worker_report("eng-real", pool), "real-key") is None
    assert fleet.targets(flush_all) == (["eng-real/dp0.tp0.pp0"], None, [])
    fleet.forget(["eng-real"])
    fleet.prune_tenure(-1.0)  # every tenure is "old": only the unheld one goes
    assert set(fleet.tenure()) == {"eng-imp"}


def _pool_report(engine: str, aid: str, master: str, keys: int, digest: str) -> Report:
    src = msgspec.structs.replace(make_source(engine, master=master, layout_digest=digest),
                                  agent_id=aid)
    return Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot", state=EngineState(
        source=src, started_ms=1.0, ts_ms=1.0, pool=PoolStats(backend="mooncake", keys=keys)))


def test_an_engines_1024_ids_share_one_set_of_verifiers() -> None:
    """A real flush or pin of one engine naming its 1,024 agent ids (one engine-bound key)
    found each id's verifiers by a scan of the fleet, 1,024 scans in the hub thread; now one
    per pool, key and layout. The answer is unchanged: the fleet-wide key's worker of the
    pool (never the engine's own key, nor another pool's), one set for all 1,024 ids; with
    ``layout`` the other layout's worker is left out."""
    fleet = Fleet()
    pool, ids = "10.0.0.7:50051", [f"big/a{i}" for i in range(MAX_AGENTS_PER_ENGINE)]
    for aid in ids:
        assert fleet.accept(b"b", _pool_report("big", aid, pool, 900, DIGEST), "big-key",
                            bound=True) is None
    assert fleet.accept(b"o", _pool_report("other", "other/a", pool, 901, DIGEST), "o-key",
                        bound=True) is None
    assert fleet.accept(b"f", _pool_report("fw", "fw/a", pool, 902, "ffffffffffff"),
                        "fleet-key") is None
    assert fleet.accept(b"x", _pool_report("far", "far/a", "10.0.0.8:50051", 5, DIGEST),
                        "fleet-key-2") is None
    found = fleet.pool_verifiers(ids)
    assert set(found) == set(ids)
    assert len({id(v) for v in found.values()}) == 1, "each id scanned the fleet again"
    assert {k: v.keys for k, v in found[ids[0]].items()} == {"fw/a": 902}
    by_layout = fleet.pool_verifiers(ids, layout=True)
    assert {k: v.keys for k, v in by_layout[ids[-1]].items()} == {"other/a": 901}
    assert fleet.pool_verifiers(["no-such-agent"]) == {}


_MANY = 100
"""Keys a flush must remove to be checked after it: more than the slack (64)."""


@pytest.fixture
def many_keys(mooncake_backend: Any, pool_buffer: ctypes.Array[ctypes.c_char],
              model: str) -> Iterator[list[str]]:
    """``_MANY`` keys of ``model`` really stored in the agent tests' pool."""
    keys = [str(PoolKey(model, DIGEST, ParallelLayout(), f"{i:032x}")) for i in range(_MANY)]
    codes = mooncake_backend.batch_put_from(
        keys, [[ctypes.addressof(pool_buffer)]] * len(keys), [[_VALUE]] * len(keys))
    assert codes == [0] * len(keys)
    yield keys
    mooncake_backend.remove_by_scope(f"^kvpool@{model}", dry_run=False, force=True)


def _real_worker(engine: str, keys: KeyPaths, hub_address: str, mooncake_backend: Any,
                 master: LocalMooncakeMaster, model: str) -> Any:
    """A real agent of worker ``engine`` over the real pool, with ``keys`` (bound to it)."""
    src = make_source(engine, model=model, master=master.address, layout_digest=DIGEST)
    return start_agent(src, address=hub_address, pool_admin_url=master.admin_url,
                       keys_dir=keys.root, operations=BackendOperations(
                           mooncake_backend, src, key_scope=(model, DIGEST, (ParallelLayout(),))))


def test_a_flush_the_pool_does_not_show_is_suspect(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]], mooncake_backend: Any,
    agent_master: LocalMooncakeMaster, model: str, many_keys: list[str],
) -> None:
    """Issue 42, attack 2, the last form: every worker of the pool has a key bound to its
    engine and an impostor's is the oldest, so ``flush --scope all`` goes to it. It answers
    "removed N of N" with N the pool's own count as the real worker reports it, which every
    check of the answer alone passes (before: printed as done, exit 0, the pool kept every
    key). Now the hub holds the answer until another key's count of the pool shows the keys
    gone; the real worker's count still holds them, so the answer is suspect."""
    imp = FakeAgent(ctx, hub_address,
                    keys=_bound_agent(tmp_path, fleet_keys["hub"], "imp-2").client("agent"))
    isrc = make_source("imp-2", model=model, master=agent_master.address, layout_digest=DIGEST)
    assert imp.report(isrc)
    wait_until(lambda: isrc.agent_id in hub.fleet())
    real = _real_worker("eng-v", _bound_agent(tmp_path, fleet_keys["hub"], "eng-v"),
                        hub_address, mooncake_backend, agent_master, model)
    try:
        aid = real.source.agent_id

        def counted() -> int:
            st = hub.fleet().get(aid)
            return st[0].pool.keys if st is not None and st[0].pool is not None else 0

        wait_until(lambda: counted() >= _MANY, 15)
        n = counted()
        with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
            got: list[CommandReply] = []
            t = threading.Thread(target=lambda: got.extend(op.command(
                "flush", flush=FlushArgs(scope="all", dry_run=False), timeout_ms=8_000)))
            t.start()
            assert _answer(imp, isrc.agent_id, n, dry_run=False) == ["flush"]
            t.join()
    finally:
        real.stop()
    (r,) = got
    assert r.agent_id == isrc.agent_id and not r.ok, r
    assert r.suspect is not None and "later the pool holds" in r.suspect, r
    assert set(many_keys) <= pool_keys(agent_master)
    audit = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    (line,) = [x for x in audit if x["command"] == "flush"]
    assert "suspect" in line["results"][0] and not line["results"][0]["ok"]


def test_a_genuine_flush_is_confirmed_by_another_keys_count(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    mooncake_backend: Any, agent_master: LocalMooncakeMaster, model: str,
    many_keys: list[str],
) -> None:
    """Two real workers of the pool, each with a key bound to its engine: the older runs
    ``flush --scope all``, the other's count of the pool confirms the keys gone (it measures
    the master every 2 s), and the answer is done, not suspect."""
    first = _real_worker("eng-f", _bound_agent(tmp_path, fleet_keys["hub"], "eng-f"),
                         hub_address, mooncake_backend, agent_master, model)
    try:
        wait_until(lambda: first.source.agent_id in hub.fleet())
        second = _real_worker("eng-s", _bound_agent(tmp_path, fleet_keys["hub"], "eng-s"),
                              hub_address, mooncake_backend, agent_master, model)
        try:
            sid = second.source.agent_id

            def counted() -> int:
                st = hub.fleet().get(sid)
                return st[0].pool.keys if st is not None and st[0].pool is not None else 0

            wait_until(lambda: counted() >= _MANY, 15)
            with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
                (r,) = op.command("flush", flush=FlushArgs(scope="all", dry_run=False),
                                  timeout_ms=8_000)
        finally:
            second.stop()
    finally:
        first.stop()
    assert r.agent_id == first.source.agent_id, r
    assert r.ok and r.suspect is None and r.flush is not None, r
    assert r.flush.removed_keys >= _MANY
    assert not set(many_keys) & pool_keys(agent_master)


class _Liar:
    """``agent`` answers every flush it receives, until stopped, with ``dry`` (a dry run) or
    ``done`` (a real flush), true or not; on its own thread (the test does not touch
    ``agent`` meanwhile)."""

    def __init__(self, agent: FakeAgent, aid: str, dry: FlushResult, done: FlushResult) -> None:
        self.agent, self.aid, self.dry, self.done = agent, aid, dry, done
        self.answered: list[bool] = []  # dry_run of each flush answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for req in self.agent.drain(100)[len(self.answered):]:
                dry = req.flush is not None and req.flush.dry_run
                self.answered.append(dry)
                self.agent.seq += 1
                self.agent.sock.send(encode(CommandReply(
                    v=PROTOCOL_VERSION, seq=self.agent.seq, request_id=req.request_id,
                    agent_id=self.aid, ok=True, flush=self.dry if dry else self.done)))

    def __enter__(self) -> _Liar:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize(("n", "claim", "suspect"), [
    (3, (10, 10, 0), "10 keys matched, but eng-u3/dp0.tp0.pp0 (another key) listed"),
    (4, (_MANY, 0, _MANY), f"removed 0 of {_MANY} matched keys ({_MANY} said leased)"),
], ids=["under-count", "all-leased"])
def test_a_model_flush_answer_another_keys_listing_contradicts_is_suspect(
    n: int, claim: tuple[int, int, int], suspect: str,
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    ctx: zmq.Context[zmq.Socket[bytes]], mooncake_backend: Any,
    agent_master: LocalMooncakeMaster, model: str, many_keys: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 42, the flush checks' gaps: every worker of the pool has a key bound to its engine
    and an impostor's is the oldest, so ``kvpool-console flush --scope model`` goes to it.
    Scope ``model`` has no count to hold an answer against and a removal within the slack is
    never re-checked, so "matched 10, removed 10" of a model holding 100 keys, or "matched
    100, removed 0, all leased", was printed as done (exit 0) and the pool kept every key.
    Now the hub has another key's worker (the real one) list the scope at the same time and
    holds the answer against that listing; a flush that left more than the slack is not done
    either way. The console prints SUSPECT and exits non-zero; every key stays; the audit
    says suspect."""
    keys, removed, leased = claim
    imp = FakeAgent(ctx, hub_address,
                    keys=_bound_agent(tmp_path, fleet_keys["hub"], f"imp-{n}").client("agent"))
    isrc = make_source(f"imp-{n}", model=model, master=agent_master.address,
                       layout_digest=DIGEST)
    assert imp.report(isrc)
    wait_until(lambda: isrc.agent_id in hub.fleet())
    # Engine names once per session: the hub's authorized keys are the session's.
    real = _real_worker(f"eng-u{n}", _bound_agent(tmp_path, fleet_keys["hub"], f"eng-u{n}"),
                        hub_address, mooncake_backend, agent_master, model)
    try:
        aid = real.source.agent_id
        # A verifier is an agent reporting the pool (its first measurement: ~2 s).
        wait_until(lambda: aid in hub.fleet() and hub.fleet()[aid][0].pool is not None, 15)
        assert hub.fleet()[aid][0].pool is not None
        with _Liar(imp, isrc.agent_id,
                   FlushResult(dry_run=True, keys=keys, bytes=keys * _VALUE),
                   FlushResult(dry_run=False, keys=keys, bytes=keys * _VALUE,
                               removed_keys=removed, skipped_leased=leased)) as liar:
            code = console_main(["flush", "--hub", hub_address, "--keys",
                                 str(fleet_keys["operator"].root), "--scope", "model",
                                 "--model", model, "--yes"])
    finally:
        real.stop()
    out = capsys.readouterr().out
    assert liar.answered == [True, False], "the impostor did not get the dry run and the flush"
    assert code != 0, out
    assert f"flush SUSPECT, not confirmed: {isrc.agent_id}: {suspect}" in out, out
    assert set(many_keys) <= pool_keys(agent_master)
    audit = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    line = [x for x in audit if x["command"] == "flush"][-1]  # the real flush, after the dry run
    assert "suspect" in line["results"][0] and not line["results"][0]["ok"], line
