"""``NullReporter`` is the reporter of a process without an agent: it must stay free on the
engine's hot paths, so it overrides every event method ``Reporter`` has (a method it inherited
would build and drop an event on every call)."""

from __future__ import annotations

import inspect

from kvpool_agent import NullReporter, Reporter

# Not event methods: the agent thread's side and the counters.
_NOT_EVENTS = {"drain", "depth"}


def _event_methods() -> list[str]:
    return [n for n, f in inspect.getmembers(Reporter, inspect.isfunction)
            if not n.startswith("_") and n not in _NOT_EVENTS]


def test_null_reporter_overrides_every_event_method() -> None:
    events = _event_methods()
    assert "lookup" in events and "transfer_finished" in events
    inherited = [n for n in events if getattr(NullReporter, n) is getattr(Reporter, n)]
    assert inherited == []


def test_null_reporter_keeps_nothing() -> None:
    r = NullReporter()
    r.lookup("req-1", 512, 0, 256, 1.5, None)
    r.error("LOOKUP", "x", "detail")
    assert r.drain() == [] and r.depth == 0 and r.dropped == 0
