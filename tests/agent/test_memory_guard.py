"""The hub's memory guard (``kvpool_agent._memory_guard``) judges a shed of connections by what
it freed, once libzmq has closed them (their memory is not freed before). Driven with an
injected RSS and clock, so the escalation the round-5 split flood met beside two CPU burners
(every port rebuilt) is reproduced without load."""

from __future__ import annotations

import socket

import pytest

from kvpool_agent import _memory_guard as mg
from kvpool_agent._hub_connections import ConnectionTable

_MIB = 1 << 20
_LIMIT = 256 * _MIB


@pytest.fixture
def rss(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The RSS the guard reads (bytes, ``rss[0]``)."""
    value = [0]
    monkeypatch.setattr(mg, "rss_bytes", lambda: value[0])
    return value


def test_a_shed_is_not_judged_while_its_connections_are_still_open(rss: list[int]) -> None:
    """The round-5 split flood beside two CPU burners, as measured: the shed at 256 MiB drops
    the viewer's connections, libzmq's I/O thread still reads what was on its way on them
    before it closes them (0.06 to 0.59 s later), and 0.28 s after the shed the RSS is 294 MiB,
    38 MiB past the shed's (``REGROW``: 32 MiB). Judged then, the shed "freed too little"
    (``again``: every port is rebuilt unless the connections left weigh 32 MiB); judged once
    libzmq closed them, the RSS is back at 66 MiB and nothing more is shed."""
    rss[0] = 256 * _MIB + 1
    before = mg.MemoryGuard(_LIMIT)  # never told of the release: the guard as it was
    assert before.over(now=0.0) == 256 * _MIB + 1 and not before.again
    rss[0] = 294 * _MIB
    assert before.over(now=0.28) == 294 * _MIB and before.again  # the escalation

    rss[0] = 256 * _MIB + 1
    guard = mg.MemoryGuard(_LIMIT)
    assert guard.over(now=0.0, releasing=True) == 256 * _MIB + 1 and not guard.again
    assert guard.over(now=0.1, releasing=True) is None  # COOLDOWN_S: not read
    rss[0] = 294 * _MIB
    assert guard.over(now=0.28, releasing=True) is None
    assert guard.over(now=0.3, releasing=True) is None  # CHECK_S later: read, not judged
    assert (guard.again, guard.settling, guard.futile, guard.rss) == (False, 2, 0, 294 * _MIB)
    rss[0] = 66 * _MIB  # libzmq closed them and freed their messages
    assert guard.over(now=0.55, releasing=False) is None
    assert (guard.again, guard.futile, guard.rss) == (False, 0, 66 * _MIB)
    rss[0] = 300 * _MIB  # a new message: a first shed again (connections, not every port)
    assert guard.over(now=0.6) == 300 * _MIB and not guard.again


def test_a_shed_that_freed_nothing_still_escalates_after_regrow(rss: list[int]) -> None:
    """Once the dropped connections are closed, a shed that left the RSS over the limit is
    judged as before: held while the RSS grew by less than ``REGROW`` of the limit (counted
    futile), then a rebuild of every port (``again``)."""
    rss[0] = 290 * _MIB
    guard = mg.MemoryGuard(_LIMIT)
    assert guard.over(now=0.0) == 290 * _MIB
    rss[0] = 300 * _MIB
    assert guard.over(now=0.25, releasing=True) is None and guard.settling == 1
    assert guard.over(now=0.3, releasing=False) is None  # closed, freed nothing
    assert (guard.futile, guard.again) == (1, False)
    rss[0] = 290 * _MIB + _LIMIT // 8  # grown by REGROW exactly: still held
    assert guard.over(now=0.55) is None and guard.futile == 2
    rss[0] += _MIB
    assert guard.over(now=0.8) == 291 * _MIB + _LIMIT // 8 and guard.again


def test_a_release_libzmq_never_reports_is_judged_after_release_s(rss: list[int]) -> None:
    """The hub waits for libzmq's close of the dropped connections ``RELEASE_S`` at most: an
    event lost or a connection never closed does not hold the guard for ever."""
    rss[0] = 290 * _MIB
    guard = mg.MemoryGuard(_LIMIT)
    assert guard.over(now=0.0) == 290 * _MIB
    rss[0] = 340 * _MIB
    assert guard.over(now=mg.RELEASE_S - 0.01, releasing=True) is None
    assert guard.over(now=mg.RELEASE_S, releasing=True) == 340 * _MIB and guard.again


def test_the_table_says_a_dropped_connection_is_releasing_until_libzmq_closes_it() -> None:
    """``ConnectionTable.releasing`` from a drop until the close of its descriptor (the hub's
    monitor reports it), or until the descriptor is accepted again for another connection."""
    srv = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(srv.getsockname())
    conn = srv.accept()[0]
    try:
        table = ConnectionTable()
        table.accepted("commands", conn.fileno())
        table.baseline(0, 4 * _MIB, now=0.0)
        peer.sendall(b"x" * _MIB)  # past REGROW of a 4 MiB limit
        got = 0
        while got < _MIB:
            got += len(conn.recv(_MIB))
        assert not table.releasing
        assert table.shed(5 * _MIB, 4 * _MIB) == 1
        assert table.releasing and len(table) == 0
        table.closed(conn.fileno())
        assert not table.releasing
    finally:
        for s in (conn, peer, srv):
            s.close()
