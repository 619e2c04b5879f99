"""Errors and slow loads of a store outage, on fleet states built from the wire schema with a
frozen clock: what an agent reports of its store (``EngineState.store_pauses``, the live case
is ``tests/replay/test_triage_faults.py``'s stopped store) makes them the store's. While the
window lasts, and for the 10 s aftermath, ``backend_errors`` names the store and its fix, not
"pool full" or "block evicted"; past that it clears (its cause has); an error after it is the
counter's own again. A window a pause of the process or the master overlaps is theirs."""

from __future__ import annotations

import msgspec
from fleetdata import NOW_MS, engine, pool

from kvpool_agent.protocol import EngineState, ErrorRecord, PauseWindow
from kvpool_agent.vocabulary import HINTS
from kvpool_console.alerts import Alert, evaluate
from kvpool_console.alerts.pauses import POOL_EMPTY_HINT, STORE_STALLED_HINT

Fleet = dict[str, EngineState]

EMPTY = PauseWindow(kind="pool_no_segments", start_ms=NOW_MS, end_ms=NOW_MS + 10_000,
                    detail="10.0.0.5:15001", errors={"NO_AVAILABLE_HANDLE": 40})
"""The master held no segment for 10 s from ``NOW_MS``; 40 saves failed in it."""


def _outage(windows: list[PauseWindow], errors: dict[str, int],
            records: list[tuple[float, str]], *, pauses: list[PauseWindow] | None = None
            ) -> Fleet:
    """Engine ``e``'s one worker with these store windows, error counts and error records
    (ms after ``NOW_MS``, name)."""
    fleet = engine("e", role="mixed", tp=1, loads=0, pool_stats=pool(ttl=5_000))
    out = {}
    for k, s in fleet.items():
        if s.source.process_role == "worker":
            s = msgspec.structs.replace(
                s, store_pauses=windows, pauses=pauses or [],
                transfers=msgspec.structs.replace(s.transfers, errors_by_name=dict(errors)),
                recent_errors=[ErrorRecord(ts_ms=NOW_MS + at, where="save", name=n,
                                           message="save of 32 block(s) failed")
                               for at, n in records])
        out[k] = s
    return out


def _backend(fleet: Fleet, at_ms: float) -> Alert | None:
    t = NOW_MS + at_ms
    return next((a for a in evaluate(fleet, {k: t for k in fleet}, t)
                 if a.key == "backend_errors:e"), None)


def test_errors_on_a_pool_without_segments_are_its_until_it_is_back_and_ten_s_after() -> None:
    fleet = _outage([EMPTY], {"NO_AVAILABLE_HANDLE": 40}, [(2_000, "NO_AVAILABLE_HANDLE"),
                                                          (9_000, "NO_AVAILABLE_HANDLE")])
    for at in (5_000, 12_000, 19_900):  # in the window, then in its aftermath
        a = _backend(fleet, at)
        assert a is not None and a.hint == POOL_EMPTY_HINT, (at, a)
        assert a.message.startswith("backend errors: NO_AVAILABLE_HANDLE 40 while master ")
        assert a.message.endswith(" held no store segment (10.0.0.5:15001 dropped)")
    assert _backend(fleet, 20_100) is None  # memory back for 10 s: the cause has cleared
    # A save failing after that is the counter's own: the pool-full fix again.
    later = _outage([EMPTY], {"NO_AVAILABLE_HANDLE": 41},
                    [(9_000, "NO_AVAILABLE_HANDLE"), (25_000, "NO_AVAILABLE_HANDLE")])
    a = _backend(later, 26_000)
    assert a is not None and a.hint == HINTS["NO_AVAILABLE_HANDLE"]


def test_an_error_whose_record_was_pushed_out_is_the_stores_when_its_windows_counted_it() -> None:
    stall = PauseWindow(kind="store_stalled", start_ms=NOW_MS - 2_000, end_ms=NOW_MS + 1_000,
                        errors={"TIMEOUT": 1})
    # The 50 records left are all NO_AVAILABLE_HANDLE: TIMEOUT's is gone.
    records = [(5_000 + i * 10, "NO_AVAILABLE_HANDLE") for i in range(50)]
    counted = _outage([stall, EMPTY], {"TIMEOUT": 1, "NO_AVAILABLE_HANDLE": 40}, records)
    a = _backend(counted, 8_000)
    assert a is not None and a.hint == POOL_EMPTY_HINT, a
    assert _backend(counted, 20_100) is None
    # One TIMEOUT more than its windows counted: not known to be the store's.
    uncounted = _outage([stall, EMPTY], {"TIMEOUT": 2, "NO_AVAILABLE_HANDLE": 40}, records)
    a = _backend(uncounted, 20_100)
    assert a is not None and a.message.startswith("backend errors: TIMEOUT 2")
    assert a.hint == HINTS["TIMEOUT"]


def test_a_stalled_stores_errors_name_the_store() -> None:
    stall = PauseWindow(kind="store_stalled", start_ms=NOW_MS, end_ms=None,
                        errors={"TIMEOUT": 1})
    fleet = _outage([stall], {"TIMEOUT": 1}, [(3_000, "TIMEOUT")])
    a = _backend(fleet, 4_000)
    assert a is not None and a.hint == STORE_STALLED_HINT
    assert a.message == ("backend errors: TIMEOUT 1 while the store did not answer "
                         "e/dp0.tp0.pp0 (its transfers stuck)")


def test_a_window_a_pause_of_the_master_overlaps_is_the_masters() -> None:
    unhealthy = PauseWindow(kind="pool_unhealthy", start_ms=NOW_MS - 1_000,
                            end_ms=NOW_MS + 6_000, detail="master admin unreachable")
    stall = PauseWindow(kind="store_stalled", start_ms=NOW_MS, end_ms=NOW_MS + 5_000,
                        errors={"TIMEOUT": 1})
    fleet = _outage([stall], {"TIMEOUT": 1}, [(3_000, "TIMEOUT")], pauses=[unhealthy])
    a = _backend(fleet, 8_000)
    assert a is not None and a.hint == HINTS["TIMEOUT"]
