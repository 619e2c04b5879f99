"""What an agent does for each operator command: ``health``, ``flush`` (``drain`` and
``snapshot`` live in the agent, they need its state).

Runs on the agent's command thread, never on an engine thread. Every function returns a result
struct or raises ``CommandError`` with a message meant for the operator.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING

from kvpool_agent.pool import mooncake_master_health
from kvpool_agent.protocol import FlushArgs, FlushResult, HealthCheck, HealthResult, Source
from kvpool_agent.vocabulary import error_name
from kvpool_connector.keys import (
    ALL_KEYS_PATTERN,
    PROBE_PREFIX,
    ParallelLayout,
    layout_pattern,
    model_pattern,
)

if TYPE_CHECKING:
    # Only for annotations: kvpool_connector.backends.base imports kvpool_agent.protocol.
    from kvpool_connector.backends.base import Backend

__all__ = ["PROBE_BYTES", "CommandError", "Prober", "flush_pattern", "run_flush", "run_health"]

PROBE_BYTES = 4096
"""Size of the health probe value (bytes)."""


_BUFFERS: weakref.WeakKeyDictionary[Backend, ctypes.Array[ctypes.c_char]] = (
    weakref.WeakKeyDictionary()
)
_BUFFERS_LOCK = threading.Lock()
_PROBE_LOCK = threading.Lock()


class CommandError(RuntimeError):
    """A command could not run here; the message tells the operator why and what to do."""


class Prober:
    """Write, read back and remove one small key under ``PROBE_PREFIX``, timing each step.

    Uses a ``2 * PROBE_BYTES`` host buffer registered once per backend (zero-copy batch calls
    only move registered memory). The buffer lives as long as the backend, not the agent: a
    freed but still registered range would make the next registration overlapping it fail.
    """

    def __init__(self, backend: Backend, agent_id: str) -> None:
        self._backend = backend
        self._agent_id = agent_id

    def _buffer(self) -> int:
        with _BUFFERS_LOCK:
            buf = _BUFFERS.get(self._backend)
            if buf is None:
                buf = ctypes.create_string_buffer(2 * PROBE_BYTES)
                self._backend.register_buffer(ctypes.addressof(buf), 2 * PROBE_BYTES)
                _BUFFERS[self._backend] = buf
        return ctypes.addressof(buf)

    def run(self) -> list[HealthCheck]:
        """Three checks, ``probe_put``, ``probe_get`` (bytes compared), ``probe_remove``.
        Never raises."""
        # One probe at a time per backend: they share the buffer.
        with _PROBE_LOCK:
            return self._run()

    def _run(self) -> list[HealthCheck]:
        key = f"{PROBE_PREFIX}{self._agent_id}@{uuid.uuid4().hex[:12]}"
        checks: list[HealthCheck] = []
        t0 = time.perf_counter()
        try:
            addr = self._buffer()
            payload = os.urandom(PROBE_BYTES)
            ctypes.memmove(addr, payload, PROBE_BYTES)
            ctypes.memset(addr + PROBE_BYTES, 0, PROBE_BYTES)
            t0 = time.perf_counter()
            (rc,) = self._backend.batch_put_from([key], [[addr]], [[PROBE_BYTES]])
            checks.append(_check("probe_put", rc == 0, t0, key, rc))
            if rc != 0:
                return checks
            t0 = time.perf_counter()
            (rc,) = self._backend.batch_get_into([key], [[addr + PROBE_BYTES]], [[PROBE_BYTES]])
            same = (
                rc == PROBE_BYTES and ctypes.string_at(addr + PROBE_BYTES, PROBE_BYTES) == payload
            )
            detail = key if same or rc < 0 else f"{key}: read {rc} bytes, content differs"
            checks.append(_check("probe_get", same, t0, detail, rc if rc < 0 else None))
            t0 = time.perf_counter()
            res = self._backend.remove_by_scope(f"^{re.escape(key)}$", dry_run=False, force=True)
            checks.append(
                _check("probe_remove", res.removed == 1, t0, f"{key}: removed {res.removed}", None)
            )
        except Exception as e:  # a probe reports a failing store, it must not raise
            name = ("probe_put", "probe_get", "probe_remove")[min(len(checks), 2)]
            checks.append(
                HealthCheck(
                    name=name,
                    ok=False,
                    latency_ms=(time.perf_counter() - t0) * 1e3,
                    detail=f"{type(e).__name__}: {e}",
                    code=getattr(e, "code", None),
                )
            )
        return checks


def _check(name: str, ok: bool, t0: float, detail: str, rc: int | None) -> HealthCheck:
    code = rc if rc is not None and rc < 0 else None
    if code is not None:
        detail = f"{detail}: {error_name(code)} ({code})"
    return HealthCheck(
        name=name, ok=ok, latency_ms=(time.perf_counter() - t0) * 1e3, detail=detail, code=code
    )


def run_health(
    backend: Backend | None, prober: Prober | None, admin_url: str | None
) -> HealthResult:
    """Backend client checks (``Backend.health()``), the master's ``/health`` when
    ``admin_url`` is known, and the write/read/remove probe when there is a backend.

    A process with neither (a scheduler: its lookups go through worker rank 0) answers one
    ``agent`` check: the agent itself is alive, and the detail says where the pool checks run.
    """
    if backend is None and admin_url is None:
        return HealthResult(
            checks=[
                HealthCheck(
                    name="agent",
                    ok=True,
                    latency_ms=0.0,
                    detail="agent alive; no pool client in this process (pool checks run on "
                    "the engine's worker agents)",
                )
            ]
        )
    checks: list[HealthCheck] = []
    if backend is not None:
        checks.extend(backend.health())
    # Mooncake's backend checks the master itself; only add the admin check when missing.
    if admin_url is not None and not any(c.name == "master" for c in checks):
        checks.append(mooncake_master_health(admin_url))
    if prober is not None:
        checks.extend(prober.run())
    return HealthResult(checks=checks)


def flush_pattern(
    args: FlushArgs, source: Source, key_scope: tuple[str, ParallelLayout] | None
) -> str:
    """The anchored key regex a flush scope means for this agent.

    ``model``: ``keys.model_pattern(args.model or this agent's model)``; ``engine``:
    ``keys.layout_pattern`` of this agent's ``key_scope`` (its model and shard); ``all``:
    ``keys.ALL_KEYS_PATTERN`` (every ``kvpool@`` key, never other tenants' keys).

    Raises:
        CommandError: the scope needs a model or key scope this agent does not have, or names
            another engine.
    """
    if args.scope == "all":
        return ALL_KEYS_PATTERN
    if args.scope == "model":
        model = args.model or (key_scope[0] if key_scope else source.model)
        if not model:
            raise CommandError("flush scope 'model' needs a model name (FlushArgs.model)")
        return model_pattern(model)
    if args.engine_id and args.engine_id != source.engine_id:
        raise CommandError(
            f"flush scope 'engine' for {args.engine_id!r} sent to an agent of {source.engine_id!r}"
        )
    if key_scope is None:
        raise CommandError(
            f"agent {source.agent_id} has no key scope (a scheduler or store process): send "
            "flush scope 'engine' to the engine's worker agents"
        )
    return layout_pattern(*key_scope)


def run_flush(
    backend: Backend | None,
    args: FlushArgs,
    source: Source,
    key_scope: tuple[str, ParallelLayout] | None,
) -> FlushResult:
    """Count (dry run) or remove the keys of ``args.scope``; leased keys are skipped unless
    ``args.force``.

    Raises:
        CommandError: no backend in this process, or the scope cannot be resolved.
        BackendError: the store failed.
    """
    if backend is None:
        raise CommandError(f"agent {source.agent_id} has no pool backend: target a worker agent")
    pattern = flush_pattern(args, source, key_scope)
    res = backend.remove_by_scope(pattern, dry_run=args.dry_run, force=args.force)
    return FlushResult(
        dry_run=args.dry_run,
        keys=res.keys,
        bytes=res.bytes,
        removed_keys=0 if args.dry_run else res.removed,
        skipped_leased=res.skipped_leased,
    )
