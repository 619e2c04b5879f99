"""Round-8 attack on the policy service's removals (``kvpool_policy._remover``): the record
budget counts chunk hashes, not the keys each fans out to (a layout's prefixes x layers, up to
``MAX_KEYS_PER_CHUNK``, 4,096), so an agent key's records of wide chunks it never saves, each
pushed out of its share by the next, make the service remove that many keys per hash.

Before the bound, every evicted chunk was expanded to its keys at once and a pass sent them all
in one ``batch_remove``: in process, of 128-key chunks (2 ranks x 64 layers) the service
applied 3,176 of 12,008 records in 10 s, sending 650,000 removes a second; at 4,096 keys a
chunk it did not finish 10 s of flood in 200 s. Now evicted chunks are queued, expanded
``REMOVE_KEYS_PER_PASS`` keys a pass shared between layouts, and past ``MAX_QUEUED_CHUNKS``
the layout queuing the most gives up its own oldest.

The remover's passes are counted on a fake store; the live test floods a real service (its
store client on a real ``mooncake_master``, a separate store process) with the attacker's
agent key while an honest engine's saved chunk is evicted: it is removed, the honest records
are applied, snapshots keep coming.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_remover import Clock
from test_service_attacks import ATTACKER, CHUNK, VICTIM, Flood, h, layout, pool, service
from test_service_live import wait_for

from kvpool_agent.vocabulary import ErrorCode
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.policy_wire import PolicyLayout, PolicyRecord
from kvpool_policy import _remover
from kvpool_policy._remover import (
    ABSENT_TRIES_PER_PASS,
    MAX_QUEUED_CHUNKS,
    REMOVE_KEYS_PER_PASS,
    Remover,
)
from kvpool_replay import LocalMooncakeMaster

__all__ = ["pool"]  # the fixture, imported for the live test

WIDE = layout("attacker-a", ATTACKER.digest, ranks=2, layers=512)
"""The attacker's layout: 1,024 keys a chunk."""


class Store:
    """Holds what is saved (``full``: every key); -704 for the rest. Keeps each
    ``batch_remove``'s keys."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.full = False
        self.batches: list[list[str]] = []

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        self.batches.append(list(keys))
        codes = [0 if self.full or k in self.keys else ErrorCode.OBJECT_NOT_FOUND for k in keys]
        self.keys -= set(keys)
        return codes


def _remover_of(monkeypatch: pytest.MonkeyPatch, pinned: frozenset[str],
                *layouts: PolicyLayout) -> tuple[Remover, Store, Clock]:
    monkeypatch.setattr(_remover, "pinned_chunks", lambda *a: pinned)
    clock, store = Clock(), Store()
    remover = Remover(store, 60.0, clock)  # type: ignore[arg-type]
    assert all(remover.learn(lay) for lay in layouts)
    return remover, store, clock


def test_a_wide_chunk_flood_removes_a_bounded_pass_and_the_honest_chunks_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes every 50 ms (the test's clock) for 5 s, each evicting 2,500 never-saved attacker
    chunks of 1,024 keys (its whole budget of 50,000 hashes a second: 2.56M keys a pass).
    No pass removes more than ``REMOVE_KEYS_PER_PASS`` keys of queued chunks (and the rest of
    its last chunk) beside the absent keys tried again; the victim's saved chunk evicted
    mid-flood is removed at the next pass, a pinned one never, one admitted again before the
    pass is not removed; the queue stays at ``MAX_QUEUED_CHUNKS``, what it gives up the
    attacker's own, counted in keys."""
    pinned = h("pinned")
    remover, store, clock = _remover_of(monkeypatch, frozenset({pinned}), WIDE, VICTIM)
    victim = [h("v0"), pinned, h("again")]
    store.keys |= set(remover.keys_of([(VICTIM.digest, v) for v in victim]))
    tried: set[str] = set()
    for k in range(100):
        clock.now += 0.05
        remover.evict([(WIDE.digest, h(f"a{k}-{i}")) for i in range(2_500)])
        if k == 50:
            remover.evict([(VICTIM.digest, v) for v in victim])
            remover.keep([(VICTIM.digest, h("again"))])  # admitted again before the pass
        remover.step()
        batch = store.batches[-1]
        again = sum(1 for key in batch if key in tried)
        assert again <= ABSENT_TRIES_PER_PASS
        assert len(batch) - again < REMOVE_KEYS_PER_PASS + 1_024  # the last chunk whole
        tried.update(batch)
        assert remover.queued <= MAX_QUEUED_CHUNKS
        if k == 50:  # the victim's chunk went at the pass after its eviction
            assert store.keys == set(remover.keys_of([(VICTIM.digest, v)
                                                      for v in (pinned, h("again"))]))
    assert store.keys == set(remover.keys_of([(VICTIM.digest, v) for v in victim[1:]]))
    taken = sum(1 for key in tried if key.split("@")[2] == WIDE.digest) // 1_024
    assert remover.deferred_dropped == (100 * 2_500 - remover.queued - taken) * 1_024


