"""The engine-side half of the agent: a bounded, never-blocking event buffer.

The connector calls these methods on its hot paths (scheduler lookup, worker load/save). Each
call only appends one tuple to a bounded deque; the agent thread (``kvpool_agent.agent``) drains
it, aggregates and publishes. When the buffer is full the event is dropped and counted: the
engine never waits for the agent.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Literal

__all__ = ["Event", "Reporter"]

Event = tuple[Any, ...]
"""``(kind, wall_ms, *fields)``; kinds and fields are the method names and arguments below."""


class Reporter:
    """Bounded event buffer between the connector and its agent thread.

    Args:
        capacity: events kept before new ones are dropped (and counted in ``dropped``).
    """

    def __init__(self, capacity: int = 65_536) -> None:
        self._events: deque[Event] = deque()
        self._capacity = capacity
        self.dropped = 0

    def _put(self, event: Event) -> None:
        # deque.append is atomic under the GIL; the length check may race by a few events,
        # which only loosens the bound slightly and never blocks.
        if len(self._events) >= self._capacity:
            self.dropped += 1
            return
        self._events.append(event)

    @property
    def depth(self) -> int:
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
    ) -> None:
        """One scheduler lookup: prompt length, tokens vLLM had locally, tokens the pool holds
        beyond those (``pool_tokens``), lookup latency. ``error`` set when the store failed."""
        self._put(("lookup", time.time() * 1e3, req_id, prompt_tokens, local_tokens,
                   pool_tokens, latency_ms, error))

    def loaded(self, req_id: str, tokens: int) -> None:
        """Tokens of ``req_id`` actually loaded from the pool (after allocation)."""
        self._put(("loaded", time.time() * 1e3, req_id, tokens))

    def transfer_started(
        self,
        req_id: str,
        kind: Literal["load", "save"],
        blocks: int,
        nbytes: int,
        layers_total: int = 0,
        lease_expires_ms: float | None = None,
    ) -> None:
        """A load or save of ``blocks`` blocks (``nbytes`` bytes) began."""
        self._put(("started", time.time() * 1e3, req_id, kind, blocks, nbytes, layers_total,
                   lease_expires_ms))

    def transfer_progress(
        self, req_id: str, kind: Literal["load", "save"], layers_done: int
    ) -> None:
        """Layer-wise progress: ``layers_done`` layers of ``req_id`` are finished."""
        self._put(("progress", time.time() * 1e3, req_id, kind, layers_done))

    def transfer_finished(
        self,
        req_id: str,
        kind: Literal["load", "save"],
        ok: bool,
        nbytes: int = 0,
        error_name: str | None = None,
        failed_blocks: int = 0,
        after_hit: bool = False,
        timed_out: bool = False,
    ) -> None:
        """A transfer ended. ``nbytes`` moved; on failure the backend ``error_name`` (e.g.
        ``LEASE_EXPIRED``), how many blocks failed, whether the lookup had reported them
        present (``after_hit``) and whether it was a layer-wise wait timeout."""
        self._put(("finished", time.time() * 1e3, req_id, kind, ok, nbytes, error_name,
                   failed_blocks, after_hit, timed_out))

    def save_skipped(self, req_id: str, blocks: int, reason: str) -> None:
        """Saves of ``blocks`` blocks were skipped (``reason`` e.g. ``NO_AVAILABLE_HANDLE``)."""
        self._put(("skipped", time.time() * 1e3, req_id, blocks, reason))

    def error(
        self,
        where: str,
        name: str,
        message: str,
        code: int | None = None,
        req_id: str | None = None,
    ) -> None:
        """Any other error worth an operator's eye."""
        self._put(("error", time.time() * 1e3, where, name, message, code, req_id))
