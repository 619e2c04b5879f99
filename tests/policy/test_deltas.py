"""Whole admission snapshots and deltas (``kvpool_policy._deltas``, ``policy_wire.SnapshotReader``):
a subscriber that receives every message holds the service's doorkeeper filter exactly; one
that missed a message keeps a filter the service published before, never a mix, until the
next whole snapshot (at most ``FULL_EVERY_S`` later); a delta of a few records is a small
fraction of a whole snapshot."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_connector.policy_wire import (
    FULL_EVERY_S,
    AdmissionSnapshot,
    DeltaError,
    SnapshotReader,
    apply_delta,
    changed_words,
)
from kvpool_policy._core import PolicyCore
from kvpool_policy._deltas import SnapshotDeltas
from kvpool_policy.policy import AccessRecord, PoolPolicy

DIGEST = "d" * 12


def _hashes(doc: int, n: int) -> tuple[str, ...]:
    return tuple(hashlib.sha256(f"{doc}-{i}".encode()).hexdigest()[:32] for i in range(n))


class _Service:
    """A policy core publishing through ``SnapshotDeltas`` on a clock of the test's."""

    def __init__(self, capacity: int, chunk_bytes: int) -> None:
        self.now = 0.0
        self.core = PolicyCore(PoolPolicy(capacity, engines_decide=True), None,
                               clock=lambda: self.now)
        self.deltas = SnapshotDeltas(clock=lambda: self.now)
        self.chunk_bytes = chunk_bytes
        self.version = 0

    def record(self, doc: int, n: int) -> None:
        self.core.policy.record(AccessRecord(DIGEST, _hashes(doc, n), self.chunk_bytes, n))

    def publish(self, *, whole: bool = False) -> tuple[AdmissionSnapshot, AdmissionSnapshot]:
        """(the whole snapshot of this version, the message that goes out)."""
        self.version += 1
        snap = self.core.snapshot("run-1", self.version)
        return snap, self.deltas.message(snap, self.core.policy.doorkeeper_changes(),
                                         whole=whole)


