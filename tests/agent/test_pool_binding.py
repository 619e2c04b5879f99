"""Issue 42, pool membership proven by the operator's authorization (``kvpool-agent authorize
--pool``): an agent key bound to a pool reports only for it, and once a key is bound to a pool
only keys bound to it receive that pool's pool-wide commands and count in its totals. Each
attack against a real keyed hub (real ZMQ, CURVE keys of the test's own) asserts it had no
effect; the honest bound member's flush removes the keys of a real ``mooncake_master``."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.auth
from agent_testlib import (
    FORGED,
    Claimant,
    assert_really_flushed,
    make_source,
    wait_until,
)

from kvpool_agent import FleetClient, FleetHub, KeyPaths, start_agent
from kvpool_agent._fleet import Fleet
from kvpool_agent.auth import (
    AllowList,
    Role,
    authorize_key,
    bound_elsewhere,
    bound_engine,
    bound_pool,
    generate_keys,
)
from kvpool_agent.cli import main as agent_main
from kvpool_agent.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    EngineState,
    FlushArgs,
    PoolStats,
    Report,
)
from kvpool_connector.keys import ParallelLayout, PoolKey
from kvpool_connector.operations import BackendOperations
from kvpool_console.cli import main as console_main
from kvpool_replay import LocalMooncakeMaster, free_port

DIGEST = "0123456789ab"
_VALUE = 4096


# -- keys and names (no sockets) -------------------------------------------------------------

def _agent_key(tmp_path: Path, hub: KeyPaths, name: str, *, engine: str | None = None,
               pool: str | None = None) -> KeyPaths:
    """A fresh agent key pair with the hub's ``hub.key``, authorized on ``hub`` bound to
    ``engine`` and/or ``pool`` (``kvpool-agent authorize --engine/--pool``)."""
    d = generate_keys(tmp_path / name, "agent")
    (d.root / "hub.key").write_bytes(hub.hub_public.read_bytes())
    authorize_key(hub.root, "agent", d.public("agent"), None if engine else name, engine, pool)
    return d


def test_authorize_pool_names_the_file_and_binds_reports_to_the_pool(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--pool`` alone and with ``--engine``: the file names the pool (quoted: an HA pool's
    ``etcd://`` has slashes), the hub reads the binding back from the name, a report for
    another pool is refused, and ``AllowList.bound_pools`` lists the pools. A second binding
    of one key is refused (one of the two would be lifted)."""
    hub = generate_keys(tmp_path / "hub", "hub")
    key = generate_keys(tmp_path / "a", "agent").public("agent")
    assert agent_main(["authorize", "--role", "agent", str(hub.root), str(key),
                       "--engine", "p0", "--pool", "10.0.0.1:50051"]) == 0
    assert "p0.engine@10.0.0.1:50051.pool.key" in capsys.readouterr().out
    name = "agent/p0.engine@10.0.0.1:50051.pool"
    assert (bound_engine(name), bound_pool(name)) == ("p0", "10.0.0.1:50051")
    store = generate_keys(tmp_path / "s", "agent").public("agent")
    dest = authorize_key(hub.root, "agent", store, "store-a", pool="etcd://10.0.0.9:2379")
    assert dest.name == "store-a@etcd:%2F%2F10.0.0.9:2379.pool.key"
    assert (bound_engine(f"agent/{dest.stem}"), bound_pool(f"agent/{dest.stem}")) == (
        None, "etcd://10.0.0.9:2379")
    assert bound_pool("agent/prefill-0.engine") is None and bound_pool("agent/agent") is None
    assert bound_elsewhere(name, make_source("p0", master="10.0.0.1:50051")) is None
    why = bound_elsewhere(name, make_source("p0", master="10.0.0.2:50051"))
    assert why is not None and why.startswith("pool:") and "10.0.0.1:50051" in why
    allow = AllowList(hub.authorized_dir, {"agents": ("agent",)})
    assert allow.bound_pools() == {"10.0.0.1:50051", "etcd://10.0.0.9:2379"}
    with pytest.raises(ValueError, match="authorized already"):
        authorize_key(hub.root, "agent", key, engine="p1")
    with pytest.raises(ValueError, match="--pool"):
        authorize_key(hub.root, "viewer", key, pool="10.0.0.1:50051")
    # The same key authorized fleet-wide beside its binding: the binding holds.
    authorize_key(hub.root, "agent", key, "zz-fleet-copy")
    public, _ = zmq.auth.load_certificate(str(hub.authorized("agent") / "zz-fleet-copy.key"))
    assert allow.name("agents", public) == name


