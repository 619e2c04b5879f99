"""``BackendOperations``: the connector's side of the agent's ``PoolOperations`` protocol.

Everything an operator command needs from the pool client of a connector process lives here:
which keys a flush scope means (``kvpool_connector.keys`` patterns), the write/read/remove
health probe, the backend's own checks and stats, and waiting for the worker's saves. The agent
(``kvpool_agent``) only sees the protocol (``kvpool_agent.operations``) and never imports this
package.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from typing import Protocol

from tenacity import RetryCallState, Retrying, retry_if_result, stop_before_delay, wait_fixed

from kvpool_agent.audit import audit
from kvpool_agent.operations import CommandError
from kvpool_agent.protocol import (
    MAX_ID_CHARS,
    MAX_PIN_TOKENS,
    PROTOCOL_VERSION,
    CommandReply,
    CommandRequest,
    DrainResult,
    FlushArgs,
    FlushRecord,
    FlushResult,
    HealthCheck,
    PinArgs,
    PinInfo,
    PinOutcome,
    PoolStats,
    Source,
    clip,
)
from kvpool_agent.reporter import NullReporter, Reporter
from kvpool_agent.vocabulary import error_name
from kvpool_connector._removals import grace_s_of
from kvpool_connector.backends.base import Backend, RemoveResult
from kvpool_connector.keys import (
    ALL_KEYS_PATTERN,
    ParallelLayout,
    digest_pattern,
    layout_pattern,
    model_pattern,
    normalize_model_name,
    probe_key,
    shard_prefix,
)
from kvpool_connector.pins import Pin, Pins

__all__ = ["PROBE_BYTES", "BackendOperations", "KeyScope", "SavesInFlight", "Tokenize",
           "flush_pattern"]

PROBE_BYTES = 4096
"""Size of the health probe value (bytes)."""

KeyScope = tuple[str, str, tuple[ParallelLayout, ...]]
"""``(model, layout digest, shards)``: the keys one worker writes (``keys.layout_pattern``):
its rank's shard, or one shard per KV-head share and stored layer range it holds
(``KVPoolWorker.shard_layouts``)."""

Tokenize = Callable[[str, bool], list[int]]
"""The engine's tokenizer: ``(text, chat_template)`` -> the token ids the engine would see
(with the chat template: ``text`` as a system message)."""

logger = logging.getLogger(__name__)

_BUFFERS: weakref.WeakKeyDictionary[Backend, ctypes.Array[ctypes.c_char]] = (
    weakref.WeakKeyDictionary()
)
_BUFFERS_LOCK = threading.Lock()
_PROBE_LOCK = threading.Lock()


class SavesInFlight(Protocol):
    """What ``BackendOperations.wait_for_saves`` and ``reset_flush`` need of
    ``KVPoolWorker``."""

    def drain_saves(self, timeout_s: float | None = None) -> bool:
        """True once every submitted save finished within ``timeout_s`` seconds."""
        ...

    @property
    def inflight_saves(self) -> int:
        """Save batches submitted and not finished yet."""
        ...

    def take_written_chunks(self) -> list[tuple[str, int, int]]:
        """``(request id, chunk, KV-cache group)`` of the chunks saves wrote since the last
        call (KV events)."""
        ...


class BackendOperations:
    """``kvpool_agent.operations.PoolOperations`` over one process's ``Backend``.

    Args:
        backend: the process's pool client.
        source: who the process reports as (its ``agent_id`` names probe keys, its
            ``engine_id`` and ``model`` resolve flush scopes).
        key_scope: the ``KeyScope`` this process writes; ``flush --scope engine`` removes
            exactly ``keys.layout_pattern`` of its model, digest and every shard. ``None`` in
            a process that writes no keys, and in a worker until vLLM registered its KV caches
            (the connector sets it then, with the layout digest and shards).

    Attributes:
        saves: the worker whose saves ``wait_for_saves`` waits for (``bind``). While ``None``
            there is no save to wait for.
        reporter: the agent's reporter, which takes ``reset_flush``'s audit record to the hub
            (``Reporter.flush_audited``; ``bind``).
        pins: this worker's pinned prefixes (``kvpool_connector.pins``; ``register``) when the
            backend can pin (Mooncake); ``None``: ``pin`` is refused here.
        tokenize: the engine's tokenizer for text pins (``register``); ``None`` (an engine
            without one, the replay's simulated engines): a text pin is refused.

    A worker's operations exist before its agent (which serves them) and before vLLM registers
    its KV caches: ``kvpool_connector._wiring`` completes them with ``bind`` once the agent and
    the worker run, and ``register`` once the layout digest is known.
    """

    def __init__(
        self,
        backend: Backend,
        source: Source,
        key_scope: KeyScope | None = None,
    ) -> None:
        self.backend = backend
        self.source = source
        self.key_scope = key_scope
        self.saves: SavesInFlight | None = None
        self.reporter: Reporter = NullReporter()
        self.pins: Pins | None = None
        self.tokenize: Tokenize | None = None
        self._prober = _Prober(backend, source.agent_id)
        # Scopes of operator flushes that removed this process's keys, for the KV events.
        self._flushes: deque[str] = deque(maxlen=64)

    def bind(self, reporter: Reporter, saves: SavesInFlight | None) -> None:
        """End of the wiring's phase 1 (``kvpool_connector._wiring``): the agent's reporter
        and the worker whose saves the flushes wait for (the worker needs the agent's
        reporter, the agent these operations)."""
        self.reporter, self.saves = reporter, saves

    def register(self, key_scope: KeyScope, pins: Pins | None,
                 tokenize: Tokenize | None) -> None:
        """The wiring's phase 2, once vLLM registered the KV caches: the key scope (model,
        layout digest, every shard written), the layout's pins and the engine's tokenizer."""
        self.key_scope, self.pins, self.tokenize = key_scope, pins, tokenize

    def health(self, probe: bool = False) -> list[HealthCheck]:
        """``Backend.health()`` (client state and master reachability; no pool key touched),
        then with ``probe`` the write/read/remove probe (``probe_put``, ``probe_get``,
        ``probe_remove``). Never raises."""
        checks = self.backend.health()
        return [*checks, *self._prober.run()] if probe else checks

    def flush(self, args: FlushArgs) -> FlushResult:
        """Count (dry run) or remove the keys of ``args.scope`` (``flush_pattern``); leased keys
        are skipped unless ``args.force``. Sizes in bytes.

        Raises:
            CommandError: the scope cannot be resolved in this process.
            BackendError: the store failed.
        """
        pattern = flush_pattern(args, self.source, self.key_scope)
        res = self.backend.remove_by_scope(pattern, dry_run=args.dry_run, force=args.force)
        scope = self.key_scope
        if not args.dry_run and scope is not None and re.match(
                pattern, shard_prefix(normalize_model_name(scope[0]), scope[1], scope[2][0])):
            self._flushes.append(args.scope)
        return FlushResult(
            dry_run=args.dry_run,
            keys=res.keys,
            bytes=res.bytes,
            removed_keys=0 if args.dry_run else res.removed,
            skipped_leased=res.skipped_leased,
        )

    def take_flushes(self) -> list[str]:
        """Scopes of the operator flushes (not dry runs) whose pattern covers this process's
        keys, since the last call (at most the last 64); the connector announces them as
        ``BlockRemoved`` (``kvpool_connector._events``)."""
        out = []
        while self._flushes:
            out.append(self._flushes.popleft())
        return out

    def reset_flush(self, saves_timeout_s: float = 30.0,
                    leases_timeout_s: float = 15.0) -> FlushResult:
        """``reset_flush_scope`` ``engine`` (vLLM's ``reset_prefix_cache`` reaching the
        connector): wait for this process's saves, then remove every key of this engine's
        model and layout digest (``keys.digest_pattern``: every shard and layer; other digests
        and models stay). A key another engine is reading holds a lease (Mooncake
        ``default_kv_lease_ttl``): it is never removed by force (its memory could be reused
        under the reader's transfer: wrong KV there), and tried again no sooner than the
        backend's transfer timeout after each refusal (``Backend.transfer_timeout_ms``, 60 s
        on Mooncake: ``_removals``), while that fits in ``leases_timeout_s`` seconds. Audited
        like a console flush: one ``kvpool_agent._audit`` line (``who``
        ``engine:<engine_id> (reset_prefix_cache)``, command ``flush``, scope ``engine``) on
        the ``kvpool.hub`` log, failures too, and a ``FlushRecord`` to ``reporter``: the hub
        writes it to its audit trail. Sizes in bytes.

        Raises:
            CommandError: no key scope yet (vLLM has not registered the KV caches), the saves
                did not finish within ``saves_timeout_s`` seconds (nothing removed), or keys
                were still leased when the next try would pass ``leases_timeout_s`` seconds (the
                others removed).
            BackendError: the store failed.
        """
        src = self.source
        args = FlushArgs(scope="engine", model=self.key_scope[0] if self.key_scope else None,
                         engine_id=src.engine_id, dry_run=False, force=False)
        req = CommandRequest(v=PROTOCOL_VERSION, seq=0, request_id=f"reset-{uuid.uuid4().hex}",
                             command="flush", sender="reset_prefix_cache",
                             targets=[src.agent_id], flush=args)
        who = f"engine:{src.engine_id} (reset_prefix_cache)"
        try:
            result = self._reset_flush(saves_timeout_s, leases_timeout_s)
        except Exception as exc:
            self._audit_reset(who, req, None, clip(f"{type(exc).__name__}: {exc}"))
            raise
        self._audit_reset(who, req, result, None)
        return result

    def _audit_reset(self, who: str, req: CommandRequest, result: FlushResult | None,
                     error: str | None) -> None:
        """The reset flush's audit line, here and (through the agent) in the hub's trail."""
        aid = self.source.agent_id
        audit(None, who, req, [aid], [CommandReply(
            v=PROTOCOL_VERSION, seq=0, request_id=req.request_id, agent_id=aid,
            ok=error is None, error=error, flush=result)])
        assert req.flush is not None
        self.reporter.flush_audited(FlushRecord(
            ts_ms=time.time() * 1e3, request_id=req.request_id, who=clip(who, MAX_ID_CHARS),
            flush=req.flush,
            ok=error is None, result=result, error=error))

    def _reset_flush(self, saves_timeout_s: float, leases_timeout_s: float) -> FlushResult:
        scope = self.key_scope
        if scope is None:
            raise CommandError("the engine's KV caches are not registered yet: nothing to flush")
        saves = self.saves
        if saves is not None and not saves.drain_saves(saves_timeout_s):
            raise CommandError(f"saves still running after {saves_timeout_s:.0f} s; nothing "
                               "removed (reset_prefix_cache again once they finished)")
        pattern = digest_pattern(scope[0], scope[1])
        rounds: list[RemoveResult] = []

        def remove() -> RemoveResult:
            rounds.append(self.backend.remove_by_scope(pattern, dry_run=False, force=False))
            return rounds[-1]

        # Leased keys are tried again a grace after each refusal (the reader may copy them
        # until its transfer timeout, _removals), within the wait; store errors are not retried.
        grace_s = grace_s_of(self.backend.transfer_timeout_ms())
        Retrying(stop=stop_before_delay(leases_timeout_s), wait=wait_fixed(max(0.5, grace_s)),
                 retry=retry_if_result(lambda r: r.skipped_leased > 0),
                 retry_error_callback=_last_result)(remove)
        if saves is not None:
            # Chunks written before the removal and not yet reported are gone: reported after
            # the reset's BlockRemoved they would tell routers the pool holds them.
            saves.take_written_chunks()
        first, last = rounds[0], rounds[-1]
        if last.skipped_leased:
            raise CommandError(
                f"{last.skipped_leased} of {first.keys} keys still leased by readers after "
                f"{leases_timeout_s:.0f} s (the others removed; a key seen leased is removed no "
                f"sooner than {grace_s:.0f} s after, the transfer timeout); reset_prefix_cache "
                "again")
        return FlushResult(dry_run=False, keys=first.keys, bytes=first.bytes,
                           removed_keys=sum(r.removed for r in rounds))

    def wait_for_saves(self, timeout_ms: int) -> DrainResult:
        """Wait up to ``timeout_ms`` ms for the worker's in-flight saves (``saves``)."""
        saves = self.saves
        if saves is None:
            return DrainResult(drained=True, waited_ms=0.0, remaining_saves=0)
        start = time.monotonic()
        drained = saves.drain_saves(timeout_ms / 1e3)
        return DrainResult(drained=drained, waited_ms=(time.monotonic() - start) * 1e3,
                           remaining_saves=saves.inflight_saves)

    def stats(self) -> PoolStats:
        """``Backend.stats()``. Never raises."""
        return self.backend.stats()

    def pinned(self, refresh: bool = True) -> tuple[int, int]:
        """``(bytes, pins)`` of this worker's layout's pins (``PinOperations.pinned``); with
        ``refresh``, after taking those other workers made or dropped from the pool's records
        (``Pins.refresh``, every ``refresh_s``). Never raises."""
        pins = self.pins
        if pins is None:
            return 0, 0
        try:
            if refresh:
                pins.refresh()
        except Exception as exc:  # the stats report must go out; the next one tries again
            logger.warning("kvpool pins of %s: records not read: %s", self.source.agent_id, exc)
        return pins.pinned_bytes, len(pins.list())

    def pin(self, args: PinArgs) -> PinOutcome:
        """Pin ``args``'s prefix in this worker's layout (``Pins.pin``): by ``token_ids``, or
        ``text`` through the engine's tokenizer (``tokenize``).

        Raises:
            CommandError: no pins here, another model, no pin id, no tokens, a text pin
                without a tokenizer or of more than ``MAX_PIN_TOKENS`` tokens.
            PinRefused: over the pool's pin share or ``MAX_PINS`` (the message has the
                numbers).
            ValueError: no whole chunk in the prefix.
        """
        pins = self._pins_of(args.model)
        if not args.pin_id:
            raise CommandError("pin needs a pin id (PinArgs.pin_id)")
        if args.text is not None:
            if self.tokenize is None:
                raise CommandError(
                    f"agent {self.source.agent_id} has no tokenizer (an engine without "
                    "vLLM's, e.g. a replay's simulated engine): pin by token ids (--tokens)")
            tokens = self.tokenize(args.text, args.chat_template)
        else:
            tokens = list(args.token_ids)
        if not tokens:
            raise CommandError("pin needs token ids or text: got neither")
        if len(tokens) > MAX_PIN_TOKENS:  # text: a tokenizer may give a token per character
            raise CommandError(f"pin {args.pin_id!r}: the text is {len(tokens)} tokens, at most "
                               f"{MAX_PIN_TOKENS} per pin")
        r = pins.pin(args.pin_id, tokens, args.mode, args.ttl_ms)
        return PinOutcome(pin=self._info(r.pin), pinned_now=r.pinned_now, pending=r.pending,
                          failed=len(r.errors), pins=[self._info(p) for p in pins.list()],
                          pinned_bytes=r.pinned_bytes, pool_bytes=r.pool_bytes)

    def unpin(self, args: PinArgs) -> PinOutcome:
        """Drop pin ``args.pin_id`` (``Pins.unpin``: its values are removed, leased ones
        retried until their leases end).

        Raises:
            CommandError: no pins here, another model, no such pin.
        """
        pins = self._pins_of(args.model)
        held = {p.pin_id: p for p in pins.list()}
        if args.pin_id not in held:
            raise CommandError(f"no pin {args.pin_id!r} of {self.source.model} here (pinned: "
                               f"{', '.join(sorted(held)) or 'none'})")
        removed = pins.unpin(args.pin_id)
        return PinOutcome(pin=self._info(held[args.pin_id]), removed_keys=removed,
                          pins=[self._info(p) for p in pins.list()],
                          pinned_bytes=pins.pinned_bytes, pool_bytes=pins.pool_bytes())

    def pins_held(self, args: PinArgs) -> PinOutcome:
        """Every pin held here (``PinOperations.pins``), with the pool's capacity as ``pin``
        reads it (``Pins.pool_bytes``: the master's ``/metrics``, 0 when it did not answer)."""
        pins = self._pins_of(args.model)
        return PinOutcome(pins=[self._info(p) for p in pins.list()],
                          pinned_bytes=pins.pinned_bytes, pool_bytes=pins.pool_bytes())

    def _pins_of(self, model: str) -> Pins:
        if model and model != self.source.model:
            raise CommandError(f"agent {self.source.agent_id} serves model "
                               f"{self.source.model!r}, not {model!r}")
        if self.pins is None:
            raise CommandError(
                f"agent {self.source.agent_id} cannot pin: its backend "
                f"{self.source.backend or '?'} has no pins (Mooncake only) or vLLM has not "
                "registered its KV caches yet")
        return self.pins

    def _info(self, pin: Pin) -> PinInfo:
        scope = self.key_scope
        assert self.pins is not None
        return PinInfo(pin_id=pin.pin_id, model=self.source.model,
                       layout_digest=scope[1] if scope else "", mode=pin.mode,
                       ttl_ms=pin.ttl_ms, tokens=pin.tokens, keys=len(pin.keys),
                       bytes=len(pin.keys) * self.pins.chunk_bytes,
                       expires_ms=int(pin.expires_ms) if pin.mode == "soft" else 0)


