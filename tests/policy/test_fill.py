"""``kvpool-policy serve --fill auto`` (``kvpool_policy._fill``): the service's capacity follows
the master's used bytes below its watermark, lowered when the master evicts; a shrink evicts
the policy's oldest chunks (never a pinned one) and hands them to the remover."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpool_policy.cli as policy_cli
from kvpool_agent.auth import local_fleet_keys
from kvpool_policy._fill import (
    FILL_BACKOFF,
    FILL_FLOOR,
    FILL_MARGIN,
    FILL_STEP,
    FillFollower,
    FillRule,
    MasterReader,
    MasterReading,
)
from kvpool_policy.policy import AccessRecord, PoolPolicy
from kvpool_replay import LocalMooncakeMaster, LocalPolicyService, LocalPoolStore

TOTAL = 1_000_000_000
"""A pool of 1 GB (bytes): shares read as round numbers."""

D = "d" * 16


def _share(capacity: int) -> float:
    return round(capacity / TOTAL, 4)


def test_the_fill_rises_a_step_a_reading_up_to_the_watermark_less_the_margin() -> None:
    rule = FillRule(0.95)
    cap = rule.start(TOTAL)
    assert _share(cap) == FILL_FLOOR == 0.8  # the fixed fill measured before auto
    seen = []
    for t in range(18):
        cap = rule.next(cap, MasterReading(cap // 2, TOTAL, 0), cap // 2, float(t))
        seen.append(_share(cap))
    ceiling = round(0.95 - FILL_MARGIN, 4)
    assert seen[:3] == [round(0.8 + k * FILL_STEP, 4) for k in (1, 2, 3)]
    assert seen[-1] == ceiling and seen.count(ceiling) >= 4  # reached, and it stays there


def test_bytes_outside_the_policy_lower_the_fill_at_once_and_for_the_window() -> None:
    rule = FillRule(0.95, window_s=30.0)
    cap = int(TOTAL * 0.93)
    # 50 MB the policy does not count (saves in flight, keys under a reader's lease).
    cap = rule.next(cap, MasterReading(int(TOTAL * 0.8), TOTAL, 0), int(TOTAL * 0.75), 0.0)
    assert _share(cap) == round(0.95 - FILL_MARGIN - 0.05, 4)
    # The others' bytes are gone at once, but their peak holds for the window...
    cap = rule.next(cap, MasterReading(int(TOTAL * 0.7), TOTAL, 0), int(TOTAL * 0.7), 10.0)
    assert _share(cap) == round(0.95 - FILL_MARGIN - 0.05, 4)
    # ...and after it the fill climbs again, a step a reading.
    cap2 = rule.next(cap, MasterReading(int(TOTAL * 0.7), TOTAL, 0), int(TOTAL * 0.7), 41.0)
    assert _share(cap2) == round(_share(cap) + FILL_STEP, 4)


def test_an_eviction_by_the_master_lowers_the_fill_by_the_backoff() -> None:
    rule = FillRule(0.95)
    cap = int(TOTAL * 0.87)
    cap = rule.next(cap, MasterReading(cap, TOTAL, 500), cap, 0.0)  # first reading: a base
    assert _share(cap) == 0.88 and rule.backoffs == 0
    cap = rule.next(cap, MasterReading(cap, TOTAL, 501), cap, 2.0)
    assert _share(cap) == round(0.88 - FILL_BACKOFF, 4) and rule.backoffs == 1
    # A restarted master counts from 0: no eviction read into it.
    cap = rule.next(cap, MasterReading(cap, TOTAL, 0), cap, 4.0)
    assert _share(cap) == round(0.88 - FILL_BACKOFF + FILL_STEP, 4) and rule.backoffs == 1
    # Evictions at the floor leave it there: never below the fixed fill it replaces.
    for t, n in enumerate(range(1, 10)):
        cap = rule.next(cap, MasterReading(cap, TOTAL, n), cap, 6.0 + t)
    assert _share(cap) == FILL_FLOOR and rule.backoffs == 10


def test_the_fill_never_leaves_its_bounds_nor_moves_without_segments() -> None:
    rule = FillRule(0.9)
    # Others hold 80% of the pool: the floor, not nothing.
    cap = rule.next(int(TOTAL * 0.85), MasterReading(int(TOTAL * 0.9), TOTAL, 0),
                    int(TOTAL * 0.1), 0.0)
    assert _share(cap) == FILL_FLOOR
    assert rule.next(cap, MasterReading(0, 0, 0), 0, 1.0) == cap
    # A watermark below the floor: the fill stays the margin under it.
    low = FillRule(0.7)
    assert _share(low.start(TOTAL)) == round(0.7 - FILL_MARGIN, 4) == _share(
        low.next(low.start(TOTAL), MasterReading(0, TOTAL, 0), 0, 0.0))


@settings(max_examples=200, deadline=None)
@given(watermark=st.floats(0.3, 1.0), start=st.floats(0.01, 1.0),
       readings=st.lists(st.tuples(st.integers(0, TOTAL), st.integers(0, TOTAL),
                                   st.integers(0, 3), st.floats(0.0, 5.0)),
                         min_size=1, max_size=30))
def test_the_fill_stays_within_its_bounds_and_backs_off_on_every_eviction(
        watermark: float, start: float,
        readings: list[tuple[int, int, int, float]]) -> None:
    rule = FillRule(watermark)
    cap, evicted, now = int(TOTAL * start), 0, 0.0
    for i, (used, policy_bytes, more_evicted, dt) in enumerate(readings):
        evicted += more_evicted
        now += dt
        before = cap
        cap = rule.next(cap, MasterReading(used, TOTAL, evicted), policy_bytes, now)
        assert int(TOTAL * rule.floor) <= cap <= int(TOTAL * rule.ceiling) or cap == 1
        assert cap <= max(before + int(TOTAL * FILL_STEP), int(TOTAL * rule.floor))
        if i and more_evicted:
            assert cap < before or cap == int(TOTAL * rule.floor)


def test_a_shrink_evicts_the_oldest_unpinned_chunks_and_a_growth_none() -> None:
    policy = PoolPolicy(10 * 100, admission="all")
    policy.record(AccessRecord(D, tuple(f"{i:016x}" for i in range(10)), 100, 10, "e"))
    policy.pin([(D, f"{0:016x}")])
    assert policy.resize(2000) == [] and policy.used_bytes == 1000
    gone = policy.resize(700)
    # Leaf-first LRU: the prefix's tail goes first; the pinned head stays.
    assert len(gone) == 3 and (D, f"{0:016x}") not in gone
    assert policy.used_bytes == 700 and policy.capacity_bytes == 700
    with pytest.raises(ValueError, match="capacity_bytes must be >= 1"):
        policy.resize(0)


class _Core:
    """What ``FillFollower.step`` uses of a ``PolicyCore``."""

    def __init__(self, capacity: int) -> None:
        self.policy = PoolPolicy(capacity, admission="all")
        self.resized: list[int] = []

    def resize(self, capacity: int) -> int:
        self.resized.append(capacity)
        return len(self.policy.resize(capacity))


def test_the_follower_applies_each_reading_once(tmp_path: Path) -> None:
    reader = MasterReader("http://127.0.0.1:1")  # never started: readings set by the test
    follower = FillFollower(FillRule(0.9), reader)
    core = _Core(int(TOTAL * 0.8))
    follower.step(core, 0.0)  # type: ignore[arg-type]
    assert core.resized == []  # no reading yet
    reader.latest, reader.reads = MasterReading(0, TOTAL, 0), 1
    follower.step(core, 1.0)  # type: ignore[arg-type]
    follower.step(core, 1.5)  # type: ignore[arg-type]
    assert [_share(c) for c in core.resized] == [0.81]
    reader.latest, reader.reads = MasterReading(0, TOTAL, 0), 2
    follower.step(core, 3.0)  # type: ignore[arg-type]
    assert [_share(c) for c in core.resized] == [0.81, 0.82]


def test_the_follower_logs_every_two_points_and_every_change_of_the_pool(
        caplog: pytest.LogCaptureFixture) -> None:
    reader = MasterReader("http://127.0.0.1:1")  # never started: readings set by the test
    follower = FillFollower(FillRule(0.95), reader)
    core = _Core(int(TOTAL * 0.8))
    caplog.set_level("INFO", logger="kvpool.policy")
    for n, total in enumerate([TOTAL] * 4 + [TOTAL // 2] + [TOTAL] * 14, start=1):
        reader.latest, reader.reads = MasterReading(0, total, 0), n
        follower.step(core, float(n))  # type: ignore[arg-type]
    logged = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert logged == [
        "kvpool policy: fill 0.810 of the pool's 1000000000 bytes",
        "kvpool policy: fill 0.830 of the pool's 1000000000 bytes",  # 0.81 -> 0.83: two points
        # A segment gone: the pool halves, the same bytes are 1.7 of it; the ceiling at once.
        "kvpool policy: fill 0.930 of the pool's 500000000 bytes",
        # Back: from the floor of the pool twice as large, every two points, and the last
        # one-point step to the ceiling.
        "kvpool policy: fill 0.800 of the pool's 1000000000 bytes",
        *(f"kvpool policy: fill 0.{p} of the pool's 1000000000 bytes"
          for p in (820, 840, 860, 880, 900, 920, 930)),
    ]


def test_the_reader_reads_a_real_master(mooncake_master: LocalMooncakeMaster) -> None:
    """Against the session's real ``mooncake_master``: a healthy reading of its metrics."""
    reader = MasterReader(mooncake_master.admin_url, every_s=0.1).start()
    try:
        deadline = time.monotonic() + 30
        while reader.reads < 2 and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        # Two healthy readings of the real master (a reader that cannot reach it has none).
        assert reader.reads >= 2 and reader.latest is not None
    finally:
        reader.close()
    assert "kvpool-policy-fill" not in [t.name for t in threading.enumerate()]


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--fill", "0", "must be auto or a share in (0, 1], e.g. 0.8, got '0'"),
    ("--fill", "1.5", "must be auto or a share in (0, 1], e.g. 0.8, got '1.5'"),
    ("--fill", "nan", "must be auto or a share in (0, 1], e.g. 0.8, got 'nan'"),
    ("--fill", "most", "must be auto or a share in (0, 1], e.g. 0.8, got 'most'"),
    ("--fill", "", "must be auto or a share in (0, 1], e.g. 0.8, got ''"),
    ("--master-watermark", "0.01", "must be in [0.1, 1], the master's "
     "eviction_high_watermark_ratio, got 0.01"),
    ("--master-watermark", "1.2", "must be in [0.1, 1], the master's "
     "eviction_high_watermark_ratio, got 1.2"),
])
def test_serve_fill_and_watermark_refuse_what_is_no_share(
        flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        policy_cli.main(["serve", "--listen", "tcp://127.0.0.1:5600", "--keys", "k",
                         "--master", "127.0.0.1:1", "--admin-url", "http://127.0.0.1:1",
                         flag, value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert err.strip() == (f"kvpool-policy serve: error: argument {flag}: {says} (see "
                           "kvpool-policy serve --help)")



def _fills(log: Path) -> list[tuple[float, int]]:
    """The service's ``fill X of the pool's N bytes`` lines: (X, N)."""
    return [(float(m[1]), int(m[2])) for m in re.finditer(
        r"kvpool policy: fill ([\d.]+) of the pool's (\d+) bytes", log.read_text())]


def test_kvpool_policy_serve_fills_up_to_the_watermark_and_follows_a_new_segment(
        tmp_path: Path) -> None:
    """The real ``kvpool-policy serve`` (its default ``--fill auto``) beside a real master
    (watermark 0.9) and a store in its own process: from 0.8 of the pool up to 0.88, then, a
    second store mounted, the same over the pool twice as large."""
    with LocalMooncakeMaster(eviction_high_watermark_ratio=0.9) as master, \
            LocalPoolStore(master, 32 << 20), \
            LocalPolicyService(master, local_fleet_keys(tmp_path / "keys")["hub"].root,
                               fill="auto", log_dir=tmp_path) as service:

        def reached(share: float, total: int | None = None) -> bool:
            return any(f == share and (total is None or n == total)
                       for f, n in _fills(service.log_path))

        deadline = time.monotonic() + 120
        while not reached(0.88):
            assert time.monotonic() < deadline, service.log_path.read_text()[-3000:]
            threading.Event().wait(0.2)
        first = _fills(service.log_path)
        (total,) = {n for _, n in first}
        assert first[0][0] == 0.81 and total >= 32 << 20
        with LocalPoolStore(master, 32 << 20):
            while not reached(0.88, 2 * total):
                assert time.monotonic() < deadline + 120, service.log_path.read_text()[-3000:]
                threading.Event().wait(0.2)
        grown = [f for f, n in _fills(service.log_path) if n == 2 * total]
        assert grown[0] <= 0.81 and grown == sorted(grown)  # from the floor, a rise
