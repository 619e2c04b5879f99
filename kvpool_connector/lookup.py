"""Prefix lookups from the scheduler process, answered by worker rank 0, over ZMQ IPC.

The scheduler (``KVPoolScheduler``) has no pool client of its own: it asks worker rank 0, which
holds one, how many leading chunks of a prompt the pool holds for *every* rank of the layout
(``KVPoolWorker.lookup_chunks``). Same split as vLLM Ascend's ``LookupKeyServer``/
``LookupKeyClient``. When worker rank 0 runs in the scheduler's own process (vLLM's ``uni``
executor, TP = PP = 1), the client hands its query to the server's local thread instead of the
socket (``_SERVED_HERE``): same answers, errors and timeouts.

Transport: a ZMQ ROUTER (server) / DEALER (client) pair on ``ipc://<dir>/kvpool-lookup-<host>-
<name>-dp<dp_rank>.sock``. ``<dir>`` is the per-user runtime directory (``_runtime_dir``:
``$KVPOOL_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/kvpool``, else ``<tempdir>/kvpool-<uid>``; 0700,
symbolic links refused). ``<name>`` is ``kv_connector_extra_config.lookup_rpc_port`` when set,
else ``i`` + 12 hex digits of SHA-256 of vLLM's ``VllmConfig.instance_id`` - one value for the
scheduler and the workers of an engine (pickled with the config into each process), a new one per
engine (``time.time_ns()`` at config creation, plus ``_dp<rank>`` per DP engine) - so engines on
one host never share a socket without configuration. Messages are msgpack-encoded msgspec structs
carrying a request id, so a late reply to a timed-out query is recognised and dropped. Next to the
socket an ``.owner`` JSON file (created with ``O_EXCL | O_NOFOLLOW``, the atomic claim of the
name) records the pid and engine holding it: a second engine on the same port is refused with
that owner's identity; a socket left by a dead process is removed.

A store failure is never turned into "0 chunks": the server counts and logs it and replies with
the error; the client raises ``LookupFailed``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import msgspec
import psutil
import zmq

from kvpool_agent.vocabulary import error_name
from kvpool_connector._runtime_dir import (
    RUNTIME_DIR_ENV,
    RuntimeDirError,
    create_private_file,
    read_private_file,
    remove_stale,
    socket_path,
)
from kvpool_connector.backends.base import BackendError

__all__ = [
    "RUNTIME_DIR_ENV",
    "LookupClient",
    "LookupFailed",
    "LookupServer",
    "PortInUse",
    "RuntimeDirError",
    "lookup_socket_path",
    "release_if_dead",
]

logger = logging.getLogger(__name__)

_POLL_MS = 100

_SERVED_HERE: dict[Path, LookupServer] = {}
"""The ``LookupServer`` of this process per socket path. vLLM runs worker rank 0 in the
scheduler's process when TP = PP = 1 (its ``uni`` executor): the scheduler's client then hands
its requests to that server's own thread as objects, skipping msgpack, the socket file and
ZMQ's I/O thread (about 0.4 ms of a 2,048-chunk lookup)."""
# A forked child has none of its parent's server threads: it asks over the socket.
os.register_at_fork(after_in_child=_SERVED_HERE.clear)


class LookupFailed(RuntimeError):
    """The lookup could not be answered: the store failed (``code`` is its error code, when
    known) or the server did not reply in time (``code`` is ``None``)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code

    @property
    def name(self) -> str:
        """Error name for reports: the backend code's name, else ``LOOKUP``."""
        return error_name(self.code) if self.code is not None else "LOOKUP"


class PortInUse(RuntimeError):
    """Another live engine holds this lookup socket (``lookup_rpc_port`` or vLLM instance id,
    and DP rank) on this host."""


class _Request(msgspec.Struct, array_like=True):
    id: int
    chunk_hashes: list[str]
    # "lookup", or "reset_flush": run the reset flush (``reset_flush_scope``) on rank 0.
    op: str = "lookup"