def _last_result(state: RetryCallState) -> RemoveResult:
    """The last attempt's result when tenacity stops retrying (instead of ``RetryError``)."""
    assert state.outcome is not None
    result: RemoveResult = state.outcome.result()
    return result


def flush_pattern(
    args: FlushArgs, source: Source, key_scope: KeyScope | None
) -> str:
    """The anchored key regex a flush scope means for the process ``source``.

    ``model``: ``keys.model_pattern(args.model or this process's model)``, every layout digest
    of the model; ``engine``: ``keys.layout_pattern`` of ``key_scope`` (its model, layout
    digest and every shard it writes: one per KV-head share); ``all``:
    ``keys.ALL_KEYS_PATTERN`` (every ``kvpool@`` key, never other tenants' keys).

    Raises:
        CommandError: the scope needs a model or key scope this process does not have, or names
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
            f"agent {source.agent_id} has no key scope (a scheduler or store process, or a "
            "worker whose KV caches vLLM has not registered yet): send flush scope 'engine' "
            "to the engine's worker agents"
        )
    model, digest, shards = key_scope
    return layout_pattern(model, digest, *shards)


class _Prober:
    """Write, read back and remove one small key (``keys.probe_key``), timing each step.

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
        # One probe at a time per process: they share the buffer.
        with _PROBE_LOCK:
            return self._run()

    def _run(self) -> list[HealthCheck]:
        key = probe_key(self._agent_id)
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
