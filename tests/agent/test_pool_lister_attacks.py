"""Insiders against the pool lister (a store agent listing its pool for dry runs of scope
``all``, ``Source.lists_pool``): a second fleet-wide agent key posing as one. Each test asserts
what the attack is left with: forged counts reach no console as true, a lister that never
answers costs one command, a forgotten lister's answer is not served, and naming the lister
beside the workers gets one listing (found by an attacker's review of the lister)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from agent_testlib import Claimant, make_source, wait_until

from kvpool_agent import FleetClient, FleetHub, KeyPaths
from kvpool_agent.auth import Role, authorize_key, generate_keys
from kvpool_agent.protocol import CommandReply, FlushArgs, PoolStats, Source

M = "127.0.0.1:59111"
HONEST = 500
DRY = FlushArgs(scope="all", dry_run=True)


def _second_fleet_key(tmp: Path, hub: KeyPaths) -> KeyPaths:
    """An agent key of its own, fleet-wide (bound to no engine or pool)."""
    d = generate_keys(tmp / "evil", "agent")
    (d.root / "hub.key").write_bytes(hub.hub_public.read_bytes())
    authorize_key(hub.root, "agent", d.public("agent"), "evil", None, None)
    return d


def _lister(engine: str) -> Source:
    return msgspec.structs.replace(make_source(engine, role="store", master=M),
                                   agent_id=engine, lists_pool=True)


class _Silent(Claimant):
    """A lister that reports and never answers."""

    def _run(self) -> None:
        while not self._stop.is_set():
            self.fake.report(self.src, send_timeout_ms=100,
                             pool=PoolStats(backend="mooncake", keys=HONEST))
            while self.fake.sock.poll(int(self.interval_s * 1e3)):
                self.received.append(self.fake.sock.recv())  # type: ignore[arg-type]


@pytest.fixture
def workers(own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths]
            ) -> Iterator[list[Claimant]]:
    """Two honest workers of pool M (the fleet-wide agent key), reporting and answering 500."""
    cs = [Claimant(hub_address, own_keys["agent"], make_source(f"eng-h{i}", master=M),
                   pool_keys=HONEST, answer=HONEST) for i in range(2)]
    for c in cs:
        c.__enter__()
    try:
        wait_until(lambda: all(c.src.agent_id in own_hub.fleet() for c in cs), 15)
        yield cs
    finally:
        for c in cs:
            c.__exit__()


def _dry(hub_address: str, keys: KeyPaths, ids: list[str] | None = None,
         timeout_ms: int = 5_000) -> list[CommandReply]:
    with FleetClient(hub_address, keys_dir=keys.root) as c:
        return c.command("flush", targets=ids or [], flush=DRY, timeout_ms=timeout_ms)


def _honest(replies: list[CommandReply]) -> bool:
    return all(r.ok and r.flush is not None and r.flush.keys == HONEST for r in replies)


def test_a_forged_listing_reaches_no_console_as_true(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths],
    workers: list[Claimant], tmp_path: Path,
) -> None:
    """A lister that reports and answers 4,242 keys of a pool whose workers hold 500: its
    copies are checked against the counts its own key does not report, so every target's
    answer, named or pool-wide, is suspect, not ok."""
    evil = _second_fleet_key(tmp_path, own_keys["hub"])
    with Claimant(hub_address, evil, _lister("evil-store"), pool_keys=4242, answer=4242) as f:
        wait_until(lambda: "evil-store" in own_hub.fleet(), 15)
        named = _dry(hub_address, own_keys["viewer"], [c.src.agent_id for c in workers])
        pool_wide = _dry(hub_address, own_keys["operator"])
    assert f.flushes, "the lister was not asked: the test shows nothing"
    assert len(named) == 2 and len(pool_wide) == 1, (named, pool_wide)
    for r in [*named, *pool_wide]:
        assert not r.ok and r.suspect, r


def test_a_lister_that_never_answers_costs_one_command(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths],
    workers: list[Claimant], tmp_path: Path,
) -> None:
    """The first dry run waits for the silent lister and fails, naming it; the lister is then
    not asked (``LISTER_BENCHED_S``) and the next dry run is the workers' own listing."""
    silent = _Silent(hub_address, _second_fleet_key(tmp_path, own_keys["hub"]),
                     _lister("evil-store"))
    with silent:
        wait_until(lambda: "evil-store" in own_hub.fleet(), 15)
        first = _dry(hub_address, own_keys["operator"], timeout_ms=1_500)
        second = _dry(hub_address, own_keys["operator"], timeout_ms=5_000)
    assert all(not r.ok and "evil-store" in (r.error or "") for r in first), first
    assert second and _honest(second), second
    assert len(silent.received) == 1
    assert own_hub._commands.pending == {}


