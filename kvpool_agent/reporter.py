"""The engine-side half of the agent: a bounded, never-blocking event buffer.

The connector calls these methods on its hot paths (scheduler lookup, worker load/save). Each
call only appends one typed event (a msgspec ``Struct`` below) to a bounded deque; the agent
thread (``kvpool_agent.agent``) drains it, aggregates and publishes. When the buffer is full the
event is dropped and counted: the engine never waits for the agent. A process without an agent
gets a ``NullReporter``, whose methods do nothing.

Events are built positionally in the order of their fields (the method parameters carry the
same names): a keyword call costs ~50 ns more per event on the engine thread, a positional
Struct costs no more than the tuple it replaces. ``gc=False``: events hold only strings and
numbers, so the cyclic GC never needs to track them.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from typing import Literal

import msgspec

from kvpool_agent.protocol import FlushRecord

__all__ = [
    "EVENT_METHODS",
    "AdapterServed",
    "Event",
    "FlushAudited",
    "LayoutKnown",
    "Loaded",
    "Lookup",
    "NullReporter",
    "PolicyReported",
    "ReportedError",
    "Reporter",
    "SaveCopied",
    "SaveSkipped",
    "Saved",
    "StartFailed",
    "TransferFinished",
    "TransferKind",
    "TransferProgress",
    "TransferStarted",
]

TransferKind = Literal["load", "save"]
"""Which way a transfer moves KV: pool -> vLLM blocks (``load``) or back (``save``)."""


class Lookup(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One scheduler lookup (see ``Reporter.lookup``); token counts in tokens, times in ms."""

    ts_ms: float
    req_id: str
    prompt_tokens: int
    local_tokens: int
    pool_tokens: int
    latency_ms: float
    error: str | None
    skipped: str | None = None
    chunk_size: int = 0
    chunks: list[str] | None = None
    """The prompt's chained chunk hashes (hex, the scheduler's own list: read, never changed),
    turned into ``protocol.Access`` ids on the agent thread."""


