"""A flush answer that matched more keys than its pool's last count, on a real keyed hub: a
pool that grew (a live fleet saves hundreds of keys a second, agents count every 2 s) is
confirmed by a later count and answered as it was; a count that never covers the claim is
suspect (``kvpool_agent._answers.outgrew``). Found by a new user's demo: 2 of 4 genuine dry
runs of a filling pool were printed "flush SUSPECT"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_testlib import Claimant, make_source, wait_until

from kvpool_agent import AGENT_KEYS_ENV, FleetClient, FleetHub, KeyPaths
from kvpool_agent.auth import Role
from kvpool_agent.protocol import FlushArgs

_MASTER = "127.0.0.1:50051"


@pytest.fixture
def keyed_hub(hub_address: str, fleet_keys: dict[Role, KeyPaths], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetHub]:
    kp = fleet_keys["hub"]
    monkeypatch.setenv(AGENT_KEYS_ENV, str(fleet_keys["agent"].root))
    with FleetHub(hub_address, authorized_keys_dir=kp.authorized_dir,
                  secret_key_file=kp.hub_secret, audit_file=tmp_path / "audit.jsonl",
                  snapshot_interval_s=1.0) as h:
        yield h


def _dry_run(address: str, keys: KeyPaths) -> list[object]:
    with FleetClient(address, keys_dir=keys.root) as op:
        return list(op.command("flush", flush=FlushArgs(scope="all"), timeout_ms=10_000))


def test_a_pool_that_grew_past_its_count_is_confirmed_by_a_later_count(
    keyed_hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths],
) -> None:
    """The worker's pool held 1,000 keys at its last count; its dry run lists 1,500 (past the
    slack of 125), and its next count says 1,600: the answer is the worker's, not suspect."""
    pool = [1000]

    def listing() -> int:
        pool[0] = 1600  # the agent's next measurement of the pool, reported after its answer
        return 1500

    src = make_source("real-0", master=_MASTER)
    with Claimant(hub_address, None, src, lambda: pool[0], listing, interval_s=0.05):
        wait_until(lambda: src.agent_id in keyed_hub.fleet()
                   and keyed_hub.fleet()[src.agent_id][0].pool is not None)
        (r,) = _dry_run(hub_address, fleet_keys["operator"])
    assert r.agent_id == src.agent_id  # type: ignore[attr-defined]
    assert r.ok and r.suspect is None, r  # type: ignore[attr-defined]
    assert r.flush is not None and r.flush.keys == 1500  # type: ignore[attr-defined]


def test_a_claim_no_later_count_covers_is_suspect(
    keyed_hub: FleetHub, hub_address: str, fleet_keys: dict[Role, KeyPaths],
) -> None:
    """The pool's count stays 1,000 while the answer claims 4,000 keys matched: held for
    later counts, then suspect, with the counts named."""
    src = make_source("real-0", master=_MASTER)
    with Claimant(hub_address, None, src, 1000, 4000, interval_s=0.05):
        wait_until(lambda: src.agent_id in keyed_hub.fleet()
                   and keyed_hub.fleet()[src.agent_id][0].pool is not None)
        (r,) = _dry_run(hub_address, fleet_keys["operator"])
    assert not r.ok  # type: ignore[attr-defined]
    assert r.suspect == ("4000 keys matched, but the pool holds 1000 as its "  # type: ignore[attr-defined]
                         "agents report it")
