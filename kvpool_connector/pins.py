"""Pinned prefixes: an operator keeps a prompt prefix (a system prompt, an agent template)
resident in a bounded pool.

A pin names a prefix by its token ids; its keys are the prefix's whole-chunk keys of one layout
(``keys.chunk_hashes`` then the layout's key function), so one worker per layout pins for every
rank. Pins use Mooncake's own mechanisms (``ReplicateConfig``):

* ``soft`` (default): ``soft_pin_action`` ENABLE with ``soft_pin_ttl_ms``; the master evicts
  soft-pinned objects only after every other one (``allow_evict_soft_pinned_objects``, default
  true) and drops the pin after the TTL (``max_kv_soft_pin_ttl`` caps it, 24 h by default);
* ``hard``: ``with_hard_pin``; never evicted.

Chunks already in the pool are upserted with the pin; chunks not in the pool yet are pinned when
this client saves them (``MooncakeBackend.pin_keys``). The pins of a layout live in the pool
too, as one hard-pinned record (``record_key``, ``keys.pins_key``): written on every ``pin`` and
``unpin``, read by every worker of the layout at start and every ``refresh_s`` (``refresh``), so
a restarted engine, another TP rank or another engine of the layout saves the pinned chunks
pinned as well. A pin whose chunks would take more than
``share`` of the pool (default 30%) together with the pins already held is refused with the
numbers (``PinRefused``): a pool full of pins evicts nothing else and serves nothing new.

Unpinning removes the pinned values (Mooncake keeps a pin through an upsert,
``MooncakeBackend.unpin_keys``), never by force (a forced remove frees memory a reader may be
copying): a key under a reader's lease is tried again no sooner than the transport's transfer
timeout after the refusal (``kvpool_connector._removals``), on a timer thread once that passes
``lease_wait_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import msgspec
from tenacity import Retrying, retry_if_result, stop_before_delay, wait_fixed

from kvpool_agent.protocol import MAX_PIN_TOKENS, MAX_SOFT_PIN_TTL_MS
from kvpool_agent.vocabulary import ErrorCode, error_name
from kvpool_connector._removals import REMOVAL_GRACE, grace_s_of, remove_later
from kvpool_connector.backends.base import Backend
from kvpool_connector.backends.mooncake import TRANSFER_TIMEOUT_MS
from kvpool_connector.keys import HashAlgo, chunk_hashes

__all__ = [
    "DEFAULT_PIN_SHARE",
    "DEFAULT_SOFT_PIN_TTL_MS",
    "MAX_PINS",
    "Pin",
    "PinMode",
    "PinRefused",
    "PinResult",
    "PinnableBackend",
    "Pins",
]

PinMode = Literal["soft", "hard"]

_Keys = list[str]
_Codes = list[int]
"""Pool keys and their per-key codes (named here: ``Pins.list`` shadows ``list`` in the
class)."""

DEFAULT_PIN_SHARE = 0.30
"""Most of the pool (fraction of its bytes) that pins may take together (issue 24)."""

MAX_PINS = 64
"""Most pins one layout holds: each is a record the worker keeps and reports, and each
``pin`` reads and upserts its keys' values (a key holder's flood of pins stops here)."""

DEFAULT_SOFT_PIN_TTL_MS = 1_800_000
"""Soft pin TTL when none is given: Mooncake master's ``default_kv_soft_pin_ttl`` (30 min)."""


@runtime_checkable
class PinnableBackend(Protocol):
    """What pins need of a backend (``MooncakeBackend``)."""

    def pin_keys(self, keys: Sequence[str], hard: bool, ttl_ms: int, *,
                 upsert: bool = True) -> list[int]: ...

    def unpin_keys(self, keys: Sequence[str]) -> list[int]: ...

    def forget_pins(self, keys: Sequence[str]) -> None: ...

    def read_record(self, key: str) -> bytes: ...

    def write_record(self, key: str, data: bytes) -> int: ...


class PinRefused(ValueError):
    """A pin would take more than its share of the pool; the message gives the numbers."""


