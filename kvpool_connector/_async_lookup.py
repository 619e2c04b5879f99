"""Prefix lookups off vLLM's scheduler thread (issue 38 item 2: the engine never waits on the pool).

vLLM's scheduler asks ``get_num_new_matched_tokens`` for every waiting request it considers, on
the thread that also schedules every running request's next step. A lookup there costs the
prompt's chunk hashes (SHA-256 over every token id: a 32k-token prompt is tens to hundreds of
microseconds) and a round trip to worker rank 0's ``LookupServer`` (up to
``lookup_timeout_ms`` when the store is slow). vLLM's contract lets a connector answer
``(None, False)`` ("ask again later": the scheduler skips the request this step and asks on a
later one); vLLM's own ``MooncakeStoreConnector`` does so with ``lookup_async``, running its
``LookupKeyClient.lookup`` on a one-thread executor keyed by request id and answering ``None``
until the future is done. This module does the same for the pool:

* ``AsyncLookups.start`` hands the request to one daemon thread, which hashes the prompt
  (``prompt_hashes``, through the scheduler's ``ChunkHashCache`` under ``PromptHasher``'s lock)
  and asks the lookup server (``run_lookup``); the scheduler answers ``None``;
* a later ask finds the answer (``take``) and the scheduler settles it exactly as it settles a
  synchronous one: the same counters, breaker, hand-over wait, report and ``LoadSpec``;
* ``discard`` (the request finished or was aborted, or the pool was flushed) cancels a queued
  lookup and drops a running one's answer, so nothing is kept for a request vLLM forgot.

Bounds: each lookup still waits at most ``lookup_timeout_ms`` for its reply (``LookupClient``),
and one that fails or times out means 0 tokens, counted as a lookup error. Lookups run one at a
time, in the order they were started, as they did on the scheduler thread (the server answers
one at a time anyway): a request whose lookup is queued behind others waits for them, the
scheduler thread does not. One daemon thread, like ``LookupServer``'s: a lookup stuck at exit
never holds up the engine's shutdown.

The lease a hit carries is counted from ``LookupAnswer.asked_ms``, taken on the lookup thread
just before the query (Mooncake grants it when ``batch_is_exist`` runs), never from when the
scheduler read the answer: the lease never looks longer than it is.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

from kvpool_agent.reporter import NullReporter, Reporter
from kvpool_connector.fingerprint import adapter_identity
from kvpool_connector.keys import ChunkHashCache
from kvpool_connector.lookup import LookupFailed

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["AsyncLookups", "Breaker", "LookupAnswer", "PrefixLookup", "PromptHasher",
           "prompt_hashes", "request_adapter", "request_extra", "run_lookup"]

logger = logging.getLogger(__name__)


class PrefixLookup(Protocol):
    """What the scheduler needs from a lookup client (``LookupClient``)."""

    def lookup(self, chunk_hashes: list[str]) -> int: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class LookupAnswer:
    """One lookup's outcome, measured where it ran.

    Attributes:
        hashes: the prompt's whole chunks' hashes (all of them: saves use them too); empty
            when the prompt cannot be keyed (``bad_tokens`` says why).
        bad_tokens: why the prompt's token ids cannot be keyed (reported as
            ``BAD_TOKEN_IDS``), else ``None``.
        hit_chunks: leading chunks the pool holds, at most the ``max_chunks`` asked for.
        error: the failed lookup (store error or no reply within ``lookup_timeout_ms``).
        latency_ms: time in the lookup client's call (ms).
        asked_ms: wall clock (epoch ms) just before the query: the earliest the pool's leases
            on the found keys can have started.
    """

    hashes: list[str]
    bad_tokens: str | None = None
    hit_chunks: int = 0
    error: LookupFailed | None = None
    latency_ms: float = 0.0
    asked_ms: float = 0.0


def request_extra(request: Request) -> bytes:
    """Bytes that change what a prompt's tokens mean: the LoRA adapter and ``cache_salt``.

    Mixed into the first chunk hash so two adapters (or two tenants salting their cache)
    never share a key for the same tokens. The adapter is named by its content
    (``fingerprint.adapter_identity`` of ``lora_path``), not by its name: one name pointed at
    a new adapter never reads the old one's KV, one adapter under two names shares. ``b""``
    for neither; else the msgpack of ``[adapter identity or None, salt or None]``: a value
    holding a separator cannot read as another pair (a salt is the client's choice).
    """
    adapter = request_adapter(request)
    return _extra(None if adapter is None else adapter[1], request)


def request_adapter(request: Request) -> tuple[str, str] | None:
    """The request's LoRA adapter as ``(name, adapter_identity)``; ``None`` without one."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    name = str(lora.lora_name)
    return name, adapter_identity(name, str(lora.lora_path))


def _extra(identity: str | None, request: Request) -> bytes:
    salt = getattr(request, "cache_salt", None)
    if identity is None and not salt:
        return b""
    return msgspec.msgpack.encode([identity, str(salt) if salt else None])


class Breaker:
    """Skip lookups for ``open_ms`` after ``failures`` failed lookups in a row (0: never).

    After the open period one lookup is tried: success closes the breaker, failure opens it
    again for another ``open_ms``.
    """

    def __init__(self, failures: int, open_ms: int) -> None:
        self.failures, self.open_ms = failures, open_ms
        self.in_a_row = 0
        self.open_until = 0.0

    def is_open(self, now: float) -> bool:
        return now < self.open_until

    def failed(self, now: float) -> bool:
        """Count a failure (``now``: monotonic seconds); True when it opens the breaker."""
        self.in_a_row += 1
        if self.failures and self.in_a_row >= self.failures:
            self.open_until = now + self.open_ms / 1e3
            self.in_a_row = 0
            return True
        return False

    def succeeded(self) -> None:
        self.in_a_row = 0


class PromptHasher:
    """The scheduler's ``ChunkHashCache`` shared by the scheduler thread (requests it keys for
    saves only) and the lookup thread: one caller at a time (the cache is not thread-safe; a
    scheduler-thread caller waits at most one prompt's hashing). Each prompt it keys under a
    LoRA adapter is reported to ``reporter`` (``Reporter.adapter_served``: the agent shows an
    engine's adapters, issue 39 item 5)."""

    def __init__(self, cache: ChunkHashCache, reporter: Reporter | None = None) -> None:
        self.cache = cache
        self.reporter = reporter or NullReporter()
        self._lock = threading.Lock()

    def extra(self, request: Request) -> bytes:
        """``request_extra(request)``, its adapter (if any) reported."""
        adapter = request_adapter(request)
        if adapter is None:
            return _extra(None, request)
        self.reporter.adapter_served(*adapter)
        return _extra(adapter[1], request)

    def hashes(self, token_ids: list[int], extra: bytes) -> list[str]:
        """``ChunkHashCache.hashes`` under the lock (raises what it raises)."""
        with self._lock:
            return self.cache.hashes(token_ids, extra)


def prompt_hashes(hasher: PromptHasher, request: Request) -> tuple[list[str], str | None]:
    """The prompt's chunk hashes, or ``([], why)`` when a token id is not an int in
    [0, 2**32), which no key can name, or the token ids cannot be read whole.

    vLLM checks token ids against the vocabulary only when it has a tokenizer
    (``skip_tokenizer_init`` skips the check), and with TP > 1 its embedding zeroes an id
    outside the vocabulary instead of failing: such a request runs, so keying it must not raise
    into vLLM's scheduler (that ends the engine). It is recomputed and never saved.
    """
    try:
        return hasher.hashes(request.prompt_token_ids or [], hasher.extra(request)), None
    except (OverflowError, TypeError, ValueError, RuntimeError) as exc:
        return [], (f"request {request.request_id}'s prompt cannot be keyed ({exc}): it runs "
                    "without the pool")


def run_lookup(client: PrefixLookup, hasher: PromptHasher, request: Request,
               max_chunks: int) -> LookupAnswer:
    """Key the prompt and ask the pool for its first ``max_chunks`` chunks (on whichever thread
    calls it: the lookup thread, or the scheduler's for a synchronous lookup)."""
    hashes, bad = prompt_hashes(hasher, request)
    asked = hashes[:max_chunks] if len(hashes) > max_chunks else hashes
    if not asked:
        return LookupAnswer(hashes, bad)
    start = time.perf_counter()
    asked_ms = time.time() * 1e3
    try:
        hit = min(client.lookup(asked), max_chunks)
    except LookupFailed as exc:
        return LookupAnswer(hashes, bad, 0, exc, (time.perf_counter() - start) * 1e3, asked_ms)
    return LookupAnswer(hashes, bad, hit, None, (time.perf_counter() - start) * 1e3, asked_ms)


_Job = tuple[Future[LookupAnswer], "Request", int]


class AsyncLookups:
    """Each waiting request's lookup on one daemon thread, collected by request id.

    Args:
        client: the lookup client; from now on used by the lookup thread (``LookupClient``
            serialises its own callers, so the scheduler's reset flush may share it).
        hasher: the scheduler's hash cache, shared under its lock.

    Scheduler-thread calls (``running``, ``take``, ``start``, ``discard``, ``clear``) cost a
    dict lookup and, for ``start``, a queue put: no hashing, no socket.
    """

    def __init__(self, client: PrefixLookup, hasher: PromptHasher) -> None:
        self._client, self._hasher = client, hasher
        self._jobs: dict[str, Future[LookupAnswer]] = {}
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="kvpool-lookup-async",
                                        daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        """Lookups started and not yet taken or discarded."""
        return len(self._jobs)

    def running(self, req_id: str) -> bool:
        """Whether ``req_id``'s lookup is queued or running."""
        fut = self._jobs.get(req_id)
        return fut is not None and not fut.done()

    def take(self, req_id: str) -> LookupAnswer | None:
        """``req_id``'s finished lookup (forgotten once taken); ``None`` when none was started
        or it is still running (``running``)."""
        fut = self._jobs.get(req_id)
        if fut is None or not fut.done():
            return None
        del self._jobs[req_id]
        return fut.result()

    def start(self, request: Request, max_chunks: int) -> None:
        """Queue ``request``'s lookup of its first ``max_chunks`` chunks."""
        fut: Future[LookupAnswer] = Future()
        self._jobs[request.request_id] = fut
        self._queue.put((fut, request, max_chunks))

    def discard(self, req_id: str) -> None:
        """Forget ``req_id``'s lookup: a queued one never runs, a running one's answer is
        dropped when it ends."""
        fut = self._jobs.pop(req_id, None)
        if fut is not None:
            fut.cancel()

    def clear(self) -> None:
        """Forget every lookup (the pool was flushed: an answer from before may name removed
        keys)."""
        for rid in list(self._jobs):
            self.discard(rid)

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            fut, request, max_chunks = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(run_lookup(self._client, self._hasher, request, max_chunks))
            except BaseException as exc:  # re-raised on the scheduler thread, as inline
                fut.set_exception(exc)

    def close(self) -> None:
        """Stop the thread once the lookup it runs ends (queued ones are cancelled); waits at
        most 2 s (a lookup is bounded by ``lookup_timeout_ms``). Idempotent."""
        self.clear()
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
