"""The one small interface every pool backend implements.

A *key* is a ``PoolKey`` string (see ``kvpool_connector.keys``). A value is stored from, and
loaded into, one or more address ranges of registered host (or device) memory: a paged KV block
of all layers is one key whose value is the concatenation of its per-layer K/V ranges, exactly
as Mooncake's ``batch_put_from_multi_buffers`` and MemCache's ``batch_put_from_layers`` take it.

Return codes follow Mooncake Store's ``ErrorCode`` (``kvpool_agent.vocabulary``): per key,
``0`` (put) or the byte count (get) on success, a negative code on failure. Backends whose
native codes differ translate them to these names so the connector, the agent and the console
speak one language.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from kvpool_agent.protocol import HealthCheck, PoolStats
from kvpool_connector.staging import NO_LIMITS, TransportLimits

__all__ = ["Backend", "BackendError", "BackendUnavailable", "RemoveResult"]


class BackendError(RuntimeError):
    """A backend call failed as a whole (not per key). ``code`` is the Mooncake ``ErrorCode``
    when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class BackendUnavailable(BackendError):
    """The backend cannot run on this machine or could not connect (e.g. MemCache without the
    Ascend driver, Mooncake master unreachable at setup). The message says what is missing."""


class RemoveResult(msgspec.Struct, kw_only=True):
    """Outcome of ``remove_by_scope``: ``keys``/``bytes`` matched, ``removed`` removed (0 on a
    dry run), ``skipped_leased`` matched but held by a lease (not removed unless forced)."""

    keys: int
    bytes: int
    removed: int = 0
    skipped_leased: int = 0


class Backend(abc.ABC):
    """A KV pool client bound to one process.

    Implementations must be thread-safe for concurrent ``batch_*`` calls from the worker's
    transfer threads and the agent's command thread.
    """

    name: ClassVar[str]
    """Registry name: ``mooncake``, ``yuanrong`` or ``memcache``."""

    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[int]:
        """Per key: 1 present, 0 absent, a negative error code when the store failed to answer.
        A lookup never turns an error into 0."""

    def exists(self, key: str) -> bool:
        """True if ``key`` is present. Raises ``BackendError`` if the store failed to answer."""
        (res,) = self.batch_exists([key])
        if res < 0:
            raise BackendError(f"exists({key!r}) failed", res)
        return res == 1

    @abc.abstractmethod
    def register_buffer(self, addr: int, size: int) -> None:
        """Register ``size`` bytes at ``addr`` for zero-copy transfers.
        Raises ``BackendError`` if the backend refuses."""

    def lease_ttl_ms(self) -> int:
        """How long (ms) a read's lease keeps a key from being removed by another client
        (Mooncake ``default_kv_lease_ttl``); 0 when the backend grants none or does not say."""
        return 0

    def transfer_timeout_ms(self) -> int:
        """How long (ms) a read's transfer may run after its lease lapsed, before the client
        fails it (Mooncake: ``MooncakeConfig.transfer_timeout_ms``, 60 s): a key seen under a
        lease is removed no sooner than this after (``kvpool_connector._removals``); 0 when
        the backend grants no leases."""
        return 0

    def transport_limits(self) -> TransportLimits:
        """What one ``batch_put_from``/``batch_get_into`` call may carry
        (``kvpool_connector.staging``); ``NO_LIMITS`` unless the transport has a slice queue."""
        return NO_LIMITS

    @abc.abstractmethod
    def batch_put_from(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Store each key from its address ranges (``addrs[i][j]`` holds ``sizes[i][j]`` bytes).
        Per key: 0 stored, or a negative ``ErrorCode`` (NO_AVAILABLE_HANDLE when the pool is
        full)."""

    @abc.abstractmethod
    def batch_get_into(
        self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Load each key into its address ranges. Per key: bytes read (equal to the sum of its
        sizes on success), or a negative ``ErrorCode`` (OBJECT_NOT_FOUND, LEASE_EXPIRED...).
        A key whose result is not the full size must be treated as not loaded."""

    def batch_remove(self, keys: Sequence[str]) -> list[int]:
        """Remove each key, never by force. Per key: 0 removed, or a negative ``ErrorCode``
        (OBJECT_NOT_FOUND, OBJECT_HAS_LEASE while a reader holds a lease). Raises
        ``BackendError`` if the backend has no such call (only Mooncake's ``batch_remove``
        is used: ``eviction: connector`` is checked against the backend in
        ``KVPoolConfig``) or failed as a whole."""
        raise BackendError(f"{type(self).__name__} cannot remove single keys")

    @abc.abstractmethod
    def remove_by_scope(self, pattern: str, *, dry_run: bool, force: bool = False) -> RemoveResult:
        """Remove every key matching the regular expression ``pattern`` (anchored by the
        caller). With ``dry_run`` only count keys and bytes. Keys under a lease are skipped
        unless ``force``."""

    @abc.abstractmethod
    def health(self) -> list[HealthCheck]:
        """Client and service health checks, each with its latency. Never raises."""

    @abc.abstractmethod
    def stats(self) -> PoolStats:
        """Pool usage as the service reports it. Never raises; unknown fields stay 0."""

    def close(self) -> None:  # noqa: B027 - optional hook, most clients need nothing
        """Release the client. Idempotent."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Backend:
        """Build from the connector's ``kv_connector_extra_config`` (and the backend's own
        config file or environment). Raises ``BackendUnavailable`` or ``ValueError`` naming
        the field to fix."""
        raise NotImplementedError