def test_a_forgotten_listers_answer_is_not_served(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths],
    workers: list[Claimant], tmp_path: Path,
) -> None:
    """A lister's answer (520 keys, within the check's slack) answers the next dry runs for
    2 s; once the operator forgets the lister, it answers none: the workers list again."""
    evil = _second_fleet_key(tmp_path, own_keys["hub"])
    with Claimant(hub_address, evil, _lister("evil-store"), pool_keys=HONEST, answer=520):
        wait_until(lambda: "evil-store" in own_hub.fleet(), 15)
        before = _dry(hub_address, own_keys["operator"])
    with FleetClient(hub_address, keys_dir=own_keys["operator"].root) as op:
        (forgot,) = op.command("forget", targets=["evil-store"])
    after = _dry(hub_address, own_keys["operator"])
    assert all(r.ok and r.flush is not None and r.flush.keys == 520 for r in before), before
    assert forgot.ok, forgot
    assert after and _honest(after), after


@pytest.mark.parametrize("store_first", [True, False])
def test_a_viewer_naming_the_lister_beside_the_workers_gets_one_listing(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths],
    workers: list[Claimant], store_first: bool,
) -> None:
    """The lister named among the targets, first or last: it is asked once, and every target
    (the lister too) gets its count; no ``hub busy``, no reply refused as unexpected."""
    with Claimant(hub_address, own_keys["agent"], _lister("store@real"), pool_keys=HONEST,
                  answer=HONEST) as store:
        wait_until(lambda: "store@real" in own_hub.fleet(), 15)
        ids = [c.src.agent_id for c in workers]
        ids = ["store@real", *ids] if store_first else [*ids, "store@real"]
        replies = _dry(hub_address, own_keys["viewer"], ids)
    assert sorted(r.agent_id for r in replies) == sorted(ids), replies
    assert _honest(replies), replies
    assert len(store.flushes) == 1
    assert not any(w.flushes for w in workers)
    assert own_hub.counters.rejected_replies == 0


def test_a_pool_with_no_live_worker_is_listed_by_its_store_agent(
    own_hub: FleetHub, hub_address: str, own_keys: dict[Role, KeyPaths],
) -> None:
    """No engine serves the pool yet: a pool-wide dry run of scope ``all`` goes to its store
    agent (it failed with "no live worker agent" before); a real flush still finds no one."""
    with Claimant(hub_address, own_keys["agent"], _lister("store@only"), pool_keys=HONEST,
                  answer=HONEST) as store:
        wait_until(lambda: "store@only" in own_hub.fleet(), 15)
        dry = _dry(hub_address, own_keys["operator"])
        with FleetClient(hub_address, keys_dir=own_keys["operator"].root) as op:
            (real,) = op.command("flush", flush=FlushArgs(scope="all", dry_run=False))
    assert [r.agent_id for r in dry] == ["store@only"] and _honest(dry), dry
    assert not real.ok and "no live worker agent" in (real.error or ""), real
    assert len(store.flushes) == 1
