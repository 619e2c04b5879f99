"""Issue 42, attack 3: a viewer's ``flush --dry-run`` naming every worker made each serving
process list every pool key (Mooncake ``/get_all_keys``), 64 in flight: 153 listings a second,
engine CPU from 6% to 134%. Against a real keyed hub and four real agents over a real Mooncake
pool (each agent's pool client counts the listings it does): a dry run lists a pool once and
its answer is shared for ``LISTING_SHARED_S``; a read-only key causes one listing of a pool per
``LISTING_INTERVAL_S`` at most; a real flush makes the next dry run list again."""

from __future__ import annotations

import ctypes
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_testlib import make_source, wait_until

from kvpool_agent import AgentHandle, FleetClient, FleetHub, KeyPaths, start_agent
from kvpool_agent._audit import READONLY_SUFFIX
from kvpool_agent._hub_listings import LISTING_INTERVAL_S, share_key
from kvpool_agent._store_agent import store_source
from kvpool_agent.auth import Role
from kvpool_agent.pool_listing import ALL_KEYS_PATTERN
from kvpool_agent.protocol import PROTOCOL_VERSION, CommandRequest, FlushArgs, FlushResult
from kvpool_connector.keys import ParallelLayout, PoolKey
from kvpool_connector.operations import BackendOperations
from kvpool_replay import LocalMooncakeMaster

DIGEST = "0123456789ab"
_VALUE = 4096
_WORKERS = 4


class _CountingOps(BackendOperations):
    """The connector's real pool operations, counting the flushes (pool listings) run."""

    listings = 0

    def flush(self, args: FlushArgs) -> FlushResult:
        self.listings += 1
        return super().flush(args)


@pytest.fixture
def workers(hub: FleetHub, hub_address: str, mooncake_backend: Any,
            pool_buffer: ctypes.Array[ctypes.c_char], agent_master: LocalMooncakeMaster,
            model: str) -> Iterator[list[tuple[AgentHandle, _CountingOps]]]:
    """Four real worker agents of ``model`` in the agent tests' pool, which holds six keys of
    ``model``."""
    keys = [str(PoolKey(model, DIGEST, ParallelLayout(), f"{i:032x}")) for i in range(6)]
    codes = mooncake_backend.batch_put_from(
        keys, [[ctypes.addressof(pool_buffer)]] * len(keys), [[_VALUE]] * len(keys))
    assert codes == [0] * len(keys)
    out = []
    for i in range(_WORKERS):
        src = make_source(f"eng-l{i}", model=model, master=agent_master.address,
                          layout_digest=DIGEST)
        ops = _CountingOps(mooncake_backend, src, key_scope=(model, DIGEST, (ParallelLayout(),)))
        out.append((start_agent(src, address=hub_address, pool_admin_url=agent_master.admin_url,
                                operations=ops), ops))
    try:
        wait_until(lambda: all(h.source.agent_id in hub.fleet() for h, _ in out), 15)
        yield out
    finally:
        for h, _ in out:
            h.stop()
        mooncake_backend.remove_by_scope(f"^kvpool@{model}", dry_run=False, force=True)


def _listings(workers: list[tuple[AgentHandle, _CountingOps]]) -> int:
    return sum(ops.listings for _, ops in workers)


def test_a_viewers_dry_run_flood_lists_the_pool_once_per_window(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
    workers: list[tuple[AgentHandle, _CountingOps]], model: str,
) -> None:
    """40 dry runs of a viewer naming all four workers, one after another. Before the fix each
    reached every worker: 160 pool listings (within the default work budget of 240). Now the
    pool is listed once per ``LISTING_SHARED_S``; every answer is the listing's (the six keys
    of the model), and every worker named gets it."""
    ids = [h.source.agent_id for h, _ in workers]
    dry = FlushArgs(scope="model", model=model, dry_run=True)
    start = time.monotonic()
    with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
        answers = [viewer.command("flush", targets=ids, flush=dry, timeout_ms=10_000)
                   for _ in range(40)]
    elapsed = time.monotonic() - start
    listed = _listings(workers)
    assert 1 <= listed <= 1 + math.ceil(elapsed / LISTING_INTERVAL_S), (listed, elapsed)
    for replies in answers:
        assert sorted(r.agent_id for r in replies) == sorted(ids), replies
        listers = {r.flush.listed_by for r in replies if r.flush is not None}
        assert listers <= set(ids) | {""} and listers - {""}, replies  # copies name the lister
        assert all(r.ok and r.flush is not None and r.flush.keys == 6 for r in replies), replies
    assert hub.counters.shared_listings == 40 * _WORKERS - listed
    audit = Path(str(tmp_path / "audit.jsonl") + READONLY_SUFFIX).read_text().splitlines()
    assert len([x for x in map(json.loads, audit) if x["command"] == "flush"]) == 40