@dataclass(frozen=True)
class Pin:
    """One pinned prefix: ``keys`` of its whole chunks, ``tokens`` pinned (whole chunks only),
    ``ttl_ms`` for a soft pin (0 for hard)."""

    pin_id: str
    mode: PinMode
    ttl_ms: int
    tokens: int
    keys: tuple[str, ...]
    hashes: tuple[str, ...] = ()
    """The chunk hashes ``keys`` are made of (what the pin records store)."""
    expires_ms: float = 0.0
    """A soft pin's end (epoch ms); 0 for a hard pin."""


class _Record(msgspec.Struct, frozen=True):
    """One pin as its layout's record stores it (``Pins`` module docstring)."""

    pin_id: str
    mode: PinMode
    ttl_ms: int
    tokens: int
    hashes: list[str]
    expires_ms: float


class _Records(msgspec.Struct, frozen=True):
    v: int
    pins: list[_Record]


_RECORDS_VERSION = 1
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PinResult:
    """What ``Pins.pin`` did. Bytes: ``pin_bytes`` this pin, ``pinned_bytes`` every pin held
    here after it, ``pool_bytes`` the pool's capacity."""

    pin: Pin
    pinned_now: int
    pending: int
    pin_bytes: int
    pinned_bytes: int
    pool_bytes: int
    errors: dict[str, int] = field(default_factory=dict)