@pytest.mark.parametrize(("argv", "says"), [
    # The console's pool name: a binding no report would ever match.
    (["--pool", "mooncake@10.0.0.1:50051"], "give the master address alone ('10.0.0.1:50051')"),
    (["--pool", "10.0.0.1:50051\u200b"], "--pool"),
    (["--name", "a/b", "--pool", "10.0.0.1:50051"], "--name 'a/b': a file name"),
    (["--secret"], "holds a secret key: give its public half"),
    (["--no-hub"], "no hub key there"),
])
def test_authorize_refuses_what_would_never_bind_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    """A new operator's mistakes, each one line and exit 2, nothing written: the console's
    ``BACKEND@ADDRESS`` as the pool, a look-alike address, a name with '/', a secret key file
    (written 0644 into the hub's directory before), a mistyped hub directory (an
    ``authorized_keys/`` the running hub never reads)."""
    hub = generate_keys(tmp_path / "hub", "hub")
    mine = generate_keys(tmp_path / "a", "agent")
    key, root = str(mine.public("agent")), str(hub.root)
    if argv == ["--secret"]:
        key, argv = str(mine.secret("agent")), ["--name", "x", "--pool", "10.0.0.1:50051"]
    elif argv == ["--no-hub"]:
        root, argv = str(tmp_path / "nohub"), []
    assert agent_main(["authorize", "--role", "agent", root, key, *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not list(hub.authorized_dir.glob("**/*.key"))
    assert not (tmp_path / "nohub").exists()


def test_a_key_authorized_again_under_its_name_takes_effect_on_a_running_hub(
        tmp_path: Path) -> None:
    """``authorize`` of a new key under an existing name (a rotated engine key, or a test
    session's second key for one engine id) rewrote the file in place: the directory did not
    change, so a hub that had read its keys kept the old one and refused the new one
    (test_hub_attacks_r5's forged-pin test failed after test_hub_review for that: its real-0
    key was refused and the pool was left out). Now the file is renamed over the old one."""
    hub = generate_keys(tmp_path / "hub", "hub")
    old, new = (generate_keys(tmp_path / n, "agent").public("agent") for n in ("o", "n"))
    authorize_key(hub.root, "agent", old, engine="real-0")
    allow = AllowList(hub.authorized_dir, {"agents": ("agent",)})
    old_z85, new_z85 = (zmq.auth.load_certificate(str(k))[0] for k in (old, new))
    assert allow.name("agents", old_z85) == "agent/real-0.engine"
    # The directory's times tick with the kernel's coarse clock: a change within the same tick
    # as the read would look like none (a limit of reading on changed times, not this test's).
    probe = tmp_path / "probe"
    stamp = hub.authorized("agent").stat().st_mtime_ns

    def ticked() -> bool:
        probe.write_bytes(b"")
        return probe.stat().st_mtime_ns > stamp

    wait_until(ticked, 30)
    authorize_key(hub.root, "agent", new, engine="real-0")
    assert allow.name("agents", new_z85) == "agent/real-0.engine"
    assert allow.name("agents", old_z85) is None
    assert sorted(p.name for p in hub.authorized("agent").iterdir()) == ["real-0.engine.key"]


def _report(engine: str, key: str, master: str, keys: int) -> Report:
    src = make_source(engine, master=master, layout_digest=DIGEST)
    return Report(v=PROTOCOL_VERSION, seq=1, kind="snapshot", state=EngineState(
        source=src, started_ms=1.0, ts_ms=1.0, pool=PoolStats(backend="mooncake", keys=keys)))


def test_a_closed_pools_counts_and_verifiers_are_its_members_only() -> None:
    """The fleet's rules, without sockets: of a pool some key is bound to (``closed``) only the
    bound keys' agents are targets, key counts and verifiers; other keys' claims stay in the
    fleet's state. Without a bound pool the earlier rules hold (a fleet-wide key first)."""
    fleet, pool = Fleet(), "10.0.0.7:50051"
    flush_all = CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="r", command="flush",
                               flush=FlushArgs(scope="all", dry_run=False))
    # Older claimants: two engine-bound keys and a fleet-wide one, then the two members.
    assert fleet.accept(b"c1", _report("col-1", "k1", pool, FORGED), "k1", bound=True) is None
    assert fleet.accept(b"c2", _report("col-2", "k2", pool, FORGED), "k2", bound=True) is None
    assert fleet.accept(b"fw", _report("fw", "kf", pool, FORGED), "kf") is None
    assert fleet.accept(b"m1", _report("mem-1", "km1", pool, 6), "km1", bound=True,
                        pool=pool) is None
    assert fleet.accept(b"m2", _report("mem-2", "km2", pool, 7), "km2", bound=True,
                        pool=pool) is None
    closed = frozenset({pool})
    assert fleet.targets(flush_all) == (["fw/dp0.tp0.pp0"], None, [])  # nothing bound
    assert fleet.targets(flush_all, closed) == (["mem-1/dp0.tp0.pp0"], None, [])
    assert fleet.pool_keys(["mem-1/dp0.tp0.pp0"], closed) == {"mem-1/dp0.tp0.pp0": 7}
    assert fleet.pool_keys(["col-1/dp0.tp0.pp0"], closed) == {"col-1/dp0.tp0.pp0": 7}
    found = fleet.pool_verifiers(["mem-1/dp0.tp0.pp0"], closed=closed)
    assert {k: v.keys for k, v in found["mem-1/dp0.tp0.pp0"].items()} == {
        "mem-2/dp0.tp0.pp0": 7}
    assert len(fleet.states()) == 5  # the claims are still shown
    # Members gone: the closed pool gets nothing, and the operator is told.
    fleet.forget(["mem-1", "mem-2"])
    ids, problem, refused = fleet.targets(flush_all, closed)
    assert ids == [] and problem is not None and refused == [pool]


def test_a_store_agent_never_draws_a_flush() -> None:
    """A store agent holds no pool client (it answered a flush "no pool backend"): a pool whose
    one live member it is gets no flush and the operator is told; beside a member worker, the
    worker runs it."""
    fleet, pool = Fleet(), "10.0.0.8:50051"
    flush_all = CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="r", command="flush",
                               flush=FlushArgs(scope="all", dry_run=False))
    store = _report("store", "ks", pool, 5)
    store = msgspec.structs.replace(store, state=msgspec.structs.replace(
        store.state, source=msgspec.structs.replace(store.state.source, process_role="store",
                                                    agent_id="store")))
    assert fleet.accept(b"s", store, "ks", pool=pool) is None
    closed = frozenset({pool})
    ids, problem, _ = fleet.targets(flush_all, closed)
    assert ids == [] and problem is not None and "no live worker agent" in problem
    assert fleet.accept(b"w", _report("w-0", "kw", pool, 5), "kw", bound=True,
                        pool=pool) is None
    assert fleet.targets(flush_all, closed) == (["w-0/dp0.tp0.pp0"], None, [])


