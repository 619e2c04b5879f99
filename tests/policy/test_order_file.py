"""The eviction order kept across the service's restarts (``kvpool_policy._order_file``): what
is written reads back, the pool's chunks are ordered by it (chunks it does not name as newer
than every chunk in it), a file that cannot be used changes nothing, and a core adopts the
found chunks in that order."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import msgspec
import pytest

from kvpool_policy._core import PolicyCore
from kvpool_policy._order_file import (
    ORDER_VERSION,
    OrderFile,
    OrderWriter,
    order_found,
    read_order,
)
from kvpool_policy.policy import PoolPolicy

A, B = "a" * 12, "b" * 12


def h(i: int) -> str:
    return f"{i:032x}"


def test_an_order_reads_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "order"
    order = [(A, h(3)), (B, h(1)), (A, h(2))]
    w = OrderWriter(path, every_s=5.0)
    w.write(order)
    assert read_order(path) == order
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    body = msgspec.msgpack.decode(path.read_bytes(), type=OrderFile)
    assert body.digests == [A, B] and body.chunks == [(0, h(3)), (1, h(1)), (0, h(2))]
    assert (w.written, w.failed) == (1, 0)
    assert [p.name for p in tmp_path.iterdir()] == ["order"]  # no temporary file left


def test_found_chunks_keep_the_files_order_and_unnamed_ones_come_after() -> None:
    """Chunks the pool holds in the file's order; chunks it does not name (saved after its last
    write) after them in listing order; chunks gone from the pool dropped."""
    found = {A: [h(5), h(1), h(9), h(2)], B: [h(7)]}
    order = [(A, h(2)), (B, h(8)), (A, h(1)), (A, h(4))]
    assert order_found(found, order) == {A: [h(2), h(1), h(5), h(9)], B: [h(7)]}
    assert order_found(found, []) == found


@pytest.mark.parametrize("content", [b"", b"\x93garbage", b"not msgpack at all"])
def test_a_file_that_cannot_be_used_is_one_line_and_no_order(
        tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "order"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="kvpool.policy"):
        assert read_order(path) == []
    assert len(caplog.records) == 1
    assert "ignored" in caplog.records[0].getMessage()
    assert "listing's order" in caplog.records[0].getMessage()


def test_another_version_or_a_bad_index_is_no_order(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "order"
    path.write_bytes(msgspec.msgpack.encode(OrderFile(ORDER_VERSION + 1, 0.0, [A], [(0, h(1))])))
    assert read_order(path) == []
    path.write_bytes(msgspec.msgpack.encode(OrderFile(ORDER_VERSION, 0.0, [A], [(3, h(1))])))
    assert read_order(path) == []
    path.write_bytes(msgspec.msgpack.encode(OrderFile(ORDER_VERSION, 0.0, [A], [(-1, h(1))])))
    assert read_order(path) == []
    assert read_order(tmp_path / "none") == []  # no file: no line
    assert len(caplog.records) == 3


def test_writes_are_spaced_and_one_at_a_time(tmp_path: Path) -> None:
    now = [100.0]
    w = OrderWriter(tmp_path / "order", every_s=30.0, clock=lambda: now[0])
    assert w.due()
    w.write_soon([(A, h(1))])
    assert w._thread is not None
    w._thread.join(10)
    assert not w.due()
    now[0] += 30.0
    assert w.due()
    w.write_soon([])  # an empty order never replaces the file's, and leaves the write due
    assert w.due() and w.written == 1
    w.close([(A, h(2))])  # a clean stop writes the last order
    assert read_order(tmp_path / "order") == [(A, h(2))]
    w.close([])  # an empty order never replaces the file's
    assert read_order(tmp_path / "order") == [(A, h(2))] and w.written == 2


def test_a_write_that_fails_is_counted_and_raises_nothing(tmp_path: Path) -> None:
    w = OrderWriter(tmp_path / "gone" / "order")
    w.write([(A, h(1))])
    assert (w.written, w.failed) == (0, 1)


def test_a_core_adopts_the_found_chunks_in_the_kept_order() -> None:
    """A restarted core whose found chunks were ordered by the file evicts the least recently
    used first (listing order would evict h(0) first); its order, before and after the
    layout's first record, is what the next file keeps."""
    listing = {A: [h(i) for i in range(6)]}
    kept = [(A, h(i)) for i in (3, 0, 5, 1)]  # least recent first; h(2), h(4) saved after
    core = PolicyCore(PoolPolicy(4 * 100, engines_decide=True), None,
                      found=order_found(listing, kept))
    assert core.order() == [(A, h(i)) for i in (3, 0, 5, 1, 2, 4)]
    core._adopt(A, 100)  # the layout's first record says its chunk bytes
    assert core.order() == [(A, h(i)) for i in (5, 1, 2, 4)]
    assert (A, h(3)) not in core.policy and (A, h(0)) not in core.policy