class Pins:
    """The pins of one layout, applied by one worker.

    Args:
        backend: the worker's pool client.
        keys_of: pool keys of chunk hashes in this layout: every rank's (and layer's) keys of
            each chunk (``KVPoolWorker.rank_keys``).
        chunk_size: tokens per chunk; ``hash_algo`` the layout's chunk-hash function.
        chunk_bytes: bytes of one key's value in this layout (for the share check).
        pool_bytes: the pool's capacity in bytes (``PoolStats.total_bytes``), asked per pin.
        share: most of ``pool_bytes`` all pins together may take (0 < share <= 1).
        lease_wait_s: how long ``unpin`` itself waits for keys under a reader's lease (s); the
            ones still leased are removed later on a timer thread.
        record_key: where this layout's pin records live in the pool (``keys.pins_key``);
            ``None`` keeps the pins in this object only.
        refresh_s: ``refresh`` reads the records at most this often (s) unless forced.
    """

    def __init__(self, backend: PinnableBackend, keys_of: Callable[[Sequence[str]], list[str]],
                 chunk_size: int, chunk_bytes: int, pool_bytes: Callable[[], int], *,
                 hash_algo: HashAlgo = "sha256", share: float = DEFAULT_PIN_SHARE,
                 lease_wait_s: float = 15.0, record_key: str | None = None,
                 refresh_s: float = 10.0) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.backend, self.keys_of = backend, keys_of
        self.chunk_size, self.chunk_bytes, self.hash_algo = chunk_size, chunk_bytes, hash_algo
        self.pool_bytes, self.share, self.lease_wait_s = pool_bytes, share, lease_wait_s
        # The wait after a key was refused under a lease: the backend's transfer timeout
        # (Mooncake's 60 s unless its config says otherwise).
        self.grace_s = grace_s_of(backend.transfer_timeout_ms() if isinstance(backend, Backend)
                                  else TRANSFER_TIMEOUT_MS)
        self.record_key, self.refresh_s = record_key, refresh_s
        self._pins: dict[str, Pin] = {}
        self._lock = threading.Lock()
        # One pin, unpin or refresh at a time: each reads, changes and writes the records.
        self._io = threading.Lock()
        self._refreshed = -float("inf")

    @property
    def pinned_bytes(self) -> int:
        """Bytes of every distinct chunk pinned here."""
        with self._lock:
            return len({k for p in self._pins.values() for k in p.keys}) * self.chunk_bytes

    def pinned_keys(self) -> frozenset[str]:
        """Every key some pin of this layout holds (the connector's eviction keeps them)."""
        with self._lock:
            return frozenset(k for p in self._pins.values() for k in p.keys)

    def list(self) -> list[Pin]:
        with self._lock:
            return list(self._pins.values())

    def pin(self, pin_id: str, token_ids: Sequence[int], mode: PinMode = "soft",
            ttl_ms: int = DEFAULT_SOFT_PIN_TTL_MS, extra: bytes = b"") -> PinResult:
        """Pin the whole chunks of ``token_ids`` (``extra``: LoRA name / ``cache_salt`` bytes,
        ``scheduler.request_extra``) under ``pin_id``; pinning an id again replaces it.

        Raises:
            ValueError: no whole chunk in ``token_ids``, a soft pin without a positive TTL.
            PinRefused: the pins would take more than ``share`` of the pool, or this layout
                holds ``MAX_PINS`` already.
        """
        if mode == "soft" and ttl_ms <= 0:
            raise ValueError(f"a soft pin needs ttl_ms > 0, got {ttl_ms}")
        hashes = chunk_hashes(token_ids, self.chunk_size, extra, self.hash_algo)
        if not hashes:
            raise ValueError(f"{len(token_ids)} tokens hold no whole chunk of {self.chunk_size} "
                             "tokens: nothing to pin")
        keys = tuple(self.keys_of(hashes))
        soft = mode == "soft"
        pin = Pin(pin_id, mode, ttl_ms if soft else 0, len(hashes) * self.chunk_size, keys,
                  tuple(hashes), time.time() * 1e3 + ttl_ms if soft else 0.0)
        with self._io:
            return self._pin(pin, hashes)

    def _pin(self, pin: Pin, hashes: Sequence[str]) -> PinResult:
        pin_id, keys = pin.pin_id, pin.keys
        # The share counts every pin of the layout, also those other workers made.
        self._refresh()
        pool = self.pool_bytes()
        with self._lock:
            if pin_id not in self._pins and len(self._pins) >= MAX_PINS:
                raise PinRefused(f"pin {pin_id!r} refused: {len(self._pins)} pins held, at most "
                                 f"{MAX_PINS} per layout; unpin one first")
            others = {k for p in self._pins.values() if p.pin_id != pin_id for k in p.keys}
            total = len(others | set(keys)) * self.chunk_bytes
            limit = int(pool * self.share)
            if total > limit:
                raise PinRefused(
                    f"pin {pin_id!r} refused: {len(hashes)} chunks ({len(keys)} keys, "
                    f"{len(keys) * self.chunk_bytes:,} bytes) would bring pinned bytes to "
                    f"{total:,}, over {self.share:.0%} of the pool's {pool:,} bytes "
                    f"({limit:,}); unpin another prefix or pin less")
            self._pins[pin_id] = pin
        codes = self.backend.pin_keys(keys, hard=pin.mode == "hard", ttl_ms=pin.ttl_ms)
        errors = {k: rc for k, rc in zip(keys, codes, strict=True) if rc < 0}
        rc = self._write()
        if rc < 0 and self.record_key is not None:
            errors[self.record_key] = rc
        return PinResult(pin, pinned_now=sum(1 for rc in codes if rc == 1),
                         pending=sum(1 for rc in codes if rc == 0),
                         pin_bytes=len(keys) * self.chunk_bytes, pinned_bytes=total,
                         pool_bytes=pool, errors=errors)

    def unpin(self, pin_id: str) -> int:
        """Drop pin ``pin_id``: its keys no other pin holds are removed from the pool, never by
        force. A key refused under a reader's lease is tried again ``grace_s`` after the
        refusal (``_removals``: the reader may copy it until its transfer timeout), here while
        that fits in ``lease_wait_s``, then on a timer thread (``remove_later``). Returns the
        keys removed before it returns.

        Raises:
            KeyError: no such pin in this layout.
        """
        with self._io:
            self._refresh()
            with self._lock:
                pin = self._pins.pop(pin_id)
                kept = {k for p in self._pins.values() for k in p.keys}
            rc = self._write()
        if rc < 0:
            log.warning("kvpool pins: unpin %r: records not stored at %s: %s (%d); other "
                        "workers keep the pin until their next restart", pin_id,
                        self.record_key, error_name(rc), rc)
        todo = [k for k in pin.keys if k not in kept]
        removed = 0

        def attempt() -> list[str]:
            nonlocal removed
            codes = self._remove_unheld(todo)
            removed += sum(1 for rc in codes if rc == 0)
            todo[:] = [k for k, rc in zip(todo, codes, strict=True)
                       if rc == ErrorCode.OBJECT_HAS_LEASE]
            return todo

        # Leased keys come back: tried again a grace after each refusal, within the wait.
        Retrying(retry=retry_if_result(bool), wait=wait_fixed(self.grace_s),
                 stop=stop_before_delay(self.lease_wait_s),
                 retry_error_callback=lambda state: None)(attempt)
        if todo:
            log.info("kvpool pins: unpin %r: %d keys leased by readers, removed no sooner than "
                     "%.0f s after (%s)", pin_id, len(todo), self.grace_s, REMOVAL_GRACE)
            remove_later(self._remove_unheld, todo, self.grace_s, f"unpin {pin_id!r}")
        return removed

    def _remove_unheld(self, keys: _Keys) -> _Codes:
        """``unpin_keys`` of the ``keys`` no pin holds now (a pin made since may hold them
        again); per key its code, 0 for a held key (left, not to be tried again)."""
        with self._lock:
            held = {k for p in self._pins.values() for k in p.keys}
        free = [k for k in keys if k not in held]
        codes = dict(zip(free, self.backend.unpin_keys(free), strict=True)) if free else {}
        return [codes.get(k, 0) for k in keys]

    def refresh(self, *, force: bool = False) -> None:
        """Take the pins other workers of this layout made or dropped from the records
        (``record_key``), at most every ``refresh_s`` unless ``force``: their keys are saved
        pinned by this worker from now on (``pin_keys(upsert=False)``: the values in the pool
        are pinned already). Soft pins past their TTL are dropped (the master dropped them).

        Raises:
            BackendError: the store failed.
        """
        with self._io:
            if force or time.monotonic() - self._refreshed >= self.refresh_s:
                self._refresh()

    def _refresh(self) -> None:
        if self.record_key is None:
            return
        self._refreshed = time.monotonic()
        data = self.backend.read_record(self.record_key)
        try:
            records = msgspec.json.decode(data, type=_Records).pins if data else []
        except msgspec.DecodeError as exc:
            log.warning("kvpool pins: records at %s unreadable (%s): kept as they were",
                        self.record_key, exc)
            return
        now = time.time() * 1e3
        # Any pool writer can store the records: none holds more than ``pin`` allows.
        most = MAX_PIN_TOKENS // self.chunk_size
        bad = {r.pin_id for r in records[MAX_PINS:]} | {
            r.pin_id for r in records[:MAX_PINS] if len(r.hashes) > most
            or (r.mode == "soft" and r.expires_ms - now > MAX_SOFT_PIN_TTL_MS)}
        if bad:
            log.warning("kvpool pins: records at %s: %d pins ignored (over %d pins, %d chunks "
                        "per pin or a %d ms TTL): %s", self.record_key, len(bad), MAX_PINS,
                        most, MAX_SOFT_PIN_TTL_MS, sorted(bad)[:8])
        live = {r.pin_id: r for r in records[:MAX_PINS] if r.pin_id not in bad
                and (r.mode == "hard" or r.expires_ms > now)}
        with self._lock:
            gone = [p for p in self._pins.values()
                    if (r := live.get(p.pin_id)) is None
                    or (r.mode, r.expires_ms, tuple(r.hashes)) != (p.mode, p.expires_ms,
                                                                   p.hashes)]
            for p in gone:
                del self._pins[p.pin_id]
            new = [Pin(r.pin_id, r.mode, r.ttl_ms, r.tokens, tuple(self.keys_of(r.hashes)),
                       tuple(r.hashes), r.expires_ms)
                   for r in live.values() if r.pin_id not in self._pins]
            for p in new:
                self._pins[p.pin_id] = p
            kept = {k for p in self._pins.values() for k in p.keys}
        dropped = [k for p in gone for k in p.keys if k not in kept]
        if dropped:
            self.backend.forget_pins(dropped)
        for p in new:
            ttl = max(1, int(p.expires_ms - now)) if p.mode == "soft" else 0
            self.backend.pin_keys(p.keys, hard=p.mode == "hard", ttl_ms=ttl, upsert=False)

    def _write(self) -> int:
        """Store every pin held here as this layout's records; 0 or a negative code."""
        if self.record_key is None:
            return 0
        records = _Records(v=_RECORDS_VERSION, pins=[
            _Record(p.pin_id, p.mode, p.ttl_ms, p.tokens, list(p.hashes), p.expires_ms)
            for p in self.list()])
        return self.backend.write_record(self.record_key, msgspec.json.encode(records))