# -- live: a real keyed hub ---------------------------------------------------------------------


def _flush_all(address: str, operator: KeyPaths, timeout_ms: int = 10_000,
               ) -> list[CommandReply]:
    with FleetClient(address, keys_dir=operator.root) as op:
        return op.command("flush", flush=FlushArgs(scope="all", dry_run=False),
                          timeout_ms=timeout_ms)


def test_a_key_bound_to_another_pool_gets_nothing_of_the_pool_it_claims(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths], tmp_path: Path,
) -> None:
    """An insider's key bound to its own pool Q (and engine) claims pool P, which a key bound
    to P serves, reporting P at 4,242 keys. Its reports are refused and counted against its
    key, it never appears in the fleet, receives no ``flush --scope all``, and its forged count
    is not P's: the member's true "removed 7 of 7" is done, not suspect."""
    pool, other = "10.0.0.41:50051", "10.0.0.42:50051"
    member = _agent_key(tmp_path, own_keys["hub"], "mem-a", engine="mem-a", pool=pool)
    evil = _agent_key(tmp_path, own_keys["hub"], "imp-a", engine="imp-a", pool=other)
    msrc = make_source("mem-a", master=pool, layout_digest=DIGEST)
    isrc = make_source("imp-a", master=pool, layout_digest=DIGEST)
    with Claimant(hub_address, member, msrc, 7, 7) as honest, \
            Claimant(hub_address, evil, isrc, FORGED, FORGED) as impostor:
        wait_until(lambda: msrc.agent_id in own_hub.fleet()
                   and own_hub.pool_binding_refused >= 3, 30)
        assert msrc.agent_id in own_hub.fleet()
        got = _flush_all(hub_address, own_keys["operator"])
        refused_key = "agent/imp-a.engine@10.0.0.42:50051.pool"
        assert own_hub.refused_by_key.get(refused_key, 0) >= 3, own_hub.refused_by_key
        assert isrc.agent_id not in own_hub.fleet()
    assert impostor.received == []
    assert [r.agent_id for r in got] == [msrc.agent_id], got
    (r,) = got
    assert r.ok and r.suspect is None and r.flush is not None and r.flush.removed_keys == 7, r
    assert [c.command for c in honest.received] == ["flush"]


