"""The policy service's removals (``kvpool_policy._remover.Remover``) on a fake store: a layout
learned since the last pin read has its pins read at the first removal pass, so its evicted
chunks go at once, not up to ``PIN_REFRESH_S`` later (a replay's small pool turns over in less);
a layout whose pins cannot be read removes nothing and is not read again before the refresh;
a chunk evicted before its save reached the pool is removed once the save lands."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpool_agent.vocabulary import ErrorCode
from kvpool_connector.keys import ParallelLayout, shard_prefix
from kvpool_connector.policy_wire import PolicyLayout
from kvpool_policy import _remover
from kvpool_policy._remover import ABSENT_RETRY_S, PIN_REFRESH_S, Remover

DIGEST = "aaaaaaaaaaaa"
LAYOUT = PolicyLayout(DIGEST, [shard_prefix("m", DIGEST, ParallelLayout(tp_rank=r))
                               for r in range(2)])


def _hash(i: int) -> str:
    return f"{i:032x}"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Store:
    """Holds keys; removes what it holds (0), -704 for the rest; counts tries per key."""

    def __init__(self, chunks: Sequence[int]) -> None:
        self.keys = {p + _hash(i) for p in LAYOUT.prefixes for i in chunks}
        self.tries: dict[str, int] = {}

    def save(self, chunk: int) -> None:
        self.keys |= {p + _hash(chunk) for p in LAYOUT.prefixes}

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        for k in keys:
            self.tries[k] = self.tries.get(k, 0) + 1
        codes = [0 if k in self.keys else ErrorCode.OBJECT_NOT_FOUND for k in keys]
        self.keys -= set(keys)
        return codes


class PinRecords:
    """``pinned_chunks`` as the remover calls it: counts reads; ``fail`` makes them raise."""

    def __init__(self) -> None:
        self.reads = 0
        self.fail = False
        self.pinned: frozenset[str] = frozenset()

    def __call__(self, backend: object, model: str, digest: str,
                 chunk_size: int) -> frozenset[str]:
        self.reads += 1
        if self.fail:
            raise RuntimeError("store down")
        return self.pinned


@pytest.fixture
def pins(monkeypatch: pytest.MonkeyPatch) -> PinRecords:
    records = PinRecords()
    monkeypatch.setattr(_remover, "pinned_chunks", records)
    return records


def test_a_new_layouts_evictions_go_at_the_first_pass(pins: PinRecords) -> None:
    clock = Clock()
    store = Store(range(4))
    remover = Remover(store, 60.0, clock)  # type: ignore[arg-type]
    assert remover.step() == 0 and pins.reads == 0  # nothing to remove: nothing read
    pins.pinned = frozenset({_hash(1)})
    assert remover.learn(LAYOUT)
    remover.evict([(DIGEST, _hash(i)) for i in range(3)])
    assert remover.step() == 4  # chunks 0 and 2, both ranks; the pinned chunk 1 stays
    assert pins.reads == 1 and remover.pinned() == {DIGEST: frozenset({_hash(1)})}
    assert store.keys == {p + _hash(i) for p in LAYOUT.prefixes for i in (1, 3)}


def test_unreadable_pins_remove_nothing_and_wait_for_the_refresh(pins: PinRecords) -> None:
    clock = Clock()
    store = Store(range(2))
    remover = Remover(store, 60.0, clock)  # type: ignore[arg-type]
    pins.fail = True
    assert remover.learn(LAYOUT)
    remover.evict([(DIGEST, _hash(0))])
    for _ in range(5):  # passes every 50 ms: one read, no storm, nothing removed
        assert remover.step() == 0
        clock.now += 0.05
    assert pins.reads == 1 and len(store.keys) == 4
    pins.fail = False
    clock.now += PIN_REFRESH_S
    assert remover.step() == 2 and pins.reads == 2
    assert store.keys == {p + _hash(1) for p in LAYOUT.prefixes}


def _passes(remover: Remover, clock: Clock, seconds: float) -> int:
    """Removal passes every 50 ms for ``seconds``: keys removed."""
    removed = 0
    for _ in range(round(seconds / 0.05)):
        clock.now += 0.05
        removed += remover.step()
    return removed


def test_a_chunk_evicted_before_its_save_is_removed_when_it_lands(pins: PinRecords) -> None:
    clock = Clock()
    store = Store([])
    remover = Remover(store, 60.0, clock)  # type: ignore[arg-type]
    assert remover.learn(LAYOUT)
    # Records come when a request is scheduled: chunks 0-2 evicted before any is saved.
    remover.evict([(DIGEST, _hash(i)) for i in range(3)])
    assert remover.step() == 0 and remover.waiting == 6
    store.save(0)
    store.save(1)
    assert _passes(remover, clock, 2.0) == 4  # the two saved chunks, both ranks
    assert store.keys == set() and remover.waiting == 2
    remover.keep([(DIGEST, _hash(2))])  # chunk 2 admitted again: its removal is dropped
    assert remover.waiting == 0
    store.save(2)
    assert _passes(remover, clock, 70.0) == 0 and len(store.keys) == 2


def test_a_save_that_never_comes_is_given_up(pins: PinRecords) -> None:
    clock = Clock()
    store = Store([])
    remover = Remover(store, 60.0, clock)  # type: ignore[arg-type]
    assert remover.learn(LAYOUT)
    remover.evict([(DIGEST, _hash(0))])
    assert _passes(remover, clock, sum(ABSENT_RETRY_S) + 1.0) == 0
    assert remover.waiting == 0
    tries = {len(ABSENT_RETRY_S) + 1}  # the first try and one after each wait
    assert set(store.tries.values()) == tries
    assert _passes(remover, clock, 60.0) == 0 and set(store.tries.values()) == tries
