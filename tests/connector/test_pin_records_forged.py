"""Attack (round 6): a pool client of ANOTHER model, on the same master, against one layout's
pin records (``kvpool_connector._pin_records``), with a real master and a store process:

* the ``@head`` hint upserted to a seq no version has: the pins read and written stay;
* a planted version over a reader's buffer (20 MiB): skipped unread, pins read and written;
* a planted chain of versions: one read probes ``MAX_PROBES`` batches, no more;
* a planted version of 64 pins x 4,096 hashes: read as what it is, not records (no hash of it
  pinned), even with ``chunk_size=1``;
* forged versions every poll naming a hard pin over chunks in the pool with
  ``renewed_ms=0``: the victim's worker renews it once, not at every version.

Each asserts no effect: the pins made before are kept, the work bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch
from pins_testlib import wait_held

from kvpool_connector._pin_records import (
    MAX_PROBES,
    MAX_RECORD_BYTES,
    PinRecord,
    Records,
    RecordStore,
)
from kvpool_connector.backends.base import BackendError
from kvpool_connector.backends.mooncake import MooncakeBackend, MooncakeConfig
from kvpool_connector.keys import chunk_hashes, pins_key
from kvpool_connector.pins import PIN_SECRET_ENV, PinReader, Pins, pinned_chunks
from kvpool_replay import LocalMooncakeMaster, LocalPoolStore, mooncake_extra_config

CHUNK = 16
VALUE = 256 << 10
MODEL = "victim-b"
_ALIVE: list[object] = []


@dataclass
class Pool:
    victim: MooncakeBackend
    """The victim model's worker: a 16 MB buffer, as the policy service's store client."""
    other: MooncakeBackend
    """Another model's pool client (64 MB buffer: it can put 20 MiB)."""
    buf: torch.Tensor


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    with LocalMooncakeMaster(default_kv_lease_ttl_ms=500) as m, LocalPoolStore(m, 96 << 20):
        conf = mooncake_extra_config(m.address, m.admin_url, lease_ttl_ms=500)["mooncake"]
        conf.update(transfer_timeout_ms=1000)
        victim = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            **conf, "local_buffer_size": "16MB"}}))
        other = MooncakeBackend(MooncakeConfig.load({"mooncake": {
            **conf, "local_buffer_size": "64MB"}}))
        buf = torch.randint(0, 255, (VALUE,), dtype=torch.uint8)
        victim.register_buffer(buf.data_ptr(), buf.numel())
        _ALIVE.append(buf)
        try:
            yield Pool(victim, other, buf)
        finally:
            victim.close()
            other.close()


def _keys(hashes: Sequence[str]) -> list[str]:
    return [f"kvpool@{MODEL}@{h}" for h in hashes]


def _pins(b: Any, digest: str) -> Pins:
    return Pins(b, _keys, CHUNK, VALUE, lambda: b.stats().total_bytes, lease_wait_s=2.0,
                record_key=pins_key(MODEL, digest))