class _Reply(msgspec.Struct, array_like=True):
    id: int
    hit_chunks: int = 0
    error: str | None = None
    code: int | None = None
    removed_keys: int = 0


def lookup_socket_path(lookup_rpc_port: int = 0, dp_rank: int = 0, *, instance_id: str = "",
                       host: str | None = None) -> Path:
    """Filesystem path of the lookup socket for one engine (DP rank) on this host, in the
    runtime directory (created 0700 when missing).

    Args:
        lookup_rpc_port: ``kv_connector_extra_config.lookup_rpc_port``; 0 = unset.
        dp_rank: the engine's data-parallel rank.
        instance_id: vLLM's ``VllmConfig.instance_id``; names the socket when the port is 0.
        host: host name (default ``socket.gethostname()``); its first 16 characters, each one
            other than a letter, digit, ``.``, ``_`` or ``-`` replaced by ``_`` (the whole path
            must fit a Unix socket address, ``_runtime_dir.SUN_PATH_MAX``).

    Raises:
        ValueError: neither a port nor an instance id.
        RuntimeDirError: the runtime directory is unsafe, or the path is too long for a Unix
            socket (the message names the path and the fix).
    """
    host = re.sub(r"[^A-Za-z0-9._-]", "_", host or socket.gethostname())[:16]
    if lookup_rpc_port:
        name = str(lookup_rpc_port)
    elif instance_id:
        # Hashed: an instance id may hold any character and be any length.
        name = "i" + hashlib.sha256(instance_id.encode()).hexdigest()[:12]
    else:
        raise ValueError("the lookup socket needs kv_connector_extra_config.lookup_rpc_port or "
                         "vLLM's instance_id; neither is set")
    return socket_path(f"kvpool-lookup-{host}-{name}-dp{dp_rank}.sock")


def _named_by(lookup_rpc_port: int, instance_id: str) -> str:
    """What names the socket, for error messages."""
    if lookup_rpc_port:
        return f"lookup_rpc_port {lookup_rpc_port}"
    return f"vLLM instance_id {instance_id!r}"


def release_if_dead(lookup_rpc_port: int, dp_rank: int = 0) -> bool:
    """Remove the socket and ``.owner`` file under ``lookup_rpc_port``'s name when the process
    that held them is gone: an engine killed before ``LookupServer.close`` (SIGKILL, or a
    SIGTERM its process did not handle) leaves both behind, and a name no engine takes again
    is never swept by ``_claim`` (a new user found 252 in the runtime directory after demos
    and interrupted replays). For whoever stopped that engine; a live holder's files are kept.

    Returns:
        Whether files were removed (False: none there, a live holder, or not removable: a
        symbolic link or directory at the path, logged).
    """
    try:
        path = lookup_socket_path(lookup_rpc_port, dp_rank)
        owner = _owner_path(path)
        try:
            raw = read_private_file(owner)
        except OSError:
            raw = b""  # unreadable: as stale as a dead holder's
        if raw is None and not path.exists():
            return False
        info: dict[str, object] = {}
        with contextlib.suppress(ValueError):
            loaded = json.loads(raw or b"null")
            info = loaded if isinstance(loaded, dict) else {}
        pid = info.get("pid")
        if isinstance(pid, int) and psutil.pid_exists(pid):
            return False
        remove_stale(owner)
        remove_stale(path)
    except RuntimeDirError as exc:
        logger.warning("kvpool lookup: the socket of lookup_rpc_port %d left in place: %s",
                       lookup_rpc_port, exc)
        return False
    return True


def _owner_path(sock: Path) -> Path:
    return sock.with_name(sock.name + ".owner")