@pytest.fixture
def real_keys(mooncake_backend: Any, pool_buffer: ctypes.Array[ctypes.c_char],
              model: str) -> Iterator[list[str]]:
    """Six keys of ``model`` really stored in the agent tests' pool."""
    keys = [str(PoolKey(model, DIGEST, ParallelLayout(), f"{i:032x}")) for i in range(6)]
    codes = mooncake_backend.batch_put_from(
        keys, [[ctypes.addressof(pool_buffer)]] * len(keys), [[_VALUE]] * len(keys))
    assert codes == [0] * len(keys)
    yield keys
    mooncake_backend.remove_by_scope(f"^kvpool@{model}", dry_run=False, force=True)


def test_unbound_keys_claiming_a_bound_pool_receive_nothing_pool_wide(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths], tmp_path: Path,
    mooncake_backend: Any, agent_master: LocalMooncakeMaster, model: str,
    real_keys: list[str],
) -> None:
    """Two colluding engine-bound keys and the fleet-wide key claim the real pool P, older than
    its real worker, reporting P at 4,242 keys and answering every flush "removed 4242 of
    4242". P is bound to the real worker's key (``authorize --engine eng-m --pool P``).
    Before the worker comes, ``flush --scope all`` and ``pins`` reach none of them (the
    operator is told P was left out); after, both go to the real worker alone, its flush
    really removes P's keys from the master, its true count is not made suspect by the
    claimants' 4,242, and the claimants, still shown in the fleet, received nothing."""
    pool = agent_master.address
    member = _agent_key(tmp_path, own_keys["hub"], "eng-m", engine="eng-m", pool=pool)
    colluders = [_agent_key(tmp_path, own_keys["hub"], e, engine=e) for e in ("col-1", "col-2")]
    sources = [make_source(e, model=model, master=pool, layout_digest=DIGEST)
               for e in ("col-1", "col-2", "fw-1")]
    with Claimant(hub_address, colluders[0], sources[0], FORGED, FORGED) as c1, \
            Claimant(hub_address, colluders[1], sources[1], FORGED, FORGED) as c2, \
            Claimant(hub_address, own_keys["agent"], sources[2], FORGED, FORGED) as fw:
        wait_until(lambda: {s.agent_id for s in sources} <= set(own_hub.fleet()), 30)
        assert {s.agent_id for s in sources} <= set(own_hub.fleet())
        before = _flush_all(hub_address, own_keys["operator"])
        assert [r.agent_id for r in before] == ["hub"], before
        assert not before[0].ok and before[0].error is not None and pool in before[0].error
        src = make_source("eng-m", model=model, master=pool, layout_digest=DIGEST)
        worker = start_agent(src, address=hub_address, pool_admin_url=agent_master.admin_url,
                             keys_dir=member.root, operations=BackendOperations(
                                 mooncake_backend, src,
                                 key_scope=(model, DIGEST, (ParallelLayout(),))))
        try:
            aid = worker.source.agent_id

            def counted() -> int:
                st = own_hub.fleet().get(aid)
                return st[0].pool.keys if st is not None and st[0].pool is not None else 0

            # The worker's first measurement of the master (every 2 s) holds the keys.
            wait_until(lambda: counted() >= len(real_keys), 30)
            assert counted() >= len(real_keys)
            with FleetClient(hub_address, keys_dir=own_keys["operator"].root) as op:
                listed = op.command("pins", timeout_ms=10_000)
            got = _flush_all(hub_address, own_keys["operator"], 15_000)
        finally:
            worker.stop()
        shown = own_hub.fleet()
        assert all(shown[s.agent_id][0].source.master == pool for s in sources)
    assert (c1.received, c2.received, fw.received) == ([], [], [])
    assert [r.agent_id for r in listed] == [aid], listed
    assert_really_flushed(got, aid, real_keys, agent_master)


def test_without_a_bound_pool_the_agreement_rules_hold(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths], tmp_path: Path,
) -> None:
    """No key bound to any pool (a deployment of today): a pool reported by the fleet-wide key
    gets its ``flush --scope all`` as before, through that key's agent."""
    src = make_source("fw-2", master="10.0.0.51:50051")
    with Claimant(hub_address, own_keys["agent"], src, 7, 7) as fw:
        wait_until(lambda: src.agent_id in own_hub.fleet(), 30)
        got = _flush_all(hub_address, own_keys["operator"])
    assert [r.agent_id for r in got] == [src.agent_id] and got[0].ok, got
    assert [c.command for c in fw.received] == ["flush"]
    assert got[0].flush is not None and got[0].flush.removed_keys == 7


