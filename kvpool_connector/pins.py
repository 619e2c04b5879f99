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
a worker of the layout saves them (``MooncakeBackend.pin_keys``). Mooncake cannot make an
existing value hard-pinned (an upsert keeps no hard pin), so a hard pin's chunks already in the
pool hold a soft pin of ``MooncakeConfig.max_kv_soft_pin_ttl`` (the master's longest, 24 h by
default): one worker of the layout upserts them again every third of it (``poll``, claimed in
the records so one worker does it), while the pin lasts. Cost: each renewal reads and upserts
the pin's values in the pool once (2x its bytes moved, every 8 h at the default TTL).

The pins of a layout live in the pool as versioned records (``kvpool_connector._pin_records``,
``record_key`` = ``keys.pins_key``): every ``pin`` and ``unpin`` writes a new version that
cannot overwrite another writer's, so concurrent pins are all kept and each can be unpinned.
Every worker of the layout reads them at start and polls for a new version every ``poll_s``
(``start``: one ``batch_is_exist`` of one key per poll on a thread of its own, off the engine's
step; 0.5 s: a master RPC per worker each 0.5 s, the records read only when they changed), agent
or not, so a restarted engine, another TP rank or another engine of the layout saves the pinned
chunks pinned within about a second. ``PinReader`` (one per layout) reads them for a process
that removes chunks from the pool (the policy service: never a pinned one). Renewal is bounded
by this worker's clock whatever the records (any pool client's writes) say: a pin at most once
per third of ``hard_pin_ttl_ms``, at most ``share`` of the pool's bytes per such third. A pin
whose chunks would take more than ``share`` of the pool (default 30%) together with the pins
already held is refused with the numbers (``PinRefused``): a pool full of pins evicts nothing
else and serves nothing new.

Unpinning removes the pinned values (Mooncake keeps a pin through an upsert,
``MooncakeBackend.unpin_keys``), never by force (a forced remove frees memory a reader may be
copying): a key under a reader's lease is tried again no sooner than the transport's transfer
timeout after the refusal (``kvpool_connector._removals``), on a timer thread once that passes
``lease_wait_s``.

Over 600 lines: this docstring (40 lines, the rules operators read) and ``Pins``, whose pin,
unpin, renewal and poll all hold its one lock over the same records and budgets.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, runtime_checkable

import msgspec
from tenacity import Retrying, retry_if_result, stop_before_delay, wait_fixed

from kvpool_agent.protocol import MAX_PIN_TOKENS, MAX_SOFT_PIN_TTL_MS
from kvpool_agent.vocabulary import ErrorCode, error_name
from kvpool_connector._pin_records import (
    MAX_RECORD_HASHES,
    PinRecord,
    RecordBackend,
    RecordsTooLarge,
    RecordStore,
    decode,
)
from kvpool_connector._removals import REMOVAL_GRACE, grace_s_of, remove_later
from kvpool_connector.backends.base import Backend, BackendError
from kvpool_connector.backends.mooncake import TRANSFER_TIMEOUT_MS
from kvpool_connector.keys import HashAlgo, chunk_hashes, pins_key

