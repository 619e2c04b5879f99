"""What an agent asks of the pool client in its process: the ``PoolOperations`` protocol.

The agent never imports the connector. A process with a pool client (a vLLM worker) hands
``start_agent`` an object with these four methods (``kvpool_connector.operations`` implements
it over a ``Backend``); a process without one (a scheduler, a store) hands nothing and the agent
answers from what it has: its own liveness, the Mooncake master's admin port, and the saves it
has seen start and not finish.

Every method runs on one of the agent's command or stats threads, never on an engine thread.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvpool_agent.protocol import (
    DrainResult,
    FlushArgs,
    FlushResult,
    HealthCheck,
    PinArgs,
    PinOutcome,
    PoolStats,
)

__all__ = ["CommandError", "PinOperations", "PoolOperations"]


class CommandError(RuntimeError):
    """A command could not run here; the message tells the operator why and what to do.

    The agent replies ``ok=False`` with ``"CommandError: <message>"`` as the error."""


class PoolOperations(Protocol):
    """The pool client of one process, as the agent's ``health``, ``flush``, ``drain`` commands
    and its pool stats see it. Implementations must be safe to call from two agent threads at
    once (commands run on a pool of two)."""

    def health(self, probe: bool = False) -> list[HealthCheck]:
        """The client's own checks (e.g. ``client``, ``master``), which must not touch pool
        keys (no write, no lease, no listing); with ``probe`` followed by a write/read/remove
        probe of one small key of its own (``probe_put``, ``probe_get``, ``probe_remove``;
        ``health --probe``, operator only), each with its ``latency_ms``. A failing check
        has ``ok=False`` and, when the store gave one, its Mooncake error ``code``. Never
        raises."""
        ...

    def flush(self, args: FlushArgs) -> FlushResult:
        """Count (``args.dry_run``) or remove the pool keys of ``args.scope``: ``engine`` (this
        process's model and shard), ``model`` (``args.model`` or this process's model, every
        shard) or ``all`` (every kvpool key, never another tenant's). Keys under a lease are
        skipped unless ``args.force``. Sizes in bytes.

        Raises:
            CommandError: the scope cannot be resolved here (no model, no key scope, another
                engine's id).
            Exception: the store failed (the reply carries its type and message).
        """
        ...

    def wait_for_saves(self, timeout_ms: int) -> DrainResult:
        """Wait up to ``timeout_ms`` ms until no save of this process is in flight; returns
        whether that happened, the time waited (ms) and the saves still in flight."""
        ...

    def stats(self) -> PoolStats:
        """Pool usage as the service reports it (bytes, keys). Never raises: an unreachable
        service gives ``healthy=False`` and the reason in ``health_detail``."""
        ...


@runtime_checkable
class PinOperations(Protocol):
    """A pool client that pins prefixes (``kvpool-console pin``; a connector worker over
    Mooncake, ``kvpool_connector.operations.BackendOperations``). The agent's ``pin``,
    ``unpin`` and ``pins`` commands need it; an agent whose client lacks it answers them
    with a ``CommandError``."""

    def pin(self, args: PinArgs) -> PinOutcome:
        """Pin ``args``'s prefix. Raises ``CommandError`` (or ``ValueError``) naming what to
        fix: no tokenizer for a text pin, no whole chunk, over the pool's pin share."""
        ...

    def unpin(self, args: PinArgs) -> PinOutcome:
        """Drop pin ``args.pin_id`` and remove its values. Raises ``CommandError``: no such
        pin."""
        ...

    def pins_held(self, args: PinArgs) -> PinOutcome:
        """Every pin held here (of ``args.model``, every model when ``""``)."""
        ...

    def pinned(self, refresh: bool = True) -> tuple[int, int]:
        """``(bytes, pins)`` the pins held here take: reported in ``PoolStats.pinned_bytes``
        and ``pins`` with every pool stats report (on the agent's pool thread, every 2 s).
        With ``refresh`` it first reads the pins' shared records from the pool; without, it
        counts what it holds. Never raises."""
        ...
