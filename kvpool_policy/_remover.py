"""The policy service's removals: every rank's keys of each chunk the pool-wide policy evicts,
never by force, never a pinned chunk, under the connector's removal rule
(``kvpool_connector.removal_rule``: a key refused under a reader's lease, -706, is tried again
no sooner than the transfer timeout after the refusal).

A key not in the pool yet (-704 OBJECT_NOT_FOUND) is tried again too (``ABSENT_RETRY_S``): an
engine sends a request's access record when the request is first scheduled, before its KV is
computed and saved, so the policy may evict a chunk whose save is still to come (one batch of
three prompts over a capacity of five chunks: its first chunks evicted while their saves were
in the worker's queue). Dropping the key at its first absence would leave that save in the pool
for good, uncounted by the policy.

What the new tries cost is bounded (``AbsentKeys``), as an agent key's records of chunks it
never saves, each pushed out by the next, make every evicted key absent: at most
``ABSENT_TRIES_PER_PASS`` keys are tried again a pass (every 50 ms), earliest due first, found
without scanning the waiting keys; past ``MAX_ABSENT`` waiting keys, the layout holding the most
gives up its oldest, so one layout's flood does not give up another's late saves. Before, the
table was trimmed one key at a time from the front of a dict (quadratic in the excess): 25,000
such chunks a second of two keys took the remover 1.7 s of CPU a second (0.06 s with one try),
a live service under 45,000 hashes a second of them applied 520 of the 2,640 records sent in
15 s (all of them with one try), and an honest engine's late save was left in the pool (its
waiting key given up for the flood's) (``tests/policy/test_service_absent_flood.py``).

What one pass removes is bounded too: evicted chunks are queued as (digest, hash), expanded to
their keys only when a pass takes them, at most ``REMOVE_KEYS_PER_PASS`` keys a pass, shared
round-robin between layouts; past ``MAX_QUEUED_CHUNKS`` queued, the layout queuing the most
gives up its own oldest. The record budget counts chunk hashes, not the keys each fans out to
(up to ``MAX_KEYS_PER_CHUNK``, 4,096): before, every evicted chunk was expanded at once and a
pass sent all its keys, so an agent key's records of 128-key chunks it never saves had the
service send 650,000 removes a second and fall behind every key's records
(``tests/policy/test_service_fanout_flood.py``).

A master that does not answer (an HA pool's leader killed, its standby not serving yet; a
master restarting) fails a removal with RPC_FAIL or a "not serving" code
(``MASTER_UNREACHABLE``), or the call raises: those keys are kept and tried again, never
counted as failed (dropped, their chunk stayed in the pool for good: one chunk over the
service's capacity after a measured failover), and the remover makes no store call, removal
or pin read, for ``UNREACHABLE_RETRY_S`` (each call against a dead master blocked the service's
loop 4.2-4.6 s, measured: few snapshots, engines back on the master for most of 26 s);
``held`` stops them all while an HA pool has no serving leader (``kvpool_policy._leader``).

Every store call, a removal or a pin read, runs off the service's loop (``StoreCalls``, one at a
time; ``kvpool_policy._store_calls`` has the measurements): ``step`` hands the next call over
and takes its answer at a later pass, so a master that does not answer (SIGSTOPped: 30 s a
removal, 90 s a pin read) holds up the removals and pin reads only, never the records or the
snapshots. A chunk admitted again while its keys' removal is in flight is kept from then on
(its keys are not tried again), as a removal the store had answered already."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from kvpool_agent.vocabulary import ErrorCode
from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_connector.keys import chunk_keys
from kvpool_connector.pins import pinned_chunks
from kvpool_connector.policy_wire import PolicyLayout
from kvpool_connector.removal_rule import LeasedKeys
from kvpool_policy._absent import ABSENT_RETRY_S, AbsentKeys, PolicyKey
from kvpool_policy._store_calls import StoreCalls

logger = logging.getLogger("kvpool.policy")

PIN_REFRESH_S = 1.0
"""How often the pin records of each layout are read again (s; from the start of one read to
the start of the next, the read running on the store thread)."""

MAX_LAYOUTS = 64
"""Layouts the service steers at most (one ``PolicyLayout`` and its pins' chunk hashes each);
records of further layouts are dropped and counted."""

MAX_QUEUED_CHUNKS = 1 << 16
"""Evicted chunks queued for removal at most, over all layouts, whether their layout's pins are
read or not (held back until they are): past it, the layout queuing the most gives up its own
oldest, its keys counted in ``Remover.deferred_dropped`` (the master's watermark evicts them).
About 0.1 KiB a chunk: 7 MiB."""

REMOVE_KEYS_PER_PASS = 4_096
"""Keys of queued chunks a removal pass expands and removes at most (the pass runs every 50 ms:
81,920 a second), shared round-robin between the layouts queuing; a chunk is taken whole, so
the last one taken may pass the bound by less than its own keys (``MAX_KEYS_PER_CHUNK``,
4,096: a pass takes under 8,192 keys, a layout of 4,096-key chunks one a pass). Measured on a real
``mooncake_master`` (one store process, loopback, a 2-core machine under a test run): one
``batch_remove`` of 4,096 keys held 6.5-7.5 ms (1.7-2.5 ms absent), 8,192 13-14 ms, 65,536
190-300 ms (24 ms absent), the service's loop waiting all of it. Absent keys tried again
(``ABSENT_TRIES_PER_PASS``) and leased keys whose grace ended come beside."""

MAX_ABSENT = 1 << 16
"""Absent keys waiting for a new try at most (past it, the layout holding the most gives up its
oldest: ``AbsentKeys.trim``)."""

ABSENT_TRIES_PER_PASS = 2_048
"""Absent keys tried again in one removal pass at most (the service's pass runs every 50 ms:
40,960 a second; ``MAX_ABSENT`` of them every 1.6 s); the rest wait for the next pass, earliest
due first. Keys evicted now are not counted here (their first try is what the record budget
bounds)."""

MASTER_UNREACHABLE = frozenset({
    ErrorCode.RPC_FAIL, ErrorCode.RPC_TIMEOUT, ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    ErrorCode.ETCD_OPERATION_ERROR, ErrorCode.ETCD_TRANSACTION_FAIL, ErrorCode.ETCD_CTX_CANCELLED})
"""``batch_remove`` codes that say the master did not answer or does not serve (Mooncake's
``types.h``: RPC_FAIL -900 from a client whose master died, RPC_TIMEOUT -901 after 30 s from
one whose master is stopped (SIGSTOP; the master may still carry the remove out when it
resumes: the retry then finds the key gone), both measured on mooncake-transfer-engine
0.3.13; UNAVAILABLE_IN_CURRENT_STATUS -1010 from a standby or a leader warming up; the etcd
ones from an HA client): the key is kept and tried again (module docstring)."""

UNREACHABLE_RETRY_S = (1.0, 2.0, 4.0, 8.0)
"""Waits (s) after the 1st, 2nd, 3rd and later store failures in a row before the remover
calls the store again: a call against a dead master blocks 4.2-4.6 s (Mooncake's RPC timeout,
measured), so a down master costs the loop at most one such call every 8 s."""

MAX_UNREACHABLE = 1 << 16
"""Keys kept for the master to answer again at most (past it the oldest are given up, counted
in ``deferred_dropped``: the master's watermark evicts them)."""



def _chunk(key: str) -> PolicyKey:
    """(digest, chunk hash) of a key: ``kvpool@<model>@<digest>@<shard>@<hash>[@L<layer>]``
    (``kvpool_connector.keys``)."""
    parts = key.split("@")
    return parts[2], parts[4]


class Remover:
    """Removes evicted chunks from the pool (module docstring).

    Args:
        backend: the service's own Mooncake store client (``MooncakeBackend``: ``batch_remove``
            unforced, and the pin records' ``read_record``).
        grace_s: the wait after a refusal under a lease (s): the store client's transfer
            timeout (``grace_s_of``).
        clock: monotonic seconds.
        calls: where the store calls run (``StoreCalls``; default: at once, in ``step``).

    Attributes:
        removed: keys removed; failed: keys the store failed to remove (not leased, not
            absent).
        layouts: digest -> its ``PolicyLayout``, as the engines first sent it (never
            replaced: a differing layout of a known digest is refused, ``learn``).
        deferred_dropped: keys not removed because their chunks were given up from the queue
            (``MAX_QUEUED_CHUNKS``: a layout whose pins stayed unread, or one queuing the most),
            or from the keys kept for the master (``MAX_UNREACHABLE``).
        held: make no store call (set while an HA pool has no serving leader:
            ``kvpool_policy._leader``); removals wait queued, the pins read last hold.
        unreachable_since: when (``clock``) the store last stopped answering (a failure, or no
            HA leader serving: ``kvpool_policy._leader``), or None.
    """

    def __init__(self, backend: MooncakeBackend, grace_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 calls: StoreCalls | None = None) -> None:
        self.backend = backend
        self._calls = calls if calls is not None else StoreCalls(threaded=False)
        # The removal on the store thread now: its keys, their chunks, the client it went to,
        # and the chunks admitted again since it was handed over (``keep``).
        self._flying: list[str] = []
        self._flying_chunks: set[PolicyKey] = set()
        self._flying_backend: MooncakeBackend | None = None
        self._kept_flying: set[PolicyKey] = set()
        self._leased = LeasedKeys(grace_s, clock)
        self.layouts: dict[str, PolicyLayout] = {}
        # Digest -> the chunk hashes its pins held when last read, and their keys.
        self._pins: dict[str, frozenset[str]] = {}
        self._pins_ok: set[str] = set()  # digests whose pins were read at the last try
        self._pins_read = -float("inf")
        self._clock = clock
        # Digest -> its evicted chunks' hashes waiting for a pass, oldest first (a dict: keep()
        # cancels one in O(1)); digests in the order the next pass serves them.
        self._queue: dict[str, dict[str, None]] = {}
        self._queued = 0
        self._keep: list[str] = []
        # Chunks some key of which was left waiting (a lease, a save to come) at a removal,
        # a superset: keep() expands only these (expanding every chunk saved cost 1,024 keys a
        # hash of a wide layout's records). Rebuilt from the waiting keys when it outgrows them.
        self._waiting_chunks: set[PolicyKey] = set()
        # Absent keys waiting for a new try: module docstring.
        self._absent = AbsentKeys()
        self.removed = self.failed = self.deferred_dropped = 0
        # Keys the master did not answer for, tried again first (module docstring).
        self._unreachable: dict[str, None] = {}
        self._store_failures = 0  # in a row
        self._retry_at = -float("inf")
        self.held = False
        self.unreachable_since: float | None = None

    def _store_paused(self) -> bool:
        """No store call now: ``held``, or waiting ``UNREACHABLE_RETRY_S`` after a failure."""
        return self.held or self._clock() < self._retry_at

    def resume(self) -> None:
        """Call the store again at once (its client reaches a serving master again:
        ``kvpool_policy._leader``)."""
        self.held = False
        self._retry_at = -float("inf")
        self._store_failures = 0

    def _store_failed(self, keys: Sequence[str], why: str, pause: bool = True) -> None:
        """Keep ``keys`` for a new try and, ``pause``, pause store calls
        (``UNREACHABLE_RETRY_S``; not for the answer of a client replaced since: the new one
        has not failed)."""
        for k in keys:
            self._unreachable[k] = None
            self._waiting_chunks.add(_chunk(k))  # keep() drops it if admitted again
        over = len(self._unreachable) - MAX_UNREACHABLE
        if over > 0:
            for k in list(itertools.islice(self._unreachable, over)):
                del self._unreachable[k]
            self.deferred_dropped += over
        if not pause:
            return
        now = self._clock()
        wait_s = UNREACHABLE_RETRY_S[min(self._store_failures, len(UNREACHABLE_RETRY_S) - 1)]
        self._store_failures += 1
        self._retry_at = now + wait_s
        if self.unreachable_since is None:
            self.unreachable_since = now
            logger.warning("kvpool policy: the master did not answer a removal (%s): %d keys "
                           "kept, the store tried again in %g s", why, len(self._unreachable),
                           wait_s)

    @property
    def queued(self) -> int:
        """Evicted chunks waiting for a removal pass."""
        return self._queued

    def fan_out(self, digest: str) -> int:
        """Keys one chunk of ``digest``'s layout fans out to (prefixes x layers; 0: unknown)."""
        lay = self.layouts.get(digest)
        return 0 if lay is None else len(lay.prefixes) * max(1, len(lay.layers or ()))

    def keys_of(self, chunks: Sequence[PolicyKey]) -> list[str]:
        """Every rank's (and layer's) keys of ``chunks`` whose layout is known."""
        out: list[str] = []
        for digest, h in chunks:
            lay = self.layouts.get(digest)
            if lay is not None:
                out += chunk_keys(lay.prefixes, [h], lay.layers or None)
        return out

    def learn(self, layout: PolicyLayout) -> bool:
        """Take a layout an engine sent (checked by the caller). A known digest keeps the layout
        it was first learned with: ``False`` when ``layout`` differs from it (a forged
        redeclaration would make pins be read, and keys removed, under another model), or when
        ``MAX_LAYOUTS`` are known already and this one is new. A new layout's pins are read at
        the next ``pinned``; until then none of its keys is removed."""
        known = self.layouts.get(layout.digest)
        if known is not None:
            return known == layout
        if len(self.layouts) >= MAX_LAYOUTS:
            return False
        self.layouts[layout.digest] = layout
        self._pins_read = -float("inf")
        return True

    def forget(self, digest: str) -> None:
        """Stop steering ``digest`` (an idle layout; ``PolicyCore``): chunks of it still queued
        are given up (counted)."""
        given_up = len(self._queue.pop(digest, {}))
        self._queued -= given_up
        self.deferred_dropped += given_up * self.fan_out(digest)
        self.layouts.pop(digest, None)
        self._pins.pop(digest, None)
        self._pins_ok.discard(digest)

    def pinned(self) -> dict[str, frozenset[str]]:
        """Digest -> chunk hashes some pin of the layout holds (``pins.pinned_chunks``), as
        last read: ``step`` reads them again every ``PIN_REFRESH_S`` on the store thread. A
        layout whose records could not be read at the last try keeps the pins read before (an
        empty answer would free them), and none of its keys is removed until they are read
        again (``step``)."""
        return dict(self._pins)

    def _pin_call(self) -> Callable[[], dict[str, frozenset[str] | Exception]] | None:
        """The read of every known layout's pins, for the store thread, when one is due (a
        layout learned since the last read, or ``PIN_REFRESH_S`` since its start)."""
        now = self._clock()
        if not self.layouts or now - self._pins_read < PIN_REFRESH_S:
            return None
        self._pins_read = now
        todo = [(d, lay.prefixes[0].split("@")[1]) for d, lay in self.layouts.items()]

        def read() -> dict[str, frozenset[str] | Exception]:
            got: dict[str, frozenset[str] | Exception] = {}
            for digest, model in todo:
                try:
                    # chunk_size 1: the loosest bound on what one pin may claim (the service
                    # does not know the layout's chunk size).
                    got[digest] = pinned_chunks(self.backend, model, digest, 1)
                except Exception as exc:  # any failure: remove nothing of it (step)
                    got[digest] = exc
            return got

        return read

    def _pins_read_now(self, got: dict[str, frozenset[str] | Exception]) -> None:
        for digest, hashes in got.items():
            if digest not in self.layouts:
                continue  # forgotten while it was read
            if isinstance(hashes, Exception):
                self._pins_ok.discard(digest)
                logger.warning("kvpool policy: pin records of %s not read: %s", digest, hashes)
            else:
                self._pins[digest] = hashes
                self._pins_ok.add(digest)

    def _pinned_keys(self) -> frozenset[str]:
        """Every key of a pinned chunk, under the layouts as known now."""
        return frozenset(self.keys_of([(d, h) for d, hs in self._pins.items() for h in hs]))

    def evict(self, chunks: Sequence[PolicyKey]) -> None:
        """Queue ``chunks`` for removal (``step`` expands them to keys, ``REMOVE_KEYS_PER_PASS``
        a pass); chunks of a layout not known are not queued. Past ``MAX_QUEUED_CHUNKS``, the
        layout queuing the most gives up its oldest."""
        queue = self._queue
        for digest, h in chunks:
            q = queue.get(digest)
            if q is None:
                if digest not in self.layouts:
                    continue
                q = queue[digest] = {}
            if h not in q:
                q[h] = None
                self._queued += 1
        self._trim()

    def _trim(self) -> None:
        """Give up queued chunks past ``MAX_QUEUED_CHUNKS``: the layout queuing the most gives
        up its oldest first (a flood takes its own, not another layout's below its count)."""
        while self._queued > MAX_QUEUED_CHUNKS:
            sizes = sorted(((len(q), d) for d, q in self._queue.items()), reverse=True)
            most, d = sizes[0]
            n = min(self._queued - MAX_QUEUED_CHUNKS,
                    max(1, most - (sizes[1][0] if len(sizes) > 1 else 0)))
            q = self._queue[d]
            for h in list(itertools.islice(q, n)):  # one pass from the front: linear
                del q[h]
            self._queued -= n
            self.deferred_dropped += n * self.fan_out(d)

    def keep(self, chunks: Sequence[PolicyKey]) -> None:
        """``chunks`` are resident again: a removal still queued or waiting (a lease, a save
        to come) is dropped."""
        waiting: list[PolicyKey] = []
        for chunk in chunks:
            q = self._queue.get(chunk[0])
            if q is not None and chunk[1] in q:
                del q[chunk[1]]
                self._queued -= 1
            if chunk in self._waiting_chunks:
                self._waiting_chunks.discard(chunk)
                waiting.append(chunk)
            if chunk in self._flying_chunks:  # its removal's answer is settled as kept
                self._kept_flying.add(chunk)
        self._no_more_tries(waiting)

    def _no_more_tries(self, chunks: Sequence[PolicyKey]) -> None:
        """The keys of ``chunks`` (resident again) are not tried again, whatever they wait
        for."""
        keys = self.keys_of(chunks)
        self._keep += keys
        for key in keys:
            self._absent.pop(key)
            self._unreachable.pop(key, None)

    def _take(self) -> list[str]:
        """The keys of at most ``REMOVE_KEYS_PER_PASS`` keys' worth of queued chunks, oldest
        first, of the layouts whose pins were read at the last try: shared evenly between them
        (what one leaves of its share goes to the others); then, while keys are left, a chunk
        wider than a share is taken whole, one a layout in turn (a layout so served goes last
        next pass): a pass takes less than ``REMOVE_KEYS_PER_PASS`` + one chunk's keys."""
        budget = REMOVE_KEYS_PER_PASS
        turn = [d for d, q in self._queue.items() if q and d in self._pins_ok]
        keys: list[str] = []
        while turn:  # each round takes some keys or ends: at most log-many rounds
            share, took, left = budget // len(turn), False, []
            for d in turn:
                n = share // self.fan_out(d)
                if n:
                    got = self._pop(d, n)
                    keys += got
                    budget -= len(got)
                    took = True
                if self._queue[d]:
                    left.append(d)
            turn = left
            if not took:
                break
        for d in turn:
            if budget > 0:
                got = self._pop(d, 1)
                keys += got
                budget -= len(got)
                self._queue[d] = self._queue.pop(d)  # round-robin: served, it goes last
        for d in [d for d, q in self._queue.items() if not q]:
            del self._queue[d]
        return keys

    def _pop(self, digest: str, n: int) -> list[str]:
        """The keys of ``digest``'s ``n`` oldest queued chunks (fewer if fewer are queued),
        taken off the queue."""
        q, lay = self._queue[digest], self.layouts[digest]
        hs = list(itertools.islice(q, n))
        for h in hs:
            del q[h]
        self._queued -= len(hs)
        return chunk_keys(lay.prefixes, hs, lay.layers or None)

    @property
    def waiting(self) -> int:
        """Keys waiting for a new try: a reader's lease to end, a save to come, or the master
        to answer."""
        return len(self._leased) + len(self._absent) + len(self._unreachable)

    def _due_absent(self) -> list[str]:
        """Absent keys whose wait ended, ``ABSENT_TRIES_PER_PASS`` at most (their try count
        kept for ``_settle_absent``)."""
        return self._absent.due(self._clock(), ABSENT_TRIES_PER_PASS)

    def _settle_absent(self, todo: Sequence[str], codes: Sequence[int]) -> None:
        """Keys found absent wait their next ``ABSENT_RETRY_S``, given up after the last; any
        other answer ends their wait."""
        now = self._clock()
        for key, rc in zip(todo, codes, strict=True):
            tries = self._absent.pop(key)
            if rc == ErrorCode.OBJECT_NOT_FOUND and tries < len(ABSENT_RETRY_S):
                self._absent.wait(key, now, tries)
        self._absent.trim(MAX_ABSENT)

    def _note_waiting(self, todo: Sequence[str], codes: Sequence[int]) -> None:
        """Add the chunks of keys left waiting (refused under a lease or a running put, or
        absent) to ``_waiting_chunks``; past 4 x the keys waiting (and a pass's), rebuild it
        from the keys waiting now (amortised O(1) a key)."""
        ok = (0, ErrorCode.OBJECT_NOT_FOUND)
        for key, rc in zip(todo, codes, strict=True):
            if rc not in ok or (rc == ErrorCode.OBJECT_NOT_FOUND and key in self._absent):
                self._waiting_chunks.add(_chunk(key))
        if len(self._waiting_chunks) > 4 * (self.waiting + REMOVE_KEYS_PER_PASS):
            self._waiting_chunks = {_chunk(k) for k in [*self._absent.keys(),
                                                        *self._leased.keys(),
                                                        *self._unreachable]}

    def step(self) -> int:
        """Take the answer of the store call handed over before, if it came (``StoreCalls``),
        then hand over the next: the pins' read when due (``_pin_call``: a layout learned since
        the last read has its pins read now, not at the service's next refresh, up to
        ``PIN_REFRESH_S`` later: a replay's pool of 300,000 tokens fills in half that, and the
        master's watermark evicted 474 keys before the first removal), else a removal of a
        pass's share of what is queued (``_take``) and what waited out its grace (a reader's
        lease, a save to come, the master: module docstring). Chunks of a layout whose pins
        were not read at the last try stay queued (``MAX_QUEUED_CHUNKS``). Nothing while the
        store is paused (``held``, or after a failure). Keys removed by the answers taken now
        (at once with the default ``StoreCalls``)."""
        removed = self._settle()
        for make in (self._pin_call, self._removal_call):
            if self._calls.busy or self._store_paused():
                break
            call: Callable[[], object] | None = make()
            if call is not None:
                self._calls.submit(call)
                removed += self._settle()
        return removed

    def _removal_call(self) -> Callable[[], list[int]] | None:
        """The next removal, for the store thread, or None (nothing to remove now)."""
        due = self._due_absent()
        again = list(self._unreachable)
        self._unreachable.clear()
        todo = self._leased.batch([*again, *self._take(), *due], self._keep, self._pinned_keys)
        self._keep = []
        tried = set(todo)
        for key in due:  # pinned now, or waiting out a lease: no longer absent's to try
            if key not in tried:
                self._absent.pop(key)
        if not todo:
            return None
        backend = self._flying_backend = self.backend
        self._flying, self._flying_chunks = todo, {_chunk(k) for k in todo}
        return lambda: backend.batch_remove(todo)

    def _settle(self) -> int:
        """Take the store call's answer if it came: keys removed."""
        fut = self._calls.take()
        if fut is None:
            return 0
        if not self._flying:
            self._pins_read_now(fut.result())  # the read caught its own failures
            return 0
        todo, kept = self._flying, self._kept_flying
        # A client replaced meanwhile (an HA leader change) answered, not the one in use.
        pause = self._flying_backend is self.backend
        self._flying, self._flying_chunks, self._kept_flying = [], set(), set()
        self._flying_backend = None
        removed = self._removal_answered(todo, fut, pause)
        self._no_more_tries(list(kept))
        return removed

    def _removal_answered(self, todo: list[str], fut: Future[list[int]], pause: bool) -> int:
        """Settle a removal's answer (module docstring): keys removed."""
        try:
            codes = fut.result()
        except Exception as exc:  # the store failed: kept, tried again (module docstring)
            self._store_failed(todo, str(exc), pause)
            return 0
        lost = [k for k, rc in zip(todo, codes, strict=True) if rc in MASTER_UNREACHABLE]
        if lost:
            self._store_failed(lost, ErrorCode(next(rc for rc in codes
                                                    if rc in MASTER_UNREACHABLE)).name, pause)
            answered = [(k, rc) for k, rc in zip(todo, codes, strict=True)
                        if rc not in MASTER_UNREACHABLE]
            todo, codes = [k for k, _ in answered], [rc for _, rc in answered]
        elif self.unreachable_since is not None:
            logger.info("kvpool policy: the master answers removals again (%.1f s after it "
                        "stopped)", self._clock() - self.unreachable_since)
            self.unreachable_since = None
            self._store_failures = 0
        removed, failed = self._leased.settle(todo, codes)
        self._settle_absent(todo, codes)
        self._note_waiting(todo, codes)
        self.removed += removed
        self.failed += failed
        return removed