__all__ = [
    "DEFAULT_PIN_SHARE",
    "DEFAULT_SOFT_PIN_TTL_MS",
    "MAX_PINS",
    "PIN_POLL_S",
    "PIN_SECRET_ENV",
    "RENEW_FRACTION",
    "Pin",
    "PinMode",
    "PinReader",
    "PinRefused",
    "PinResult",
    "PinnableBackend",
    "Pins",
    "pin_secret",
    "pinned_chunks",
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

PIN_POLL_S = 0.5
"""How often (s) a started ``Pins`` asks the pool for a new version of its records (issue 40:
a new pin reaches every worker within about a second)."""

RENEW_FRACTION = 3
"""A hard pin's soft-pinned chunks are upserted again once ``1 / RENEW_FRACTION`` of their soft
pin TTL has passed: two more tries before it lapses if a renewing worker dies."""

_FAIL_LOG_S = 60.0
"""A poll thread failing again and again logs at most this often (s)."""


@runtime_checkable
class PinnableBackend(RecordBackend, Protocol):
    """What pins need of a backend (``MooncakeBackend``): the records' calls and these."""

    def pin_keys(self, keys: Sequence[str], hard: bool, ttl_ms: int, *,
                 upsert: bool = True) -> list[int]: ...

    def unpin_keys(self, keys: Sequence[str]) -> list[int]: ...

    def forget_pins(self, keys: Sequence[str]) -> None: ...

    def hard_pin_ttl_ms(self) -> int: ...


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
    renewed_ms: float = 0.0
    """A hard pin: when its chunks already in the pool were last soft-pinned (epoch ms)."""
    renew_ttl_ms: int = 0
    """That soft pin's TTL (ms); 0: nothing to renew."""

    def record(self) -> PinRecord:
        return PinRecord(self.pin_id, self.mode, self.ttl_ms, self.tokens, list(self.hashes),
                         self.expires_ms, self.renewed_ms, self.renew_ttl_ms)

    def renew_due(self, now_ms: float) -> bool:
        return self.renew_ttl_ms > 0 and now_ms >= (self.renewed_ms
                                                    + self.renew_ttl_ms / RENEW_FRACTION)


log = logging.getLogger(__name__)


def _live(data: bytes, chunk_size: int, now_ms: float, where: str) -> dict[str, PinRecord] | None:
    """The pins of one version of the records that hold now: hard ones, soft ones before
    their end. Any pool writer can store records: none holds more than ``pin`` allows (more
    than ``MAX_PINS`` pins, ``MAX_PIN_TOKENS`` tokens or a 24 h soft TTL is ignored with a
    logged line). ``None``: unreadable (logged)."""
    if not data:
        return {}
    try:
        records = decode(data).pins
    except msgspec.DecodeError as exc:
        log.warning("kvpool pins: records at %s unreadable (%s): kept as they were", where, exc)
        return None
    most = MAX_PIN_TOKENS // chunk_size
    bad = {r.pin_id for r in records[MAX_PINS:]} | {
        r.pin_id for r in records[:MAX_PINS] if len(r.hashes) > most
        or (r.mode == "soft" and r.expires_ms - now_ms > MAX_SOFT_PIN_TTL_MS)
        or r.renew_ttl_ms > MAX_SOFT_PIN_TTL_MS}
    if bad:
        log.warning("kvpool pins: records at %s: %d pins ignored (over %d pins, %d chunks per "
                    "pin or a %d ms TTL): %s", where, len(bad), MAX_PINS, most,
                    MAX_SOFT_PIN_TTL_MS, sorted(bad)[:8])
    return {r.pin_id: r for r in records[:MAX_PINS] if r.pin_id not in bad
            and (r.mode == "hard" or r.expires_ms > now_ms)}


class PinReader:
    """The chunk hashes some pin of one layout holds now (hard pins; soft pins before their
    end), read from the pool per ``read``: what a process that removes chunks (the policy
    service) must leave. Keep one per layout: each read probes forward from the version it
    read last, so a head hint another pool client moved, or removed versions, never read as
    "no pins". ``chunk_size`` (tokens, the layout's real one) bounds the hashes a planted pin
    may claim (``MAX_PIN_TOKENS // chunk_size``); every version holds at most
    ``MAX_RECORD_HASHES`` of them. ``secret``: the fleet's pin secret (``pin_secret``): only
    records signed with it are read."""

    def __init__(self, backend: PinnableBackend, model: str, layout_digest: str,
                 chunk_size: int, secret: bytes | None = None) -> None:
        self.key = pins_key(model, layout_digest)
        self.chunk_size = chunk_size
        self._store = RecordStore(backend, self.key, secret)
        self.seq = -1
        """The newest version seen (-1: none read yet)."""

    def read(self) -> frozenset[str]:
        """The hashes pinned now.

        Raises:
            BackendError: the store failed, or no version can be read now (the caller keeps
                the chunks it read last: an empty answer would free them).
        """
        n = self._store.latest(self.seq)
        if n.data is None:
            if n.final:
                self.seq = max(self.seq, n.top)
            raise BackendError(f"pin records at {self.key}: version {n.top} not readable")
        live = _live(n.data, self.chunk_size, time.time() * 1e3, self.key)
        if live is None:
            raise BackendError(f"pin records at {self.key}: version {n.seq} not readable")
        self.seq = n.top
        return frozenset(h for r in live.values() for h in r.hashes)


PIN_SECRET_ENV = "KVPOOL_PIN_SECRET"
"""The environment variable holding the fleet's pin secret (``pin_secret``)."""


def pin_secret() -> bytes | None:
    """The fleet's pin secret from ``KVPOOL_PIN_SECRET`` (``None`` when unset or empty): set it
    on every engine and on the policy service, agent or not."""
    return os.environ.get(PIN_SECRET_ENV, "").encode() or None


def pinned_chunks(backend: PinnableBackend, model: str, layout_digest: str,
                  chunk_size: int, secret: bytes | None = None) -> frozenset[str]:
    """``PinReader(...).read()`` once, from no version read before: a process that reads
    again and again keeps a ``PinReader`` per layout instead.

    Raises:
        BackendError: the store failed, or the newest version cannot be read now or decoded
            (the caller keeps the chunks it read last: an empty answer would free them).
    """
    return PinReader(backend, model, layout_digest, chunk_size, secret).read()


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
        refresh_s: ``refresh`` looks for new records at most this often (s) unless forced.
        secret: the fleet's pin secret (``pin_secret``): records are signed with it, and only
            records signed with it are read (``None``: unsigned, every record read).
    """

    def __init__(self, backend: PinnableBackend, keys_of: Callable[[Sequence[str]], list[str]],
                 chunk_size: int, chunk_bytes: int, pool_bytes: Callable[[], int], *,
                 hash_algo: HashAlgo = "sha256", share: float = DEFAULT_PIN_SHARE,
                 lease_wait_s: float = 15.0, record_key: str | None = None,
                 refresh_s: float = 10.0, secret: bytes | None = None) -> None:
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
        self._records = (RecordStore(backend, record_key, secret) if record_key is not None
                         else None)
        self._seq = -1  # the version of the records applied here; -1: none read yet
        self._pins: dict[str, Pin] = {}
        self._lock = threading.Lock()
        # One pin, unpin, refresh or poll at a time: each reads and may write the records.
        self._io = threading.Lock()
        self._refreshed = -float("inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals = 0
        """Renewals of hard pins this worker made (``poll``)."""
        # Pin id -> when this worker last renewed it (monotonic s), and the renewal window
        # (its start, bytes renewed in it): the limits records cannot move.
        self._renewed_here: dict[str, float] = {}
        self._window: tuple[float, int, int] = (-float("inf"), 0, 0)

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
        ``scheduler.request_extra``) under ``pin_id``; pinning an id again replaces it. The
        records are written first (a new version, kept whatever other workers write at the
        same time), then the keys pinned.

        Raises:
            ValueError: no whole chunk in ``token_ids``, a soft pin without a positive TTL.
            PinRefused: the pins would take more than ``share`` of the pool, or this layout
                holds ``MAX_PINS`` already.
            BackendError: the records could not be written (nothing pinned).
        """
        if mode == "soft" and ttl_ms <= 0:
            raise ValueError(f"a soft pin needs ttl_ms > 0, got {ttl_ms}")
        hashes = chunk_hashes(token_ids, self.chunk_size, extra, self.hash_algo)
        if not hashes:
            raise ValueError(f"{len(token_ids)} tokens hold no whole chunk of {self.chunk_size} "
                             "tokens: nothing to pin")
        keys = tuple(self.keys_of(hashes))
        soft = mode == "soft"
        now = time.time() * 1e3
        hard_ttl = 0 if soft else self.backend.hard_pin_ttl_ms()
        pin = Pin(pin_id, mode, ttl_ms if soft else 0, len(hashes) * self.chunk_size, keys,
                  tuple(hashes), now + ttl_ms if soft else 0.0, 0.0 if soft else now, hard_ttl)
        with self._io:
            return self._pin(pin, hashes)

    def _pin(self, pin: Pin, hashes: Sequence[str]) -> PinResult:
        pin_id, keys = pin.pin_id, pin.keys
        pool = self.pool_bytes()
        total = 0

        def change(seq: int, data: bytes | None) -> list[PinRecord]:
            nonlocal total
            # The share counts every pin of the layout, also those other workers made.
            self._apply(seq, data)
            total = self._admit(pin, len(hashes), pool)
            return [p.record() for p in self.list() if p.pin_id != pin_id] + [pin.record()]

        if self._records is None:
            total = self._admit(pin, len(hashes), pool)
        else:
            try:
                self._seq = self._records.update(change, since=self._seq) or self._seq
            except RecordsTooLarge as exc:
                raise PinRefused(f"pin {pin_id!r} refused: {exc}") from exc
        with self._lock:
            self._pins[pin_id] = pin
        codes = self.backend.pin_keys(keys, hard=pin.mode == "hard", ttl_ms=pin.ttl_ms)
        errors = {k: rc for k, rc in zip(keys, codes, strict=True) if rc < 0}
        return PinResult(pin, pinned_now=sum(1 for rc in codes if rc == 1),
                         pending=sum(1 for rc in codes if rc == 0),
                         pin_bytes=len(keys) * self.chunk_bytes, pinned_bytes=total,
                         pool_bytes=pool, errors=errors)

    def _admit(self, pin: Pin, chunks: int, pool: int) -> int:
        """The pinned bytes with ``pin`` (replacing a pin of its id); raises ``PinRefused``."""
        pin_id, keys = pin.pin_id, pin.keys
        with self._lock:
            if pin_id not in self._pins and len(self._pins) >= MAX_PINS:
                raise PinRefused(f"pin {pin_id!r} refused: {len(self._pins)} pins held, at most "
                                 f"{MAX_PINS} per layout; unpin one first")
            others = {k for p in self._pins.values() if p.pin_id != pin_id for k in p.keys}
            hashes = sum(len(p.hashes) for p in self._pins.values() if p.pin_id != pin_id)
        if hashes + len(pin.hashes) > MAX_RECORD_HASHES:
            raise PinRefused(f"pin {pin_id!r} refused: {len(pin.hashes)} chunks with the "
                             f"{hashes} the layout's other pins hold are over "
                             f"{MAX_RECORD_HASHES} per layout; unpin one or pin less")
        total = len(others | set(keys)) * self.chunk_bytes
        limit = int(pool * self.share)
        if total > limit:
            raise PinRefused(
                f"pin {pin_id!r} refused: {chunks} chunks ({len(keys)} keys, "
                f"{len(keys) * self.chunk_bytes:,} bytes) would bring pinned bytes to "
                f"{total:,}, over {self.share:.0%} of the pool's {pool:,} bytes "
                f"({limit:,}); unpin another prefix or pin less")
        return total

    def unpin(self, pin_id: str) -> int:
        """Drop pin ``pin_id`` (a new version of the records without it, whoever made it):
        its keys no other pin holds are removed from the pool, never by force. A key refused
        under a reader's lease is tried again ``grace_s`` after the refusal (``_removals``: the
        reader may copy it until its transfer timeout), here while that fits in
        ``lease_wait_s``, then on a timer thread (``remove_later``). Returns the keys removed
        before it returns.

        Raises:
            KeyError: no such pin in this layout.
            BackendError: the records could not be written (the pin holds).
        """
        with self._io:
            if self._records is None:
                with self._lock:
                    pin = self._pins.pop(pin_id)
            else:
                def change(seq: int, data: bytes | None) -> list[PinRecord]:
                    self._apply(seq, data)
                    with self._lock:
                        if pin_id not in self._pins:
                            raise KeyError(pin_id)
                        return [p.record() for p in self._pins.values() if p.pin_id != pin_id]

                self._seq = self._records.update(change, since=self._seq) or self._seq
                with self._lock:
                    pin = self._pins.pop(pin_id)
            with self._lock:
                kept = {k for p in self._pins.values() for k in p.keys}
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
        """Take the pins other workers of this layout made or dropped: the newest records
        when a version newer than the one applied here exists (one ``batch_is_exist``), at
        most every ``refresh_s`` unless ``force`` (which reads the newest records whatever).
        Their keys are saved pinned by this worker from now on (``pin_keys(upsert=False)``:
        the values in the pool are pinned already). Soft pins past their TTL are dropped (the
        master dropped them).

        Raises:
            BackendError: the store failed.
        """
        with self._io:
            if force or time.monotonic() - self._refreshed >= self.refresh_s:
                self._refreshed = time.monotonic()
                self._sync(force)

    def poll(self) -> int:
        """One round of the poll thread (``start``): new records taken (``refresh``), soft
        pins past their end dropped, and the hard pins whose chunks' soft pin is due renewed
        (module docstring): claimed by a new version of the records, so one worker of the
        layout renews each, then upserted soft-pinned again (``pin_keys``). Returns the pins
        renewed.

        Raises:
            BackendError: the store failed.
        """
        with self._io:
            self._sync(False)
            ttl = self.backend.hard_pin_ttl_ms()
            if self._records is None or not any(self._due(p, time.time() * 1e3, ttl)
                                                for p in self.list()):
                return 0
            # Renewal bytes per third of the TTL at most what pins may hold (``share``):
            # records any pool client can write move no more than real pins do.
            mono = time.monotonic()
            if mono - self._window[0] >= ttl / RENEW_FRACTION / 1e3:
                # (start, bytes renewed, limit): the pool's size asked once per window.
                self._window = (mono, 0, int(self.pool_bytes() * self.share))
            budget = self._window[2] - self._window[1]
            due: list[Pin] = []
            claimed = [0.0]  # when (monotonic) the renewal was claimed: this worker's clock

            def change(seq: int, data: bytes | None) -> list[PinRecord] | None:
                self._apply(seq, data)
                now = time.time() * 1e3
                left = budget
                with self._lock:
                    due.clear()
                    for p in self._pins.values():
                        cost = len(p.keys) * self.chunk_bytes
                        if self._due(p, now, ttl) and cost <= left:
                            due.append(p)
                            left -= cost
                    if not due:
                        return None  # another worker renewed them, or over the budget
                    claimed[0] = time.monotonic()
                    for p in due:
                        self._pins[p.pin_id] = replace(p, renewed_ms=now, renew_ttl_ms=ttl)
                    return [p.record() for p in self._pins.values()]

            self._seq = self._records.update(change, since=self._seq) or self._seq
            self._window = (self._window[0], self._window[1] + sum(
                len(p.keys) for p in due) * self.chunk_bytes, self._window[2])
            for p in due:
                self._renewed_here[p.pin_id] = claimed[0]
        for p in due:
            codes = self.backend.pin_keys(p.keys, hard=True, ttl_ms=0)
            if any(rc < 0 for rc in codes):
                log.warning("kvpool pins: hard pin %r: %d of %d keys not renewed: %s",
                            p.pin_id, sum(1 for rc in codes if rc < 0), len(codes),
                            sorted({error_name(rc) for rc in codes if rc < 0}))
        self.renewals += len(due)
        return len(due)

    def _due(self, p: Pin, now_ms: float, ttl_ms: int) -> bool:
        """Whether hard pin ``p`` is to be renewed now: the records say so, and this worker
        did not renew it within a third of its own ``ttl_ms`` (its clock, whatever
        ``renewed_ms`` or ``renew_ttl_ms`` the records hold)."""
        last = self._renewed_here.get(p.pin_id)
        return p.renew_due(now_ms) and (
            last is None or time.monotonic() - last >= ttl_ms / RENEW_FRACTION / 1e3)

    def start(self, poll_s: float = PIN_POLL_S) -> None:
        """Poll the records every ``poll_s`` on a daemon thread (``poll``) until ``close``;
        nothing without ``record_key``."""
        if self._records is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), daemon=True,
                                        name="kvpool-pins")
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the poll thread (waits for a round in progress at most ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _watch(self, poll_s: float) -> None:
        logged = -float("inf")
        while not self._stop.wait(poll_s):
            try:
                self.poll()
            except BackendError as exc:
                if exc.code == ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS:
                    return  # the backend closed under the thread
                if time.monotonic() - logged >= _FAIL_LOG_S:
                    logged = time.monotonic()
                    log.warning("kvpool pins: records at %s not polled: %s (tried again every "
                                "%.1f s)", self.record_key, exc, poll_s)

    def _sync(self, force: bool) -> None:
        """The newest records applied here when there are newer ones (or ``force``); soft
        pins past their end dropped in any case."""
        if self._records is not None and (force or self._seq < 0
                                          or self._records.newer(self._seq)):
            n = self._records.latest(self._seq)
            if n.data is not None:
                self._apply(n.top, n.data)
            elif n.final:  # versions that never read: the pins held here stay
                self._seq = max(self._seq, n.top)
            # else not readable yet: asked again at the next poll
        else:
            self._expire()

    def _expire(self) -> None:
        now = time.time() * 1e3
        with self._lock:
            gone = [p for p in self._pins.values() if p.mode == "soft" and p.expires_ms <= now]
            for p in gone:
                del self._pins[p.pin_id]
            kept = {k for p in self._pins.values() for k in p.keys}
        dropped = [k for p in gone for k in p.keys if k not in kept]
        if dropped:
            self.backend.forget_pins(dropped)

    def _apply(self, seq: int, data: bytes | None) -> None:
        """Make the pins here those of version ``seq`` of the records (``data``; ``None``:
        the versions up to ``seq`` never read, the pins here stay)."""
        if data is None:
            return
        now = time.time() * 1e3
        live = _live(data, self.chunk_size, now, self.record_key or "")
        if live is None:
            return
        self._seq = seq
        with self._lock:
            gone = [p for p in self._pins.values()
                    if (r := live.get(p.pin_id)) is None
                    or (r.mode, r.expires_ms, tuple(r.hashes)) != (p.mode, p.expires_ms,
                                                                   p.hashes)]
            for p in gone:
                del self._pins[p.pin_id]
            # The same pin renewed: its renewal times only (its keys stay pinned here), never
            # earlier than seen here nor in the future (records any pool client can write).
            for pid, p in self._pins.items():
                r = live[pid]
                self._pins[pid] = replace(p, renewed_ms=min(max(p.renewed_ms, r.renewed_ms),
                                                            now),
                                          renew_ttl_ms=r.renew_ttl_ms)
            new = [Pin(r.pin_id, r.mode, r.ttl_ms, r.tokens, tuple(self.keys_of(r.hashes)),
                       tuple(r.hashes), r.expires_ms, min(r.renewed_ms, now), r.renew_ttl_ms)
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