class LookupServer:
    """Answers prefix lookups on worker rank 0 from a background thread.

    Args:
        lookup_chunks: ``chunk_hashes -> leading chunks present for every rank``; raises
            ``BackendError`` when the store fails (``KVPoolWorker.lookup_chunks``).
        lookup_rpc_port, instance_id, dp_rank: select the socket (see ``lookup_socket_path``).
        engine_id: recorded in the owner file so a conflicting engine can be named.
        reset_flush: runs the scheduler's ``reset_cache`` flush (``reset_flush_scope``) and
            returns the keys removed; ``None``: such a request is answered with an error.
            No lookup is answered while it runs (the socket's thread and the one for
            clients of this process answer one query at a time between them).

    Attributes:
        lookups: queries answered; ``errors``: queries answered with an error.

    Raises:
        PortInUse: a live process (another engine) holds the socket; the message names its
            pid, engine id and the socket path, and says to pick another ``lookup_rpc_port``.
        RuntimeDirError: the runtime directory is unsafe, the socket path is too long, or a
            symbolic link or directory sits at the socket or owner file path (never followed).
    """

    def __init__(
        self,
        lookup_chunks: Callable[[list[str]], int],
        *,
        lookup_rpc_port: int = 0,
        instance_id: str = "",
        dp_rank: int = 0,
        engine_id: str = "engine",
        reset_flush: Callable[[], int] | None = None,
    ) -> None:
        self._lookup = lookup_chunks
        self._reset_flush = reset_flush
        self.path = lookup_socket_path(lookup_rpc_port, dp_rank, instance_id=instance_id)
        self._named_by = _named_by(lookup_rpc_port, instance_id)
        self._fix = ("give this engine another kv_connector_extra_config.lookup_rpc_port"
                     if lookup_rpc_port else
                     "set kv_connector_extra_config.lookup_rpc_port to a port unique on this host")
        self.engine_id = engine_id
        self.lookups = 0
        self.errors = 0
        self._claim()
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"ipc://{self.path}")
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._answering = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="kvpool-lookup", daemon=True)
        self._thread.start()
        self._local: queue.SimpleQueue[tuple[_Request, Future[_Reply]] | None] = (
            queue.SimpleQueue())
        # A daemon thread, like the socket's: a store call stuck at exit cannot hold up the
        # engine's shutdown (a ThreadPoolExecutor's worker would be joined).
        self._local_thread = threading.Thread(target=self._serve_local,
                                              name="kvpool-lookup-local", daemon=True)
        self._local_thread.start()
        _SERVED_HERE[self.path] = self

    def _claim(self) -> None:
        """Take the socket's name: refuse a live holder, remove what a dead one left, then
        create the owner file (``O_EXCL``: of two engines starting at once, one wins)."""
        owner = _owner_path(self.path)
        info = self._holder(owner)
        if info is not None:
            # Left behind by a process that died (or unreadable): remove it.
            logger.info("removing stale lookup owner file %s (%s)", owner, info or "unreadable")
            remove_stale(owner)
        record = {"pid": os.getpid(), "engine_id": self.engine_id, "started": time.time()}
        try:
            create_private_file(owner, json.dumps(record).encode())
        except FileExistsError:
            raise self._in_use(self._holder(owner) or {}) from None
        try:
            # A socket file without a live owner is stale; bind would fail on it.
            remove_stale(self.path)
        except RuntimeDirError:
            owner.unlink(missing_ok=True)
            raise

    def _holder(self, owner: Path) -> dict[str, object] | None:
        """The owner file's record; ``None`` when there is none, ``{}`` when unreadable.

        Raises:
            PortInUse: a live process other than this one holds the socket.
            RuntimeDirError: a symbolic link or directory is at the owner file path.
        """
        try:
            raw = read_private_file(owner)
        except OSError:
            return {}
        if raw is None:
            return None
        info: dict[str, object] = {}
        with contextlib.suppress(ValueError):
            loaded = json.loads(raw)
            info = loaded if isinstance(loaded, dict) else {}
        pid = info.get("pid")
        if isinstance(pid, int) and pid != os.getpid() and psutil.pid_exists(pid):
            raise self._in_use(info)
        return info

    def _in_use(self, info: dict[str, object]) -> PortInUse:
        return PortInUse(
            f"{self._named_by} is in use: {self.path} is held by engine "
            f"{info.get('engine_id')!r} (pid {info.get('pid')}); {self._fix}"
        )

    def _serve(self) -> None:
        enc = msgspec.msgpack.Encoder()
        dec = msgspec.msgpack.Decoder(_Request)
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            try:
                ident, payload = self._sock.recv_multipart(zmq.NOBLOCK)
            except (zmq.ZMQError, ValueError):
                continue
            try:
                req = dec.decode(payload)
            except msgspec.DecodeError as exc:
                self.errors += 1
                logger.error("kvpool lookup: malformed request dropped: %s", exc)
                continue
            self._sock.send_multipart([ident, enc.encode(self._answer(req))])

    def _submit(self, req: _Request) -> Future[_Reply]:
        """Answer ``req`` of a client of this process on the server's local thread (a stuck
        store never blocks the caller past its timeout)."""
        fut: Future[_Reply] = Future()
        self._local.put((req, fut))
        return fut

    def _serve_local(self) -> None:
        while (item := self._local.get()) is not None:
            req, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            # Queued when close() came: its owner closes the store next, so it is not asked.
            fut.set_result(_Reply(req.id, error="the lookup server closed")
                           if self._stop.is_set() else self._answer(req))

    def _answer(self, req: _Request) -> _Reply:
        # One at a time across both threads: a reset flush never overlaps a lookup, and the
        # counters stay exact.
        with self._answering:
            return self._answer_one(req)

    def _answer_one(self, req: _Request) -> _Reply:
        if req.op == "reset_flush":
            return self._flush(req)
        self.lookups += 1
        try:
            return _Reply(req.id, hit_chunks=self._lookup(req.chunk_hashes))
        except BackendError as exc:
            self.errors += 1
            logger.error("kvpool lookup of %d chunks failed in the store: %s (code %s)",
                         len(req.chunk_hashes), exc, exc.code)
            return _Reply(req.id, error=str(exc), code=exc.code)
        except Exception as exc:  # the server thread must outlive any bug in one lookup
            self.errors += 1
            logger.exception("kvpool lookup of %d chunks failed", len(req.chunk_hashes))
            return _Reply(req.id, error=f"{type(exc).__name__}: {exc}")

    def _flush(self, req: _Request) -> _Reply:
        if self._reset_flush is None:
            return _Reply(req.id, error="this engine's reset_flush_scope is none")
        try:
            return _Reply(req.id, removed_keys=self._reset_flush())
        except BackendError as exc:
            logger.error("kvpool reset flush failed in the store: %s (code %s)", exc, exc.code)
            return _Reply(req.id, error=str(exc), code=exc.code)
        except Exception as exc:  # the server thread must outlive a failed flush
            logger.exception("kvpool reset flush failed")
            return _Reply(req.id, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop the threads (waiting up to 2 s each for a store call under way), close the
        socket and remove the socket and owner files; queries of this process still queued
        are answered with an error, not asked of the store. Idempotent. In a process forked
        from the server's it does nothing: the threads, socket and files are the parent's."""
        if self._stop.is_set() or os.getpid() != self._pid:
            return
        self._stop.set()
        if _SERVED_HERE.get(self.path) is self:
            del _SERVED_HERE[self.path]
        self._local.put(None)
        self._thread.join(timeout=2)
        self._local_thread.join(timeout=2)
        self._sock.close(linger=0)
        self.path.unlink(missing_ok=True)
        _owner_path(self.path).unlink(missing_ok=True)


class LookupClient:
    """The scheduler's side: ask worker rank 0 how many leading chunks the pool holds.

    Args:
        lookup_rpc_port, instance_id, dp_rank: select the socket (see ``lookup_socket_path``).
        timeout_ms: how long one query waits for its reply.
        in_process: when a ``LookupServer`` of this process serves the socket (worker rank 0
            in the scheduler's process: vLLM's ``uni`` executor at TP = PP = 1), hand it the
            query directly (no msgpack, socket file or ZMQ I/O thread; same answers, errors
            and timeouts); ``False``: always the socket.

    Raises:
        RuntimeDirError: the runtime directory is unsafe or the socket path too long.

    Thread-safe: one query at a time (a lock around each), so the scheduler's lookup thread
    (``_async_lookup``) and its own thread (the reset flush) share the one socket.
    """

    def __init__(self, *, lookup_rpc_port: int = 0, instance_id: str = "", dp_rank: int = 0,
                 timeout_ms: int = 5_000, in_process: bool = True) -> None:
        self.path = lookup_socket_path(lookup_rpc_port, dp_rank, instance_id=instance_id)
        self._named_by = _named_by(lookup_rpc_port, instance_id)
        self.timeout_ms = timeout_ms
        self.in_process = in_process
        self._ids = itertools.count(1)
        self._asking = threading.Lock()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(_Reply)
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{self.path}")

    def lookup(self, chunk_hashes: list[str]) -> int:
        """Leading chunks of ``chunk_hashes`` present in the pool for every rank.

        Returns:
            0 .. ``len(chunk_hashes)``.

        Raises:
            LookupFailed: the store failed (with its code) or no reply within ``timeout_ms``.
        """
        if not chunk_hashes:
            return 0
        return self._ask(_Request(next(self._ids), chunk_hashes), self.timeout_ms,
                         "pool lookup").hit_chunks

    def reset_flush(self, timeout_ms: int) -> int:
        """Ask worker rank 0 to run the reset flush (``reset_flush_scope``) and wait up to
        ``timeout_ms`` for it; returns the keys removed.

        Raises:
            LookupFailed: the flush failed (with the store's code when known), this engine
                does not flush on reset, or no reply within ``timeout_ms``.
        """
        req = _Request(next(self._ids), [], op="reset_flush")
        return self._ask(req, timeout_ms, "pool reset flush").removed_keys

    def _ask(self, req: _Request, timeout_ms: int, what: str) -> _Reply:
        """Send ``req`` and wait up to ``timeout_ms`` for its reply (late answers to earlier,
        timed-out requests are skipped); a caller waits for another's query first (a ZMQ
        socket is not thread-safe).

        Raises:
            LookupFailed: the reply names an error (``what`` failed, with the store's code
                when known), or no reply within ``timeout_ms``.
        """
        with self._asking:
            return self._ask_one(req, timeout_ms, what)

    def _ask_one(self, req: _Request, timeout_ms: int, what: str) -> _Reply:
        # Per query: vLLM may start the worker or the scheduler first.
        server = _SERVED_HERE.get(self.path) if self.in_process else None
        if server is not None:
            fut = server._submit(req)
            try:
                reply = fut.result(timeout_ms / 1e3)
            except FutureTimeout:
                fut.cancel()  # still queued behind a stuck one: never sent to the store
            else:
                if reply.error is not None:
                    raise LookupFailed(f"{what} failed: {reply.error}", reply.code)
                return reply
            raise self._no_reply(timeout_ms)
        self._sock.send(self._enc.encode(req))
        deadline = time.monotonic() + timeout_ms / 1e3
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1e3) + 1):
                break
            reply = self._dec.decode(self._sock.recv())
            if reply.id != req.id:
                continue  # the late answer to an earlier, timed-out query
            if reply.error is not None:
                raise LookupFailed(f"{what} failed: {reply.error}", reply.code)
            return reply
        raise self._no_reply(timeout_ms)

    def _no_reply(self, timeout_ms: int) -> LookupFailed:
        return LookupFailed(
            f"no reply from the lookup server at {self.path} within {timeout_ms} ms "
            f"(is worker rank 0 running, with the same {self._named_by}?)"
        )

    def close(self) -> None:
        """Close the socket (after a query under way). Idempotent."""
        with self._asking:
            self._sock.close(linger=0)
