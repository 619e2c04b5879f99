"""The policy service's store calls off its loop: one at a time, on a thread of their own.

Measured on mooncake-transfer-engine 0.3.13 (one ``mooncake_master``, one store process, a
loaded 2-core machine), one call of the service's store client against a master that does not
answer: SIGKILLed, a ``batch_remove`` came back RPC_FAIL after 4.3-4.5 s and a pin read (three
calls: the head record's ``get_size``, the versions' ``batch_is_exist``, the unversioned
record's ``get_size``) after 8.5-13.3 s; SIGSTOPped, ``batch_remove`` came back after 30.0 s
and the pin read after 90.0 s. Called on the service's loop (a pin read every second, under
``_guard``), that was the loop's time: a subscriber saw no snapshot for the whole 15 s the
master was stopped (0.50 s apart before), engines took the master in charge after their
``policy_stale_ms`` (3 s), and records waited in their sockets. So the remover
(``kvpool_policy._remover``) hands each blocking call to ``StoreCalls`` and takes its answer at
a later pass: the loop never waits for the store.

Both pin reads answered "no pins" on the dead master (the empty set, no error): the connector's
record reader (``kvpool_connector._pin_records``) took ``batch_is_exist``'s error code and
``get_size``'s negative code for "not there"; it raises on them now, so a master that does not
answer leaves the pins read last in force.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["StoreCalls"]

logger = logging.getLogger("kvpool.policy")


class StoreCalls:
    """One store call at a time, on a daemon thread of its own (``threaded``) or at once in the
    caller (tests and offline runs: the answer is ready when ``submit`` returns).

    ``submit`` a call, then ``take`` its ``Future`` once done (``None`` before); ``busy`` from
    the ``submit`` until the ``take``. ``close`` stops the thread without waiting for a call
    still blocked in the store (a daemon: it never holds the process's exit; a
    ``ThreadPoolExecutor``'s threads are joined at the interpreter's exit, a 30-90 s call to a
    stopped master included).
    """

    def __init__(self, threaded: bool = True) -> None:
        self._pending: Future[Any] | None = None
        self._todo: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] | None = None
        if threaded:
            self._todo = queue.SimpleQueue()
            threading.Thread(target=self._run, daemon=True, name="kvpool-policy-store").start()

    @property
    def busy(self) -> bool:
        """A call submitted and not yet taken."""
        return self._pending is not None

    def submit(self, call: Callable[[], Any]) -> None:
        """Run ``call`` (one at a time: never while ``busy``)."""
        assert self._pending is None, "one store call at a time"
        fut: Future[Any] = Future()
        self._pending = fut
        if self._todo is None:
            _run_into(call, fut)
        else:
            self._todo.put((call, fut))

    def take(self) -> Future[Any] | None:
        """The submitted call's ``Future`` once it is done (``busy`` ends), else ``None``."""
        fut = self._pending
        if fut is None or not fut.done():
            return None
        self._pending = None
        return fut

    def _run(self) -> None:
        assert self._todo is not None
        while (item := self._todo.get()) is not None:
            _run_into(*item)

    def close(self) -> None:
        """Stop the thread after the call it runs, if any (not waited for). Idempotent."""
        if self._todo is not None:
            self._todo.put(None)


def _run_into(call: Callable[[], Any], fut: Future[Any]) -> None:
    try:
        fut.set_result(call())
    except BaseException as exc:  # handed to the loop with the answer (Remover settles it)
        fut.set_exception(exc)
