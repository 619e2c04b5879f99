"""Loads whose outcome the scheduler still waits for (``AwaitedLoads``): the one place hit
tokens are settled, once per load.

A load is awaited from when vLLM accepted its tokens (``update_state_after_alloc``) until the
workers' ``LoadOutcomes`` say what it really brought in. A synchronous or layer-wise load ends
within its step, on every rank, so its outcome is final when it arrives. An async load ends on
each rank in its own step: the least loaded so far is kept until vLLM reports the request in
``finished_recving`` (every rank done). An awaited load outlives its request's record: vLLM
finishes a request (a P/D prefill's one token) before it hands over the step's outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

__all__ = ["AwaitedLoads"]


class AwaitedLoads:
    """Request id -> tokens vLLM accepted from the pool, for loads not settled yet."""

    def __init__(self) -> None:
        self._accepted: dict[str, int] = {}
        # Async loads some rank already answered: the least loaded so far (tokens).
        self._partial: dict[str, int] = {}

    def expect(self, rid: str, accepted: int) -> None:
        """``rid``'s load of ``accepted`` tokens went to the workers (or will)."""
        self._accepted[rid] = accepted

    def drop(self, rid: str) -> None:
        """``rid`` never ran its load: no outcome will come."""
        self._accepted.pop(rid, None)
        self._partial.pop(rid, None)

    def settle(self, outcomes: Mapping[str, tuple[int, int]], finished_recving: Iterable[str],
               loading: Callable[[str], bool]) -> list[tuple[str, int, int]]:
        """The loads this step ended: ``(request id, accepted, loaded)`` tokens, each once.

        Args:
            outcomes: ``LoadOutcomes.outcomes`` of the step (request id -> (accepted, loaded)).
            finished_recving: async loads every rank finished (vLLM's ``finished_recving``).
            loading: whether a request's async load may still run on some rank.
        """
        final: dict[str, int] = {}
        for rid, (_accepted, loaded) in outcomes.items():
            if rid not in self._accepted:
                continue
            if loading(rid):
                prev = self._partial.get(rid)
                self._partial[rid] = loaded if prev is None else min(prev, loaded)
            else:
                final[rid] = loaded
        for rid in finished_recving:
            if rid in self._partial:
                final[rid] = self._partial.pop(rid)
        out = []
        for rid, loaded in final.items():
            accepted = self._accepted.pop(rid)
            out.append((rid, accepted, min(loaded, accepted)))
        return out