_STEPS = st.lists(st.one_of(
    st.tuples(st.just("record"), st.integers(0, 40), st.integers(1, 12)),
    st.tuples(st.just("publish"), st.sampled_from(["delivered", "lost", "unsent"]),
              st.booleans()),
    st.tuples(st.just("wait"), st.floats(0.1, 6.0), st.just(0)),
), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(_STEPS)
def test_a_reader_holds_the_services_filter_or_one_it_published(
        steps: list[tuple[str, object, object]]) -> None:
    svc = _Service(capacity=64 << 20, chunk_bytes=64 << 10)
    reader = SnapshotReader()
    published: dict[int, bytes] = {}  # version -> the whole filter the service held then
    synced = False  # the reader got every message since its last whole one
    last_whole_at = None
    for kind, a, b in steps:
        if kind == "record":
            svc.record(int(a), int(b))  # type: ignore[call-overload]
        elif kind == "wait":
            svc.now += float(a)  # type: ignore[arg-type]
        else:
            snap, msg = svc.publish(whole=bool(b))
            assert msg.version == snap.version and msg.records == snap.records
            if a == "unsent":  # ZMQ refused it: the service does not count it as sent
                continue
            svc.deltas.sent(msg)
            published[snap.version] = snap.bloom
            if not msg.base:
                assert msg == snap
                last_whole_at = svc.now
            else:
                assert (msg.bits, msg.bloom) == (0, b"")
                assert last_whole_at is not None and svc.now - last_whole_at < FULL_EVERY_S
            if a == "lost":  # a slow subscriber's queue dropped it
                synced = synced and False
                continue
            got = reader.take(msg)
            synced = not msg.base or synced
            if synced:
                assert (got.bits, got.bloom) == (snap.bits, snap.bloom)
            elif got.bits:
                # Never a mix: a filter the service published whole at some version.
                assert got.bloom in published.values()
            assert got.base == 0 and got.version == snap.version


def test_a_missed_delta_holds_the_old_filter_until_the_next_whole_snapshot() -> None:
    svc = _Service(capacity=64 << 20, chunk_bytes=64 << 10)
    reader = SnapshotReader()
    svc.record(1, 8)
    first, msg = svc.publish()
    svc.deltas.sent(msg)
    assert reader.take(msg).bloom == first.bloom
    svc.record(2, 8)
    _, lost = svc.publish()
    svc.deltas.sent(lost)
    assert lost.base == first.version  # a delta, never delivered
    svc.record(3, 8)
    third, msg = svc.publish()
    svc.deltas.sent(msg)
    assert msg.base == lost.version
    got = reader.take(msg)
    assert reader.missed == 1 and got.bloom == first.bloom != third.bloom
    svc.now += FULL_EVERY_S
    fourth, msg = svc.publish()
    svc.deltas.sent(msg)
    assert msg.base == 0 and reader.take(msg).bloom == fourth.bloom


def test_a_delta_is_a_sliver_of_a_whole_snapshot_and_a_rotation_sends_it_whole() -> None:
    # 256 GiB of 64 KiB chunks: the largest filter (4 MiB).
    svc = _Service(capacity=256 << 30, chunk_bytes=64 << 10)
    svc.record(0, 16)
    whole, msg = svc.publish()
    svc.deltas.sent(msg)
    whole_bytes = len(msgspec.msgpack.encode(msg))
    assert msg.base == 0 and (4 << 20) - 8 <= len(whole.bloom) <= 4 << 20
    for doc in range(1, 11):  # ten prompts of 16 chunks
        svc.record(doc, 16)
    snap, msg = svc.publish()
    delta_bytes = len(msgspec.msgpack.encode(msg))
    # 12 bytes a changed word, 4 words (probes) a chunk at most: 160 chunks, under 8 KB.
    assert msg.base == whole.version and delta_bytes <= 12 * 4 * 160 + 200
    assert 500 * delta_bytes < whole_bytes
    assert apply_delta(whole.bloom, msg.words, msg.values) == snap.bloom


def test_a_rotation_of_the_doorkeeper_sends_a_whole_snapshot() -> None:
    """The doorkeeper's snapshot is its two generations OR-ed; at its second rotation the
    oldest generation's bits leave it, which a delta cannot name: that message is whole. 16
    new chunks a publication (at most 64 words changed: deltas otherwise), 64 MiB of 64 KiB
    chunks (8,192 a generation)."""
    svc = _Service(capacity=64 << 20, chunk_bytes=64 << 10)
    reader = SnapshotReader()
    svc.record(-1, 1)  # the filter is sized on the first record
    entries = svc.core.policy.doorkeeper_entries
    assert entries == 8_192
    kinds = []
    prev_set = 0
    for doc in range(0, 2 * entries + entries // 2, 16):
        for d in range(doc, doc + 16):
            svc.record(d, 1)
        snap, msg = svc.publish()
        svc.deltas.sent(msg)
        now_set = sum(bin(b).count("1") for b in snap.bloom)
        kinds.append(("cleared" if now_set < prev_set else "set",
                      "whole" if not msg.base else "delta"))
        prev_set = now_set
        assert reader.take(msg).bloom == snap.bloom
    assert ("cleared", "whole") in kinds and ("cleared", "delta") not in kinds
    assert kinds.count(("set", "delta")) > len(kinds) - 4


def test_bad_deltas_are_refused_whole() -> None:
    bloom = bytes(20)
    words, values = changed_words(bytes(range(20)), {0, 2})
    assert apply_delta(bloom, words, values)[16:] == bytes([16, 17, 18, 19])
    with pytest.raises(DeltaError):
        apply_delta(bloom, words + b"\0\0\0\0", values)
    with pytest.raises(DeltaError):
        apply_delta(bloom, (3).to_bytes(4, "little"), bytes(8))
    reader = SnapshotReader()
    base = AdmissionSnapshot(1, "run", 1, True, 160, bloom, 1, 0, 0, 0, 0)
    reader.take(base)
    bad = msgspec.structs.replace(base, version=2, bits=0, bloom=b"", base=1,
                                  words=(9).to_bytes(4, "little"), values=bytes(8))
    got = reader.take(bad)
    assert reader.missed == 1 and (got.bits, got.bloom) == (160, bloom)
