"""Attack: pin records another pool writer planted at a layout's ``kvpool-pins@...`` key
(``Pins.refresh``) are ignored with a logged line, never an exception into the engine (its start
reads them in ``register_kv_caches``) and never more work than ``pin`` itself allows; a planted
version that cannot be read drops no pin and frees no pinned chunk (``pinned_chunks`` raises)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import msgspec
import pytest
from mooncake.store import ReplicateConfig

from kvpool_agent.operations import CommandError
from kvpool_agent.protocol import MAX_PIN_TOKENS, PinArgs, Source
from kvpool_connector.backends.base import BackendError
from kvpool_connector.operations import BackendOperations
from kvpool_connector.pins import MAX_PINS, Pins, pinned_chunks

CHUNK = 16
KEY = "kvpool-pins@m@d"


class _Pool:
    """The record calls of ``MooncakeBackend`` over a dict (``put`` creates only, as
    Mooncake's); ``pin_keys`` sets the TTL on a real ``ReplicateConfig`` as it does (uint64
    ms: a larger int raises ``TypeError``)."""

    def __init__(self, record: bytes) -> None:
        self.values = {KEY: record} if record else {}
        self.pinned = 0

    def pin_keys(self, keys: Sequence[str], hard: bool, ttl_ms: int, *,
                 upsert: bool = True) -> list[int]:
        ReplicateConfig().soft_pin_ttl_ms = ttl_ms
        self.pinned += len(keys)
        return [0] * len(keys)

    def unpin_keys(self, keys: Sequence[str]) -> list[int]:
        return [0] * len(keys)

    def forget_pins(self, keys: Sequence[str]) -> None:
        pass

    def hard_pin_ttl_ms(self) -> int:
        return 86_400_000

    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        return [int(k in self.values) for k in keys]

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        return [0 if self.values.pop(k, None) is not None else -704 for k in keys]

    def read_record(self, key: str) -> bytes:
        return self.values.get(key, b"")

    def record_size(self, key: str) -> int:
        return len(self.values[key]) if key in self.values else -704

    def write_record(self, key: str, data: bytes) -> int:
        self.values[key] = data
        return 0

    def create_record(self, key: str, data: bytes) -> int:
        self.values.setdefault(key, data)
        return 0


def _record(pin_id: str, hashes: int, expires_ms: float, mode: str = "soft") -> dict:
    return {"pin_id": pin_id, "mode": mode, "ttl_ms": 60_000, "tokens": hashes * CHUNK,
            "hashes": [f"{i:064x}" for i in range(hashes)], "expires_ms": expires_ms}


def _pins(pool: _Pool) -> Pins:
    return Pins(pool, lambda hs: [f"k@{h}" for h in hs], CHUNK, 1024, lambda: 1 << 40,
                record_key=KEY)


def test_a_planted_soft_pin_ttl_past_uint64_is_ignored_not_raised(
        caplog: pytest.LogCaptureFixture) -> None:
    now = time.time() * 1e3
    pool = _Pool(msgspec.json.encode({"v": 1, "pins": [
        _record("evil", 1, 1e300), _record("ok", 2, now + 60_000)]}))
    pins = _pins(pool)
    with caplog.at_level(logging.WARNING):
        pins.refresh(force=True)  # the engine's start: it must not raise
    assert [p.pin_id for p in pins.list()] == ["ok"]
    assert pool.pinned == 2
    assert "evil" in caplog.text


def test_a_planted_record_holds_no_more_than_pin_allows(
        caplog: pytest.LogCaptureFixture) -> None:
    now = time.time() * 1e3
    huge = _record("huge", MAX_PIN_TOKENS // CHUNK + 1, 0.0, mode="hard")
    many = [_record(f"p{i}", 1, now + 60_000) for i in range(MAX_PINS + 1)]
    for planted in ([huge], many):
        pool = _Pool(msgspec.json.encode({"v": 1, "pins": planted}))
        pins = _pins(pool)
        with caplog.at_level(logging.WARNING):
            pins.refresh(force=True)
        assert len(pins.list()) <= MAX_PINS
        assert pool.pinned <= MAX_PINS
        assert all(p.tokens <= MAX_PIN_TOKENS for p in pins.list())


def test_a_text_pin_tokenized_past_max_pin_tokens_is_refused() -> None:
    # 262,144 characters are in MAX_PIN_TEXT_CHARS; a tokenizer may give a token per char.
    ops = BackendOperations(_Pool(b""), Source(  # type: ignore[arg-type]
        agent_id="e/dp0.tp0.pp0", engine_id="e", instance_role="mixed", model="m",
        kv_role="kv_both", process_role="worker"))
    pool = _Pool(b"")
    ops.pins = _pins(pool)
    ops.tokenize = lambda text, chat: [ord(c) for c in text]
    with pytest.raises(CommandError, match=f"at most {MAX_PIN_TOKENS}"):
        ops.pin(PinArgs(model="m", pin_id="long", text="a" * (2 * MAX_PIN_TOKENS)))
    assert pool.pinned == 0 and ops.pins.list() == []


def test_a_planted_unreadable_version_drops_no_pin() -> None:
    pool = _Pool(b"")
    pins = _pins(pool)
    pins.pin("ok", list(range(CHUNK)), "hard")
    pool.values[f"{KEY}@v2"] = b"not records"  # a newer version another pool writer put
    pins.refresh(force=True)
    assert [p.pin_id for p in pins.list()] == ["ok"]
    # A remover of chunks reads the newest version that is records (v1), never an empty set
    # that would free the pinned ones; with none left, an error.
    assert len(pinned_chunks(pool, "m", "d", CHUNK)) == 1
    del pool.values[f"{KEY}@v1"]
    with pytest.raises(BackendError, match="not readable"):
        pinned_chunks(pool, "m", "d", CHUNK)
    # The next write supersedes it with the pins held.
    pins.pin("next", list(range(100, 100 + CHUNK)), "hard")
    assert len(pinned_chunks(pool, "m", "d", CHUNK)) == 2
