"""Lookups off vLLM's scheduler thread (issue 38 item 2, ``kvpool_connector._async_lookup``): a
real KVPoolScheduler asks a real LookupServer (real ZMQ IPC) backed by a real KVPoolWorker and
mooncake_master; the first ask answers vLLM's "later" (``(None, False)``), a later one the
lookup's answer, and every answer, counter and load equals the synchronous path's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from test_scheduler import (  # the scheduler tests' engine: worker, server and pool
    Engine,
    _blocks,
    _pd_request,
    _prompt,
    _request,
    _runtime_dir,  # noqa: F401  (autouse: a private runtime directory per test)
    backend,  # noqa: F401  (the module's Mooncake client)
)
from vllm.v1.request import Request

from kvpool_connector.backends.mooncake import MooncakeBackend
from kvpool_connector.lookup import LookupClient, LookupServer
from kvpool_connector.scheduler import KVPoolScheduler

WAIT_S = 60
"""Upper bound on any condition a test waits for (a loaded 2-core CI machine)."""


def _until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def _answer(sched: KVPoolScheduler, req: Request, local: int = 0) -> tuple[int | None, bool]:
    """Ask as vLLM does, step after step, until the answer is not "later"."""
    deadline = time.monotonic() + WAIT_S
    while (got := sched.get_num_new_matched_tokens(req, local))[0] is None:
        assert time.monotonic() < deadline, "no answer"
        time.sleep(0.001)
    return got


class Gate:
    """Worker rank 0's ``lookup_chunks`` held until ``open`` (a store that has not answered
    yet); counts the lookups that reached it."""

    def __init__(self, lookup: Callable[[list[str]], int]) -> None:
        self._lookup = lookup
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.asked: list[int] = []

    def __call__(self, hashes: list[str]) -> int:
        self.asked.append(len(hashes))
        self.entered.set()
        self.opened.wait(WAIT_S)
        return self._lookup(hashes)


@pytest.fixture
def gated(backend: MooncakeBackend) -> Iterator[tuple[Engine, Gate]]:  # noqa: F811
    """An engine whose lookup server waits at the gate (a second server on the same port
    replaces the first)."""
    e = Engine(backend, 7231, timeout_ms=WAIT_S * 1000, lookup_async=True)
    e.server.close()
    gate = Gate(e.worker.lookup_chunks)
    e.server = LookupServer(gate, lookup_rpc_port=7231)
    yield e, gate
    gate.opened.set()
    e.close()


def test_async_answers_equal_the_synchronous_path(backend: MooncakeBackend) -> None:  # noqa: F811
    """Same requests, same pool: every answer, counter, report and load of the lookup thread
    equals the scheduler thread's (no hit lost by going async)."""
    e = Engine(backend, 7230)
    lazy = KVPoolScheduler(e.config, LookupClient(lookup_rpc_port=7230, timeout_ms=3000),
                           e.reporter, lookup_async=True)
    try:
        long_prompt = _prompt(32 * 16 + 5, 3)
        e.store(long_prompt, 20)
        hit, partial, miss = _prompt(70, 1), _prompt(70, 2), _prompt(70, 4)
        e.store(hit, 4)
        e.store(partial, 2)
        cases = [(hit, 0), (hit, 16), (hit, 64), (partial, 0), (miss, 0), (long_prompt, 0),
                 (long_prompt, 48), (_prompt(10, 5), 0), (hit, 0)]
        for i, (prompt, local) in enumerate(cases):
            want = e.sched.get_num_new_matched_tokens(_request(f"s{i}", prompt), local)
            req = _request(f"a{i}", prompt)
            first = lazy.get_num_new_matched_tokens(req, local)
            got = _answer(lazy, req, local)
            assert got == want, (i, got, want)
            # Asked before the lookup could run: "later"; a skip answers at once.
            assert first == ((None, False) if local < (len(prompt) - 1) // 16 * 16 else want)
            # The load vLLM confirms is the same.
            for s, rid in ((e.sched, f"s{i}"), (lazy, f"a{i}")):
                r = _request(rid, prompt)
                s.update_state_after_alloc(r, _blocks(list(range(len(prompt) // 16 + 1))),
                                           want[0] or 0)
            sync_load = e.sched._requests[f"s{i}"].confirmed
            lazy_load = lazy._requests[f"a{i}"].confirmed
            assert (sync_load is None) == (lazy_load is None)
            if sync_load is not None and lazy_load is not None:
                assert sync_load.spec.kvpool_cached_tokens == lazy_load.spec.kvpool_cached_tokens
                assert sync_load.hashes == lazy_load.hashes
        c, a = e.sched.counters, lazy.counters
        assert (a.lookups, a.lookup_errors, a.prompt_tokens, a.local_tokens, a.lookup_skipped,
                a.skip_reasons) == (c.lookups, c.lookup_errors, c.prompt_tokens,
                                    c.local_tokens, c.lookup_skipped, c.skip_reasons)
        assert c.lookups == 7 and c.skip_reasons == {"LOCAL_CACHE": 1, "SHORT_PROMPT": 1}
        assert len(lazy.match.lookups or ()) == 0
    finally:
        lazy.close()
        e.close()


def test_later_while_the_lookup_runs_then_its_answer_and_the_cached_answer(
        gated: tuple[Engine, Gate]) -> None:
    e, gate = gated
    prompt = _prompt(70, 11)
    e.store(prompt, 3)
    req = _request("r", prompt)
    assert e.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert gate.entered.wait(WAIT_S)
    # The store has not answered: later again, nothing counted, no second lookup.
    assert e.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert e.sched.counters.lookups == 0
    gate.opened.set()
    assert _answer(e.sched, req) == (48, False)
    assert (e.sched.counters.lookups, gate.asked) == (1, [4])
    # vLLM asks again while the request waits for blocks: the kept answer, no lookup.
    assert e.sched.get_num_new_matched_tokens(req, 0) == (48, False)
    assert (e.sched.counters.lookup_cached, gate.asked) == (1, [4])


def test_a_lookup_past_its_timeout_is_a_counted_miss(backend: MooncakeBackend) -> None:  # noqa: F811
    """lookup_timeout_ms bounds a lookup on the lookup thread as it did on the scheduler's:
    no reply in time means 0 tokens, a lookup error, and the breaker counts it."""
    e = Engine(backend, 7232, timeout_ms=100, lookup_async=True, lookup_breaker_failures=1)
    e.server.close()
    gate = Gate(e.worker.lookup_chunks)
    e.server = LookupServer(gate, lookup_rpc_port=7232)
    try:
        prompt = _prompt(70, 12)
        e.store(prompt, 3)
        req = _request("t", prompt)
        assert _answer(e.sched, req) == (0, False)
        c = e.sched.counters
        assert (c.lookups, c.lookup_errors) == (1, 1)
        # The breaker opened (1 failure): the next request is a counted skip, at once.
        assert e.sched.get_num_new_matched_tokens(_request("u", prompt), 0) == (0, False)
        assert c.skip_reasons == {"BREAKER_OPEN": 1}
    finally:
        gate.opened.set()
        e.close()


def test_an_aborted_request_leaves_nothing_and_a_queued_lookup_never_runs(
        gated: tuple[Engine, Gate]) -> None:
    e, gate = gated
    running, queued = _request("run", _prompt(70, 13)), _request("q", _prompt(90, 14))
    e.store(running.prompt_token_ids or [], 2)
    assert e.sched.get_num_new_matched_tokens(running, 0) == (None, False)
    assert gate.entered.wait(WAIT_S)
    assert e.sched.get_num_new_matched_tokens(queued, 0) == (None, False)
    # Both aborted while the first lookup is in the store and the second queued behind it.
    assert e.sched.request_finished(running, []) == (False, None)
    assert e.sched.request_finished(queued, []) == (False, None)
    assert e.sched.match.lookups is not None and len(e.sched.match.lookups) == 0
    gate.opened.set()
    # The lookup thread is free again: a new request's lookup runs and is answered.
    fresh = _request("fresh", running.prompt_token_ids or [])
    assert _answer(e.sched, fresh) == (32, False)
    # The queued lookup never reached the store; the running one's answer was dropped.
    assert gate.asked == [4, 4]
    assert e.sched.counters.lookups == 1
    assert "run" not in e.sched._requests and "q" not in e.sched._requests


def test_a_flush_drops_a_running_lookups_answer(gated: tuple[Engine, Gate]) -> None:
    """An answer from before the pool was flushed may name removed keys: asked again."""
    e, gate = gated
    prompt = _prompt(70, 15)
    e.store(prompt, 3)
    req = _request("f", prompt)
    assert e.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert gate.entered.wait(WAIT_S)
    e.sched.forget_lookups()
    gate.opened.set()
    assert _answer(e.sched, req) == (48, False)
    assert gate.asked == [4, 4]
    assert e.sched.counters.lookups == 1


def test_pd_handover_waits_with_async_lookups(backend: MooncakeBackend) -> None:  # noqa: F811
    """The hand-over's wait (handover.py) works over lookups on the lookup thread: "later"
    until the pool holds the promised tokens, then the whole hand-over, one lookup counted."""
    decode = Engine(backend, 7233, role="kv_consumer", consumer_is_to_load=True,
                    handover_wait_ms=60_000, lookup_async=True)
    try:
        prompt = _prompt(50, 21)  # 3 whole chunks
        dreq = _pd_request("d", prompt, {"kvpool_handover": {"tokens": 48}})
        c = decode.sched.counters
        # Nothing saved: the lookup runs, finds 0 of 48 and the request keeps waiting.
        _until(lambda: decode.sched.get_num_new_matched_tokens(dreq, 0) == (None, False)
               and c.handover_waits >= 1)
        assert c.lookups == 0
        decode.store(prompt, 3)
        assert _answer(decode.sched, dreq) == (48, False)
        assert (c.lookups, c.handover_short) == (1, 0)
    finally:
        decode.close()
