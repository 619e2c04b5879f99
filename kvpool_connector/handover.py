"""Prefill/decode through the pool: the prefill engine's saves are its decode engine's KV.

A disaggregating proxy (the ``mooncake-transfer-engine`` wheel's
``mooncake/vllm_v1_proxy_server.py``, a copy of vLLM's toy proxy) sends each request to a
prefill engine with ``max_tokens`` 1 and ``kv_transfer_params`` ``{"do_remote_decode": true,
...}``, then the same request to a decode engine with the ``kv_transfer_params`` the prefill's
response carried. vLLM returns a request's output as soon as it finishes, while its saves may
still run, so a decode engine that looked up at once would find part of the prefix and
recompute the rest. The hand-over closes that gap:

* the prefill engine (``KVPoolScheduler.request_finished``) answers a request marked
  ``do_remote_decode`` with ``{"kvpool_handover": {"tokens": n}}``: the leading prompt tokens
  whose chunks it saved or found in the pool;
* the decode engine (``kv_consumer`` with ``consumer_is_to_load``) keeps such a request waiting
  (vLLM's ``get_num_new_matched_tokens`` answering ``None``: "ask again later"; other requests
  are scheduled meanwhile) until the pool holds those tokens or ``handover_wait_ms`` passed,
  then loads what is there (a short hand-over is counted: ``HANDOVER_INCOMPLETE``).

``kv_transfer_params`` come from whoever calls the engine's API: a promise is only a reason to
wait, and never decides what is loaded (the lookup does). What one costs is bounded: a request
waits at most ``handover_wait_ms``, asks the pool again at most every ``RECHECK_MS`` (vLLM's
scheduler asks on every step, which on an idle engine is a busy loop), at most ``MAX_RECHECKS``
waiting requests ask again per ``RECHECK_MS`` in all (each lookup runs on vLLM's scheduler
thread, ahead of the running requests' next step), and at most ``MAX_WAITING`` requests wait at
once (the next ones run with what the pool holds).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

__all__ = ["HANDOVER_PARAM", "MAX_RECHECKS", "MAX_WAITING", "RECHECK_MS", "HandoverWaits",
           "handover_params", "promised_tokens", "wants_handover"]

HANDOVER_PARAM = "kvpool_handover"
"""The ``kv_transfer_params`` key of the hand-over (distinct from vLLM's P/D connectors' keys,
so ``MultiConnector`` merges it without a clash)."""

MAX_WAITING = 1024
"""Requests that may wait for a hand-over at once."""

RECHECK_MS = 20
"""A waiting request asks the pool again at most this often (ms)."""

MAX_RECHECKS = 32
"""Waiting requests that may ask the pool again per ``RECHECK_MS``, all together; a request
whose ``handover_wait_ms`` is up makes its last lookup regardless (its own, as without a
promise)."""


def wants_handover(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's ``kv_transfer_params`` ask this (prefill) engine to hand its KV
    over to a decode engine: vLLM's P/D proxies set ``do_remote_decode``."""
    return bool(params) and params.get("do_remote_decode") is True  # type: ignore[union-attr]


def handover_params(tokens: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill engine returns: ``tokens`` leading prompt tokens
    (whole chunks) are in the pool once its saves end."""
    return {HANDOVER_PARAM: {"tokens": tokens}}


def promised_tokens(params: Mapping[str, Any] | None, prompt_len: int) -> int | None:
    """The tokens a decode request's prefill engine promised (``handover_params``), or
    ``None`` when there is no promise or it is not an int in ``[1, prompt_len]`` (the params
    are the API caller's input: a malformed one is ignored, never an error)."""
    if not params:
        return None
    entry = params.get(HANDOVER_PARAM)
    tokens = entry.get("tokens") if isinstance(entry, Mapping) else None
    if type(tokens) is not int or not 0 < tokens <= prompt_len:
        return None
    return tokens


class HandoverWaits:
    """When each waiting request first waited for its hand-over (monotonic seconds).

    Args:
        wait_ms: ``handover_wait_ms``; 0 = never wait.
    """

    def __init__(self, wait_ms: int) -> None:
        self.wait_s = wait_ms / 1e3
        # Request -> (when it began waiting, when it last asked the pool).
        self._waiting: dict[str, tuple[float, float]] = {}
        # The current RECHECK_MS window of rechecks: when it began, rechecks made in it.
        self._window, self._rechecks = -float("inf"), 0

    def ask_later(self, req_id: str, now: float | None = None) -> bool:
        """Whether waiting request ``req_id`` asked the pool less than ``RECHECK_MS`` ago, or
        ``MAX_RECHECKS`` waiting requests asked again in this ``RECHECK_MS`` already (answer
        "later" again without a lookup); never once its ``wait_ms`` is up."""
        entry = self._waiting.get(req_id)
        now = time.monotonic() if now is None else now
        if entry is None or now - entry[0] >= self.wait_s:
            return False
        if now - entry[1] < RECHECK_MS / 1e3:
            return True
        if now - self._window >= RECHECK_MS / 1e3:
            self._window, self._rechecks = now, 0
        if self._rechecks >= MAX_RECHECKS:
            return True
        self._rechecks += 1
        return False

    def keep_waiting(self, req_id: str, found: int, promised: int,
                     now: float | None = None) -> bool:
        """Whether request ``req_id`` should wait longer: the pool holds ``found`` of the
        ``promised`` tokens and its wait has not reached ``wait_ms``. Forgets the request
        once the answer is no."""
        now = time.monotonic() if now is None else now
        entry = self._waiting.pop(req_id, None)
        if found >= promised or self.wait_s <= 0:
            return False
        if entry is None:
            if len(self._waiting) >= MAX_WAITING:
                return False
            entry = (now, now)
        if now - entry[0] >= self.wait_s:
            return False
        self._waiting[req_id] = (entry[0], now)
        return True

    def forget(self, req_id: str) -> None:
        """The request finished (or was aborted) while it may have been waiting."""
        self._waiting.pop(req_id, None)