def test_a_viewer_changing_the_model_each_time_gets_one_listing_per_interval(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    workers: list[tuple[AgentHandle, _CountingOps]],
) -> None:
    """A viewer defeats the shared answer by naming another model each time (each a listing
    of the pool): past its first listing of the pool it is answered ``hub busy`` until
    ``LISTING_INTERVAL_S`` has passed, and no worker lists for it."""
    ids = [h.source.agent_id for h, _ in workers]
    start = time.monotonic()
    with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
        answers = [viewer.command("flush", targets=ids, timeout_ms=10_000, flush=FlushArgs(
            scope="model", model=f"org/other-{i}", dry_run=True)) for i in range(30)]
    elapsed = time.monotonic() - start
    listed = _listings(workers)
    assert 1 <= listed <= 1 + math.ceil(elapsed / LISTING_INTERVAL_S), (listed, elapsed)
    busy = [a for a in answers if [r.agent_id for r in a] == ["hub"]]
    assert len(busy) == 30 - listed
    assert all(a[0].error is not None and "one listing per pool" in a[0].error for a in busy)
    # The pool by the name the console shows it by (``pool_readings.pool_name``).
    assert all("pool 'mooncake@" in (a[0].error or "") for a in busy), busy[0][0].error


def test_a_real_flush_makes_the_next_dry_run_list_again(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    workers: list[tuple[AgentHandle, _CountingOps]], model: str,
) -> None:
    """A dry run's shared answer is dropped when the operator flushes its pool: the dry run
    right after lists again and says what the pool holds now (nothing of the model)."""
    ids = [h.source.agent_id for h, _ in workers]
    dry = FlushArgs(scope="model", model=model, dry_run=True)
    with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
        before = op.command("flush", targets=ids, flush=dry)
        (flushed,) = op.command("flush", flush=FlushArgs(scope="model", model=model,
                                                         dry_run=False))
        after = op.command("flush", targets=ids, flush=dry)
    assert all(r.ok and r.flush is not None and r.flush.keys == 6 for r in before), before
    assert flushed.ok and flushed.flush is not None and flushed.flush.removed_keys == 6, flushed
    assert all(r.ok and r.flush is not None and r.flush.keys == 0 for r in after), after
    assert _listings(workers) == 3


def test_only_a_fleet_wide_keys_listing_is_shared_across_keys() -> None:
    """Agents of one pool and scope share a listing; an engine-bound key's listing is shared
    with agents of that key only (its answer is its own claim)."""
    req = CommandRequest(v=PROTOCOL_VERSION, seq=1, request_id="r", command="flush",
                         flush=FlushArgs(scope="all", dry_run=True))
    a, b = make_source("eng-a", master="m:1"), make_source("eng-b", master="m:1")
    assert share_key(req, a, "k1", False) == share_key(req, b, "k2", False)
    assert share_key(req, a, "k1", True) != share_key(req, b, "k2", False)
    assert share_key(req, a, "k1", True) == share_key(req, b, "k1", True)
    assert share_key(req, a, "k1", False) != share_key(
        req, make_source("eng-c", master="m:2"), "k1", False)


def test_a_store_agent_lists_the_pool_in_place_of_the_engines(
    hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths],
    workers: list[tuple[AgentHandle, _CountingOps]], agent_master: LocalMooncakeMaster,
    mooncake_backend: Any,
) -> None:
    """With a store agent beside the master (``kvpool-agent store``: ``Source.lists_pool``), a
    dry run of scope ``all`` naming every worker, or naming none (pool-wide), is listed by the
    store agent from the master's admin port: no worker lists at all, every target's answer
    is the pool's count, and the store agent, not named, gets no answer of its own."""
    store = start_agent(store_source("store@listing-test", agent_master.address),
                        address=hub_address, pool_admin_url=agent_master.admin_url)
    try:
        wait_until(lambda: store.source.agent_id in hub.fleet(), 15)
        assert hub.fleet()[store.source.agent_id][0].source.lists_pool
        ids = [h.source.agent_id for h, _ in workers]
        dry = FlushArgs(scope="all", dry_run=True)
        with FleetClient(hub_address, keys_dir=fleet_keys["viewer"].root) as viewer:
            named = viewer.command("flush", targets=ids, flush=dry, timeout_ms=10_000)
        with FleetClient(hub_address, keys_dir=fleet_keys["operator"].root) as op:
            pool_wide = op.command("flush", flush=dry, timeout_ms=10_000)
        truth = mooncake_backend.remove_by_scope(ALL_KEYS_PATTERN, dry_run=True)
    finally:
        store.stop()
    assert truth.keys >= 6
    assert sorted(r.agent_id for r in named) == sorted(ids), named
    (one,) = pool_wide
    assert one.agent_id in ids, pool_wide
    for r in [*named, one]:
        assert r.ok and r.flush is not None, r
        assert (r.flush.keys, r.flush.bytes) == (truth.keys, truth.bytes), (r, truth)
        # Each answer names whose listing it is (the console prints it).
        assert r.flush.listed_by == store.source.agent_id, r
    assert _listings(workers) == 0