def test_wide_layouts_take_turns_and_a_narrow_one_goes_within_its_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three layouts of 4,096 keys a chunk (one fills a pass) queuing a chunk each a pass take
    turns; a 2-key layout's chunks go at the pass they are queued whatever the others queued
    (every key saved: no absent key is tried again)."""
    wide = [layout(f"w{i}", f"{i}" * 12, ranks=4, layers=1_024) for i in range(3)]
    remover, store, clock = _remover_of(monkeypatch, frozenset(), *wide, VICTIM)
    store.full = True
    for k in range(9):
        clock.now += 0.05
        remover.evict([(lay.digest, h(f"w{k}")) for lay in wide])
        remover.evict([(VICTIM.digest, h(f"v{k}-{i}")) for i in range(100)])
        remover.step()
        batch = store.batches[-1]
        assert len(batch) == REMOVE_KEYS_PER_PASS + 200
        assert {key.split("@")[2] for key in batch} == {wide[k % 3].digest, VICTIM.digest}


def test_unread_pins_hold_chunks_queued_within_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout whose pins cannot be read removes nothing; its chunks stay queued, past
    ``MAX_QUEUED_CHUNKS`` its oldest given up (counted in keys), and go once read."""
    remover, store, clock = _remover_of(monkeypatch, frozenset(), VICTIM)

    def unreadable(*a: object) -> frozenset[str]:
        raise RuntimeError("store down")

    monkeypatch.setattr(_remover, "pinned_chunks", unreadable)
    remover.evict([(VICTIM.digest, h(f"v{i}")) for i in range(MAX_QUEUED_CHUNKS + 10)])
    assert remover.step() == 0 and not store.batches
    assert remover.queued == MAX_QUEUED_CHUNKS and remover.deferred_dropped == 2 * 10
    monkeypatch.setattr(_remover, "pinned_chunks", lambda *a: frozenset())
    clock.now += _remover.PIN_REFRESH_S
    remover.step()
    assert store.batches[-1][:2] == remover.keys_of([(VICTIM.digest, h("v10"))])
    assert len(store.batches[-1]) == REMOVE_KEYS_PER_PASS


def test_the_live_service_keeps_up_with_a_flood_of_wide_chunks(
        pool: LocalMooncakeMaster, tmp_path: Path) -> None:
    """The attacker's agent key sends 45,000 hashes a second (its budget is 50,000) of records
    of 1,024-key chunks it never saves (46M keys a second to remove), each record pushing its
    older ones out of its share; an honest engine (the fleet key) saves a chunk, then records
    24 more that push it out of its own share. The saved chunk is removed while the flood goes
    on, the service applies every batch, none over budget or lost, and snapshots keep coming."""
    rate, per = 45_000, 256
    with service(tmp_path, pool) as env:
        last = [env.snapshot()]
        flood = Flood(env, WIDE, per, rate)
        gaps: list[float] = []
        saved = h("saved")
        try:
            def flooding() -> bool:  # the pool full of its chunks: it evicts its own
                last.append(env.snapshot(last[-1].version))
                return last[-1].records > 40

            wait_for(flooding, 60, "the flood evicting", log=env.log)
            for p in VICTIM.prefixes:
                assert env.store.store.put(p + saved, b"x" * 4096) == 0
            env.send("victim-eng", 0, [VICTIM], [PolicyRecord(VICTIM.digest, [saved], CHUNK, 1)],
                     fleet=True)
            env.send("victim-eng", 1, [VICTIM], [PolicyRecord(
                VICTIM.digest, [h(f"v{i}") for i in range(24)], CHUNK, 24)], fleet=True)
            seen = [env.snapshot(last[-1].version)]
            at = [time.monotonic()]

            def removed() -> bool:
                seen.append(env.snapshot(seen[-1].version, timeout_s=10))
                at.append(time.monotonic())
                gaps.append(at[-1] - at[-2])
                return saved not in env.resident(VICTIM)

            wait_for(removed, 60, "the honest chunk removed in the flood", log=env.log)
            assert flood.thread.is_alive()
        finally:
            flood.close()
        assert env.alive(), env.log()
        # Every record sent is applied, none lost (how far behind the flood it ran is a rate:
        # the absent-key flood's "a third of those sent" failed at a load average of 14).
        final = env.settled(flood.sent + 2)
        assert final.dropped == 0, final
        stale_s = KVPoolConfig.model_fields["policy_stale_ms"].default / 1e3
        steps = [(gap, b.version - a.version)
                 for gap, a, b in zip(gaps, seen[:-1], seen[1:], strict=True)]
        assert all(gap < stale_s or (dv > 1 and gap < 2 * stale_s) for gap, dv in steps), steps


def test_keep_expands_only_chunks_left_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record's saves are kept (``Remover.keep``): only chunks some key of which waits (a
    lease, a save to come) are expanded, not every saved chunk's 1,024 keys; a leased chunk
    admitted again is not tried again after its grace."""
    remover, store, clock = _remover_of(monkeypatch, frozenset(), WIDE, VICTIM)
    remover.keep([(WIDE.digest, h(f"s{i}")) for i in range(2_500)])
    assert remover._keep == []
    leased = remover.keys_of([(VICTIM.digest, h("leased"))])

    def refuse(keys: Sequence[str]) -> list[int]:
        store.batches.append(list(keys))
        return [ErrorCode.OBJECT_HAS_LEASE for _ in keys]

    monkeypatch.setattr(store, "batch_remove", refuse)
    remover.evict([(VICTIM.digest, h("leased"))])
    remover.step()
    assert store.batches == [leased] and remover.waiting == 2
    remover.keep([(VICTIM.digest, h("leased"))])
    clock.now += 61.0
    remover.step()
    assert store.batches == [leased] and remover.waiting == 0