def test_a_members_forged_flush_is_held_against_another_members_count(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths], tmp_path: Path,
) -> None:
    """Binding proves membership, not honesty: P's members are a key bound to P alone (first:
    not bound to an engine) and a key bound to engine ``mem-d`` and P. The first answers
    ``flush --scope all`` "removed 5000 of 5000" while the pool keeps its 5,000 keys as the
    other member reports them. Outside a bound pool a key not bound to an engine is checked by
    such keys only, so the answer would have been printed as done; in a bound pool any other
    member's count checks it (and lists the pool for it), and the answer is suspect."""
    pool = "10.0.0.61:50051"
    liar = _agent_key(tmp_path, own_keys["hub"], "liar", pool=pool)
    honest_key = _agent_key(tmp_path, own_keys["hub"], "mem-d", engine="mem-d", pool=pool)
    lsrc = make_source("liar-0", master=pool)
    hsrc = make_source("mem-d", master=pool)
    with Claimant(hub_address, liar, lsrc, 5000, 5000) as first, \
            Claimant(hub_address, honest_key, hsrc, 5000, 5000) as other:
        wait_until(lambda: {lsrc.agent_id, hsrc.agent_id} <= set(own_hub.fleet()), 30)
        got = _flush_all(hub_address, own_keys["operator"])
    assert [c.command for c in first.received] == ["flush"]
    # The other member only lists the pool for the check (a dry run), never runs the flush.
    assert [(c.command, c.flush is not None and c.flush.dry_run) for c in other.received] == [
        ("flush", True)]
    (r,) = got
    assert r.agent_id == lsrc.agent_id and not r.ok, r
    assert r.suspect is not None and "later the pool holds 5000" in r.suspect, r


def test_a_pool_binding_mismatch_is_not_counted_as_a_takeover(
    hub_address: str, own_keys: dict[Role, KeyPaths], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A key bound to pool Q reporting pool P raises ``pool_binding_refused`` and not
    ``takeover_refused``; a second key reporting an agent id a live connection of another key
    holds raises ``takeover_refused`` and not ``pool_binding_refused``. Both are shown where
    takeovers are: ``/metrics`` and ``status --json``'s ``hub_counters``."""
    pool, other = "10.0.0.51:50051", "10.0.0.52:50051"
    wrong = _agent_key(tmp_path, own_keys["hub"], "mis-a", engine="mis-a", pool=other)
    first = _agent_key(tmp_path, own_keys["hub"], "dup-a", pool=pool)
    second = _agent_key(tmp_path, own_keys["hub"], "dup-b", pool=pool)
    kp = own_keys["hub"]
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  snapshot_interval_s=0.5, metrics_port=free_port()) as hub:
        with Claimant(hub_address, wrong, make_source("mis-a", master=pool)):
            wait_until(lambda: hub.pool_binding_refused >= 3, 30)
        assert hub.pool_binding_refused >= 3 and hub.takeover_refused == 0
        assert hub.refused_by_key.get("agent/mis-a.engine@10.0.0.52:50051.pool", 0) >= 3
        mismatches = hub.pool_binding_refused
        dup = make_source("dup-0", master=pool)
        with Claimant(hub_address, first, dup, 5, 5):
            wait_until(lambda: dup.agent_id in hub.fleet(), 30)
            assert dup.agent_id in hub.fleet()
            with Claimant(hub_address, second, dup, 5, 5):
                wait_until(lambda: hub.takeover_refused >= 3, 30)
        takeovers = hub.takeover_refused
        assert takeovers >= 3 and hub.pool_binding_refused == mismatches
        assert hub.refused_by_key.get("agent/dup-b@10.0.0.51:50051.pool", 0) >= 3
        assert hub.metrics is not None
        served = dict(line.rsplit(" ", 1) for line in httpx.get(
            hub.metrics.url, timeout=5.0).text.splitlines() if not line.startswith("#"))
        assert float(served["kvpool_hub_pool_binding_refused_total"]) == mismatches
        assert float(served["kvpool_hub_takeover_refused_total"]) == takeovers
        # The counters come in a snapshot (every 0.5 s here), read by status --json.
        assert console_main(["status", "--json", "--hub", hub_address, "--keys",
                             str(own_keys["operator"].root)]) == 0
        counters = json.loads(capsys.readouterr().out)["hub_counters"]
        assert (counters["pool_binding_refused"], counters["takeover_refused"]) == (
            mismatches, takeovers)