class _Counting:
    """A store client counting its ``batch_is_exist`` calls."""

    def __init__(self, inner: MooncakeBackend) -> None:
        self.inner, self.exists = inner, 0

    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        self.exists += 1
        return self.inner.batch_exists(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_head_moved_past_every_version_hides_no_pin(pool: Pool) -> None:
    digest = "head"
    old = list(range(CHUNK * 2))
    pins = _pins(pool.victim, digest)
    pins.pin("old", old, "hard")
    reader = PinReader(pool.victim, MODEL, digest, CHUNK)  # the policy service's
    assert reader.read() == frozenset(chunk_hashes(old, CHUNK))
    key = pins_key(MODEL, digest)
    assert pool.other.write_record(f"{key}@head", b"999999999") == 0
    # The remover of chunks still reads the pin (never "no pins"), stateful or not.
    assert reader.read() == frozenset(chunk_hashes(old, CHUNK))
    assert pinned_chunks(pool.victim, MODEL, digest, CHUNK) == frozenset(chunk_hashes(old, CHUNK))
    # The victim's next pin is written after its last version, holding both pins.
    new = list(range(500, 500 + CHUNK))
    assert pins.pin("new", new, "hard").pin.pin_id == "new"
    both = frozenset(chunk_hashes(old, CHUNK) + chunk_hashes(new, CHUNK))
    assert reader.read() == both
    assert pool.victim.read_record(f"{key}@head") == b"2"  # the writer set it right again
    fresh = _pins(pool.victim, digest)
    fresh.refresh(force=True)
    assert sorted(p.pin_id for p in fresh.list()) == ["new", "old"]
    # Removed versions (any client may remove): a reader that read one keeps its answer.
    pool.other.write_record(f"{key}@head", b"999999999")
    wait_held(lambda: all(rc in (0, -704) for rc in pool.other.batch_remove(
        [f"{key}@v1", f"{key}@v2"])), 10, "the versions removed (after the readers' lease)")
    with pytest.raises(BackendError, match="not readable"):
        reader.read()
    fresh.refresh(force=True)
    assert sorted(p.pin_id for p in fresh.list()) == ["new", "old"]


def test_an_oversized_version_is_skipped_and_pins_still_write(pool: Pool) -> None:
    digest = "big"
    pins = _pins(pool.victim, digest)
    old = list(range(CHUNK))
    pins.pin("old", old, "hard")
    store = RecordStore(pool.other, pins_key(MODEL, digest))
    big = msgspec.json.encode(Records(2, [], 2, "x" * (20 << 20)))
    assert len(big) > 16 << 20 > MAX_RECORD_BYTES
    assert pool.other.create_record(store.version_key(2), big) == 0
    assert pool.other.record_size(store.version_key(2)) == len(big)
    reader = PinReader(pool.victim, MODEL, digest, CHUNK)
    assert reader.read() == frozenset(chunk_hashes(old, CHUNK))  # v1, under the planted v2
    start = time.monotonic()
    new = list(range(700, 700 + CHUNK))
    pins.pin("new", new, "hard")  # written as v3, over the planted v2
    assert time.monotonic() - start < 5.0  # was: 10.3 s, then BackendError for good
    assert reader.read() == frozenset(chunk_hashes(old, CHUNK) + chunk_hashes(new, CHUNK))
    assert reader.seq == 3
    pins.unpin("new")
    assert reader.read() == frozenset(chunk_hashes(old, CHUNK))


def test_a_planted_chain_of_versions_costs_a_read_max_probes_calls(pool: Pool) -> None:
    digest = "chain"
    pins = _pins(pool.victim, digest)
    old = list(range(CHUNK))
    pins.pin("old", old, "hard")
    store = RecordStore(pool.other, pins_key(MODEL, digest))
    body = msgspec.json.encode(Records(2, [], 0, "x"))
    for s in range(2, 202):  # 200 versions, no head moved
        assert pool.other.create_record(store.version_key(s), body) == 0
    counting = _Counting(pool.victim)
    reader = PinReader(counting, MODEL, digest, CHUNK)  # type: ignore[arg-type]
    reader.read()
    # The head check and MAX_PROBES probes at most (was: one per 7 versions, 29 here).
    assert counting.exists <= MAX_PROBES + 1
    assert reader.seq < 2 + MAX_PROBES * 8


def test_a_planted_version_of_too_many_hashes_pins_nothing(pool: Pool) -> None:
    digest = "wide"
    pins = _pins(pool.victim, digest)
    old = list(range(CHUNK))
    pins.pin("old", old, "hard")
    store = RecordStore(pool.other, pins_key(MODEL, digest))
    # Short hashes: under MAX_RECORD_BYTES, so the hash count is what refuses it.
    forged = [PinRecord(f"f{i}", "hard", 0, 1, [f"{i:02x}{j:06x}" for j in range(4096)], 0.0)
              for i in range(64)]
    body = msgspec.json.encode(Records(2, forged, 2, "x"))
    assert len(body) < MAX_RECORD_BYTES
    assert pool.other.create_record(store.version_key(2), body) == 0
    # chunk_size=1, as the policy service asks: 131,072 hashes a pin would pass; the version
    # (262,144 hashes) is not records, v1 is the answer.
    assert pinned_chunks(pool.victim, MODEL, digest, 1) == frozenset(chunk_hashes(old, CHUNK))
    pins.refresh(force=True)
    assert [p.pin_id for p in pins.list()] == ["old"]


def test_forged_versions_do_not_make_a_worker_renew_again_and_again(pool: Pool) -> None:
    digest = "renew"
    n = 8
    prefix = list(range(9000, 9000 + CHUNK * n))
    hashes = chunk_hashes(prefix, CHUNK)
    keys = _keys(hashes)
    assert pool.victim.batch_put_from(keys, [[pool.buf.data_ptr()]] * n, [[VALUE]] * n) == [0] * n
    pins = _pins(pool.victim, digest)
    upserted = [0]
    real = pool.victim.pin_keys

    def counting(keys: Sequence[str], hard: bool, ttl_ms: int, *,
                 upsert: bool = True) -> list[int]:
        codes = real(keys, hard, ttl_ms, upsert=upsert)
        upserted[0] += sum(1 for rc in codes if rc == 1)
        return codes

    pool.victim.pin_keys = counting  # type: ignore[method-assign]
    store = RecordStore(pool.other, pins_key(MODEL, digest))
    written: list[int] = []
    stop = threading.Event()

    def forge() -> None:
        while not stop.is_set():
            written.append(store.update(lambda seq, data: [PinRecord(
                "forged", "hard", 0, n * CHUNK, hashes, 0.0, 0.0, 60_000)]) or 0)
            stop.wait(0.5)

    pins.start(poll_s=0.1)
    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    try:
        # Twelve forged versions, each read by the worker (it polls every 0.1 s).
        wait_held(lambda: len(written) >= 12 and pins._seq >= written[11], 30, "forged versions")
    finally:
        stop.set()
        thread.join(5)
        pins.close()
        del pool.victim.pin_keys
    # Renewed once (its first sight: the records say due), then not within a third of this
    # worker's TTL whatever the versions say (was: one renewal per forged version).
    assert pins.renewals == 1
    assert upserted[0] == n


def test_a_head_on_a_planted_version_makes_no_new_writer_drop_pins(
        pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpool_connector._pin_records as records

    monkeypatch.setattr(records, "WRITE_DEADLINE_S", 1.0)
    digest = "headbig"
    key = pins_key(MODEL, digest)
    pins = _pins(pool.victim, digest)
    old = list(range(CHUNK))
    pins.pin("old", old, "hard")  # v1
    store = RecordStore(pool.other, key)
    assert pool.other.create_record(store.version_key(2), msgspec.json.encode(
        Records(2, [], 2, "x" * (8 << 20)))) == 0
    assert pool.other.write_record(f"{key}@head", b"2") == 0
    wait_held(lambda: all(rc in (0, -704)
                          for rc in pool.other.batch_remove([store.version_key(1)])),
              10, "v1 removed (after the readers' lease)")
    # A worker that never read the records: every version it finds is oversized. It must not
    # write its pin over them alone (the layout's "old" pin would be lost): it fails instead.
    fresh = _pins(pool.victim, digest)
    with pytest.raises(BackendError, match="not readable"):
        fresh.pin("new", list(range(300, 300 + CHUNK)), "hard")
    assert not pool.victim.batch_exists([store.version_key(3)])[0]
    # The worker that read v1 writes over the planted v2, holding both.
    pins.pin("new", list(range(300, 300 + CHUNK)), "hard")
    assert PinReader(pool.victim, MODEL, digest, CHUNK).read() == frozenset(
        chunk_hashes(old, CHUNK) + chunk_hashes(list(range(300, 300 + CHUNK)), CHUNK))


def test_with_a_pin_secret_planted_records_are_not_read(pool: Pool) -> None:
    digest = "signed"
    key = pins_key(MODEL, digest)
    secret = b"fleet pin secret"
    pins = Pins(pool.victim, _keys, CHUNK, VALUE, lambda: pool.victim.stats().total_bytes,
                lease_wait_s=2.0, record_key=key, secret=secret)
    old = list(range(CHUNK))
    pins.pin("old", old, "hard")  # v1, signed
    store = RecordStore(pool.other, key)
    v1 = msgspec.json.decode(pool.victim.read_record(store.version_key(1)), type=Records)
    assert len(v1.mac) == 64
    # Valid records without the secret's MAC (what another model's client can write), and the
    # signed v1 copied to v3 (a replay): neither is read.
    assert pool.other.create_record(store.version_key(2), msgspec.json.encode(
        Records(2, [], 2, "x"))) == 0
    assert pool.other.create_record(store.version_key(3), msgspec.json.encode(
        msgspec.structs.replace(v1, pins=[]))) == 0
    assert pool.other.write_record(f"{key}@head", b"3") == 0
    reader = PinReader(pool.victim, MODEL, digest, CHUNK, secret)
    assert reader.read() == frozenset(chunk_hashes(old, CHUNK))
    assert pinned_chunks(pool.victim, MODEL, digest, CHUNK, secret) == frozenset(
        chunk_hashes(old, CHUNK))
    # The control: a reader without the secret takes the newest forged version (no pins).
    assert pinned_chunks(pool.victim, MODEL, digest, CHUNK) == frozenset()
    # A worker with the secret that never read the records writes over them, keeping "old".
    fresh = Pins(pool.victim, _keys, CHUNK, VALUE, lambda: pool.victim.stats().total_bytes,
                 lease_wait_s=2.0, record_key=key, secret=secret)
    new = list(range(400, 400 + CHUNK))
    fresh.pin("new", new, "hard")
    assert reader.read() == frozenset(chunk_hashes(old, CHUNK) + chunk_hashes(new, CHUNK))
    assert reader.seq == 4
    # Another secret reads none of them (its own fleet's records only).
    with pytest.raises(BackendError, match="not readable"):
        PinReader(pool.victim, MODEL, digest, CHUNK, b"another").read()


def test_an_engine_without_an_agent_reads_only_records_signed_with_its_env_secret(
        pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_replay import EngineSpec, ModelShape, free_port
    from kvpool_replay._sim_engine import SimEngine

    monkeypatch.setenv(PIN_SECRET_ENV, "fleet pin secret")
    master = pool.victim.config.master_server_address
    admin = pool.victim.config.master_admin_url
    model, chunk = "org/pin-signed", 64
    engine = SimEngine(EngineSpec(
        engine_id="pin-signed", master_address=master, model=model,
        shape=ModelShape(layers=4, kv_heads=4, head_size=64, block_size=16), chunk_size=chunk,
        trace_path="unused", wait_saves=True, lookup_rpc_port=free_port(),
        extra_config=mooncake_extra_config(master, admin, lease_ttl_ms=500)), num_blocks=64)
    try:
        worker = engine.worker.pool_worker
        assert worker is not None and worker.pinned_keys is not None
        key = pins_key(model, worker.layout_digest)
        other = Pins(pool.victim, worker.rank_keys, chunk, worker.key_bytes,
                     lambda: pool.victim.stats().total_bytes, record_key=key,
                     secret=b"fleet pin secret")
        prefix = list(range(chunk * 2))
        keys = frozenset(worker.rank_keys(chunk_hashes(prefix, chunk)))
        other.pin("signed", prefix, "hard")
        wait_held(lambda: keys <= worker.pinned_keys(), 2.0, "the engine learns the signed pin")
        # An unsigned version of no pins, after it: the engine keeps the pin.
        store = RecordStore(pool.other, key)
        assert pool.other.create_record(store.version_key(2), msgspec.json.encode(
            Records(2, [], 2, "x"))) == 0
        side = engine.worker._worker_side
        assert side is not None and side.operations.pins is not None
        pins = side.operations.pins
        # The engine's poll (every 0.5 s) reads v2 and skips it: its pin holds.
        wait_held(lambda: pins._seq >= 2, 3.0, "the engine polled v2")
        assert keys <= worker.pinned_keys()
        assert [p.pin_id for p in pins.list()] == ["signed"]
        other.unpin("signed")
        wait_held(lambda: not worker.pinned_keys(), 2.0, "the engine learns the signed unpin")
    finally:
        engine.close()