class Loaded(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Tokens of ``req_id`` actually loaded from the pool, and those vLLM accepted but the
    load failed to bring (recomputed), see ``Reporter.loaded``."""

    ts_ms: float
    req_id: str
    tokens: int
    failed_tokens: int = 0


class TransferStarted(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A load or save began (see ``Reporter.transfer_started``); ``nbytes`` in bytes,
    ``lease_expires_ms`` wall-clock ms since the epoch."""

    ts_ms: float
    req_id: str
    kind: TransferKind
    blocks: int
    nbytes: int
    layers_total: int
    lease_expires_ms: float | None


class TransferProgress(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Layer-wise progress of a transfer (see ``Reporter.transfer_progress``)."""

    ts_ms: float
    req_id: str
    kind: TransferKind
    layers_done: int


class TransferFinished(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A transfer ended (see ``Reporter.transfer_finished``); ``nbytes`` moved, in bytes;
    ``bytes_by_group`` those bytes by KV-cache group (hybrid models; ``None`` otherwise)."""

    ts_ms: float
    req_id: str
    kind: TransferKind
    ok: bool
    nbytes: int
    error_name: str | None
    failed_blocks: int
    after_hit: bool
    timed_out: bool
    bytes_by_group: dict[int, int] | None = None


class SaveSkipped(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Saves of ``blocks`` blocks were skipped (see ``Reporter.save_skipped``)."""

    ts_ms: float
    req_id: str
    blocks: int
    reason: str


class SaveCopied(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A save's values are in the staging buffer: its engine blocks are free before its put
    ended (see ``Reporter.save_copied``)."""

    ts_ms: float
    req_id: str


class Saved(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Chunks a worker's save left stored in the pool (see ``Reporter.saved``)."""

    ts_ms: float
    chunks: list[str]
    """Their chained chunk hashes (hex), the caller's list: read, never changed."""


class ReportedError(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Any other error worth an operator's eye (see ``Reporter.error``)."""

    ts_ms: float
    where: str
    name: str
    message: str
    code: int | None
    req_id: str | None


class LayoutKnown(msgspec.Struct, array_like=True, frozen=True):
    """The worker's layout digest and what it covers (see ``Reporter.layout``)."""

    ts_ms: float
    digest: str
    facts: dict[str, str | int]


class StartFailed(msgspec.Struct, array_like=True, frozen=True):
    """The connector failed to start (see ``Reporter.start_failed``)."""

    ts_ms: float
    name: str
    message: str
    hint: str


class AdapterServed(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A request under LoRA adapter ``name`` was keyed with its content ``identity`` (see
    ``Reporter.adapter_served``)."""

    ts_ms: float
    name: str
    identity: str


class PolicyReported(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Who steers the scheduler's saves (see ``Reporter.policy``); spans in ms."""

    ts_ms: float
    in_charge: str
    service: str
    silent_ms: float
    stale_ms: float
    records_connected: bool
    records_sent: int
    records_dropped: int
    service_removed: int = 0


class FlushAudited(msgspec.Struct, array_like=True, frozen=True):
    ts_ms: float
    record: FlushRecord


Event = (
    Lookup
    | Loaded
    | TransferStarted
    | TransferProgress
    | TransferFinished
    | SaveSkipped
    | SaveCopied
    | Saved
    | ReportedError
    | LayoutKnown
    | StartFailed
    | FlushAudited
    | AdapterServed
    | PolicyReported
)
"""What ``Reporter.drain`` returns; ``ts_ms`` of every event is wall-clock ms since the epoch."""


class Reporter:
    """Bounded event buffer between the connector and its agent thread.

    Args:
        capacity: events kept before new ones are dropped (and counted in ``dropped``).
    """

    def __init__(self, capacity: int = 65_536) -> None:
        self._events: deque[Event] = deque()
        self._capacity = capacity
        self.dropped = 0

    def put(self, event: Event) -> None:
        """Queue ``event`` (every event method below builds one and calls this; a reporter
        that watches events, such as the connector's stats tap, overrides it and forwards)."""
        # deque.append is atomic under the GIL; the length check may race by a few events,
        # which only loosens the bound slightly and never blocks.
        if len(self._events) >= self._capacity:
            self.dropped += 1
            return
        self._events.append(event)

    @property
    def depth(self) -> int:
        """Events queued and not yet drained."""
        return len(self._events)

    def drain(self, limit: int = 100_000) -> list[Event]:
        """Take up to ``limit`` queued events, oldest first (agent thread only)."""
        out: list[Event] = []
        pop = self._events.popleft
        try:
            for _ in range(limit):
                out.append(pop())
        except IndexError:
            pass
        return out

    def lookup(
        self,
        req_id: str,
        prompt_tokens: int,
        local_tokens: int,
        pool_tokens: int,
        latency_ms: float,
        error: str | None = None,
        skipped: str | None = None,
        chunk_size: int = 0,
        chunks: list[str] | None = None,
    ) -> None:
        """One scheduler lookup: prompt length, tokens vLLM had locally, tokens the pool holds
        beyond those (``pool_tokens``), lookup latency. ``error`` set when the store failed;
        ``skipped`` (the reason, e.g. ``MULTIMODAL``, ``BREAKER_OPEN``) when no lookup was
        made. ``chunks``: the hashes looked up (``chunk_size`` tokens each), kept by reference
        (O(1) here) for the hub's reuse window; the caller never changes the list after."""
        self.put(Lookup(time.time() * 1e3, req_id, prompt_tokens, local_tokens, pool_tokens,
                         latency_ms, error, skipped, chunk_size, chunks))

    def loaded(self, req_id: str, tokens: int, failed_tokens: int = 0) -> None:
        """A load of ``req_id`` ended: ``tokens`` really loaded, ``failed_tokens`` accepted by
        vLLM but not brought in (recomputed). Reported once per load, by the scheduler."""
        self.put(Loaded(time.time() * 1e3, req_id, tokens, failed_tokens))

    def transfer_started(
        self,
        req_id: str,
        kind: TransferKind,
        blocks: int,
        nbytes: int,
        layers_total: int = 0,
        lease_expires_ms: float | None = None,
    ) -> None:
        """A load or save of ``blocks`` blocks (``nbytes`` bytes) began."""
        self.put(TransferStarted(time.time() * 1e3, req_id, kind, blocks, nbytes, layers_total,
                                  lease_expires_ms))

    def transfer_progress(self, req_id: str, kind: TransferKind, layers_done: int) -> None:
        """Layer-wise progress: ``layers_done`` layers of ``req_id`` are finished."""
        self.put(TransferProgress(time.time() * 1e3, req_id, kind, layers_done))

    def transfer_finished(
        self,
        req_id: str,
        kind: TransferKind,
        ok: bool,
        nbytes: int = 0,
        error_name: str | None = None,
        failed_blocks: int = 0,
        after_hit: bool = False,
        timed_out: bool = False,
        bytes_by_group: dict[int, int] | None = None,
    ) -> None:
        """A transfer ended. ``nbytes`` moved; on failure the backend ``error_name`` (e.g.
        ``LEASE_EXPIRED``), how many blocks failed, whether the lookup had reported them
        present (``after_hit``) and whether it was a layer-wise wait timeout;
        ``bytes_by_group``: ``nbytes`` by KV-cache group (hybrid models)."""
        self.put(TransferFinished(time.time() * 1e3, req_id, kind, ok, nbytes, error_name,
                                   failed_blocks, after_hit, timed_out, bytes_by_group))

    def save_skipped(self, req_id: str, blocks: int, reason: str) -> None:
        """Saves of ``blocks`` blocks were skipped (``reason`` e.g. ``NO_AVAILABLE_HANDLE``)."""
        self.put(SaveSkipped(time.time() * 1e3, req_id, blocks, reason))

    def save_copied(self, req_id: str) -> None:
        """``req_id``'s running save copied its values into the staging buffer and released
        its engine blocks; its put goes on (``transfer_finished`` ends it)."""
        self.put(SaveCopied(time.time() * 1e3, req_id))

    def saved(self, chunk_hashes: list[str]) -> None:
        """A save ended with these chunks (hex chunk hashes) stored in the pool under this
        worker's layout digest, written now or already there. Kept by reference (O(1) here);
        the agent sends their ids to the hub's saved-chunk memory (``Report.saves``)."""
        self.put(Saved(time.time() * 1e3, chunk_hashes))

    def error(
        self,
        where: str,
        name: str,
        message: str,
        code: int | None = None,
        req_id: str | None = None,
    ) -> None:
        """Any other error worth an operator's eye."""
        self.put(ReportedError(time.time() * 1e3, where, name, message, code, req_id))

    def layout(self, digest: str, facts: dict[str, str | int]) -> None:
        """The layout digest in this worker's keys and the facts it hashes (once, when vLLM
        registers the KV caches); the agent reports them in ``Source.layout_digest`` and
        ``Source.layout``."""
        self.put(LayoutKnown(time.time() * 1e3, digest, facts))

    def start_failed(self, name: str, message: str, hint: str) -> None:
        """The connector failed to start and its process is about to exit: ``name`` of the
        error (``PortInUse``, ``BackendUnavailable``...), its ``message`` and the ``hint`` that
        fixes it. The agent reports it in ``EngineState.start_failure``."""
        self.put(StartFailed(time.time() * 1e3, name, message, hint))

    def flush_audited(self, record: FlushRecord) -> None:
        """The process ran a flush on its own (``FlushRecord``); the agent reports it in
        ``EngineState.flushes`` and the hub writes it to its audit trail."""
        self.put(FlushAudited(time.time() * 1e3, record))

    def adapter_served(self, name: str, identity: str) -> None:
        """A request under LoRA adapter ``name`` was keyed with ``identity``
        (``kvpool_connector.fingerprint.adapter_identity``); the agent reports the latest per
        name in ``LookupStats.adapters`` (issue 39 item 5)."""
        self.put(AdapterServed(time.time() * 1e3, name, identity))


    def policy(self, in_charge: str, service: str, silent_ms: float, stale_ms: float,
               records_connected: bool, records_sent: int, records_dropped: int,
               service_removed: int = 0) -> None:
        """An ``admission: service`` scheduler's ``PolicyClient`` (every second and on a
        change): ``in_charge`` (``"service"`` or ``"master"``), the service's address,
        ``silent_ms`` since its last snapshot (since the client started without one), the
        client's ``stale_ms``, whether its records socket is connected, its records sent
        and dropped since start and the keys the service's last snapshot says it removed.
        The agent reports the latest in ``EngineState.policy``."""
        self.put(PolicyReported(time.time() * 1e3, in_charge, service, silent_ms, stale_ms,
                                records_connected, records_sent, records_dropped,
                                service_removed))

EVENT_METHODS: tuple[str, ...] = tuple(
    name for name, member in vars(Reporter).items()
    if inspect.isfunction(member) and not name.startswith("_") and name not in ("put", "drain"))
"""``Reporter``'s event methods (``lookup``, ``transfer_finished``...): the connector -> agent
interface, declared once, in ``Reporter``."""


def _does_nothing(*_args: object, **_kwargs: object) -> None:
    """Does nothing."""


class NullReporter(Reporter):
    """A ``Reporter`` for a process without an agent: every event method returns at once, no
    event is built, ``depth`` and ``dropped`` stay 0 and ``drain`` returns ``[]``.

    Its event methods are ``Reporter``'s replaced by one that does nothing (below), so the
    interface is declared once, in ``Reporter``.
    """

    def __init__(self) -> None:
        super().__init__(capacity=0)

    def put(self, event: Event) -> None:
        """Does nothing (an event built elsewhere and forwarded here is dropped uncounted)."""


# The engine's hot paths pay no event construction without an agent.
for _name in EVENT_METHODS:
    setattr(NullReporter, _name, _does_nothing)
